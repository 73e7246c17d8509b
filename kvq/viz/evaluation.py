"""Figures of kvq's evaluation (``kvq.evaluation``, book chapter "Real models"): quality against memory.

    from kvq.viz.evaluation import plot_quality_vs_bits
    fig = plot_quality_vs_bits(points, quality="perplexity", budgets=[2.5, 4.5])
    # points: [{"method": "KIVI-K2V2", "bits": 2.48, "value": 12.3, "config": "<=2.5"}, ...]

One point per (method, configuration), one colour and marker per method, points of a method joined in
order of bits (a curve per method once it is measured at several budgets); the budgets as dashed
vertical lines, so that a reader sees which points were compared at equal memory.
"""

from __future__ import annotations

import math

import numpy as np

from ._common import legend_outside, new_axes, set_title

__all__ = ["plot_quality_vs_bits"]

_MARKERS = "os^Dvp*hX<>"


def plot_quality_vs_bits(points, quality: str = "perplexity", budgets=None, reference=None, ax=None,
                         title=None, log_y: bool = False):
    """Quality against bits per element, one series per method.

    points: an iterable of dicts with "method" (str), "bits" (bits per element, > 0), "value" (the
    quality metric, finite) and optionally "config" (a short label such as "paper" or "<=2.5": a point
    labelled "paper" is drawn hollow, so the papers' own configurations stand apart from the equal-memory
    ones). quality: the metric's name and unit for the y label (e.g. "perplexity", "attention KL
    (nats)"). budgets: bits-per-element budgets drawn as dashed vertical lines. reference: an optional
    (label, value) drawn as a horizontal line (e.g. ("FP16", 11.9)). log_y: log scale for the metric.
    Returns the Figure. ValueError when a point lacks a field or a number is out of range.
    """
    pts = list(points)
    if not pts:
        raise ValueError("points is empty: give at least one {'method', 'bits', 'value'} dict")
    for i, p in enumerate(pts):
        if not isinstance(p, dict) or not {"method", "bits", "value"} <= set(p):
            raise ValueError(f"points[{i}] must be a dict with 'method', 'bits' and 'value', got {p!r}")
        b, v = p["bits"], p["value"]
        if isinstance(b, bool) or not isinstance(b, (int, float, np.integer, np.floating)) or not b > 0 \
                or not math.isfinite(b):
            raise ValueError(f"points[{i}]['bits'] must be a finite number > 0, got {b!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
            raise ValueError(f"points[{i}]['value'] must be a finite number, got {v!r}")
        if log_y and v <= 0:
            raise ValueError(f"points[{i}]['value'] = {v!r}: a log y axis needs positive values")
    budgets = [] if budgets is None else [float(b) for b in budgets]
    if any(not math.isfinite(b) or b <= 0 for b in budgets):
        raise ValueError(f"budgets must be finite numbers > 0, got {budgets!r}")
    fig, ax = new_axes(ax, figsize=(6.4, 4.0))
    methods = list(dict.fromkeys(p["method"] for p in pts))
    colors = [f"C{i % 10}" for i in range(len(methods))]
    for i, m in enumerate(methods):
        mine = sorted((p for p in pts if p["method"] == m), key=lambda p: p["bits"])
        x = [float(p["bits"]) for p in mine]
        y = [float(p["value"]) for p in mine]
        mk = _MARKERS[i % len(_MARKERS)]
        ax.plot(x, y, color=colors[i], lw=1.0, alpha=0.6)
        for xi, yi, p in zip(x, y, mine):
            paper = p.get("config") == "paper"
            ax.plot([xi], [yi], marker=mk, ms=6, ls="none", color=colors[i],
                    markerfacecolor="none" if paper else colors[i])
        ax.plot([], [], marker=mk, color=colors[i], ls="-", label=m)
    for b in budgets:
        ax.axvline(b, color="0.5", ls="--", lw=0.8)
        ax.annotate(f"{b:g} b/e", (b, 1.0), xycoords=("data", "axes fraction"), ha="left", va="top",
                    fontsize=7, color="0.4", xytext=(2, -2), textcoords="offset points")
    if reference is not None:
        label, value = reference
        ax.axhline(float(value), color="k", lw=0.8, ls=":", label=str(label))
    if any(p.get("config") == "paper" for p in pts):
        ax.plot([], [], marker="o", ls="none", color="0.3", markerfacecolor="none", label="paper config (hollow)")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("bits per element (K and V, metadata and FP16 tokens counted)")
    ax.set_ylabel(quality)
    ax.grid(alpha=0.3)
    legend_outside(ax, fontsize=7)
    set_title(ax, title, f"{quality} against bits per element")
    return fig
