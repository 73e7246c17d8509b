"""Small helpers of the benchmark scripts: profile_fused.apply_tune (the --tune option of the profilers)
and ncu_stalls.summarize (the stall table of benchmarks/ncu_page.sh)."""

from __future__ import annotations

import csv
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


def test_apply_tune_sets_and_checks_keys(bench_path, monkeypatch):
    PF = importlib.import_module("profile_fused")
    paged = importlib.import_module("kvq.fast.cupy.paged")
    monkeypatch.setattr(paged, "TUNE", dict(paged.TUNE))
    PF.apply_tune("cupy", "max_blocks_per_sm=4;side_stream=False;tail_mma=None")
    assert paged.TUNE["max_blocks_per_sm"] == 4
    assert paged.TUNE["side_stream"] is False and paged.TUNE["tail_mma"] is None
    before = dict(paged.TUNE)
    PF.apply_tune("cupy", "")                                  # nothing to set
    assert paged.TUNE == before
    with pytest.raises(SystemExit, match="not a TUNE key"):
        PF.apply_tune("cupy", "no_such_knob=1")
    # OSCAR's decode knobs (kvq.fast.cupy.oscar_decode.TUNE) under the "oscar." prefix
    OD = importlib.import_module("kvq.fast.cupy.oscar_decode")
    monkeypatch.setattr(OD, "TUNE", dict(OD.TUNE))
    PF.apply_tune("cupy", "oscar.tail_prec=1;oscar.tail_first=False")
    assert OD.TUNE["tail_prec"] == 1 and OD.TUNE["tail_first"] is False
    assert paged.TUNE == before
    with pytest.raises(SystemExit, match="not a TUNE key"):
        PF.apply_tune("cupy", "oscar.max_blocks_per_sm=1")      # a paged knob is not an OSCAR one
    with pytest.raises(SystemExit, match="not a TUNE key"):
        PF.apply_tune("triton", "oscar.tail_prec=1")            # OSCAR's knobs are the CuPy decode's


def test_ncu_stalls_summary(bench_path, tmp_path):
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
