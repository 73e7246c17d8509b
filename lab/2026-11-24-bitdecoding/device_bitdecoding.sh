#!/usr/bin/env bash
# Issue 6 on the device in one call: the BitDecoding GPU tests, compute-sanitizer memcheck of both fused
# decodes over odd cache lengths, Nsight Compute's tensor-pipe / DRAM counters of one decode per backend,
# then the decode benchmark grid for what time is left. Everything lands in $OUT.
#
#   KVQ_COMMIT=<sha> bash lab/2026-11-24-bitdecoding/device_bitdecoding.sh                 # as the device tool's command
#   STEPS=bench CONTEXTS="131072" bash lab/2026-11-24-bitdecoding/device_bitdecoding.sh    # some steps / contexts only
#
# Steps (STEPS, default "tests,memcheck,ncu,bench"); each has its own timeout and a failed step does not
# stop the next. The grid's contexts / batches / g_q come from CONTEXTS / BATCHES / GQS; BENCH_S is its budget.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvq-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STEPS="${STEPS:-tests,memcheck,ncu,bench}"
T0=$SECONDS
nvidia-smi -L
echo "commit: ${KVQ_COMMIT:-unknown}"
has() { [[ ",$STEPS," == *",$1,"* ]]; }

if has tests; then
    echo "== gpu tests (BitDecoding)"
    XDIST=(); python3 -c "import xdist" 2>/dev/null && XDIST=(-n "${XDIST_N:-8}")
    timeout -k 10 "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} \
        tests/parity/test_bitdecoding_cache.py tests/parity/test_bitdecoding_decode_cupy.py \
        tests/parity/test_bitdecoding_decode_triton.py tests/parity/test_bitdecoding_cupy.py \
        tests/parity/test_bitdecoding_triton.py > "$OUT/gpu-bitdecoding-tests.log" 2>&1
    echo "rc=$? $(tail -n 1 "$OUT/gpu-bitdecoding-tests.log")  [$((SECONDS - T0)) s]"
fi

if has memcheck; then
    echo "== compute-sanitizer memcheck, odd lengths"
    timeout -k 10 "${SAN_TIMEOUT:-150}" compute-sanitizer --tool memcheck --error-exitcode 3 \
        python3 lab/2026-11-24-bitdecoding/bitdecoding_once.py --sanitize > "$OUT/memcheck.log" 2>&1
    echo "rc=$? $(grep -c ': ok$' "$OUT/memcheck.log") cases ok; $(grep -E 'ERROR SUMMARY|sanitize:' "$OUT/memcheck.log" | tr '\n' ' ')  [$((SECONDS - T0)) s]"
fi

if has ncu; then
    echo "== ncu counters of one decode (8 x 128K, g_q 4, KC2)"
    M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
    for be in cupy triton; do
        K=bd_decode; [ "$be" = triton ] && K=_decode_kernel
        for gq in 1 4 8; do
            timeout -k 10 90 ncu --kernel-name "regex:$K" --launch-skip 1 --launch-count 1 --metrics "$M" \
                python3 lab/2026-11-24-bitdecoding/bitdecoding_once.py --backend "$be" --B 8 --T 131072 --gq "$gq" --bits 2 \
                > "$OUT/ncu-$be-gq$gq.txt" 2>&1
            echo "$be g_q=$gq rc=$?"; grep -E "hmma|dram__|duration|registers" "$OUT/ncu-$be-gq$gq.txt" | sed 's/^ */    /'
        done
    done
    echo "[$((SECONDS - T0)) s]"
fi

if has bench; then
    echo "== decode grid"
    timeout -k 10 "$(( ${BENCH_S:-240} + 40 ))" python3 benchmarks/bench_bitdecoding_decode.py --out "$OUT" --quick \
        --batches ${BATCHES:-1 8 32} --contexts ${CONTEXTS:-8192 32768 131072} --gq ${GQS:-1 4 8} \
        --budget-s "${BENCH_S:-240}" --name "${BENCH_NAME:-bitdecoding_decode_grid}" 2>&1 | tee "$OUT/bench.log"
fi
echo "== done in $((SECONDS - T0)) s"
