#!/usr/bin/env bash
# Nsight Compute on one decode step's kernel: the full section set (speed of light, warp states with their
# stall reasons, scheduler, memory) and the per-SASS-instruction samples, for a few shapes; one tarball in $OUT.
#
#   SHAPES="8 32768 KIVI-K2V2;32 8192 Kitty" bash lab/2026-11-22-kivi-kitty-decode/ncu_page.sh
#   KERNEL=paged_tail_attn SHAPES="1 32768 KIVI-K2V2" bash lab/2026-11-22-kivi-kitty-decode/ncu_page.sh      # another kernel
#   TUNE="max_blocks_per_sm=4" SHAPES="8 32768 KIVI-K2V2" bash lab/2026-11-22-kivi-kitty-decode/ncu_page.sh  # paged.Knobs values
#
# Per shape: <tag>.ncu-rep, <tag>.details.txt (every section), <tag>.sass.csv (per-instruction counters)
# and <tag>.stalls.txt (lab/2026-11-22-kivi-kitty-decode/ncu_stalls.py: stall reasons, instruction mix), in $OUT/ncu-<KERNEL>.tgz.
#
# ncu locks the clocks at base and flushes the caches before the profiled launch (its defaults), so its
# durations are not the benchmark's; the stall shares and instruction counts are what to read here.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvq-out}"
D="$OUT/ncu"
mkdir -p "$D"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
IFS=';' read -ra SH <<< "${SHAPES:-8 32768 KIVI-K2V2}"
for s in "${SH[@]}"; do
    read -r B T M <<< "$s"
    tag="${M}_B${B}_T${T}"
    echo "== ncu $tag (${KERNEL:-paged_decode_mma2})"
    ncu --kernel-name "regex:${KERNEL:-paged_decode_mma2}" --launch-count 1 --set full --import-source no -f \
        -o "$D/$tag" python3 benchmarks/profile_fused.py --backend cupy --once --B "$B" --T "$T" --methods "$M" \
        --tune "${TUNE:-}" > "$D/$tag.run.log" 2>&1 || { echo "ncu failed"; tail -n 20 "$D/$tag.run.log"; continue; }
    ncu -i "$D/$tag.ncu-rep" --page details > "$D/$tag.details.txt" 2>&1
    ncu -i "$D/$tag.ncu-rep" --page source --csv --print-source sass > "$D/$tag.sass.csv" 2>&1
    python3 lab/2026-11-22-kivi-kitty-decode/ncu_stalls.py "$D/$tag.sass.csv" > "$D/$tag.stalls.txt"
    head -n 12 "$D/$tag.stalls.txt"
    grep -E "Duration|Executed Ipc A|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per" \
        "$D/$tag.details.txt" | head -n 20
done
tar -czf "$OUT/ncu-${KERNEL:-paged_decode_mma2}.tgz" -C "$OUT" ncu && rm -rf "$D"   # one tarball per kernel: a second call in the same run keeps the first
