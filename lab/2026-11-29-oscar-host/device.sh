#!/usr/bin/env bash
# One device call for NOTE.md: the Triton OSCAR decode's and append's host cost after 0c7392a (sink and
# window read in place, rotate_heads, launches kept across steps), against .before/ (`git archive 95e408b kvq
# | tar -x -C .before`), and the GPU tests of what changed.
#   TESTS=1   the GPU tests: OSCAR decode / parity / fused append, BitDecoding decode / cache, attention,
#             plans, the model-level tests (TEST_PATHS / TEST_K to change them)
#   HOST=1    profile_host.py --backend triton --methods OSCAR at 1 x 32K, after then before
#   EAGER=1   eager_calls.py (OSCAR, BitDecoding-KC2, KIVI-K2V2, Kitty, SDPA) at 1 x 32K, after then before
#   STEP=1    step_host.py at 1 x 32K (StaticCache and $STEP_CACHES): after, then before
# Everything lands in $OUT (at most 8 files come back: logs are tarred).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvq-out}"; mkdir -p "$OUT" /tmp/h
export PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
echo "commit: ${KVQ_COMMIT:-unknown}" | tee -a "$OUT/card.txt"
if [ -n "${TESTS-1}" ]; then
  timeout -k 10 "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 \
      ${TEST_PATHS:-tests/parity/test_oscar_decode_parity.py tests/parity/test_oscar_parity.py tests/parity/test_oscar_append_fused.py \
      tests/parity/test_attention_parity.py tests/fast/test_triton_plans.py tests/integrations/test_kvq_attention.py \
      tests/integrations/test_graphs.py} -k "${TEST_K:-triton or graph}" -rfE --tb=short > "$OUT/gpu-tests.log" 2>&1
  echo "tests rc=$?"; tail -n 2 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -n 20
fi
if [ -n "${HOST-1}" ]; then
  for tree in after before; do
    timeout -k 10 "${HOST_TIMEOUT:-120}" python3 - "$tree" <<'PY' > "/tmp/h/host-$tree.log" 2>&1
import runpy, sys
tree = sys.argv[1]
if tree == "before":
    sys.path.insert(0, ".before")
import kvq, kvq.fast.common as C
print("kvq from", kvq.__file__)
C.set_validation(False)
sys.argv = ["profile_host.py", "--backend", "triton", "--methods", "OSCAR", "--B", "1", "--T", "32768",
            "--calls", "200", "--out", f"/tmp/h/{tree}"]
runpy.run_path("benchmarks/profile_host.py", run_name="__main__")
PY
    echo "host $tree rc=$?"; grep -E "host_us" "/tmp/h/host-$tree.log" | cut -c1-250 | head -n 4
  done
  tar -czf "$OUT/host.tgz" -C /tmp/h .
fi
if [ -n "${EAGER:-}" ]; then
  for tree in after before; do
    timeout -k 10 "${EAGER_TIMEOUT:-60}" python3 lab/2026-11-29-oscar-host/eager_calls.py \
        $( [ "$tree" = before ] && echo --kvq .before ) --out "$OUT/eager-$tree.json" > "/tmp/h/eager-$tree.log" 2>&1
    echo "eager $tree rc=$?"; grep -E "^\{" "/tmp/h/eager-$tree.log" | cut -c1-200; tail -n 2 "/tmp/h/eager-$tree.log" | cut -c1-300
  done
  tar -czf "$OUT/host.tgz" -C /tmp/h .
fi
if [ -n "${STEP-1}" ]; then
  for tree in after before; do
    timeout -k 10 "${STEP_TIMEOUT:-120}" python3 lab/2026-11-28-decode-host/step_host.py \
        $( [ "$tree" = before ] && echo --kvq .before ) --shapes 1x32768 --steps 5 --blocks 2 \
        --caches StaticCache ${STEP_CACHES:-OSCAR:triton KIVI-K2V2:triton} --label "$tree" --out "$OUT/step_host-$tree.json" \
        > "/tmp/h/step-$tree.log" 2>&1
    echo "step $tree rc=$?"; grep -E "^\{" "/tmp/h/step-$tree.log" | cut -c1-250
  done
  tar -czf "$OUT/host.tgz" -C /tmp/h .
fi
