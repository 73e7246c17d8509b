"""Figures of kvq's evaluation (``kvq.evaluation``, book chapter "Real models"): quality against memory.

    from kvq.viz.evaluation import plot_quality_vs_bits
    fig = plot_quality_vs_bits(points, quality="perplexity", budgets=[2.5, 4.5])
    # points: [{"method": "KIVI-K2V2", "bits": 2.48, "value": 12.3, "config": "<=2.5"}, ...]

One point per (method, configuration), one colour and marker per method, points of a method joined in
order of bits (a curve per method once it is measured at several budgets); the budgets as dashed
vertical lines, so that a reader sees which points were compared at equal memory.

The long-context model (``benchmarks/train_long_lm.py``'s ``long_lm.json``), its rows passed as they are:

    fig = plot_ppl_by_position(doc["ppl_by_position"]["rows"])          # a line per row
    fig = plot_retrieval_by_depth(doc["retrieval"]["rows"])             # a panel per context length

A row is one evaluated configuration: ``"label"`` (e.g. "FP16", "KIVI-K2V2 (paper)", "KIVI-K2V2 @ <=2.5
b/e"), ``"method"``, ``"budget"`` (None for FP16 and the papers' configurations) and its measurements;
rows that were skipped or failed (no measurements) are left out. One colour per method, one line style
per configuration: solid for the paper's (and FP16, in black), dashed / dotted / dash-dot for the budgets
in increasing order.
"""

from __future__ import annotations

import math

import numpy as np

from .common import legend_outside, new_axes, set_title

__all__ = ["plot_quality_vs_bits", "plot_ppl_by_position", "plot_retrieval_by_depth"]

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
        ax.annotate(f"{b:g} b/e", (b, 1.0), xycoords=("data", "axes fraction"), ha="right", va="top",
                    fontsize=7, color="0.4", xytext=(-2, -2), textcoords="offset points")   # inside the axes
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


_BUDGET_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)))


def _row_styles(rows) -> dict:
    """label -> (colour, line style, marker): a colour per method (FP16 black), solid for a paper / FP16
    row, a dashed style per budget in increasing order."""
    methods = [m for m in dict.fromkeys(r.get("method", r["label"]) for r in rows) if m != "FP16"]
    budgets = sorted({float(r["budget"]) for r in rows if r.get("budget") is not None})
    out = {}
    for r in rows:
        m = r.get("method", r["label"])
        if m == "FP16":
            out[r["label"]] = ("k", "-", "o")
            continue
        i = methods.index(m)
        b = r.get("budget")
        ls = "-" if b is None else _BUDGET_STYLES[budgets.index(float(b)) % len(_BUDGET_STYLES)]
        out[r["label"]] = (f"C{i % 10}", ls, _MARKERS[i % len(_MARKERS)])
    return out


def _measured(rows, key: str, what: str) -> list:
    """The rows of ``rows`` that hold ``key`` (skipped / failed rows left out); ValueError when a row is not
    a dict with a label, or when none holds ``key``."""
    rows = list(rows)
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get("label"), str):
            raise ValueError(f"rows[{i}] must be a dict with a 'label' (str), got {r!r:.80}")
    got = [r for r in rows if r.get(key)]
    if not got:
        raise ValueError(f"rows hold no row with {key!r}: nothing to draw ({what}; skipped or failed rows "
                         f"are left out)")
    return got


