"""Figures for channel-wise precision boost (Kitty section 3.2, Figures 2a and 2b).

Keys have a few channels of consistently large magnitude (Figure 2a), and quantizing those channels
alone to INT2 hurts the attention scores most (Figure 2b); Kitty therefore keeps the top channels by
mean magnitude ``s_i = mean_t |k_{t,i}|`` (Eq. 2) in INT4. These three plots show that argument.

    fig = plot_channel_magnitudes(k[0, 0])                       # k: (B, H_kv, T, D) -> one head (T, D)
    fig = plot_channel_sensitivity(mse, top=8)                   # mse: (H_group, D)
    fig = plot_error_vs_boost(rates, errs, labels=["magnitude", "random"])
"""

from __future__ import annotations

import numpy as np

from .common import as_array, check_top, legend_outside, new_axes, set_title

__all__ = ["plot_channel_magnitudes", "plot_channel_sensitivity", "plot_error_vs_boost"]

_TOP_COLOR = "#d62728"
_MEAN_COLOR = "#1f77b4"
_MAX_TOP_LABELS = 8  # channel numbers written on the figure; more would overlap


def _label_top(ax, channels, heights, color=_TOP_COLOR):
    """Write the channel numbers of the (at most 8) highest ``heights`` just above them.

    A label within ``D / 40`` channels of the previous one is lifted a line so that they do not overlap.
    """
    channels = np.asarray(channels)
    order = np.argsort(heights[channels], kind="stable")[::-1][:_MAX_TOP_LABELS]
    near = max(2, len(heights) // 40)
    prev, lift = None, 0
    for c in np.sort(channels[order]):
        lift = lift + 1 if prev is not None and c - prev <= near else 0
        ax.annotate(str(int(c)), (c, heights[c]), xytext=(0, 2 + 8 * lift), textcoords="offset points",
                    ha="center", va="bottom", fontsize=7, color=color)
        prev = c


def plot_channel_magnitudes(k, ax=None, title=None, top=None):
    """Heatmap of ``|k|`` over tokens x channels for one key head, with a per-channel strip above.

    The Kitty paper's Figure 2a draws the same data as a 3-D bar chart (Qwen3-8B, layer 10, first KV
    head); a heatmap shows it without occlusion. The strip above the heatmap shares its channel axis
    and shows, per channel, the max ``|k|`` over tokens (grey) and the mean ``|k|`` (blue, the Kitty
    selection score ``s_i``, Eq. 2). The ``top`` channels by ``s_i`` (the ones Kitty boosts) are red,
    and the largest of them are numbered.

    k: (T, D) keys of one head (tokens x channels), any real dtype.
    ax: Axes for the heatmap (the strip and colour bar are split off it), or None for a new Figure.
    title: text above the strip (default: "|k| per token and channel"); the legend sits between it and
    the strip.  top: how many channels to mark, default ``max(1, D // 8)`` (12.5%).
    Returns the Figure (3 Axes are added: heatmap, strip, colour bar).
    """
    from matplotlib.patches import Patch
    from mpl_toolkits.axes_grid1 import make_axes_locatable

    k = as_array("k", k, 2)  # (T, D)
    T, D = k.shape
    top = max(1, D // 8) if top is None else check_top(top, D)
    mag = np.abs(k.astype(np.float64))  # (T, D)
    if not np.all(np.isfinite(mag)):
        raise ValueError("k contains NaN or inf")
    s = mag.mean(axis=0)  # (D,) Eq. 2
    peak = mag.max(axis=0)  # (D,)
    top_idx = np.sort(np.argsort(s, kind="stable")[::-1][:top])

    own = ax is None
    fig, ax = new_axes(ax, figsize=(8.0, 5.6), layout=None)  # the divider places the extra Axes
    if own:
        fig.subplots_adjust(left=0.09, right=0.9, bottom=0.09, top=0.87)   # title and legend above
    divider = make_axes_locatable(ax)
    strip = divider.append_axes("top", size="30%", pad=0.08, sharex=ax)
    cax = divider.append_axes("right", size="2.5%", pad=0.08)

    im = ax.imshow(mag, aspect="auto", interpolation="nearest", cmap="magma",
                   extent=(-0.5, D - 0.5, T - 0.5, -0.5))
    fig.colorbar(im, cax=cax, label="|k|")
    ax.set_xlabel("key channel (index)")
    ax.set_ylabel("token (position)")

    x = np.arange(D)
    colors = np.where(np.isin(x, top_idx), _TOP_COLOR, _MEAN_COLOR)
    strip.bar(x, peak, width=1.0, color="0.8")
    strip.bar(x, s, width=1.0, color=colors)
    _label_top(strip, top_idx, peak)
    strip.set_ylim(0, peak.max() * 1.7 if peak.max() > 0 else 1.0)
    strip.set_xlim(-0.5, D - 0.5)
    strip.tick_params(axis="x", labelbottom=False)
    strip.set_ylabel("|k| per\nchannel", fontsize=8)
    strip.tick_params(axis="y", labelsize=7)
    keys = [Patch(color="0.8", label="max |k| over tokens"), Patch(color=_MEAN_COLOR, label="mean |k| (Eq. 2)"),
            Patch(color=_TOP_COLOR, label=f"top {top} by mean")]        # not the bars': a top bar may come first
    legend_outside(strip, "above", handles=keys, fontsize=7, ncol=3)
    set_title(strip, title, "|k| per token and channel", pad=18)      # above the legend
    return fig


def plot_channel_sensitivity(mse, ax=None, top=None, yscale="linear", title=None):
    """Attention-score MSE when channel ``c`` alone is quantized to INT2, per query head (Figure 2b).

    One line with markers per query head of a GQA group (they share the key head, so the pattern
    repeats across heads, as the paper notes). With ``top``, the ``top`` channels by MSE averaged over
    heads are shaded and the largest are numbered.

    mse: (H_group, D), or (D,) for one head; non-negative.
    ax: Axes to draw on, or None.  top: int or None.  yscale: "linear" or "log".
    title: default "attention-score MSE when one key channel is INT2"; the legend (one entry per
    head) sits right of the Axes. Returns the Figure (one Line2D per head on ``ax``).
    """
    mse = as_array("mse", mse, (1, 2))
    if mse.ndim == 1:
        mse = mse[None, :]  # (1, D)
    H, D = mse.shape
    mse = mse.astype(np.float64)
    if not np.all(np.isfinite(mse)) or mse.min() < 0:
        raise ValueError("mse must be finite and non-negative")
    if yscale not in ("linear", "log"):
        raise ValueError(f"yscale must be 'linear' or 'log'; got {yscale!r}")

    fig, ax = new_axes(ax, figsize=(8.0, 3.6))
    x = np.arange(D)
    if top:
        top = check_top(top, D)
        mean = mse.mean(axis=0)  # (D,)
        top_idx = np.sort(np.argsort(mean, kind="stable")[::-1][:top])
        for c in top_idx:
            ax.axvspan(c - 0.5, c + 0.5, color=_TOP_COLOR, alpha=0.12, lw=0, zorder=0)
        _label_top(ax, top_idx, mse.max(axis=0))
    for h in range(H):
        ax.plot(x, mse[h], marker="o", ms=2.5, lw=0.8, alpha=0.85, label=f"q head {h}")
    ax.set_yscale(yscale)
    ax.set_xlim(-0.5, D - 0.5)
    if yscale == "linear":
        ax.set_ylim(0, mse.max() * (1.2 if top else 1.05) if mse.max() > 0 else 1.0)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))   # 1.5 x 1e-4, not 0.000150
    ax.set_xlabel("key channel quantized to INT2 (index)")
    ax.set_ylabel("attention-score MSE (squared logits)")
    ax.grid(axis="y", alpha=0.3)
    if H > 1:  # outside, on the right: the peaks are the point of the figure
        legend_outside(ax, fontsize=7, ncol=1 if H <= 16 else 2)
    set_title(ax, title, "attention-score MSE when one key channel is INT2")
    return fig


