#!/usr/bin/env bash
# One device call: a model step's synchronizations and ms with the FP16 and AQUA-KV caches before / after
# 9a40d64 (the stores' own value scans off with validate=False), then the GPU tests it touches. CACHES,
# SHAPES, TEST_PATHS and TEST_K choose other caches and tests (the OSCAR rotations' call, 2026-11-29).
#
#   KVQ_COMMIT=<commit> bash lab/2026-11-28-step-syncs/fp16_aqua.sh      (.before/ holds the "before" kvq/)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvq-out}"
mkdir -p "$OUT"
ARGS="--shapes ${SHAPES:-1x32768} --caches ${CACHES:-StaticCache FP16:triton AQUA-KV:triton KIVI-K2V2:triton} --steps 5 --blocks 2"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p .before/lab/s && cp lab/2026-11-28-step-syncs/step_syncs.py .before/lab/s/
# the script puts its checkout's root first on sys.path: .before/'s kvq for "before"
KVQ_COMMIT="${BEFORE_COMMIT:-before}" timeout -k 5 170 python3 .before/lab/s/step_syncs.py $ARGS \
    --out "$OUT/step_syncs-before.json" > "$OUT/syncs-before.log" 2>&1
echo "before rc=$?"; grep '^{' "$OUT/syncs-before.log"
KVQ_COMMIT="${KVQ_COMMIT:-unknown}" timeout -k 5 170 python3 lab/2026-11-28-step-syncs/step_syncs.py $ARGS \
    --out "$OUT/step_syncs-after.json" > "$OUT/syncs-after.log" 2>&1
echo "after rc=$?"; grep '^{' "$OUT/syncs-after.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout -k 5 "${TEST_TIMEOUT:-230}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 \
    ${TEST_PATHS:-tests/integrations/test_kvq_attention.py tests/integrations/test_capacity.py tests/integrations/test_store_atomicity.py} \
    -k "${TEST_K:-synchronization or validate or rejected or aqua or AQUA or FP16}" > "$OUT/gpu-tests.log" 2>&1
echo "tests rc=$?"; tail -n 3 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -n 40
