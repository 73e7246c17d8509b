"""phase_sweep.py (beside this file): the mean step over a page period and its ratios to KIVI-K2V2 of the same
backend; a phase that failed its check leaves the method without a mean.

A lab test (not collected by ``make test``: pytest's testpaths are ``tests/``); run it by hand:
``.venv/bin/python -m pytest lab/2026-11-23-phase-sweep/test_phase_sweep.py -q``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))          # phase_sweep, beside this file

import phase_sweep as P  # noqa: E402


def _rows(table):
    """table: method -> per-phase ms (None: failed)."""
    n = len(next(iter(table.values())))
    return [{"T": 8192 + 32 * i, "methods": {m: {"ms": v[i], "valid": v[i] is not None} for m, v in table.items()}}
            for i in range(n)]


def test_means_and_ratios_per_backend():
    s = P.summarize(_rows({"KIVI-K2V2 [cupy]": [1.0, 2.0, 3.0, 2.0], "Kitty [cupy]": [1.5, 2.0, 3.0, 3.5],
                           "KIVI-K2V2": [2.0, 2.0, 2.0, 2.0], "Kitty": [3.0, 3.0, 3.0, 3.0]}))
    assert s["Kitty [cupy]"]["mean_ms"] == pytest.approx(2.5)
    assert s["Kitty [cupy]"]["ratio_of_means"] == pytest.approx(2.5 / 2.0)
    assert s["Kitty [cupy]"]["ratios"] == pytest.approx([1.5, 1.0, 1.0, 1.75])
    assert s["Kitty"]["ratio_of_means"] == pytest.approx(1.5)             # against the Triton KIVI row
    assert s["KIVI-K2V2 [cupy]"]["ratio_of_means"] == pytest.approx(1.0)


def test_a_failed_phase_leaves_no_mean():
    s = P.summarize(_rows({"KIVI-K2V2 [cupy]": [1.0, 1.0], "Kitty [cupy]": [1.2, None]}))
    assert s["Kitty [cupy]"]["mean_ms"] is None and "ratio_of_means" not in s["Kitty [cupy]"]
    lines = P.summary_lines({"offsets": [0, 32], "shapes": [{"B": 32, "T0": 8192, "summary": s}]})
    assert lines[0] == "B=32 T0=8192 (+0, +32):" and "1.2000 -" in lines[2]
