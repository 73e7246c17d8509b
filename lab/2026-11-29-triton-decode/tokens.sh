#!/usr/bin/env bash
# One device call for TOKENS.md: the Triton KIVI / Kitty parity tests on the GPU (both fused kernels), then
# sweep.py --grid $GRID (default tokens-3: the rows kernel against _tokens_kernel's knobs at the issue's shapes, GPU time),
# then kernels.py (each kernel's device time per call). Everything lands in $OUT. TESTS= (empty) skips the
# tests; SWEEP= the sweep; KERNELS= the profile; BASELINE=1 adds baseline.py (KIVI / Kitty only), RUNALL=1
# run_all.py (ceilings, kivi_kitty), E2E=1 e2e_ab.py, NCU=1 Nsight Compute on _tokens_kernel.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvq-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
echo "commit: ${KVQ_COMMIT:-unknown}" | tee -a "$OUT/card.txt"
if [ -n "${TESTS-1}" ]; then
  timeout -k 10 "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 \
      ${TEST_PATHS:-tests/parity/test_kivi_kitty_parity.py} -k "${TEST_K:-triton}" > "$OUT/gpu-tests.log" 2>&1
  echo "tests rc=$?"; tail -n 2 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -n 20
fi
if [ -n "${SWEEP-1}" ]; then
  timeout -k 10 "${SWEEP_TIMEOUT:-330}" python3 lab/2026-11-29-triton-decode/sweep.py --grid "${GRID:-tokens-3}" \
      --out "$OUT/tokens-sweep.json" --budget-s "${SWEEP_BUDGET:-300}" ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$?"; grep -c "check=True" "$OUT/sweep.log"; grep -E "ERR|check=False" "$OUT/sweep.log" | head -n 10
fi
if [ -n "${KERNELS-1}" ]; then
  timeout -k 10 "${KERNELS_TIMEOUT:-120}" python3 lab/2026-11-29-triton-decode/kernels.py --out "$OUT/kernels.json" \
      > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$?"; tail -n 3 "$OUT/kernels.log" | cut -c1-400
fi
if [ -n "${BASELINE:-}" ]; then      # BASELINE=1: baseline.py --only kivi_kitty (SDPA, Triton, CuPy; the issue's shapes)
  timeout -k 10 "${BASELINE_TIMEOUT:-400}" python3 lab/2026-11-29-triton-decode/baseline.py --out "$OUT/baseline" \
      --only kivi_kitty --budget-s "${BASELINE_BUDGET:-330}" > "$OUT/baseline.log" 2>&1
  echo "baseline rc=$?"; tail -n 8 "$OUT/baseline.log" | cut -c1-300
  tar -czf "$OUT/baseline.tgz" -C "$OUT" baseline && rm -rf "$OUT/baseline"
fi
if [ -n "${RUNALL:-}" ]; then        # RUNALL=1: the suite's KIVI / Kitty benchmark, all its shapes (results/h200)
  timeout -k 10 "${RUNALL_TIMEOUT:-260}" python3 benchmarks/run_all.py --out "$OUT/run_all" --only ceilings,kivi_kitty \
      --budget-s "${RUNALL_BUDGET:-200}" > "$OUT/run_all.log" 2>&1
  echo "run_all rc=$?"; tail -n 4 "$OUT/run_all.log" | cut -c1-300
  tar -czf "$OUT/run_all.tgz" -C "$OUT" run_all && rm -rf "$OUT/run_all"
fi
if [ -n "${E2E:-}" ]; then           # E2E=1: e2e_ab.py (the model's step, rows then tokens knobs, one process)
  timeout -k 10 "${E2E_TIMEOUT:-300}" python3 lab/2026-11-29-triton-decode/e2e_ab.py --out "$OUT/e2e" \
      ${E2E_ROUNDS:+--rounds $E2E_ROUNDS} > "$OUT/e2e.log" 2>&1
  echo "e2e rc=$?"; grep -E "ms|round" "$OUT/e2e.log" | cut -c1-200 | tail -n 16
  tar -czf "$OUT/e2e.tgz" -C "$OUT" e2e && rm -rf "$OUT/e2e"
fi
if [ -n "${NCU:-}" ]; then            # NCU=1: Nsight Compute on _tokens_kernel (NCU_SHAPE "B T METHOD"), stalls as the H100 lab reads them
  read -r B T M <<< "${NCU_SHAPE:-8 32768 KIVI-K2V2}"
  D="$OUT/ncu"; mkdir -p "$D"; tag="tokens_${M}_B${B}_T${T}"
  timeout -k 10 "${NCU_TIMEOUT:-200}" ncu --kernel-name "regex:${NCU_KERNEL:-_tokens_kernel}" --launch-count 1 --set full \
      --import-source no -f -o "$D/$tag" python3 benchmarks/profile_fused.py --backend triton --once --B "$B" --T "$T" \
      --methods "$M" > "$D/$tag.run.log" 2>&1; echo "ncu rc=$?"
  ncu -i "$D/$tag.ncu-rep" --page details > "$D/$tag.details.txt" 2>&1
  ncu -i "$D/$tag.ncu-rep" --page source --csv --print-source sass > "$D/$tag.sass.csv" 2>&1
  python3 lab/2026-11-22-kivi-kitty-decode/ncu_stalls.py "$D/$tag.sass.csv" > "$D/$tag.stalls.txt" 2>&1
  head -n 14 "$D/$tag.stalls.txt"
  grep -E "Duration|Executed Ipc A|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|DRAM Throughput|Achieved Occupancy|Registers Per|Shared Memory Configuration Size|Block Limit" \
      "$D/$tag.details.txt" | head -n 24
  rm -f "$D/$tag.ncu-rep"; tar -czf "$OUT/ncu-tokens.tgz" -C "$OUT" ncu && rm -rf "$D"
fi
