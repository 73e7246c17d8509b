"""Every figure of kvq.viz is readable: a title, every axis that shows a scale labelled, every text inside
the figure, and a legend that covers no data.

Each public ``plot_*`` function of ``kvq.viz`` is drawn on small inputs (a test fails when a new one is
added without a case here). After ``fig.canvas.draw()``, in display coordinates:

* the figure has a non-empty title (a suptitle or an Axes title);
* every visible Axes that holds data (lines, collections, patches, images; colour bars included) has a
  non-empty label on each axis whose tick labels are shown (an axis without tick labels has no scale
  to name: the index strips of the Kitty page, the upper panels of a shared x axis);
* titles, axis labels and legends lie inside the figure (nothing is cut off when saved);
* no legend covers data: no line vertex (nor a point along a drawn segment), scatter point, bar or
  image of any Axes lies inside a legend's box.
"""

from __future__ import annotations

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

import kvq.viz as viz  # noqa: E402
from kvq.reference import bitdecoding as bd  # noqa: E402
from kvq.reference.higgs import load_grid  # noqa: E402
from kvq.viz.common import legend_outside, new_figure, set_title  # noqa: E402

RNG = np.random.default_rng(0)
PIXEL = 1.5                     # tolerance, display pixels (anti-aliasing, rounding of text extents)


def _keys(T=64, D=32):
    k = RNG.standard_normal((T, D)).astype(np.float32)
    k[:, [3, 17]] *= 8.0
    return k


def _page(D=16, G=16, d_boost=4):
    low = RNG.integers(0, 4, (D, G), dtype=np.uint8)
    high = RNG.integers(0, 4, (d_boost, G), dtype=np.uint8)
    idx = np.full(D, d_boost, np.uint8)
    idx[np.sort(RNG.choice(D, d_boost, replace=False))] = np.arange(d_boost)
    return low, high, idx, RNG.uniform(0.01, 1, D), RNG.uniform(-2, 0, D)


def _group_ranges_two():
    k = _keys()
    fig = viz.plot_group_ranges(k, 8, axis=-1, label="per token (groups of 8 channels)")
    return viz.plot_group_ranges(k, 8, axis=0, ax=fig.axes[0], label="per channel (groups of 8 tokens)")


def _higgs_pair():
    """The book's layout: two grids side by side on one constrained Figure."""
    fig = new_figure(figsize=(9, 4.5))
    a, b = fig.subplots(1, 2)
    viz.plot_higgs_grid(load_grid(2, 16), ax=a, samples=500)
    return viz.plot_higgs_grid(load_grid(2, 256), ax=b, samples=500)


def _spectrum(D=32, decay=1.0):
    return np.sort(RNG.uniform(0.1, 5, D) / (1 + np.arange(D)) ** decay)[::-1]


_U, _ = np.linalg.qr(RNG.standard_normal((16, 16)))
_SMALL_BD = bd.BitDecodingConfig(bits=4, warps_n=1, k_group=32, v_group=32)
_TABLE = {m: {k: float(v) for k, v in zip(("k_rel_mse", "v_rel_mse", "logit_mse", "attention_kl"), row)}
          for m, row in zip(("naive INT2", "Hadamard", "OSCAR"), ([1.0, 1.0, 1.0, 1.0], [0.3, 0.5, 0.25, 0.2],
                                                                  [0.2, 0.3, 0.2, 0.15]))}

