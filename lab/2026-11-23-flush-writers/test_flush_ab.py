"""flush_ab.py (beside this file) times each backend's flush with the single-kernel writers on, then off, and
leaves ``kvq.fast.caches.codecs.FUSED_FLUSH`` as it found it.

A lab test (not collected by ``make test``: pytest's testpaths are ``tests/``); run it by hand:
``.venv/bin/python -m pytest lab/2026-11-23-flush-writers/test_flush_ab.py -q``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))          # flush_ab, beside this file

import flush_ab  # noqa: E402
from kvq.fast.caches import codecs as _codecs  # noqa: E402


def test_alternates_writers_on_and_off_and_restores(monkeypatch):
    seen = []

    def fake(device, quick, dry, deadline, backend):
        seen.append((backend, _codecs.FUSED_FLUSH))
        return {"KIVI-K2V2": {"ms": 0.01 if _codecs.FUSED_FLUSH else 0.02, "fused": _codecs.FUSED_FLUSH}}

    monkeypatch.setattr(flush_ab.K, "time_flush", fake)
    res = flush_ab.run("cpu", ["triton", "cupy"], 2, True)
    assert seen == [(b, f) for b in ("triton", "cupy") for _ in range(2) for f in (True, False)]
    assert _codecs.FUSED_FLUSH is True
    row = res["backends"]["cupy"]["KIVI-K2V2"]
    assert [r["ms"] for r in row["fused"]] == [0.01, 0.01] and [r["ms"] for r in row["unfused"]] == [0.02, 0.02]
    lines = flush_ab.summary_lines(res)
    assert len(lines) == 2 and "0.0100 / 0.0100" in lines[0] and "one kernel each" in lines[0]


def test_restores_the_switch_when_timing_raises(monkeypatch):
    def boom(*a):
        raise RuntimeError("no")

    monkeypatch.setattr(flush_ab.K, "time_flush", boom)
    with pytest.raises(RuntimeError):
        flush_ab.run("cpu", ["triton"], 1, True)
    assert _codecs.FUSED_FLUSH is True


def test_summary_names_a_path_that_did_not_take_the_writers():
    res = {"backends": {"triton": {"Kitty": {"fused": [{"ms": 0.1, "fused": False}], "unfused": [{"error": "x"}]}}}}
    (line,) = flush_ab.summary_lines(res)
    assert "NOT single-kernel" in line and "| quantize + copies x ms" in line
