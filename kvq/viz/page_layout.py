"""One Kitty key page, drawn as its stored tensors (Kitty section 4.1, Figure 3a).

A key page holds G tokens x D channels. Kitty splits its mixed 2/4-bit codes into two 2-bit planes:
the dense ``Tensor_2bits`` (D, G) with every channel's low two bits, and the compact
``Tensor_High_2bits`` (D_boost, G) with the high two bits of the boosted channels only. The uint8
index ``boost_idx`` (D,) maps channel ``c`` to its compact row, or to a sentinel for INT2 channels
(the paper writes 1-based indices and sentinel D_boost + 1; kvq is 0-based, sentinel D_boost).

    low, high = unpack(page.low, 2, -1), unpack(page.high, 2, -1)     # (D, G), (D_boost, G) codes
    fig = plot_page_layout(low, high, page.boost_idx, page.scale, page.mn)
    fig.savefig("page.png")
"""

from __future__ import annotations

import numpy as np

from .common import as_array, check_codes, new_axes

__all__ = ["plot_page_layout"]

_LOW_COLORS = ["#eff3ff", "#9ecae1", "#4292c6", "#08519c"]  # 2-bit codes 0..3 (blues)
_HIGH_COLORS = ["#feedde", "#fdbe85", "#fd8d3c", "#d94701"]  # high 2 bits 0..3 (oranges)
_NOT_BOOSTED = "#d9d9d9"


def _check_page(low_plane, high_plane, boost_idx, scale, mn, sentinel):
    """Validate shapes and the index; returns arrays and the boosted channels in compact-row order."""
    low = check_codes("low_plane", as_array("low_plane", low_plane, 2))  # (D, G)
    D, G = low.shape
    high = np.asarray(high_plane)
    if high.ndim != 2 or high.shape[1] != G:
        raise ValueError(f"high_plane must be (D_boost, G) = (D_boost, {G}) to match low_plane "
                         f"{low.shape}; got shape {high.shape}")
    d_boost = high.shape[0]
    if d_boost > D:
        raise ValueError(f"high_plane has {d_boost} rows, more than the {D} channels of low_plane")
    if d_boost:
        check_codes("high_plane", high)
    idx = as_array("boost_idx", boost_idx, 1)  # (D,)
    if idx.shape != (D,):
        raise ValueError(f"boost_idx must have shape (D,) = ({D},); got {idx.shape}")
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"boost_idx must be an integer (uint8) array; got dtype {idx.dtype}")
    meta = []
    for name, m in (("scale", scale), ("mn", mn)):
        m = as_array(name, m, (1, 2))
        if m.shape not in ((D,), (D, 1)):
            raise ValueError(f"{name} must have shape (D,) = ({D},) (one value per channel); got {m.shape}")
        meta.append(m.reshape(D).astype(np.float64))
    sentinel = d_boost if sentinel is None else int(sentinel)
    if sentinel < d_boost:
        raise ValueError(f"sentinel={sentinel} collides with a compact row (rows are 0..{d_boost - 1})")
    idx = idx.astype(np.int64)
    bad = (idx != sentinel) & ((idx < 0) | (idx >= d_boost))
    if bad.any():
        c = int(np.flatnonzero(bad)[0])
        raise ValueError(f"boost_idx[{c}] = {idx[c]} is neither a compact row in [0, {d_boost}) "
                         f"nor the sentinel {sentinel}")
    boosted = np.flatnonzero(idx != sentinel)  # channels, ascending
    rows = idx[boosted]
    if len(boosted) != d_boost or len(np.unique(rows)) != d_boost:
        raise ValueError(f"boost_idx must send exactly D_boost = {d_boost} channels to distinct compact "
                         f"rows; it boosts {len(boosted)} channels onto {len(np.unique(rows))} rows")
    row_to_channel = np.empty(d_boost, dtype=np.int64)
    row_to_channel[rows] = boosted
    return low, high, idx, meta[0], meta[1], sentinel, row_to_channel


def _cell_text(ax, values, fmt="{}", fontsize=6, dark=None):
    """Write each value of a 2-D array in its cell (small pages only); white on ``dark`` cells."""
    for (r, c), v in np.ndenumerate(values):
        color = "white" if dark is not None and dark[r, c] else "black"
        ax.text(c, r, fmt.format(v), ha="center", va="center", fontsize=fontsize, color=color)


