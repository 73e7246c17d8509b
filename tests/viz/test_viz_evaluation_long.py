"""kvq.viz.evaluation's long-context figures (issue 40): perplexity by position (a line per row) and
retrieval accuracy against needle depth (a line per row, a panel per context length), drawn from rows
shaped as benchmarks/train_long_lm.py writes them; skipped rows left out; readable (title, labelled axes,
a legend that covers no data: ``test_figure_labels.problems``); clear errors. The numbers below are
synthetic figure inputs, not results."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from kvq.viz.evaluation import plot_ppl_by_position, plot_retrieval_by_depth  # noqa: E402

from .test_figure_labels import problems  # noqa: E402

BUCKETS = [(0, 256), (256, 512), (512, 1024), (1024, 2047)]


def _ppl_row(label, method, budget, values):
    return {"label": label, "method": method, "budget": budget,
            "buckets": [{"start": a, "end": b, "ppl": v} for (a, b), v in zip(BUCKETS, values)]}


PPL_ROWS = [_ppl_row("FP16", "FP16", None, [4.0, 3.5, 3.2, 3.0]),
            _ppl_row("KIVI-K2V2 (paper)", "KIVI-K2V2", None, [4.1, 3.7, 3.5, 3.4]),
            _ppl_row("KIVI-K2V2 @ <=2.5 b/e", "KIVI-K2V2", 2.5, [4.2, 3.9, 3.7, 3.6]),
            {"label": "OSCAR @ <=2.5 b/e", "method": "OSCAR", "budget": 2.5, "skipped": "no configuration fits"},
            _ppl_row("OSCAR @ <=4.5 b/e", "OSCAR", 4.5, [4.0, 3.6, 3.3, 3.1])]


def _ret_row(label, method, budget, acc):
    cells = [{"context": n, "depth": d, "accuracy": a} for n, row in acc.items() for d, a in zip((0.1, 0.5, 0.9), row)]
    return {"label": label, "method": method, "budget": budget, "cells": cells}


RET_ROWS = [_ret_row("FP16", "FP16", None, {1024: [1.0, 1.0, 0.875], 2048: [1.0, 0.75, 0.875]}),
            _ret_row("KIVI-K2V2 @ <=2.5 b/e", "KIVI-K2V2", 2.5, {1024: [0.5, 0.625, 1.0], 2048: [0.25, 0.5, 1.0]}),
            {"label": "Kitty (paper)", "method": "Kitty", "budget": None, "error": "RuntimeError: boom"}]


def test_ppl_by_position_a_line_per_measured_row():
    fig = plot_ppl_by_position(PPL_ROWS)
    ax = fig.axes[0]
    assert problems(fig) == []
    assert ax.get_title() == "perplexity by position" and ax.get_ylabel() == "perplexity"
    assert ax.get_xscale() == "log"
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(lines) == ["FP16", "KIVI-K2V2 (paper)", "KIVI-K2V2 @ <=2.5 b/e", "OSCAR @ <=4.5 b/e"]   # skipped out
    assert list(lines["FP16"].get_xdata()) == [(a + b) / 2 for a, b in BUCKETS]
    assert list(lines["KIVI-K2V2 @ <=2.5 b/e"].get_ydata()) == [4.2, 3.9, 3.7, 3.6]
    assert lines["FP16"].get_color() == "k"
    assert lines["KIVI-K2V2 (paper)"].get_color() == lines["KIVI-K2V2 @ <=2.5 b/e"].get_color()  # one per method
    assert lines["KIVI-K2V2 (paper)"].get_linestyle() == "-"
    assert lines["KIVI-K2V2 @ <=2.5 b/e"].get_linestyle() == "--"                            # first budget
    assert lines["OSCAR @ <=4.5 b/e"].get_linestyle() == ":"                                 # second budget


def test_retrieval_by_depth_a_panel_per_context():
    fig = plot_retrieval_by_depth(RET_ROWS)
    assert problems(fig) == []
    axes = [a for a in fig.axes if a.get_lines()]
    assert [a.get_title() for a in axes] == ["context 1024 tokens", "context 2048 tokens"]
    assert fig._suptitle.get_text() == "retrieval accuracy against needle depth"
    assert axes[0].get_ylabel() == "retrieval accuracy" and axes[1].get_xlabel().startswith("needle depth")
    for ax, n in zip(axes, (1024, 2048)):
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert list(lines) == ["FP16", "KIVI-K2V2 @ <=2.5 b/e"]                         # the failed row is out
        want = [c["accuracy"] for c in RET_ROWS[1]["cells"] if c["context"] == n]
        assert list(lines["KIVI-K2V2 @ <=2.5 b/e"].get_xdata()) == [0.1, 0.5, 0.9]
        assert list(lines["KIVI-K2V2 @ <=2.5 b/e"].get_ydata()) == want
    only = plot_retrieval_by_depth(RET_ROWS, contexts=[2048])
    assert [a.get_title() for a in only.axes] == ["context 2048 tokens"]


def test_bad_rows():
    with pytest.raises(ValueError, match="no row with 'buckets'"):
        plot_ppl_by_position([PPL_ROWS[3]])
    with pytest.raises(ValueError, match=r"rows\[0\] must be a dict with a 'label'"):
        plot_ppl_by_position([{"buckets": []}])
    with pytest.raises(ValueError, match=r"buckets\[0\]\['ppl'\]"):
        plot_ppl_by_position([_ppl_row("x", "x", None, [float("nan")])])
    with pytest.raises(ValueError, match=r"buckets\[0\] must be"):
        plot_ppl_by_position([{"label": "x", "buckets": [{"start": 5, "end": 5, "ppl": 1.0}]}])
    with pytest.raises(ValueError, match="no row with 'cells'"):
        plot_retrieval_by_depth([RET_ROWS[2]])
    with pytest.raises(ValueError, match=r"cells\[0\]\['accuracy'\]"):
        plot_retrieval_by_depth([{"label": "x", "cells": [{"context": 8, "depth": 0.5, "accuracy": 2.0}]}])
    with pytest.raises(ValueError, match="contexts must be"):
        plot_retrieval_by_depth(RET_ROWS, contexts=[4096])
