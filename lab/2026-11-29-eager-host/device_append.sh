#!/usr/bin/env bash
# One device call: the GPU tests of the one-kernel token append, then step_host.py (a model's eager decode
# step, 1 x 32K) with the kvq of .before/ ("before": `git archive <commit> kvq | tar -x -C .before`) and with
# this checkout's ("after"), one process each, in the order ROUNDS gives (default: before after before after).
# Everything lands in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvq-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "commit: ${KVQ_COMMIT:-unknown}"
if [ -n "${TESTS:-1}" ]; then
  timeout -k 10 "${TEST_TIMEOUT:-260}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 ${TEST_PATHS:-tests/parity/test_pool_writers.py} \
      > "$OUT/gpu-tests.log" 2>&1
  echo "tests rc=$?"; tail -n 2 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -n 20
fi
CACHES="${CACHES:-StaticCache KIVI-K2V2:cupy Kitty:cupy KIVI-K2V2:triton Kitty:triton}"
k=0
for tree in ${ROUNDS:-before after before after}; do
  k=$((k + 1))
  timeout -k 10 "${STEP_TIMEOUT:-150}" python3 lab/2026-11-28-decode-host/step_host.py \
      $([ "$tree" = before ] && echo --kvq .before) --label "$tree" --shapes ${SHAPES:-1x32768} --steps 5 --blocks 2 \
      --caches $CACHES --out "$OUT/step_host-$k-$tree.json" > /tmp/step_host-$k-$tree.log 2>&1
  echo "step $k $tree rc=$?"; grep -E '^\{' "/tmp/step_host-$k-$tree.log" | cut -c1-220
done
