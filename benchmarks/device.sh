#!/usr/bin/env bash
# One device call: versions, the GPU tests, then every benchmark; everything lands in $OUT.
#
#   bash benchmarks/device.sh [COMMIT]          # as the device tool's command, from the repository root
#   BENCH_QUICK=1 bash benchmarks/device.sh     # fewer shapes and rounds
#   BENCH_ONLY=ceilings,kivi_kitty bash benchmarks/device.sh   # some benchmark sections only
#   BENCH_ONLY=ceilings,aqua bash benchmarks/device.sh         # AQUA-KV (aqua.json); sections: ceilings, quant,
#                                                                decode, kivi_kitty, oscar, aqua (run_all.py --only)
#
# COMMIT (or env KVQ_COMMIT) names the commit in the results (a .git on the device copy may be stale).
# Each step has its own timeout (tests TEST_TIMEOUT=240 s, benchmarks BENCH_TIMEOUT=280 s) and a failed
# step does not stop the next. Files written to $OUT (7; the device returns at most 8):
#   gpu-tests.xml gpu-tests.log gpu-tests.json bench.log ceilings.json quant.json decode.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvq-out}"
mkdir -p "$OUT"
if [ "$#" -ge 1 ] && [ -n "$1" ]; then export KVQ_COMMIT="$1"; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
T0=$SECONDS

echo "== device"
nvidia-smi -L
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv,noheader
python3 - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for m in ("triton", "cupy", "numpy", "pytest", "hypothesis"):
    try:
        print(f"  {m} {__import__(m).__version__}")
    except Exception as e:
        print(f"  {m} unavailable: {type(e).__name__}")
EOF
nvcc --version 2>/dev/null | tail -n 1
echo "commit: ${KVQ_COMMIT:-unknown}"

echo "== gpu tests"
# pytest-xdist (on the device image) spreads the tests over XDIST_N (8) processes: Triton and NVRTC compile on the CPU.
XDIST=()
if python3 -c "import xdist" 2>/dev/null; then XDIST=(-n "${XDIST_N:-8}"); fi
timeout -k 10 "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} tests/ \
    --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log"
TEST_RC=${PIPESTATUS[0]}
python3 benchmarks/junit_summary.py "$OUT/gpu-tests.xml" "$OUT/gpu-tests.json" --rc "$TEST_RC"
echo "[$((SECONDS - T0)) s] tests done"

echo "== benchmarks"
QUICK=()
if [ "${BENCH_QUICK:-0}" = "1" ]; then QUICK=(--quick); fi
timeout -k 10 "${BENCH_TIMEOUT:-280}" python3 benchmarks/run_all.py --out "$OUT" \
    --only "${BENCH_ONLY:-ceilings,quant,decode,kivi_kitty}" \
    --budget-s "$(( ${BENCH_TIMEOUT:-280} - 30 ))" ${QUICK[@]+"${QUICK[@]}"} \
    2>&1 | tee "$OUT/bench.log"
BENCH_RC=${PIPESTATUS[0]}

echo "== done in $((SECONDS - T0)) s: tests rc=$TEST_RC, benchmarks rc=$BENCH_RC"
