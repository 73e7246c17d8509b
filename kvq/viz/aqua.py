"""Figures for AQUA-KV (AQUA-KV §3.1 Fig. 2; HIGGS grids, §4.1; residual variance per layer).

    fig = plot_explained_variance(probes)                 # probes: {"K": {"L-1": 0.57, ...}, "V": {...}}
    fig = plot_higgs_grid(load_grid(2, 16))               # the d = 2 grid over an N(0, I) cloud
    fig = plot_residual_variance(before, after)           # (2, L) arrays: keys, values per layer
"""

from __future__ import annotations

import numpy as np

from .common import as_array, legend_outside, new_axes, set_title

__all__ = ["plot_explained_variance", "plot_higgs_grid", "plot_residual_variance"]

_ROLE_COLORS = {"K": "#1f77b4", "V": "#ff7f0e"}
#: explained variance of 1- and 2-bit quantizers quoted in AQUA-KV §3.1
_QUANTIZER_EV = ((0.75, "1-bit quantizer"), (0.89, "2-bit quantizer"))


def plot_explained_variance(probes, ax=None, title=None, quantizer_lines=True):
    """Fig. 2 layout: bars of explained variance per probe source, keys and values side by side.

    probes: ``{"K": {source: ev}, "V": {source: ev}}`` (``aqua_probes.probe_explained_variance``);
    the sources of the two roles are aligned by position (the last one is the other role).
    quantizer_lines: dashed lines at the 1-bit and 2-bit quantizers' explained variance (0.75, 0.89).
    title: default "explained variance of linear probes (held out)"; the legend sits right of the Axes.
    Returns the Figure.
    """
    if not isinstance(probes, dict) or not probes or not all(isinstance(v, dict) and v for v in probes.values()):
        raise ValueError("probes must be a non-empty dict {role: {source: explained variance}}")
    roles = list(probes)
    n = max(len(probes[r]) for r in roles)
    if any(len(probes[r]) != n for r in roles):
        raise ValueError(f"every role needs the same number of sources; got {[len(probes[r]) for r in roles]}")
    vals = np.array([[float(v) for v in probes[r].values()] for r in roles])          # (roles, sources)
    if not np.all(np.isfinite(vals)):
        raise ValueError("explained variances must be finite")
    fig, ax = new_axes(ax, figsize=(7.5, 3.8))
    x = np.arange(n)
    w = 0.8 / len(roles)
    for i, r in enumerate(roles):
        bars = ax.bar(x + (i - (len(roles) - 1) / 2) * w, vals[i], w, label=f"predict {r}",
                      color=_ROLE_COLORS.get(r, f"C{i}"))
        for b, name in zip(bars, probes[r]):
            ax.annotate(name, (b.get_x() + b.get_width() / 2, max(b.get_height(), 0)), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=6, rotation=90)
    if quantizer_lines:
        for ev, label in _QUANTIZER_EV:
            ax.axhline(ev, ls="--", lw=0.8, color="grey")
            ax.annotate(label, (n - 0.5, ev), xytext=(0, 2), textcoords="offset points", ha="right",
                        fontsize=7, color="grey")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(x, [f"{' / '.join(list(probes[r])[j] for r in roles)}" for j in range(n)], fontsize=7)
    ax.set_xlabel("probe source (" + " / ".join(f"predicting {r}" for r in roles) + ")")
    ax.set_ylabel("explained variance, held out (fraction)")
    ax.set_ylim(min(0.0, vals.min() - 0.05), 1.12)
    legend_outside(ax, fontsize=8)
    set_title(ax, title or None, "explained variance of linear probes (held out)")
    return fig


def plot_higgs_grid(grid, ax=None, samples=4000, seed=0, title=None):
    """A d = 2 HIGGS grid (n, 2) drawn over ``samples`` draws of N(0, I_2), with each point's index.

    title: default "HIGGS grid d = 2, n = <n> (<bits> bits / value)"; the legend sits under the Axes.
    Returns the Figure."""
    grid = as_array("grid", grid, 2)
    if grid.shape[1] != 2:
        raise ValueError(f"grid must have shape (n, 2) to be drawn in the plane; got {grid.shape}")
    fig, ax = new_axes(ax, figsize=(5.0, 5.0))
    cloud = np.random.default_rng(seed).standard_normal((int(samples), 2))
    ax.scatter(cloud[:, 0], cloud[:, 1], s=2, color="0.75", alpha=0.6, rasterized=True, label="N(0, I)")
    ax.scatter(grid[:, 0], grid[:, 1], s=18, color="#d62728", zorder=3, label=f"grid, n = {len(grid)}")
    if len(grid) <= 64:
        for i, (gx, gy) in enumerate(grid):
            ax.annotate(str(i), (gx, gy), xytext=(3, 3), textcoords="offset points", fontsize=6)
    lim = max(3.5, float(np.abs(grid).max()) + 0.3)
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.set_aspect("equal")
    ax.set_xlabel("coordinate 1 (standard deviations)")
    ax.set_ylabel("coordinate 2 (standard deviations)")
    legend_outside(ax, "below", fontsize=7, ncol=2)
    ax.set_title(title or f"HIGGS grid d = 2, n = {len(grid)} ({np.log2(len(grid)) / 2:g} bits / value)")
    return fig


def plot_residual_variance(before, after, ax=None, roles=("K", "V"), title=None):
    """Per layer, the variance of what is quantized without (``before``) and with prediction (``after``).

    before, after: (R, L) arrays (``aqua_probes.residual_variance``: row 0 keys, row 1 values) or (L,).
    Drawn on a log scale; the ratio after / before is what the predictor leaves to the quantizer.
    title: default "variance to quantize per layer, before and after prediction"; the legend sits
    right of the Axes. Returns the Figure.
    """
    b = as_array("before", before, (1, 2)).astype(np.float64)
    a = as_array("after", after, (1, 2)).astype(np.float64)
    b, a = np.atleast_2d(b), np.atleast_2d(a)
    if a.shape != b.shape:
        raise ValueError(f"before {b.shape} and after {a.shape} must have the same shape")
    if len(roles) < b.shape[0]:
        raise ValueError(f"{b.shape[0]} rows need {b.shape[0]} role names; got {roles!r}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))) or np.any(a <= 0) or np.any(b <= 0):
        raise ValueError("variances must be finite and positive (log scale)")
    fig, ax = new_axes(ax, figsize=(6.4, 3.6))
    layers = np.arange(b.shape[1])
    for i in range(b.shape[0]):
        c = _ROLE_COLORS.get(roles[i], f"C{i}")
        ax.plot(layers, b[i], "o--", color=c, alpha=0.6, label=f"{roles[i]}: before prediction")
        ax.plot(layers, a[i], "o-", color=c, label=f"{roles[i]}: residual after prediction")
    ax.set_yscale("log")
    ax.set_xticks(layers)
    ax.set_xlabel("layer (index)")
    ax.set_ylabel("total variance (sum over channels)")
    legend_outside(ax, fontsize=7)
    set_title(ax, title or None, "variance to quantize per layer, before and after prediction")
    return fig
