"""kvq.viz.fragments: one labelled cell per matrix element, in the PTX layout; draws into given Axes;
refuses bad operands; never imports matplotlib.pyplot (checked in a fresh interpreter)."""

import io
import re

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from kvq.viz.common import new_figure  # noqa: E402
from kvq.viz.fragments import plot_fragment_layout  # noqa: E402

from ._fresh import run_fresh  # noqa: E402

CELL = re.compile(r"T(\d+)\n([abc])(\d)")


def cells(ax):
    """``{(row, col): (lane, letter, i)}`` from the Axes' cell labels."""
    out = {}
    for t in ax.texts:
        m = CELL.fullmatch(t.get_text())
        if m:
            x, y = t.get_position()
            out[int(round(y)), int(round(x))] = (int(m.group(1)), m.group(2), int(m.group(3)))
    return out


@pytest.mark.parametrize("operand,shape,n", [("a", (16, 16), 8), ("b", (16, 8), 4), ("c", (16, 8), 4)])
def test_figure_per_operand(operand, shape, n):
    fig = plot_fragment_layout(operand, title="t")
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    assert ax.get_title() == "t"
    got = cells(ax)
    assert len(got) == shape[0] * shape[1] == len([t for t in ax.texts if CELL.fullmatch(t.get_text())])
    assert set(got) == {(r, c) for r in range(shape[0]) for c in range(shape[1])}
    assert {v[1] for v in got.values()} == {operand}
    assert len({(lane, i) for lane, _, i in got.values()}) == 32 * n      # every (lane, i) once
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=30)
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cells_follow_ptx_layout():
    # a few cells of the PTX ISA figures (BitDecoding Fig. 3a for B)
    b = cells(plot_fragment_layout("b").axes[0])
    assert b[0, 0] == (0, "b", 0) and b[1, 0] == (0, "b", 1) and b[8, 0] == (0, "b", 2)
    assert b[2, 1] == (5, "b", 0) and b[15, 7] == (31, "b", 3)
    a = cells(plot_fragment_layout("a").axes[0])
    assert a[0, 8] == (0, "a", 4) and a[8, 0] == (0, "a", 2) and a[15, 15] == (31, "a", 7)
    c = cells(plot_fragment_layout("c").axes[0])
    assert c[0, 1] == (0, "c", 1) and c[9, 4] == (6, "c", 2)


def test_default_title_and_given_axes():
    fig = plot_fragment_layout()                                          # default operand "b"
    assert "matrix B" in fig.axes[0].get_title()
    host = new_figure((8, 4))
    axes = host.subplots(1, 2)
    assert plot_fragment_layout("a", ax=axes[0]) is host
    assert plot_fragment_layout("c", ax=axes[1]) is host
    assert len(cells(axes[0])) == 256 and len(cells(axes[1])) == 128


@pytest.mark.parametrize("bad", ["d", "A", "", None, 1])
def test_bad_operand(bad):
    with pytest.raises(ValueError, match="operand"):
        plot_fragment_layout(bad)


def test_no_pyplot_imported():
    run_fresh("""
        import sys, io
        import kvq.viz.fragments as v
        assert "matplotlib" not in sys.modules, "kvq.viz.fragments imports matplotlib eagerly"
        for op in "abc":
            v.plot_fragment_layout(op).savefig(io.BytesIO(), format="png", dpi=20)
        bad = [m for m in ("matplotlib.pyplot", "torch") if m in sys.modules]
        assert not bad, bad
        print("ok")
    """)
