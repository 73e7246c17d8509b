"""Figures for OSCAR (covariance-aware rotations for a 2-bit KV cache; OSCAR paper Figs. 1, 2/8, 3, 7, Table 10).

    fig = plot_token_groups({"raw": k_t, "H": k_t @ H, "OSCAR": k_t @ R_K}, group_size=32)   # Table 10
    fig = plot_spectra({"Q^T Q": lam_Q, "K^T K": lam_K}); plot_alignment(U_Q, U_K, top=16)  # Fig. 7
    fig = plot_kl_vs_context(lengths, kl, labels=["naive INT2", "Hadamard", "OSCAR"])        # Fig. 3
    fig = plot_error_table(rotations.error_table(q, k, v, methods))                          # Figs. 2 / 8

Every function returns a ``matplotlib.figure.Figure`` and never imports ``matplotlib.pyplot``.
"""

from __future__ import annotations

import numpy as np

from .common import as_array, check_top, legend_outside, new_axes, new_figure, set_title

__all__ = ["plot_token_groups", "plot_spectra", "plot_alignment", "plot_kl_vs_context", "plot_error_table"]

_GROUP_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _finite(name, a):
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or inf")
    return a


def plot_token_groups(rows: dict, group_size: int, ax=None, title=None):
    """One token's D channel values under each rotation, one panel per rotation, bars coloured by
    quantization group, each group's ``max - min`` written above it (Table 10 / Fig. 1 style).

    rows: name -> (D,) values (e.g. ``k_t``, ``k_t H``, ``k_t R_K``), all of the same D, a multiple of
    ``group_size``. ax: None (a new Figure) or a sequence of ``len(rows)`` Axes. Panels share the y
    range, so the ranges compare by eye. title: default "one token's channels under each rotation".
    Returns the Figure.
    """
    if not isinstance(rows, dict) or not rows:
        raise ValueError("rows must be a non-empty dict name -> (D,) values")
    vals = {str(n): _finite(f"rows[{n!r}]", as_array(f"rows[{n!r}]", r, 1).astype(np.float64)) for n, r in rows.items()}
    D = {v.shape[0] for v in vals.values()}
    if len(D) != 1:
        raise ValueError(f"every row must have the same length; got {sorted(D)}")
    D = D.pop()
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1 or D % group_size:
        raise ValueError(f"group_size={group_size!r} must be a positive int dividing D={D}")
    if ax is None:
        fig = new_figure((8.0, 1.7 * len(vals) + 0.6))
        axes = fig.subplots(len(vals), 1, sharex=True, squeeze=False)[:, 0]
        fig.supylabel("value per channel (each panel: one rotation)", fontsize=9)
    else:
        axes = list(ax) if not hasattr(ax, "plot") else [ax]
        if len(axes) != len(vals):
            raise ValueError(f"got {len(axes)} Axes for {len(vals)} rows")
        fig = new_axes(axes[0])[0]
    lim = max(np.abs(v).max() for v in vals.values()) * 1.35 or 1.0
    x = np.arange(D)
    for a, (name, v) in zip(axes, vals.items()):
        g = v.reshape(-1, group_size)
        colors = [_GROUP_COLORS[i % len(_GROUP_COLORS)] for i in x // group_size]
        a.bar(x, v, width=1.0, color=colors)
        for i, grp in enumerate(g):
            a.text((i + 0.5) * group_size - 0.5, lim * 0.98, f"{grp.max() - grp.min():.3g}", ha="center",
                   va="top", fontsize=7)
            if i:
                a.axvline(i * group_size - 0.5, color="0.5", lw=0.6, ls=":")
        a.set_ylim(-lim, lim)
        a.set_xlim(-0.5, D - 0.5)
        a.set_ylabel(name, fontsize=8)
        a.tick_params(labelsize=7)
    axes[-1].set_xlabel(f"channel (index; groups of {group_size}; numbers: max - min per group)")
    set_title(axes[0], title, "one token's channels under each rotation")
    return fig


def plot_spectra(spectra: dict, ax=None, normalize: bool = True, title=None):
    """Eigenvalue spectra (descending) on a log scale, one line per target (Fig. 7, third panel).

    spectra: name -> (D,) non-negative eigenvalues. normalize: divide each by its trace (fractions of
    the total energy), so targets of different scales compare. title: default "eigenvalue spectra";
    the legend sits right of the Axes. Returns the Figure.
    """
    if not isinstance(spectra, dict) or not spectra:
        raise ValueError("spectra must be a non-empty dict name -> (D,) eigenvalues")
    fig, ax = new_axes(ax, figsize=(5.6, 3.8))
    for name, lam in spectra.items():
        lam = _finite(f"spectra[{name!r}]", as_array(f"spectra[{name!r}]", lam, 1).astype(np.float64))
        if lam.min() < -1e-9 * max(lam.max(), 1.0):
            raise ValueError(f"spectra[{name!r}] has negative eigenvalues")
        lam = np.sort(np.clip(lam, 0, None))[::-1]
        if normalize:
            lam = lam / lam.sum() if lam.sum() > 0 else lam
        ax.plot(np.arange(1, lam.size + 1), np.where(lam > 0, lam, np.nan), marker="o", ms=2.5, lw=1.2, label=str(name))
    ax.set_yscale("log")
    ax.set_xlabel("eigenvalue rank (1 = largest)")
    ax.set_ylabel("eigenvalue / trace (fraction of energy)" if normalize else "eigenvalue")
    ax.grid(alpha=0.3)
    legend_outside(ax, fontsize=8)
    set_title(ax, title, "eigenvalue spectra" + (", normalized by the trace" if normalize else ""))
    return fig


def plot_alignment(U_a, U_b, top=None, ax=None, labels=("U_Q", "U_K"), title=None):
    """``|U_a^T U_b|``: the absolute overlap of two eigenbases, both sorted by descending eigenvalue
    (Fig. 7, fourth panel). A bright diagonal means a shared basis; a uniform texture, unrelated bases
    (random overlap ~ 1 / sqrt(D)). top: show only the leading ``top`` x ``top`` block. Returns the Figure."""
    U_a = _finite("U_a", as_array("U_a", U_a, 2).astype(np.float64))
    U_b = _finite("U_b", as_array("U_b", U_b, 2).astype(np.float64))
    if U_a.shape != U_b.shape or U_a.shape[0] != U_a.shape[1]:
        raise ValueError(f"U_a {U_a.shape} and U_b {U_b.shape} must be square and of the same shape")
    D = U_a.shape[0]
    n = D if top is None else check_top(top, D)
    if n == 0:
        raise ValueError("top must be at least 1")
    A = np.abs(U_a.T @ U_b)[:n, :n]
    fig, ax = new_axes(ax, figsize=(4.8, 4.0))
    im = ax.imshow(A, vmin=0, vmax=1, cmap="magma", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="|overlap|")
    ax.set_xlabel(f"{labels[1]} eigenvector (rank)")
    ax.set_ylabel(f"{labels[0]} eigenvector (rank)")
    ax.set_title(title if title is not None else f"|{labels[0]}^T {labels[1]}|, diag mean {np.diag(A).mean():.2f}"
                 f" (random ~ {1 / np.sqrt(D):.2f})", fontsize=9)
    return fig


def plot_kl_vs_context(lengths, kl, labels=None, ax=None, title=None):
    """Attention KL against context length, one line per method (Fig. 3).

    lengths: (n,) positive context lengths (tokens); kl: (n_series, n) or (n,) non-negative, in nats
    (``kvq.reference.metrics.attention_kl``). labels: one per series, drawn right of the Axes.
    title: default "attention KL divergence against context length". Returns the Figure."""
    lengths = as_array("lengths", lengths, 1).astype(np.float64)
    kl = as_array("kl", kl, (1, 2)).astype(np.float64)
    kl = kl[None] if kl.ndim == 1 else kl
    if kl.shape[1] != lengths.shape[0]:
        raise ValueError(f"kl has shape {kl.shape}; expected (n_series, {lengths.shape[0]}) to match lengths")
    if not np.all(np.isfinite(kl)) or kl.min() < 0 or not np.all(lengths > 0):
        raise ValueError("kl must be finite and non-negative, lengths positive")
    if labels is not None and len(list(labels)) != kl.shape[0]:
        raise ValueError(f"got {len(list(labels))} labels for {kl.shape[0]} series")
    fig, ax = new_axes(ax, figsize=(5.6, 3.8))
    for i, row in enumerate(kl):
        ax.plot(lengths, row, marker="os^Dv"[i % 5], ms=4, lw=1.5, label=None if labels is None else str(list(labels)[i]))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log" if kl.min() > 0 else "linear")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KL(p_fp || p_quantized) (nats)")
    ax.grid(alpha=0.3)
    if labels is not None:
        legend_outside(ax, fontsize=8)
    set_title(ax, title, "attention KL divergence against context length")
    return fig


