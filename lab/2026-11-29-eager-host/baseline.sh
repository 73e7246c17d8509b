#!/usr/bin/env bash
# One device call: where an eager decode call and an eager model step spend their host time now (issue 37,
# item 3: at most 40 us of Python per eager decode_attention call). Everything lands in $OUT.
#   profile_host.py (CuPy, then Triton) at 1 x 32K, and step_host.py at 1 x 32K with its cProfile.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvq-out}"; mkdir -p "$OUT" /tmp/h
export PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "commit: ${KVQ_COMMIT:-unknown}"
for be in ${BACKENDS:-cupy triton}; do
  timeout -k 10 200 python3 benchmarks/profile_host.py --methods "${METHODS:-KIVI-K2V2,Kitty,OSCAR}" --backend $be \
      --B 1 --T 32768 --calls 200 --out /tmp/h/host-$be > /tmp/h/host-$be.log 2>&1
  echo "host $be rc=$?"; grep -E '^\{' /tmp/h/host-$be.log | cut -c1-400
done
if [ -n "${STEP:-1}" ]; then
  timeout -k 10 300 python3 lab/2026-11-28-decode-host/step_host.py --shapes 1x32768 --steps 5 --blocks 2 \
      --caches ${CACHES:-StaticCache KIVI-K2V2:cupy Kitty:cupy OSCAR:cupy BitDecoding-2:cupy KIVI-K2V2:triton} \
      --out "$OUT/step_host.json" > /tmp/h/step_host.log 2>&1
  echo "step rc=$?"; grep -v -i warn /tmp/h/step_host.log | tail -n 20
fi
tar -czf "$OUT/host.tar.gz" -C /tmp/h .
