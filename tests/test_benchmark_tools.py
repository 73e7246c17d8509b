"""Small helpers of the benchmark scripts: profile_fused.apply_tune (the --tune option of the profilers).
(ncu_stalls.summarize, the stall table of an Nsight Compute capture, moved with its script to
lab/2026-11-22-kivi-kitty-decode/test_ncu_stalls.py.)"""

from __future__ import annotations

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