def plot_error_vs_boost(rates, errors, labels=None, ax=None, ylabel="error", yscale="linear",
                        title=None):
    """Error against the fraction of key channels boosted to INT4, one line per selection rule.

    E.g. magnitude-based selection (Kitty Eq. 2) against random selection, the comparison of Kitty
    section 3.2 / 5: 0 is plain INT2 (KIVI-K2), 1 is all-INT4 (KIVI-K4).

    rates: (n_rates,) boost fractions in [0, 1], drawn as percent.
    errors: (n_series, n_rates), or (n_rates,) for one series.
    labels: n_series strings for the legend (drawn right of the Axes), or None.
    ylabel: the error's name and unit.  yscale: "linear" or "log".
    title: default "error against the share of key channels boosted to INT4".
    Returns the Figure (one Line2D per series on ``ax``).
    """
    rates = as_array("rates", rates, 1).astype(np.float64)  # (n_rates,)
    errors = as_array("errors", errors, (1, 2)).astype(np.float64)
    if errors.ndim == 1:
        errors = errors[None, :]  # (1, n_rates)
    if errors.shape[1] != rates.shape[0]:
        raise ValueError(f"errors has shape {errors.shape}; expected (n_series, {rates.shape[0]}) "
                         f"to match rates of shape {rates.shape}")
    if not np.all(np.isfinite(rates)) or rates.min() < 0 or rates.max() > 1:
        raise ValueError("rates must be boost fractions in [0, 1]")
    if labels is not None:
        labels = list(labels) if not isinstance(labels, str) else [labels]
        if len(labels) != errors.shape[0]:
            raise ValueError(f"got {len(labels)} labels for {errors.shape[0]} series")
    if yscale not in ("linear", "log"):
        raise ValueError(f"yscale must be 'linear' or 'log'; got {yscale!r}")

    fig, ax = new_axes(ax, figsize=(5.6, 3.8))
    markers = "osD^v<>ph*"
    for i, e in enumerate(errors):
        ax.plot(100 * rates, e, marker=markers[i % len(markers)], ms=5, lw=1.5,
                label=None if labels is None else str(labels[i]))
    ax.set_yscale(yscale)
    ax.set_xlabel("key channels boosted to INT4 (%)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if labels is not None:
        legend_outside(ax, fontsize=8)
    set_title(ax, title, "error against the share of key channels boosted to INT4")
    return fig
