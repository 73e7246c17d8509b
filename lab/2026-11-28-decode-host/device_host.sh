#!/usr/bin/env bash
# One device call: the GPU tests of the planned paged decode, then profile_host.py for this checkout's kvq
# ("after") and the kvq of .before/ ("before", `git archive <commit> kvq | tar -x -C .before`), validation
# on and off, batch 1 and 8 at 32K. Everything lands in $OUT (host runs packed into host.tar.gz).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvq-out}"; mkdir -p "$OUT" /tmp/h
export PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "commit: ${KVQ_COMMIT:-unknown}"
if [ -n "${TESTS:-1}" ]; then
  timeout -k 10 "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 ${TEST_PATHS:-tests/parity/test_kivi_kitty_parity.py} \
      > "$OUT/gpu-tests.log" 2>&1
  echo "tests rc=$?"; tail -n 2 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -n 20
fi
for tree in after before; do
  PP="$PWD"
  for run in "on 1" "off 1" "off 8"; do
    set -- $run
    PYTHONPATH="$PP" timeout -k 10 120 python3 - "$1" "$2" "$tree" <<'PY' > "/tmp/h/$tree-$1-B$2.log" 2>&1
import runpy, sys
val, B, tree = sys.argv[1:4]
if tree == "before":                   # the interpreter puts the working directory first: .before/ goes before it
    sys.path.insert(0, ".before")
import kvq, kvq.fast._common as C
print("kvq from", kvq.__file__)
C.set_validation(val == "on")
sys.argv = ["profile_host.py", "--methods", "KIVI-K2V2,Kitty", "--B", B, "--T", "32768", "--calls", "200",
            "--out", f"/tmp/h/{tree}-{val}-B{B}"]
runpy.run_path("benchmarks/profile_host.py", run_name="__main__")
PY
    echo "$tree validation=$1 B=$2 rc=$?"; grep -E "host_us|KIVI|Kitty|SDPA|sdpa" "/tmp/h/$tree-$1-B$2.log" | head -n 8
  done
done
tar -czf "$OUT/host.tar.gz" -C /tmp/h .
