#!/usr/bin/env bash
# The device call of NOTE.md: the GPU tests, kvq's Python per layer and per eager decode call against
# .before_pkg / .before (the trees of main's head before this change; the commands are in ../2026-11-30-layer-host/NOTE.md),
# through ../2026-11-30-layer-host/device.sh, then one decode step of the 8B-shaped model at batch 1 through
# benchmarks/bench_e2e.py: eager, by graph replay, and through kvq.integrations.graphs, one run on one card.
#   E2E_SHAPES (default 1x32768), E2E_CACHES, E2E_TIMEOUT; the other variables: ../2026-11-30-layer-host/device.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvq-out}"; mkdir -p "$OUT"
bash lab/2026-11-30-layer-host/device.sh
if [ -n "${E2E:-}" ]; then
  tag="${E2E_TAG:-}"
  timeout -k 10 "${E2E_TIMEOUT:-300}" python3 benchmarks/bench_e2e.py --shapes ${E2E_SHAPES:-1x32768} \
      --caches ${E2E_CACHES:-StaticCache quanto-2 KIVI-K2V2:triton Kitty:triton BitDecoding-2:triton OSCAR:triton \
      KIVI-K2V2:cupy Kitty:cupy BitDecoding-2:cupy OSCAR:cupy} --steps 4 --warmup 2 --graph 5 --graphed 3 \
      --out "$OUT/e2e$tag.json" > "$OUT/e2e$tag.log" 2>&1
  echo "e2e$tag rc=$?"; tail -n 25 "$OUT/e2e$tag.log" | cut -c1-250
fi
if [ -n "${PROFILE:-}" ]; then
  mkdir -p /tmp/h
  timeout -k 10 "${PROFILE_TIMEOUT:-150}" python3 lab/2026-11-30-layer-host/layer_host.py --caches ${PROFILE_CACHES:-KIVI-K2V2:triton OSCAR:triton} \
      --calls 10 --rounds 2 --profile 10 --out /tmp/h/profile.json > /tmp/h/profile.log 2>&1
  echo "profile rc=$?"; grep -E "^\{" /tmp/h/profile.log | cut -c1-200
  tar -czf "$OUT/layer.tgz" -C /tmp/h .
fi
