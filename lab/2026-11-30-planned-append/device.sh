#!/usr/bin/env bash
# The device call of NOTE.md: the GPU tests of the OSCAR append, kvq's Python per layer against .before_pkg
# (the tree of c42c43d, renamed kvq_before: ../2026-11-30-layer-host/NOTE.md has the commands), through
# ../2026-11-30-layer-host/device.sh, then one eager decode call's host time and its cProfile
# (benchmarks/profile_host.py) on each backend, and the batch-1 decode step through benchmarks/bench_e2e.py.
#   PH=1          profile_host.py, Triton and CuPy (PH_METHODS, default KIVI-K2V2,Kitty,OSCAR; PH_ARGS, e.g.
#                 --validation off)
#   KT=1          kernel_times.py: GPU time per kernel of one decode call (KT_CASES, KT_ARGS)
#   E2E=1         bench_e2e.py at E2E_SHAPES (default 1x32768) for E2E_CACHES, with E2E_ARGS (e.g. --graph 5);
#                 the wheels in .whl/ (optimum-quanto for the quanto rows) are installed first where present
# The other variables: ../2026-11-30-layer-host/device.sh (TESTS, TEST_PATHS, AB, AB_ARGS, ...).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvq-out}"; mkdir -p "$OUT" /tmp/h
bash lab/2026-11-30-layer-host/device.sh
if [ -n "${PH:-}" ]; then
  for be in triton cupy; do
    mkdir -p "/tmp/h/ph-$be"
    timeout -k 10 "${PH_TIMEOUT:-200}" python3 benchmarks/profile_host.py --backend $be \
        --methods "${PH_METHODS:-KIVI-K2V2,Kitty,OSCAR}" --calls 200 ${PH_ARGS:-} --out "/tmp/h/ph-$be" > "/tmp/h/ph-$be.log" 2>&1
    echo "ph $be rc=$?"; grep -E "^\{" "/tmp/h/ph-$be.log" | cut -c1-250; tail -n 2 "/tmp/h/ph-$be.log" | cut -c1-250
  done
  tar -czf "$OUT/layer.tgz" -C /tmp/h .
fi
if [ -n "${KT:-}" ]; then
  timeout -k 10 "${KT_TIMEOUT:-200}" python3 lab/2026-11-30-planned-append/kernel_times.py ${KT_ARGS:-} \
      --out "$OUT/kernels.json" > /tmp/h/kernels.log 2>&1
  echo "kt rc=$?"; cut -c1-600 /tmp/h/kernels.log | tail -n 12
fi
if [ -n "${E2E:-}" ]; then
  tag="${E2E_TAG:-}"
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PWD:/tmp/site"
  fi
  timeout -k 10 "${E2E_TIMEOUT:-300}" python3 benchmarks/bench_e2e.py --shapes ${E2E_SHAPES:-1x32768} \
      --caches ${E2E_CACHES:-StaticCache OSCAR:triton OSCAR:cupy} --steps 4 --warmup 2 ${E2E_ARGS:-} \
      --out "$OUT/e2e$tag.json" > "$OUT/e2e$tag.log" 2>&1
  echo "e2e$tag rc=$?"; tail -n 40 "$OUT/e2e$tag.log" | cut -c1-250
fi
