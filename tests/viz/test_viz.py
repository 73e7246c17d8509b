"""kvq.viz: every plot returns a Figure, draws into a given Axes, refuses bad shapes, saves to PNG,
and never imports matplotlib.pyplot (checked in a fresh interpreter)."""

import io
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import ConnectionPatch  # noqa: E402

from kvq.viz import (  # noqa: E402
    group_ranges,
    plot_channel_magnitudes,
    plot_channel_sensitivity,
    plot_error_vs_boost,
    plot_group_ranges,
    plot_page_layout,
)
from kvq.viz.common import new_figure  # noqa: E402

RNG = np.random.default_rng(0)


def keys(T=64, D=32):
    k = RNG.standard_normal((T, D)).astype(np.float32)
    k[:, [3, 17]] *= 8.0  # two outlier channels
    return k


def page(D=16, G=16, d_boost=4):
    low = RNG.integers(0, 4, (D, G), dtype=np.uint8)  # (D, G)
    high = RNG.integers(0, 4, (d_boost, G), dtype=np.uint8)  # (D_boost, G)
    boosted = np.sort(RNG.choice(D, d_boost, replace=False))
    idx = np.full(D, d_boost, np.uint8)
    idx[boosted] = np.arange(d_boost)
    scale = RNG.uniform(0.01, 1.0, D).astype(np.float16)
    mn = RNG.uniform(-2.0, 0.0, D).astype(np.float16)
    return low, high, idx, scale, mn


def png_bytes(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    data = buf.getvalue()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return data


def all_axes(fig):
    """The Figure's Axes plus their inset (child) Axes."""
    return [a for ax in fig.axes for a in [ax, *ax.child_axes]]


def host_axes():
    fig = new_figure((6, 4))
    return fig, fig.add_subplot()


# ---------------------------------------------------------------- channel magnitudes (Figure 2a)

def test_channel_magnitudes_figure():
    fig = plot_channel_magnitudes(keys(), title="head 0", top=2)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 3  # heatmap, strip, colour bar
    heat, strip = fig.axes[0], fig.axes[1]
    assert len(heat.images) == 1 and heat.images[0].get_array().shape == (64, 32)
    red = [p for p in strip.patches if np.isfinite(p.get_height())
           and p.get_facecolor()[:3] == matplotlib.colors.to_rgb("#d62728")]
    assert len(red) == 2 and sorted(round(p.get_x() + p.get_width() / 2) for p in red) == [3, 17]
    assert strip.get_title() == "head 0"
    png_bytes(fig)


def test_channel_magnitudes_given_ax():
    fig, ax = host_axes()
    assert plot_channel_magnitudes(keys(), ax=ax) is fig
    assert len(fig.axes) == 3


@pytest.mark.parametrize("bad", [np.zeros(8), np.zeros((2, 3, 4)), np.zeros((0, 4))])
def test_channel_magnitudes_bad_shape(bad):
    with pytest.raises(ValueError, match="k "):
        plot_channel_magnitudes(bad)


def test_channel_magnitudes_bad_top_and_nan():
    with pytest.raises(ValueError, match="top"):
        plot_channel_magnitudes(keys(), top=99)
    k = keys()
    k[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        plot_channel_magnitudes(k)


# ---------------------------------------------------------------- channel sensitivity (Figure 2b)

def test_channel_sensitivity_figure():
    mse = RNG.uniform(0, 1e-5, (4, 32))
    fig = plot_channel_sensitivity(mse, top=3)
    ax = fig.axes[0]
    assert len(fig.axes) == 1
    assert len(ax.lines) == 4  # one per query head
    assert len(ax.patches) == 3  # shaded top channels
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"q head {h}" for h in range(4)]
    png_bytes(fig)


def test_channel_sensitivity_given_ax_and_1d():
    fig, ax = host_axes()
    assert plot_channel_sensitivity(RNG.uniform(0, 1, 16), ax=ax, yscale="log") is fig
    assert len(ax.lines) == 1 and ax.get_yscale() == "log"


@pytest.mark.parametrize("bad", [np.zeros((2, 3, 4)), np.zeros((2, 0)), -np.ones((2, 4))])
def test_channel_sensitivity_bad(bad):
    with pytest.raises(ValueError, match="mse"):
        plot_channel_sensitivity(bad)


# ---------------------------------------------------------------- error vs boost rate

def test_error_vs_boost_figure():
    rates = np.array([0, 0.125, 0.25, 0.5, 1.0])
    errs = np.array([[1.0, 0.5, 0.2, 0.05, 0.0], [1.0, 0.9, 0.75, 0.5, 0.0]])
    fig = plot_error_vs_boost(rates, errs, labels=["magnitude", "random"])
    ax = fig.axes[0]
    assert len(ax.lines) == 2
    np.testing.assert_allclose(ax.lines[0].get_xdata(), 100 * rates)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["magnitude", "random"]
    png_bytes(fig)


def test_error_vs_boost_given_ax():
    fig, ax = host_axes()
    assert plot_error_vs_boost([0, 0.5, 1], [3.0, 2.0, 1.0], ax=ax) is fig
    assert len(ax.lines) == 1 and ax.get_legend() is None


def test_error_vs_boost_bad():
    with pytest.raises(ValueError, match="errors has shape"):
        plot_error_vs_boost([0, 0.5, 1], np.zeros((2, 4)))
    with pytest.raises(ValueError, match="rates"):
        plot_error_vs_boost([0, 0.5, 2.0], np.zeros((1, 3)))
    with pytest.raises(ValueError, match="rates must be 1-D"):
        plot_error_vs_boost(np.zeros((2, 2)), np.zeros((1, 2)))
    with pytest.raises(ValueError, match="labels"):
        plot_error_vs_boost([0, 1], np.zeros((2, 2)), labels=["one"])


# ---------------------------------------------------------------- page layout (Figure 3a)

@pytest.mark.parametrize("D,G,d_boost", [(16, 16, 4), (64, 32, 8), (8, 8, 0)])
def test_page_layout_figure(D, G, d_boost):
    low, high, idx, scale, mn = page(D, G, d_boost)
    fig = plot_page_layout(low, high, idx, scale, mn)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 1 and len(all_axes(fig)) == 8  # host; scale, mn, idx, planes, colour bars
    host = fig.axes[0]
    insets = host.child_axes
    planes = [a for a in insets if a.images and a.images[0].get_array().ndim == 2
              and a.images[0].get_array().shape[1] == G]
    shapes = sorted(a.images[0].get_array().shape for a in planes)
    assert (D, G) in shapes and (d_boost == 0 or (d_boost, G) in shapes)
    high_ax = insets[4]
    arrows = [a for a in high_ax.get_children() if isinstance(a, ConnectionPatch)]
    assert len(arrows) == d_boost  # one arrow per boosted channel
    png_bytes(fig)


def test_page_layout_given_ax_and_sentinel():
    low, high, idx, scale, mn = page(16, 16, 4)
    idx = np.where(idx == 4, 255, idx).astype(np.uint8)  # a different sentinel
    fig, ax = host_axes()
    assert plot_page_layout(low, high, idx, scale[:, None], mn, ax=ax, sentinel=255) is fig
    assert not ax.axison and len(all_axes(fig)) == 8


def test_page_layout_bad():
    low, high, idx, scale, mn = page(16, 16, 4)
    with pytest.raises(ValueError, match="high_plane must be"):
        plot_page_layout(low, high[:, :8], idx, scale, mn)
    with pytest.raises(ValueError, match="boost_idx must have shape"):
        plot_page_layout(low, high, idx[:8], scale, mn)
    with pytest.raises(ValueError, match="scale must have shape"):
        plot_page_layout(low, high, idx, scale[:8], mn)
    with pytest.raises(ValueError, match="unpacked 2-bit codes"):
        plot_page_layout(low * 5, high, idx, scale, mn)  # packed bytes, not codes
    bad = idx.copy()
    bad[np.flatnonzero(idx == 4)[0]] = 0  # two channels on compact row 0
    with pytest.raises(ValueError, match="distinct compact rows"):
        plot_page_layout(low, high, bad, scale, mn)
    bad = idx.copy()
    bad[0] = 9
    with pytest.raises(ValueError, match=r"boost_idx\[0\] = 9"):
        plot_page_layout(low, high, bad, scale, mn)
    with pytest.raises(ValueError, match="sentinel=2 collides"):
        plot_page_layout(low, high, idx, scale, mn, sentinel=2)


# ---------------------------------------------------------------- group ranges

def test_group_ranges_values():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)  # (3, 4)
    np.testing.assert_array_equal(group_ranges(x, 2, axis=-1), np.ones((3, 2)))
    np.testing.assert_array_equal(group_ranges(x, 3, axis=0), np.full((4, 1), 8.0))