#: (case id, the kvq.viz function it draws, a builder returning the Figure)
CASES = [
    ("channel_magnitudes", "plot_channel_magnitudes", lambda: viz.plot_channel_magnitudes(_keys(), top=2)),
    ("channel_sensitivity", "plot_channel_sensitivity",
     lambda: viz.plot_channel_sensitivity(RNG.uniform(0, 1e-5, (4, 32)), top=3)),
    ("error_vs_boost", "plot_error_vs_boost",
     lambda: viz.plot_error_vs_boost([0, 0.0625, 0.125, 0.25, 0.5], [[1.26, 0.27, 0.26, 0.22, 0.16],
                                                                     [1.26, 1.25, 1.23, 1.2, 0.7]],
                                     labels=["magnitude (Kitty)", "random channels"], ylabel="key MSE")),
    ("page_layout", "plot_page_layout", lambda: viz.plot_page_layout(*_page())),
    ("group_ranges_hist", "plot_group_ranges", _group_ranges_two),
    ("group_ranges_map", "plot_group_ranges", lambda: viz.plot_group_ranges(_keys(), 16, axis=0, kind="map")),
    ("explained_variance", "plot_explained_variance",
     lambda: viz.plot_explained_variance({"K": {"L-1": 0.57, "L-1..2": 0.72, "T-1": -0.02, "V": 0.64},
                                          "V": {"L-1": 0.54, "L-1..2": 0.7, "T-1": -0.05, "K": 0.63}})),
    ("higgs_grid", "plot_higgs_grid", lambda: viz.plot_higgs_grid(load_grid(2, 16), samples=500)),
    ("higgs_grid_pair", "plot_higgs_grid", _higgs_pair),
    ("residual_variance", "plot_residual_variance",
     lambda: viz.plot_residual_variance([[60, 56, 58, 64, 58, 57], [61, 57, 59, 60, 56, 54]],
                                        [[60, 24, 28, 30, 28, 28], [61, 10.5, 13, 13.2, 14, 13]])),
    ("token_groups", "plot_token_groups",
     lambda: viz.plot_token_groups({"identity": _keys(1, 32)[0], "hadamard": RNG.standard_normal(32)}, 16)),
    ("spectra", "plot_spectra", lambda: viz.plot_spectra({"C_Q": _spectrum(), "C_K": _spectrum(decay=0.5),
                                                          "C_S": _spectrum(decay=2.0)})),
    ("alignment", "plot_alignment", lambda: viz.plot_alignment(_U, _U[:, ::-1], top=8)),
    ("kl_vs_context", "plot_kl_vs_context",
     lambda: viz.plot_kl_vs_context([128, 256, 512, 1024], [[0.028, 0.025, 0.024, 0.027],
                                                            [0.0058, 0.0059, 0.0055, 0.0057],
                                                            [0.0045, 0.0044, 0.0041, 0.0042]],
                                    labels=["naive INT2", "Hadamard", "OSCAR"])),
    ("error_table", "plot_error_table", lambda: viz.plot_error_table(_TABLE)),
    ("fragment_layout", "plot_fragment_layout", lambda: viz.plot_fragment_layout("b")),
    ("induced_packing_k", "plot_induced_packing", lambda: viz.plot_induced_packing(_SMALL_BD, "k", lane=5)),
    ("induced_packing_v", "plot_induced_packing", lambda: viz.plot_induced_packing(_SMALL_BD, "v", lane=5)),
    ("warp_partition", "plot_warp_partition", lambda: viz.plot_warp_partition(warps_n=4, tile_n=64)),
]

#: axis labels that must name a unit: case id -> (x label fragment, y label fragment)
UNITS = {
    "kl_vs_context": ("(tokens)", "(nats)"),
    "error_vs_boost": ("(%)", "key MSE"),
    "channel_magnitudes": ("(index)", "(position)"),
    "residual_variance": ("(index)", "sum over channels"),
    "spectra": ("rank", "(fraction of energy)"),
    "error_table": ("metric", "(ratio)"),
    "group_ranges_hist": ("max - min", "(count)"),
}


# ---------------------------------------------------------------------------------------------------
# what a readable figure is, in display coordinates


def _all_axes(fig):
    return [a for ax in fig.axes for a in (ax, *ax.child_axes)]


def _titles(fig):
    """Every title text of the figure: suptitle and each Axes' centre / left / right titles."""
    out = [t for t in (fig._suptitle,) if t is not None]
    for ax in _all_axes(fig):
        out += [ax.title, ax._left_title, ax._right_title]
    return [t for t in out if t.get_visible() and t.get_text().strip()]


def _has_data(ax) -> bool:
    return bool(ax.lines or ax.collections or ax.patches or ax.images)


def _shown_tick_labels(axis) -> list:
    return [t for t in axis.get_ticklabels() if t.get_visible() and t.get_text().strip()]


def _line_points(line: Line2D, per_segment: int = 24) -> np.ndarray:
    """(n, 2) display points of a line: its vertices, plus points along each drawn segment."""
    xy = np.asarray(line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float)))
    xy = xy[np.all(np.isfinite(xy), axis=1)] if xy.size else xy.reshape(0, 2)
    if line.get_linestyle() in ("None", " ", "", "none") or len(xy) < 2:
        return xy
    t = np.linspace(0.0, 1.0, per_segment)[:, None, None]                    # (s, 1, 1)
    seg = xy[:-1][None] * (1 - t) + xy[1:][None] * t                         # (s, n - 1, 2)
    return np.concatenate([xy, seg.reshape(-1, 2)])


def _covered(ax, box, renderer) -> list:
    """What of ``ax``'s data lies inside the display box ``box`` (and inside the Axes, where it shows)."""
    area = ax.bbox
    hit = []
    inner = box.padded(-PIXEL)

    def inside(xy):
        xy = np.asarray(xy).reshape(-1, 2)
        in_ax = ((xy[:, 0] >= area.x0) & (xy[:, 0] <= area.x1) & (xy[:, 1] >= area.y0) & (xy[:, 1] <= area.y1))
        in_box = ((xy[:, 0] > inner.x0) & (xy[:, 0] < inner.x1) & (xy[:, 1] > inner.y0) & (xy[:, 1] < inner.y1))
        return bool(np.any(in_ax & in_box))

    for line in ax.lines:
        if line.get_visible() and inside(_line_points(line)):
            hit.append(f"line {line.get_label()!r}")
    for coll in ax.collections:
        if not coll.get_visible():
            continue
        if isinstance(coll, PathCollection):                                  # scatter: its points
            pts = coll.get_offset_transform().transform(np.asarray(coll.get_offsets(), dtype=float))
            if inside(pts):
                hit.append(f"scatter {coll.get_label()!r}")
        elif coll.get_window_extent(renderer).overlaps(inner):                # anything else: its extent
            hit.append(type(coll).__name__)
    for artist in [*ax.patches, *ax.images]:
        if not artist.get_visible():
            continue
        ext = artist.get_window_extent(renderer)
        clipped = ext.intersection(ext, area) if ext.overlaps(area) else None
        if clipped is not None and clipped.width > 0 and clipped.height > 0 and clipped.overlaps(inner):
            hit.append(f"{type(artist).__name__} {artist.get_label()!r}")
    return hit


