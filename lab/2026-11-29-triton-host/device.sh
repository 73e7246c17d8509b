#!/usr/bin/env bash
# One device call for NOTE.md: what an eager Triton KIVI / Kitty decode call costs on the host once its
# launches are planned and run through their compiled kernels (kvq.fast.triton._launch), against the same
# calls of .before/ (`git archive <commit> kvq | tar -x -C .before`: the tree before the change).
#   TESTS=1     the Triton GPU tests (KIVI / Kitty parity, the model-level tests of the Triton caches)
#   HOST="1 8"  profile_host.py --backend triton at B x 32K, validation off, after then before per batch
#   STEP=1      step_host.py: a model's eager step at 1 x 32K (StaticCache, KIVI-K2V2 and Kitty on Triton)
#   AB=1        step_ab.py: the same step, compiled launches against Triton's dispatch, one process
#   EAGER=1     eager_calls.py: the Triton OSCAR and BitDecoding decodes, the same A/B per call
# Everything lands in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvq-out}"; mkdir -p "$OUT" /tmp/h
export PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
echo "commit: ${KVQ_COMMIT:-unknown}" | tee -a "$OUT/card.txt"
if [ -n "${TESTS-1}" ]; then
  timeout -k 10 "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 \
      ${TEST_PATHS:-tests/parity/test_kivi_kitty_parity.py tests/integrations/test_kvq_attention.py tests/integrations/test_graphs.py} \
      -k "${TEST_K:-triton or graph}" -rfE --tb=short > "$OUT/gpu-tests.log" 2>&1
  echo "tests rc=$?"; tail -n 2 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -n 20
fi
for B in ${HOST-1 8}; do
  for tree in after before; do
    timeout -k 10 "${HOST_TIMEOUT:-100}" python3 - "$B" "$tree" <<'PY' > "/tmp/h/$tree-B$B.log" 2>&1
import runpy, sys
B, tree = sys.argv[1:3]
if tree == "before":                   # the interpreter puts the working directory first: .before/ goes before it
    sys.path.insert(0, ".before")
import kvq, kvq.fast.common as C
print("kvq from", kvq.__file__)
C.set_validation(False)
sys.argv = ["profile_host.py", "--backend", "triton", "--methods", "KIVI-K2V2,Kitty", "--B", B, "--T", "32768",
            "--calls", "200", "--out", f"/tmp/h/{tree}-B{B}"]
runpy.run_path("benchmarks/profile_host.py", run_name="__main__")
PY
    echo "$tree B=$B rc=$?"; grep -E "host_us" "/tmp/h/$tree-B$B.log" | cut -c1-200 | head -n 4
  done
done
[ -d /tmp/h/after-B1 ] && tar -czf "$OUT/host.tgz" -C /tmp/h .
if [ -n "${STEP-1}" ]; then
  for tree in after before; do
    timeout -k 10 "${STEP_TIMEOUT:-150}" python3 lab/2026-11-28-decode-host/step_host.py \
        $( [ "$tree" = before ] && echo --kvq .before ) --shapes 1x32768 --steps 5 --blocks 2 \
        --caches StaticCache KIVI-K2V2:triton Kitty:triton --label "$tree" --out "$OUT/step_host-$tree.json" \
        > "/tmp/h/step-$tree.log" 2>&1
    echo "step $tree rc=$?"; grep -E "^\{" "/tmp/h/step-$tree.log" | cut -c1-250
  done
  tar -czf "$OUT/host.tgz" -C /tmp/h .
fi
if [ -n "${AB:-}" ]; then
  timeout -k 10 "${AB_TIMEOUT:-200}" python3 lab/2026-11-29-triton-host/step_ab.py --out "$OUT/step_ab.json" \
      > "$OUT/step_ab.log" 2>&1
  echo "step_ab rc=$?"; grep -E "^\{" "$OUT/step_ab.log" | cut -c1-250
fi
if [ -n "${EAGER:-}" ]; then
  timeout -k 10 "${EAGER_TIMEOUT:-150}" python3 lab/2026-11-29-triton-host/eager_calls.py --out "$OUT/eager_calls.json" \
      > "$OUT/eager_calls.log" 2>&1
  echo "eager_calls rc=$?"; grep -E "^\{" "$OUT/eager_calls.log" | cut -c1-250; tail -n 3 "$OUT/eager_calls.log" | cut -c1-300
fi