def plot_page_layout(low_plane, high_plane, boost_idx, scale, mn, ax=None, sentinel=None):
    """Draw one Kitty key page as in Figure 3a: two 2-bit planes, the index, per-channel metadata.

    Left to right: ``scale`` and ``mn`` (per-channel metadata, one value per channel for the page),
    ``boost_idx`` (grey = sentinel, colour = boosted), the dense plane ``Tensor_2bits`` (D, G) of low
    2-bit codes, and the compact plane ``Tensor_High_2bits`` (D_boost, G). An arrow joins each boosted
    channel's row in the dense plane to its compact row; arrow and index cell share a colour.
    Channel c dequantizes as ``(low[c] + 4 * high[boost_idx[c]]) * scale[c] + mn[c]`` if boosted,
    else ``low[c] * scale[c] + mn[c]``. Small pages (D <= 32) get the numbers written in the cells.

    low_plane: (D, G) unpacked 2-bit codes (uint8, values 0..3), channels x tokens.
    high_plane: (D_boost, G) unpacked high 2-bit codes; D_boost may be 0.
    boost_idx: (D,) integers, 0-based compact row, or ``sentinel`` (default D_boost) if not boosted.
    scale, mn: (D,) (or (D, 1)) per-channel metadata.
    ax: Axes whose area the panels subdivide (its own frame is hidden), or None for a new Figure.
    Returns the Figure: the host Axes carries 7 inset Axes (``host.child_axes``): scale, mn,
    boost_idx, the two planes, two code colour bars.
    """
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import ConnectionPatch

    low, high, idx, scale, mn, sentinel, row_to_channel = _check_page(
        low_plane, high_plane, boost_idx, scale, mn, sentinel)
    D, G = low.shape
    d_boost = high.shape[0]
    fig, host = new_axes(ax, figsize=(11.0, 5.6), layout=None)
    if ax is None:
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.93)   # the title above
    host.set_axis_off()
    small = D <= 32
    code_norm = BoundaryNorm(np.arange(-0.5, 4.5), 4)
    row_colors = [_row_color(r) for r in range(d_boost)]

    # Geometry in host-axes fractions: columns, then the two planes with a gap for the arrows.
    y0, h = 0.24, 0.58
    col_w, gap = (0.045 if small else 0.03), 0.012
    x = 0.06
    panels = {}
    for name in ("scale", "mn", "boost_idx"):
        panels[name] = host.inset_axes([x, y0, col_w, h])
        x += col_w + gap
    low_w = 0.34 if G >= 32 else 0.3
    x_low = x + 0.01
    panels["low"] = host.inset_axes([x_low, y0, low_w, h])
    x_high = x_low + low_w + 0.11
    hh = min(h, max(h * d_boost / D, 0.026 * d_boost))
    panels["high"] = host.inset_axes([x_high, y0 + (h - hh) / 2, 0.26, max(hh, 1e-3)])

    # Metadata and index columns, aligned with the dense plane's rows.
    extent_col = (-0.5, 0.5, D - 0.5, -0.5)
    for name, values, cmap in (("scale", scale, "viridis"), ("mn", mn, "cividis")):
        p = panels[name]
        p.imshow(values[:, None], aspect="auto", cmap=cmap, interpolation="nearest", extent=extent_col)
        p.set_title(name, fontsize=8, rotation=90, va="bottom")
        p.set_xticks([])
        if small:  # viridis / cividis are dark at the low end
            span = values.max() - values.min()
            rel = (values - values.min()) / span if span > 0 else np.full(D, 0.5)
            _cell_text(p, values[:, None], "{:.2g}", fontsize=5, dark=(rel < 0.5)[:, None])
    panels["scale"].set_ylabel("channel c")
    panels["mn"].set_yticks([])
    p = panels["boost_idx"]
    rgb = np.array([_hex_rgb(_NOT_BOOSTED)] * D)  # (D, 3)
    for r, c in enumerate(row_to_channel):
        rgb[c] = _hex_rgb(row_colors[r])
    p.imshow(rgb[:, None, :], aspect="auto", interpolation="nearest", extent=extent_col)
    p.set_title("boost_idx", fontsize=8, rotation=90, va="bottom")
    p.set_xticks([])
    p.set_yticks([])
    if small:
        _cell_text(p, idx[:, None], fontsize=6)

    # Dense plane: low 2 bits of every channel.
    p = panels["low"]
    im_low = p.imshow(low, aspect="auto", interpolation="nearest", extent=(-0.5, G - 0.5, D - 0.5, -0.5),
                      cmap=ListedColormap(_LOW_COLORS), norm=code_norm)
    p.set_title(f"Tensor_2bits  (D, G) = ({D}, {G})\nlow 2 bits of every channel", fontsize=9)
    p.set_xlabel("token in page")
    _token_ticks(p, G)
    p.set_yticks([])
    if small and G <= 32:
        _cell_text(p, low, fontsize=5, dark=low >= 2)

    # Compact plane: high 2 bits of the boosted channels, one row each.
    p = panels["high"]
    if d_boost:
        im_high = p.imshow(high, aspect="auto", interpolation="nearest",
                           extent=(-0.5, G - 0.5, d_boost - 0.5, -0.5),
                           cmap=ListedColormap(_HIGH_COLORS), norm=code_norm)
        step = max(1, int(np.ceil(d_boost / 24)))
        rows = np.arange(0, d_boost, step)
        p.set_yticks(rows, [f"{r}: ch {row_to_channel[r]}" for r in rows], fontsize=6)
        p.yaxis.tick_right()
        p.yaxis.set_label_position("right")
        p.set_ylabel("compact row: channel", fontsize=8)
        for label, r in zip(p.get_yticklabels(), rows):
            label.set_color(row_colors[r])
        if small and G <= 32:
            _cell_text(p, high, fontsize=5, dark=high >= 2)
    else:
        im_high = None
        p.set_yticks([])
        p.text(0.5, 0.5, "no boosted channels", transform=p.transAxes, ha="center", va="center")
    p.set_title(f"Tensor_High_2bits  (D_boost, G) = ({d_boost}, {G})\nhigh 2 bits of boosted channels",
                fontsize=9)
    p.set_xlabel("token in page", fontsize=8)
    _token_ticks(p, G)

    # Arrows: dense row c -> compact row boost_idx[c].
    for r, c in enumerate(row_to_channel):
        con = ConnectionPatch(xyA=(G - 0.5, c), coordsA=panels["low"].transData,
                              xyB=(-0.5, r), coordsB=panels["high"].transData,
                              arrowstyle="-|>", mutation_scale=7, lw=0.8, color=row_colors[r],
                              shrinkA=1, shrinkB=1, clip_on=False)
        panels["high"].add_artist(con)

    # Code colour keys under the planes.
    for x_left, im, label in ((x_low, im_low, "low 2-bit code"), (x_high, im_high, "high 2-bit code")):
        cax = host.inset_axes([x_left, 0.08, 0.16, 0.025])
        if im is None:
            cax.set_axis_off()
            continue
        cb = fig.colorbar(im, cax=cax, orientation="horizontal", ticks=range(4))
        cb.ax.tick_params(labelsize=7)
        cb.set_label(label, fontsize=7)
    host.set_title(f"Kitty key page: {d_boost} of {D} channels boosted to INT4; "
                   f"boost_idx[c] = compact row, or {sentinel} (sentinel) for INT2 channels",
                   loc="left", fontsize=9)
    return fig


def _token_ticks(ax, G: int):
    """Token ticks at quarters of the page (0, 32, 64, 96, 127 for G = 128), else integer ticks."""
    from matplotlib.ticker import MaxNLocator

    if G >= 8 and G % 4 == 0:
        ax.set_xticks(list(range(0, G, G // 4)) + [G - 1])
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _row_color(r: int) -> str:
    """A colour per compact row: tab10, cycled (rows are in channel order, so repeats lie far apart)."""
    from matplotlib import colormaps

    rgba = colormaps["tab10"](r % 10)
    return "#{:02x}{:02x}{:02x}".format(*(int(round(255 * v)) for v in rgba[:3]))


def _hex_rgb(color: str) -> list[float]:
    return [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
