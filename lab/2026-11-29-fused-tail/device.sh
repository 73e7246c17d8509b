#!/usr/bin/env bash
# One device call for NOTE.md: the Triton KIVI / Kitty decode with the tail attended in _tokens_kernel's
# launch (660df17), by GPU time against the gathered tail and SDPA, and by host time against .before/
# (`git archive 1e07ef3 kvq | tar -x -C .before`), plus the GPU tests of what changed.
#   TESTS=1   the KIVI / Kitty parity tests on Triton and the model-level tests (-k "triton or graph")
#   SWEEP=1   sweep.py --grid fused-tail at SHAPES (GPU time by CUDA-graph replay, every row checked)
#   EAGER=1   lab/2026-11-29-oscar-host/eager_calls.py at 1 x 32K: after, then before
# Everything lands in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvq-out}"; mkdir -p "$OUT" /tmp/h
export PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
echo "commit: ${KVQ_COMMIT:-unknown}" | tee -a "$OUT/card.txt"
if [ -n "${TESTS-1}" ]; then
  timeout -k 10 "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 \
      tests/parity/test_kivi_kitty_parity.py tests/integrations/test_kvq_attention.py tests/integrations/test_graphs.py \
      -k "${TEST_K:-triton or graph}" -rfE --tb=short > "$OUT/gpu-tests.log" 2>&1
  echo "tests rc=$?"; tail -n 2 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -n 20
fi
if [ -n "${SWEEP-1}" ]; then
  timeout -k 10 "${SWEEP_TIMEOUT:-220}" python3 lab/2026-11-29-triton-decode/sweep.py --grid fused-tail \
      --shapes ${SHAPES:-1x32768 1x131072 8x32768 8x131072 32x32768} --budget-s "${SWEEP_BUDGET:-190}" \
      --out "$OUT/sweep-fused-tail.json" > "/tmp/h/sweep.log" 2>&1
  echo "sweep rc=$?"; grep -E "us check|SDPA" /tmp/h/sweep.log | cut -c1-160
fi
if [ -n "${EAGER-1}" ]; then
  for tree in after before; do
    timeout -k 10 "${EAGER_TIMEOUT:-60}" python3 lab/2026-11-29-oscar-host/eager_calls.py \
        $( [ "$tree" = before ] && echo --kvq .before ) --out "$OUT/eager-$tree.json" > "/tmp/h/eager-$tree.log" 2>&1
    echo "eager $tree rc=$?"; grep -E "^\{" "/tmp/h/eager-$tree.log" | cut -c1-200; tail -n 2 "/tmp/h/eager-$tree.log" | cut -c1-300
  done
fi
tar -czf "$OUT/logs.tgz" -C /tmp/h .
