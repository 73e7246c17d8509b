#!/usr/bin/env bash
# Issue 7 on the device in one call: the HF-integration GPU tests, then the tiny Llama-style LM trained
# from scratch (benchmarks/train_tiny_lm.py), then `kvq eval ppl` of every method on its held-out text,
# calibrations fit in the same call (no checkpoint travels). Everything lands in $OUT.
#
#   KVQ_COMMIT=<sha> bash benchmarks/device_tiny_lm.sh
#   STEPS=tests bash benchmarks/device_tiny_lm.sh          # steps: tests, train, ppl, throughput
#
# TRAIN_MINUTES (4), TRAIN_ARGS, PPL_SEQ (2048: the training context and the evaluation window; RoPE
# positions past the training context are untrained), PPL_WINDOWS (16), PPL_CHUNK (256), PPL_CALIB_TOKENS
# (8192), PPL_BACKEND (reference; auto = the Triton tier on the GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvq-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
STEPS="${STEPS:-tests,train,ppl}"
MODEL="${MODEL_DIR:-/tmp/kvq-tiny-lm}"
T0=$SECONDS
nvidia-smi -L
echo "commit: ${KVQ_COMMIT:-unknown}"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
has() { [[ ",$STEPS," == *",$1,"* ]]; }

if has tests; then
    echo "== gpu tests (kvq.integrations)"
    XDIST=(); python3 -c "import xdist" 2>/dev/null && XDIST=(-n "${XDIST_N:-8}")
    timeout -k 10 "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} \
        tests/integrations > "$OUT/gpu-integrations-tests.log" 2>&1
    echo "rc=$? $(tail -n 1 "$OUT/gpu-integrations-tests.log")  [$((SECONDS - T0)) s]"
fi

if has train; then
    echo "== train the tiny LM"
    timeout -k 10 "${TRAIN_TIMEOUT:-400}" python3 benchmarks/train_tiny_lm.py --out "$MODEL" \
        --minutes "${TRAIN_MINUTES:-4}" --seq-len "${PPL_SEQ:-2048}" ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
    echo "rc=$?  [$((SECONDS - T0)) s]"; tail -n 4 "$OUT/train.log"
    cp "$MODEL/train.json" "$OUT/train.json" 2>/dev/null
fi

if has ppl; then
    echo "== kvq eval ppl"
    timeout -k 10 "${PPL_TIMEOUT:-300}" python3 -m kvq eval ppl --model "$MODEL" --windows "${PPL_WINDOWS:-16}" \
        --seq-len "${PPL_SEQ:-2048}" --chunk "${PPL_CHUNK:-256}" --batch-size "${PPL_WINDOWS:-16}" --calibrate \
        --calib-tokens "${PPL_CALIB_TOKENS:-8192}" --calib-seq-len "${PPL_SEQ:-2048}" \
        --backend "${PPL_BACKEND:-reference}" --dtype float32 --out "$OUT/ppl.json" --quiet > "$OUT/ppl.log" 2>&1
    echo "rc=$?  [$((SECONDS - T0)) s]"; grep -v "^{" "$OUT/ppl.log" | tail -n 16
fi

if has throughput; then
    echo "== throughput at a fixed memory budget"
    if [ ! -f "$MODEL/config.json" ]; then        # speed does not depend on the weights: a short run will do
        python3 benchmarks/train_tiny_lm.py --out "$MODEL" --steps 20 --seq-len 1024 > "$OUT/train-short.log" 2>&1
    fi
    mkdir -p /tmp/kvq-calib
    python3 -m kvq calibrate oscar --model "$MODEL" --out /tmp/kvq-calib/oscar.safetensors --tokens 4096 \
        --seq-len 1024 --quiet > "$OUT/calibrate.log" 2>&1
    python3 -m kvq calibrate aqua --model "$MODEL" --out /tmp/kvq-calib/aqua.safetensors --tokens 4096 \
        --seq-len 1024 --quiet >> "$OUT/calibrate.log" 2>&1
    echo "calibrated [$((SECONDS - T0)) s]"
    timeout -k 10 "${TP_TIMEOUT:-240}" python3 benchmarks/throughput_tiny_lm.py --model "$MODEL" --calib /tmp/kvq-calib \
        --quiet --out "$OUT/throughput.json" ${TP_ARGS:-} > "$OUT/throughput.log" 2>&1
    echo "rc=$?  [$((SECONDS - T0)) s]"; tail -n 20 "$OUT/throughput.log"
fi
echo "== done in $((SECONDS - T0)) s"