def test_group_ranges_compare_on_one_ax():
    k = keys()
    fig = plot_group_ranges(k, 8, axis=-1, label="per-token")
    ax = fig.axes[0]
    assert plot_group_ranges(k, 16, axis=0, ax=ax, label="per-channel") is fig
    assert len(ax.lines) == 2  # median lines
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts[0].startswith("per-token") and texts[1].startswith("per-channel")
    png_bytes(fig)


def test_group_ranges_map_and_log():
    fig = plot_group_ranges(keys(), 16, axis=0, kind="map")
    assert len(fig.axes) == 2 and fig.axes[0].images[0].get_array().shape == (32, 4)
    fig, ax = host_axes()
    plot_group_ranges(keys(), 8, ax=ax, xscale="log")
    assert ax.get_xscale() == "log"
    png_bytes(fig)


def test_group_ranges_bad():
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        plot_group_ranges(np.zeros((4, 6)), 4)
    with pytest.raises(ValueError, match="axis=2"):
        plot_group_ranges(np.zeros((4, 8)), 4, axis=2)
    with pytest.raises(ValueError, match="group_size"):
        plot_group_ranges(np.zeros((4, 8)), 0)
    with pytest.raises(ValueError, match="2-D"):
        plot_group_ranges(np.zeros((2, 4, 8)), 4, kind="map")
    with pytest.raises(ValueError, match="kind"):
        plot_group_ranges(np.zeros((4, 8)), 4, kind="bars")


# ---------------------------------------------------------------- no pyplot, no torch

def test_no_pyplot_no_torch_imported():
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import kvq.viz as v
        assert "matplotlib" not in sys.modules, "kvq.viz imports matplotlib eagerly"
        rng = np.random.default_rng(0)
        k = rng.standard_normal((32, 16))
        figs = [v.plot_channel_magnitudes(k), v.plot_channel_sensitivity(np.abs(k[:4]), top=2),
                v.plot_error_vs_boost([0, 0.5, 1], [[1, 0.5, 0]], labels=["m"]),
                v.plot_group_ranges(k, 8), v.plot_group_ranges(k, 8, axis=0, kind="map"),
                v.plot_page_layout(np.zeros((16, 8), np.uint8), np.ones((2, 8), np.uint8),
                                   np.array([0, 1] + [2] * 14, np.uint8), np.ones(16), np.zeros(16))]
        import io
        for f in figs:
            f.savefig(io.BytesIO(), format="png", dpi=20)
        bad = [m for m in ("matplotlib.pyplot", "torch") if m in sys.modules]
        assert not bad, bad
        print("ok")
    """)
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
