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


def test_apply_tune_sets_and_checks_keys(bench_path):
    """apply_tune returns {prefix: Knobs} with the values set (the library's modules hold no tuning dict
    any more); unknown keys are refused, bad values by the Knobs."""
    PF = importlib.import_module("profile_fused")
    paged = importlib.import_module("kvq.fast.cupy.paged")
    assert not hasattr(paged, "TUNE")
    kn = PF.apply_tune("cupy", "max_blocks_per_sm=4;side_stream=False;tail_mma=None")
    assert kn[""].max_blocks_per_sm == 4
    assert kn[""].side_stream is False and kn[""].tail_mma is None
    assert kn[""] != paged.Knobs() and paged.DEFAULT_KNOBS == paged.Knobs()    # the defaults untouched
    before = dict(kn)
    assert PF.apply_tune("cupy", "", kn) == before                             # nothing to set
    with pytest.raises(SystemExit, match="not a TUNE key"):
        PF.apply_tune("cupy", "no_such_knob=1")
    with pytest.raises(ValueError, match="tail_sums"):
        PF.apply_tune("cupy", "tail_sums=3")
    # OSCAR's decode knobs (kvq.fast.cupy.oscar_decode.Knobs) under the "oscar." prefix
    OD = importlib.import_module("kvq.fast.cupy.oscar_decode")
    kn2 = PF.apply_tune("cupy", "oscar.tail_prec=1;oscar.tail_first=False", kn)
    assert kn2["oscar."].tail_prec == 1 and kn2["oscar."].tail_first is False
    assert kn2[""] == before[""] and OD.DEFAULT_KNOBS == OD.Knobs()
    with pytest.raises(SystemExit, match="not a TUNE key"):
        PF.apply_tune("cupy", "oscar.max_blocks_per_sm=1")      # a paged knob is not an OSCAR one
    with pytest.raises(SystemExit, match="not a TUNE key"):
        PF.apply_tune("triton", "oscar.tail_prec=1")            # OSCAR's knobs are the CuPy decode's
    assert PF.apply_tune("triton", "split_p=True;num_warps=8")[""].split_p is True
