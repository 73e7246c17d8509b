#!/usr/bin/env bash
# One device call of the reliability and production-decode work (issues 36, 37); everything lands in $OUT.
#
#   STEPS="tests memcheck" TEST_N=12 SHUFFLE=1 bash benchmarks/device_session.sh
#   STEPS="tests e2e" TEST_N=8 bash benchmarks/device_session.sh
#
# Steps (in this order, each under its own timeout; a failed step does not stop the next):
#   tests     the GPU suite (TEST_PATHS, default tests/): pytest -m gpu -n TEST_N [--shuffle=SHUFFLE] -> gpu-tests-<tag>.{log,json}
#   memcheck  compute-sanitizer memcheck over every fast cache's append / decode and rejected calls
#             (benchmarks/memcheck_caches.py) -> memcheck.log
#   e2e       benchmarks/bench_e2e.py (E2E_ARGS) -> e2e.json, e2e.log; optimum-quanto and hqq are installed
#             from .whl/ (carried) into /tmp/site for this step only
#   host      benchmarks/profile_host.py (HOST_METHODS, HOST_BACKEND, HOST_ARGS) -> host.json, host.log,
#             host-profiles.tar.gz
#   syncs     lab/2026-11-28-step-syncs/step_syncs.py (SYNCS_ARGS) -> step_syncs.json, step_syncs.log
# KVQ_COMMIT names the commit in the results (the device copy's .git may be stale).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvq-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STEPS="${STEPS:-tests}"
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
echo "commit: ${KVQ_COMMIT:-unknown}"

for step in $STEPS; do
  case "$step" in
  tests)
    TAG="n${TEST_N:-8}${SHUFFLE:+-shuffle$SHUFFLE}${TEST_PATHS:+-part}"
    timeout -k 10 "${TEST_TIMEOUT:-480}" python3 -m pytest -m gpu -q -p no:cacheprovider -n "${TEST_N:-8}" \
        ${SHUFFLE:+--shuffle=$SHUFFLE} ${TEST_PATHS:-tests/} --junitxml="$OUT/gpu-tests-$TAG.xml" > "$OUT/gpu-tests-$TAG.log" 2>&1
    RC=$?
    python3 benchmarks/junit_summary.py "$OUT/gpu-tests-$TAG.xml" "$OUT/gpu-tests-$TAG.json" --rc "$RC"
    rm -f "$OUT/gpu-tests-$TAG.xml"
    tail -n 3 "$OUT/gpu-tests-$TAG.log"
    grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests-$TAG.log" | head -n 40
    ;;
  memcheck)
    timeout -k 10 "${MEMCHECK_TIMEOUT:-200}" compute-sanitizer --tool memcheck --error-exitcode 99 \
        python3 benchmarks/memcheck_caches.py > "$OUT/memcheck.log" 2>&1
    echo "memcheck rc=$?"
    grep -E "memcheck_caches:|ERROR SUMMARY|failed$" "$OUT/memcheck.log" | grep -v " 0 failed$" | head -n 30
    ;;
  e2e)
    if [ -d .whl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && E2E_PATH=/tmp/site
    fi
    PYTHONPATH="$PYTHONPATH${E2E_PATH:+:$E2E_PATH}" timeout -k 10 "${E2E_TIMEOUT:-360}" \
        python3 benchmarks/bench_e2e.py --out "$OUT/e2e.json" ${E2E_ARGS:-} > "$OUT/e2e.log" 2>&1
    echo "e2e rc=$?"
    grep -v -i warn "$OUT/e2e.log" | tail -n 60
    ;;
  host)
    # the eager host cost of one decode call (profile_host.py: host / wall / graph-replay us per call, and
    # cProfile tables, packed into one file to keep $OUT under the device tool's file count)
    mkdir -p /tmp/host
    timeout -k 10 "${HOST_TIMEOUT:-240}" python3 benchmarks/profile_host.py --out /tmp/host \
        --methods "${HOST_METHODS:-KIVI-K2V2,Kitty,OSCAR}" --backend "${HOST_BACKEND:-cupy}" ${HOST_ARGS:-} > "$OUT/host.log" 2>&1
    echo "host rc=$?"
    cp /tmp/host/host.json "$OUT/host.json" 2>/dev/null
    tar -czf "$OUT/host-profiles.tar.gz" -C /tmp/host . 2>/dev/null
    tail -n 20 "$OUT/host.log"
    ;;
  syncs)
    # lab/2026-11-28-step-syncs: a model's decode step with validation on / off (syncs counted)
    timeout -k 10 "${SYNCS_TIMEOUT:-200}" python3 lab/2026-11-28-step-syncs/step_syncs.py --out "$OUT/step_syncs.json" \
        ${SYNCS_ARGS:-} > "$OUT/step_syncs.log" 2>&1
    echo "syncs rc=$?"
    grep -v -i warn "$OUT/step_syncs.log" | tail -n 20
    ;;
  *) echo "unknown step $step" ;;
  esac
  echo "[$((SECONDS - T0)) s] $step done"
done
