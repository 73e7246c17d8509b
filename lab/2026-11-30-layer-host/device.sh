#!/usr/bin/env bash
# The device calls of NOTE.md: kvq's Python per layer of an eager decode step (update + kvq attention) and per
# eager decode call, this tree against .before/ (`git archive e1009b1 kvq | tar -x -C .before`), and the GPU
# tests of what changed.
#   TESTS=1   the GPU tests (TEST_PATHS / TEST_K to change them)
#   LAYER=1   layer_host.py at 1 x 32K, after / before / after / before (one process each)
#   EAGER=1   lab/2026-11-29-oscar-host/eager_calls.py at 1 x 32K, after then before
#   AB=1      ab_layer.py: this tree against $AB_BEFORE (default .before_pkg; its kvq renamed kvq_before) in one
#             process, rounds interleaved, to $OUT/ab_layer$AB_TAG.json
# Everything lands in $OUT (at most 8 files come back: logs are tarred).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvq-out}"; mkdir -p "$OUT" /tmp/h
export PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
echo "commit: ${KVQ_COMMIT:-unknown}" | tee -a "$OUT/card.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/card.txt"
if [ -n "${TESTS:-}" ]; then
  timeout -k 10 "${TEST_TIMEOUT:-400}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 \
      ${TEST_PATHS:-tests/parity/test_bitdecoding_decode_triton.py tests/parity/test_oscar_decode_parity.py \
      tests/parity/test_oscar_decode_cupy.py tests/parity/test_kivi_kitty_parity.py tests/fast/test_triton_plans.py \
      tests/integrations/test_kvq_attention.py tests/integrations/test_graphs.py} -k "${TEST_K:-not nothing}" \
      -rfE --tb=short > "$OUT/gpu-tests.log" 2>&1
  echo "tests rc=$?"; tail -n 2 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -n 20
fi
if [ -n "${LAYER:-}" ]; then
  for tree in after before after before; do
    n=$(ls /tmp/h | grep -c "^layer-$tree" || true)
    timeout -k 10 "${LAYER_TIMEOUT:-150}" python3 lab/2026-11-30-layer-host/layer_host.py \
        $( [ "$tree" = before ] && echo --kvq .before ) --out "/tmp/h/layer-$tree-$n.json" > "/tmp/h/layer-$tree-$n.log" 2>&1
    echo "layer $tree $n rc=$?"; grep -E "^\{" "/tmp/h/layer-$tree-$n.log" | cut -c1-200
  done
  tar -czf "$OUT/layer.tgz" -C /tmp/h .
fi
if [ -n "${EAGER:-}" ]; then
  for tree in after before; do
    timeout -k 10 "${EAGER_TIMEOUT:-90}" python3 lab/2026-11-29-oscar-host/eager_calls.py \
        $( [ "$tree" = before ] && echo --kvq .before ) --out "/tmp/h/eager-$tree.json" > "/tmp/h/eager-$tree.log" 2>&1
    echo "eager $tree rc=$?"; grep -E "^\{" "/tmp/h/eager-$tree.log" | cut -c1-200; tail -n 2 "/tmp/h/eager-$tree.log" | cut -c1-300
  done
  tar -czf "$OUT/layer.tgz" -C /tmp/h .
fi
if [ -n "${AB:-}" ]; then
  tag="${AB_TAG:-}"
  timeout -k 10 "${AB_TIMEOUT:-300}" python3 lab/2026-11-30-layer-host/ab_layer.py --before "${AB_BEFORE:-.before_pkg}" \
      --out "$OUT/ab_layer$tag.json" ${AB_ARGS:-} > "/tmp/h/ab_layer$tag.log" 2>&1
  echo "ab$tag rc=$?"; grep -E "^\{" "/tmp/h/ab_layer$tag.log" | cut -c1-250; tail -n 3 "/tmp/h/ab_layer$tag.log" | cut -c1-300
  tar -czf "$OUT/layer.tgz" -C /tmp/h .
fi