def plot_ppl_by_position(rows, ax=None, title=None, log_y: bool = False):
    """Perplexity against position in the sequence, a line per row (FP16 and each method / configuration).

    rows: ``long_lm.json``'s ``ppl_by_position["rows"]``: dicts with "label", "method", "budget" and
    "buckets" (a list of {"start", "end", "ppl"}: the perplexity of the positions in [start, end)); rows
    without buckets (skipped, failed) are left out. Each bucket is drawn at its middle position, on a
    log2 x axis (buckets double in length). log_y: log scale for the perplexity. Returns the Figure;
    ValueError when no row has buckets or a bucket is malformed.
    """
    got = _measured(rows, "buckets", "perplexity by position")
    for r in got:
        for j, b in enumerate(r["buckets"]):
            if not isinstance(b, dict) or not {"start", "end", "ppl"} <= set(b) or not b["end"] > b["start"] >= 0:
                raise ValueError(f"row {r['label']!r}: buckets[{j}] must be a dict with 0 <= 'start' < 'end' and "
                                 f"'ppl', got {b!r}")
            if isinstance(b["ppl"], bool) or not isinstance(b["ppl"], (int, float)) or not math.isfinite(b["ppl"]) \
                    or b["ppl"] <= 0:
                raise ValueError(f"row {r['label']!r}: buckets[{j}]['ppl'] must be a finite number > 0, "
                                 f"got {b['ppl']!r}")
    fig, ax = new_axes(ax, figsize=(6.4, 4.0))
    styles = _row_styles(got)
    for r in got:
        c, ls, mk = styles[r["label"]]
        x = [(b["start"] + b["end"]) / 2.0 for b in r["buckets"]]
        y = [float(b["ppl"]) for b in r["buckets"]]
        ax.plot(x, y, color=c, ls=ls, marker=mk, ms=4, lw=1.2, label=r["label"])
    if max(len(r["buckets"]) for r in got) > 1:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("position in the sequence (tokens, middle of each bucket)")
    ax.set_ylabel("perplexity")
    ax.grid(alpha=0.3)
    legend_outside(ax, fontsize=7)
    set_title(ax, title, "perplexity by position")
    return fig


def plot_retrieval_by_depth(rows, contexts=None, title=None):
    """Retrieval accuracy against the needle's depth, a line per row, one panel per context length.

    rows: ``long_lm.json``'s ``retrieval["rows"]``: dicts with "label", "method", "budget" and "cells" (a
    list of {"context", "depth", "accuracy"}; a cell with "skipped" instead, a context the configuration
    cannot serve, is left out); rows without cells are left out. contexts: the context lengths to draw,
    one panel each (default: every context in the cells, in increasing order). Accuracy in [0, 1], depth
    the fraction of the document before the needle. Returns the Figure (a new one: several panels);
    ValueError when no row has cells or a cell is malformed.
    """
    got = _measured(rows, "cells", "retrieval by depth")
    for r in got:
        for j, c in enumerate(r["cells"]):
            if not isinstance(c, dict) or "context" not in c:
                raise ValueError(f"row {r['label']!r}: cells[{j}] must be a dict with 'context', got {c!r}")
            if "accuracy" in c:
                a, d = c["accuracy"], c.get("depth")
                if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
                    raise ValueError(f"row {r['label']!r}: cells[{j}]['accuracy'] must be in [0, 1], got {a!r}")
                if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0:
                    raise ValueError(f"row {r['label']!r}: cells[{j}]['depth'] must be in [0, 1], got {d!r}")
    seen = sorted({int(c["context"]) for r in got for c in r["cells"]})
    if contexts is None:
        contexts = seen
    else:
        contexts = [int(n) for n in contexts]
        missing = [n for n in contexts if n not in seen]
        if not contexts or missing:
            raise ValueError(f"contexts must be context lengths of the cells ({seen}); got {contexts}")
    from .common import new_figure
    fig = new_figure(figsize=(min(3.2 * len(contexts) + 2.0, 16.0), 3.6))
    axes = fig.subplots(1, len(contexts), sharey=True, squeeze=False)[0]
    styles = _row_styles(got)
    for ax, n in zip(axes, contexts):
        for r in got:
            cells = sorted((c for c in r["cells"] if int(c["context"]) == n and "accuracy" in c),
                           key=lambda c: c["depth"])
            if not cells:
                continue
            c_, ls, mk = styles[r["label"]]
            ax.plot([c["depth"] for c in cells], [c["accuracy"] for c in cells], color=c_, ls=ls, marker=mk,
                    ms=4, lw=1.2, label=r["label"])
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlim(-0.05, 1.05)
        ax.set_xlabel("needle depth (fraction)")
        ax.set_title(f"context {n} tokens", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("retrieval accuracy")
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="outside right upper", frameon=False, fontsize=7)   # constrained layout
    fig.suptitle("retrieval accuracy against needle depth" if title is None else str(title))
    return fig
