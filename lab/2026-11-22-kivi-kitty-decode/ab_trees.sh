#!/usr/bin/env bash
# A/B of two kernel trees in one device session: this checkout's kvq against an older one, two rounds
# each (old, new, old, new), by profile_fused.py's cold-cache timing of whole decode steps; then
# per-kernel timelines of this checkout.
#
#   mkdir ab_old && git archive <old-commit> kvq | tar -x -C ab_old   # here, before the device call
#   bash lab/2026-11-22-kivi-kitty-decode/ab_trees.sh ab_old > $OUT/ab.log 2>&1     # on the device
#
# ab_old stays untracked (not ignored, so the device copy of the working tree carries it); remove it after.
#
# SHAPES (env): "B T methods" triples separated by ";" (default: the h100-7ba6718 A/B's).
set -uo pipefail
cd "$(dirname "$0")/.."
OLD_DIR="$(cd "${1:?usage: ab_trees.sh OLD_DIR}" && pwd)"
NEW="$PWD"; OLD="$OLD_DIR:$PWD"
SHAPES="${SHAPES:-1 131072 KIVI-K4V4,KIVI-K2V2,Kitty;8 32768 KIVI-K4V4,KIVI-K2V2;8 8192 KIVI-K2V2,Kitty}"
P="python3 benchmarks/profile_fused.py --backend cupy --grid side_stream=True --out /tmp"
for round in 1 2; do
  for tree in OLD NEW; do
    export PYTHONPATH="${!tree}"
    IFS=';' read -ra list <<< "$SHAPES"
    for shape in "${list[@]}"; do
      set -- $shape
      $P --B "$1" --T "$2" --methods "$3" | sed "s/^/$tree B=$1 T=$2 /"
    done
  done
done
export PYTHONPATH="$NEW"
for shape in "8 8192" "1 32768"; do
  set -- $shape
  python3 lab/2026-11-22-kivi-kitty-decode/profile_decode_kernels.py --timeline --B "$1" --T "$2" --methods KIVI-K2V2,Kitty --reps 24
done
