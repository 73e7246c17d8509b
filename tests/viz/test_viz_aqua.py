"""kvq.viz.aqua: each plot returns a Figure, draws into a given Axes, refuses bad input, saves to PNG,
and the module never imports matplotlib.pyplot (checked in a fresh interpreter)."""

import io
import subprocess
import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from kvq.reference.higgs import load_grid  # noqa: E402
from kvq.viz.common import new_figure  # noqa: E402
from kvq.viz.aqua import plot_explained_variance, plot_higgs_grid, plot_residual_variance  # noqa: E402

PROBES = {"K": {"L-1": 0.6, "L-1..2": 0.7, "T-1": -0.02, "V": 0.64},
          "V": {"L-1": 0.5, "L-1..2": 0.7, "T-1": 0.01, "K": 0.63}}
BEFORE = np.array([[4.0, 3.0, 3.5, 3.2], [2.0, 2.1, 2.2, 2.3]])
AFTER = np.array([[4.0, 1.0, 1.1, 1.2], [2.0, 0.3, 0.25, 0.2]])


def png(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explained_variance_bars():
    fig = plot_explained_variance(PROBES, title="probes")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(ax.patches) == 8                                       # 4 sources x 2 roles
    heights = sorted(round(p.get_height(), 3) for p in ax.patches)
    assert heights == sorted(v for r in PROBES.values() for v in r.values())
    png(fig)


def test_grid_over_cloud_and_given_axes():
    grid = load_grid(2, 16)
    fig = new_figure()
    ax = fig.add_subplot()
    assert plot_higgs_grid(grid, ax=ax) is fig
    offsets = ax.collections[1].get_offsets()
    np.testing.assert_allclose(np.asarray(offsets), grid)
    png(plot_higgs_grid(load_grid(2, 256)))


def test_residual_variance_lines():
    fig = plot_residual_variance(BEFORE, AFTER)
    ax = fig.axes[0]
    assert len(ax.lines) == 4 and ax.get_yscale() == "log"
    np.testing.assert_array_equal(ax.lines[1].get_ydata(), AFTER[0])
    png(plot_residual_variance(BEFORE[0], AFTER[0]))


def test_bad_input():
    with pytest.raises(ValueError, match="shape \\(n, 2\\)"):
        plot_higgs_grid(load_grid(4, 256))
    with pytest.raises(ValueError, match="same number"):
        plot_explained_variance({"K": {"a": 1}, "V": {"a": 1, "b": 2}})
    with pytest.raises(ValueError, match="non-empty"):
        plot_explained_variance({})
    with pytest.raises(ValueError, match="same shape"):
        plot_residual_variance(BEFORE, AFTER[:, :3])
    with pytest.raises(ValueError, match="positive"):
        plot_residual_variance(BEFORE, -AFTER)
    with pytest.raises(TypeError, match="Axes"):
        plot_residual_variance(BEFORE, AFTER, ax="nope")


def test_no_pyplot_import():
    code = ("import sys, numpy as np\nfrom kvq.viz.aqua import plot_higgs_grid\n"
            "from kvq.reference.higgs import load_grid\nplot_higgs_grid(load_grid(2, 16))\n"
            "assert 'matplotlib.pyplot' not in sys.modules\nprint('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
