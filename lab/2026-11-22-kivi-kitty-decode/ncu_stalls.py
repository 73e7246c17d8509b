"""Stall reasons and instruction mix of one kernel from Nsight Compute's source page (CSV, SASS):

    ncu -i rep.ncu-rep --page source --csv --print-source sass > k.sass.csv
    python lab/2026-11-22-kivi-kitty-decode/ncu_stalls.py k.sass.csv

Prints the share of each warp-stall reason over all samples, and per SASS opcode its share of the
executed warp instructions and of the samples.
"""

from __future__ import annotations

import collections
import csv
import re
import sys


def summarize(path: str, top: int = 16) -> str:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[start], rows[start + 1:]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    stalls, execs, samples = collections.Counter(), collections.Counter(), collections.Counter()
    for r in data:
        if len(r) < len(hdr):
            continue
        for h in reasons:
            stalls[h] += int(r[ix[h]] or 0)
        op = re.sub(r"^@!?U?P\w+\s+", "", r[ix["Source"]].strip()).split(" ")[0].split(".")[0]
        execs[op] += int(r[ix["Instructions Executed"]] or 0)
        samples[op] += int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
    S, E = max(sum(stalls.values()), 1), max(sum(execs.values()), 1)
    out = [f"samples {S}, executed warp instructions {E}", "stall reasons (share of samples):"]
    out += [f"  {h:28s} {100 * v / S:5.1f}%" for h, v in stalls.most_common(12)]
    out += ["opcodes (share of executed, share of samples):"]
    out += [f"  {o:8s} {100 * v / E:5.1f}%  {100 * samples[o] / S:5.1f}%" for o, v in execs.most_common(top)]
    return "\n".join(out)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(f"== {p}\n{summarize(p)}")
