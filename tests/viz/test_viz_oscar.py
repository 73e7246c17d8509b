"""kvq.viz.oscar: every plot returns a Figure, draws into given Axes, refuses bad input, saves to PNG,
and never imports matplotlib.pyplot (checked in a fresh interpreter)."""

import io

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from kvq.viz.common import new_figure  # noqa: E402
from kvq.viz.oscar import (  # noqa: E402
    plot_alignment,
    plot_error_table,
    plot_kl_vs_context,
    plot_spectra,
    plot_token_groups,
)

from ._fresh import run_fresh  # noqa: E402

RNG = np.random.default_rng(0)


def png(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=30)
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def test_token_groups():
    k = RNG.standard_normal(16)
    k[3] = 9.0
    fig = plot_token_groups({"raw": k, "flat": np.ones(16)}, group_size=8, title="t")
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    raw = fig.axes[0]
    assert len(raw.patches) == 16
    texts = [t.get_text() for t in raw.texts]                     # one range label per group
    assert texts == [f"{np.ptp(k[:8]):.3g}", f"{np.ptp(k[8:]):.3g}"]
    assert [t.get_text() for t in fig.axes[1].texts] == ["0", "0"]
    assert fig.axes[0].get_ylim() == fig.axes[1].get_ylim()      # shared scale
    png(fig)
    host = new_figure((6, 4))
    axes = host.subplots(2, 1)
    assert plot_token_groups({"a": k, "b": k}, 4, ax=axes) is host
    with pytest.raises(ValueError, match="divid"):
        plot_token_groups({"a": k}, 5)
    with pytest.raises(ValueError, match="same length"):
        plot_token_groups({"a": k, "b": k[:8]}, 4)
    with pytest.raises(ValueError, match="2 rows"):
        plot_token_groups({"a": k, "b": k}, 4, ax=axes[:1])
    with pytest.raises(ValueError, match="NaN"):
        plot_token_groups({"a": np.full(8, np.nan)}, 4)


def test_spectra_and_alignment():
    lam = np.sort(RNG.uniform(0.1, 5, 32))[::-1]
    fig = plot_spectra({"Q^T Q": lam, "K^T K": lam[::-1] * 2})
    lines = fig.axes[0].get_lines()
    assert len(lines) == 2
    np.testing.assert_allclose(lines[1].get_ydata(), lam / lam.sum())     # sorted, normalized
    png(fig)
    with pytest.raises(ValueError, match="negative"):
        plot_spectra({"x": -lam})
    U, _ = np.linalg.qr(RNG.standard_normal((16, 16)))
    fig = plot_alignment(U, U, top=8)
    img = fig.axes[0].images[0].get_array()
    assert img.shape == (8, 8)
    np.testing.assert_allclose(np.diag(img), 1.0, atol=1e-12)              # a basis against itself
    png(fig)
    host = new_figure()
    ax = host.add_subplot()
    assert plot_alignment(U, np.eye(16), ax=ax) is host
    with pytest.raises(ValueError, match="same shape"):
        plot_alignment(U, U[:8, :8])


def test_kl_vs_context_and_error_table():
    fig = plot_kl_vs_context([256, 512, 1024], [[0.1, 0.2, 0.3], [0.01, 0.02, 0.04]], labels=["a", "b"])
    lines = fig.axes[0].get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[0.1, 0.2, 0.3], [0.01, 0.02, 0.04]]
    png(fig)
    with pytest.raises(ValueError, match="match lengths"):
        plot_kl_vs_context([1, 2], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="labels"):
        plot_kl_vs_context([1, 2], [0.1, 0.2], labels=["a", "b"])
    table = {"naive": {"k": 4.0, "v": 2.0}, "oscar": {"k": 1.0, "v": 0.5}}
    fig = plot_error_table(table)
    heights = sorted(round(p.get_height(), 6) for p in fig.axes[0].patches)
    assert heights == [0.25, 0.25, 1.0, 1.0]                                # relative to the first method
    png(fig)
    with pytest.raises(ValueError, match="positive"):
        plot_error_table({"a": {"k": 0.0}})
    with pytest.raises(ValueError, match="missing"):
        plot_error_table({"a": {"k": 1.0}, "b": {"v": 1.0}})


def test_no_pyplot_imported():
    run_fresh("""
        import sys, io
        import numpy as np
        import kvq.viz.oscar as v
        assert "matplotlib" not in sys.modules, "kvq.viz.oscar imports matplotlib eagerly"
        x = np.arange(8.0)
        figs = [v.plot_token_groups({"a": x}, 4), v.plot_spectra({"a": x + 1}), v.plot_alignment(np.eye(4), np.eye(4)),
                v.plot_kl_vs_context([1, 2], [1.0, 2.0]), v.plot_error_table({"a": {"k": 1.0}})]
        for f in figs:
            f.savefig(io.BytesIO(), format="png", dpi=20)
        bad = [m for m in ("matplotlib.pyplot", "torch") if m in sys.modules]
        assert not bad, bad
        print("ok")
    """)