def plot_error_table(table: dict, ax=None, metrics=None, title=None):
    """Grouped bars of each method's errors relative to the first method's (Figs. 2 / 8 in one panel).

    table: method -> {metric: value}, e.g. ``rotations.error_table``; metrics: which keys (default:
    all of the first method's). Each metric is divided by the first method's value, so 1 = as bad as
    it (e.g. naive INT2) and lower is better; log y axis. The legend (one entry per method) sits right
    of the Axes. title: default "errors relative to <first method> (lower is better)". Returns the
    Figure."""
    if not isinstance(table, dict) or not table:
        raise ValueError("table must be a non-empty dict method -> {metric: value}")
    methods = list(table)
    metrics = list(table[methods[0]]) if metrics is None else list(metrics)
    try:
        vals = np.array([[float(table[m][k]) for k in metrics] for m in methods])   # (n_methods, n_metrics)
    except KeyError as err:
        raise ValueError(f"metric {err} is missing for some method") from None
    if not np.all(np.isfinite(vals)) or np.any(vals <= 0):
        raise ValueError("every error must be finite and positive")
    rel = vals / vals[0]
    fig, ax = new_axes(ax, figsize=(7.2, 3.8))
    w = 0.8 / len(methods)
    x = np.arange(len(metrics))
    for i, m in enumerate(methods):
        ax.bar(x + (i - (len(methods) - 1) / 2) * w, rel[i], width=w, label=str(m))
    ax.set_yscale("log")
    ax.set_xticks(x, metrics, fontsize=8)
    ax.axhline(1.0, color="0.4", lw=0.8)
    ax.set_xlabel("metric")
    ax.set_ylabel(f"error / error of {methods[0]} (ratio)")
    legend_outside(ax, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    set_title(ax, title, f"errors relative to {methods[0]} (lower is better)")
    return fig
