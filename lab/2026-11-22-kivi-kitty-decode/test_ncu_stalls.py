"""ncu_stalls.summarize (beside this file): the stall table of ncu_page.sh's Nsight Compute captures.

A lab test (not collected by ``make test``: pytest's testpaths are ``tests/``); run it by hand:
``.venv/bin/python -m pytest lab/2026-11-22-kivi-kitty-decode/test_ncu_stalls.py -q``."""

from __future__ import annotations

import csv
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))          # ncu_stalls, beside this file


def test_ncu_stalls_summary(tmp_path):
    NS = importlib.import_module("ncu_stalls")
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
           "stall_wait", "stall_math", "stall_wait (Not Issued)"]
    rows = [["0x0", "      LOP3.LUT R1, R2, R3, R4, 0xea, !PT ;", "3", "300", "2", "1", "2"],
            ["0x10", "@!P0 HFMA2 R5, R1, R6, R7 ;", "1", "100", "0", "1", "0"]]
    p = tmp_path / "k.sass.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(hdr)
        w.writerows(rows)
    out = NS.summarize(str(p))
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert lines[0] == "samples 4, executed warp instructions 400"
    assert "stall_wait 50.0%" in lines and "stall_math 50.0%" in lines   # (2 + 0) / 4, (1 + 1) / 4
    assert "LOP3 75.0% 75.0%" in lines and "HFMA2 25.0% 25.0%" in lines  # the predicate is not the opcode
    assert "Not Issued" not in out
