"""Per-group ranges (max - min): why keys are quantized per channel and values per token.

Asymmetric b-bit quantization of a group has step ``(max - min) / (2^b - 1)``, so the group range
sets the error. KIVI (section 3.1) groups keys along tokens (per channel), because a few key channels
carry outliers that would widen every per-token group. Draw both groupings on one Axes to compare:

    fig = plot_group_ranges(k, 32, axis=-1, label="per-token (groups of channels)")
    plot_group_ranges(k, 32, axis=0, ax=fig.axes[0], label="per-channel (groups of tokens)")
    fig.savefig("ranges.png")
"""

from __future__ import annotations

import numpy as np

from .common import legend_outside, new_axes, set_title

__all__ = ["group_ranges", "plot_group_ranges"]


def group_ranges(x, group_size: int, axis: int = -1) -> np.ndarray:
    """``max - min`` of each group of ``group_size`` consecutive elements along ``axis``.

    x: any real array whose length along ``axis`` is a multiple of ``group_size``.
    Returns float64 of shape ``x.shape`` with ``axis`` moved last and replaced by n_groups.
    """
    x = np.asarray(x)
    if x.ndim == 0 or x.size == 0:
        raise ValueError(f"x must be a non-empty array; got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"x must be numeric; got dtype {x.dtype}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for x of shape {x.shape}")
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size must be a positive int; got {group_size!r}")
    n = x.shape[axis]
    if n % group_size:
        raise ValueError(f"x has length {n} along axis {axis}, not a multiple of group_size={group_size}")
    g = np.moveaxis(x.astype(np.float64), axis, -1)  # (..., n)
    g = g.reshape(*g.shape[:-1], n // group_size, group_size)  # (..., n_groups, group_size)
    r = g.max(axis=-1) - g.min(axis=-1)  # (..., n_groups)
    if not np.all(np.isfinite(r)):
        raise ValueError("x contains NaN or inf")
    return r


def plot_group_ranges(x, group_size: int, axis: int = -1, ax=None, label=None, kind="hist", bins=40,
                      xscale="linear"):
    """Distribution (or map) of the per-group ranges of ``x`` for one grouping.

    kind="hist": a histogram of all group ranges with a dashed line at the median; call it twice on
    one Axes (``axis=-1`` and ``axis=0`` on keys of shape (T, D)) to compare per-token with
    per-channel grouping (the argument of KIVI section 3.1, and Kitty Figure 2a's outlier channels).
    kind="map": for 2-D ``x``, a heatmap of the ranges: rows index the other axis, columns the groups.

    x: array, length along ``axis`` a multiple of ``group_size``.  label: legend text (hist, the
    legend sits under the Axes) or the title (map).
    bins: histogram bins.  xscale: "linear" or "log" for the range axis of the histogram.
    Titles: hist "range (max - min) of each quantization group" unless the Axes has one already;
    map ``label`` or "group ranges, groups of <group_size> along axis <axis>".
    Returns the Figure (hist: one filled patch set + one median Line2D per call; map: an image and a
    colour bar Axes).
    """
    r = group_ranges(x, group_size, axis)  # (..., n_groups)
    if kind not in ("hist", "map"):
        raise ValueError(f"kind must be 'hist' or 'map'; got {kind!r}")
    if xscale not in ("linear", "log"):
        raise ValueError(f"xscale must be 'linear' or 'log'; got {xscale!r}")
    ax_norm = axis % np.ndim(x)
    if kind == "map":
        if r.ndim != 2:
            raise ValueError(f"kind='map' needs a 2-D x; got shape {np.shape(x)}")
        fig, ax = new_axes(ax, figsize=(6.4, 4.8))
        im = ax.imshow(r, aspect="auto", interpolation="nearest", cmap="viridis")
        fig.colorbar(im, ax=ax, label="group range (max - min)")
        ax.set_xlabel(f"group of {group_size} along axis {ax_norm} (index)")
        ax.set_ylabel(f"position along axis {1 - ax_norm} (index)")
        set_title(ax, label, f"group ranges, groups of {group_size} along axis {ax_norm}")
        return fig

    fig, ax = new_axes(ax, figsize=(6.4, 4.0))
    flat = r.ravel()
    med = float(np.median(flat))
    if xscale == "log":
        pos = flat[flat > 0]
        if pos.size == 0:
            raise ValueError("xscale='log' needs some positive ranges; every group is constant")
        edges = np.geomspace(pos.min(), pos.max() * (1 + 1e-9), bins + 1)
        flat = pos
    else:
        edges = bins
    text = f"axis {ax_norm}, groups of {group_size}" if label is None else str(label)
    _, _, patches = ax.hist(flat, bins=edges, histtype="stepfilled", alpha=0.45,
                            label=f"{text}: median {med:.3g}")
    color = patches[0].get_facecolor()[:3]
    ax.axvline(med, color=color, ls="--", lw=1.2)
    ax.set_xscale(xscale)
    ax.set_xlabel("group range (max - min)")
    ax.set_ylabel("groups (count)")
    legend_outside(ax, "below", fontsize=8)
    set_title(ax, None, "range (max - min) of each quantization group")
    return fig