def problems(fig) -> list:
    """Every readability problem of ``fig`` (an empty list: readable)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = fig.bbox.padded(PIXEL)
    out = []
    if not _titles(fig):
        out.append("no title")
    axes = _all_axes(fig)
    texts = list(_titles(fig))
    for i, ax in enumerate(axes):
        if not ax.get_visible() or not ax.axison or not _has_data(ax):
            continue
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            if _shown_tick_labels(axis) and not axis.label.get_text().strip():
                out.append(f"Axes {i} ({ax.get_title()!r}): {name} axis shows a scale but has no label")
            if axis.label.get_text().strip():
                texts.append(axis.label)
    for extra in (fig._supxlabel, fig._supylabel):
        if extra is not None and extra.get_text().strip():
            texts.append(extra)
    for t in texts:
        ext = t.get_window_extent(renderer)
        if not frame.contains(ext.x0, ext.y0) or not frame.contains(ext.x1, ext.y1):
            out.append(f"text {t.get_text()!r} is cut off by the figure's edge")
    legends = [ax.get_legend() for ax in axes if ax.get_legend() is not None] + list(fig.legends)
    for leg in legends:
        box = leg.get_window_extent(renderer)
        if not frame.contains(box.x0, box.y0) or not frame.contains(box.x1, box.y1):
            out.append("a legend is cut off by the figure's edge")
        for i, ax in enumerate(axes):
            if ax.get_visible() and ax.bbox.overlaps(box):
                out += [f"the legend covers {what} of Axes {i}" for what in _covered(ax, box, renderer)]
    return out


# ---------------------------------------------------------------------------------------------------
# the tests


def test_every_figure_function_has_a_case():
    public = {n for n in viz.__all__ if n.startswith("plot_")}
    assert {fn for _, fn, _ in CASES} == public


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_figure_is_readable(case):
    name, _, build = case
    fig = build()
    assert problems(fig) == []
    if name in UNITS:
        ax = fig.axes[0]
        x, y = UNITS[name]
        assert x in ax.get_xlabel() and y in ax.get_ylabel(), (ax.get_xlabel(), ax.get_ylabel())


def test_a_legend_over_the_data_is_found():
    """The check itself: a legend drawn inside the Axes, across a line, is reported; moved outside, not."""
    fig = new_figure((4, 3))
    ax = fig.add_subplot()
    x = np.linspace(0, 1, 50)
    ax.plot(x, np.full_like(x, 0.9), label="a long label across the line")
    ax.plot(x, x, label="b")
    ax.set(xlabel="x (units)", ylabel="y (units)", ylim=(0, 1))
    set_title(ax, None, "t")
    ax.legend(loc="upper right")
    assert any("covers line" in p for p in problems(fig))
    legend_outside(ax)
    assert problems(fig) == []


def test_missing_title_and_label_are_found():
    fig = new_figure((4, 3))
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1])
    found = problems(fig)
    assert "no title" in found and any("x axis shows a scale" in p for p in found)


def test_set_title_keeps_a_callers_title():
    fig = new_figure((4, 3))
    ax = fig.add_subplot()
    set_title(ax, None, "default")
    assert ax.get_title() == "default"
    set_title(ax, None, "another default")
    assert ax.get_title() == "default"
    set_title(ax, "mine", "default")
    assert ax.get_title() == "mine"
    with pytest.raises(ValueError, match="where must be"):
        legend_outside(ax, "inside")


def test_channel_magnitudes_legend_keys_have_the_bars_colours():
    """The legend's keys are drawn for it: "mean |k|" stays blue when the first channel is a top (red) one."""
    k = _keys()
    k[:, 0] *= 20.0                                       # channel 0 has the largest mean |k|
    fig = viz.plot_channel_magnitudes(k, top=2)
    legend = fig.axes[1].get_legend()
    colours = {t.get_text(): h.get_facecolor()[:3] for t, h in zip(legend.get_texts(), legend.legend_handles)}
    assert colours["mean |k| (Eq. 2)"] == matplotlib.colors.to_rgb("#1f77b4")
    assert colours["top 2 by mean"] == matplotlib.colors.to_rgb("#d62728")
    assert colours["max |k| over tokens"] == matplotlib.colors.to_rgb("0.8")
