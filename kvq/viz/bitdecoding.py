"""Figures for BitDecoding: the induced low-bit layout (Fig. 5) and the warp partition along N (Fig. 6).

``plot_induced_packing`` draws, for one lane of a warp, the FP16 values ``ldmatrix`` puts in its
registers, coloured by the 16-bit word (and slot) the Residual Kernel packs each of them into, beside
the word matrix where those words land (section IV-A(1)). Nothing is hard-coded: the cells come from
``kvq.reference.fragments.ldmatrix`` and the layout rules of ``kvq.reference.bitdecoding`` (keys:
word (8w + g, c) slot i <- K[w 8R + 8i + g, c]; values: word (t, 8u + g) slot i <- V[t, 8(uR + i) + g]).
``plot_warp_partition`` is a schematic of Algorithm 1: a tile of T_n keys split across W_n warps, the
row maxima meeting in ``sTMP`` and the probabilities in ``sAcc`` (section IV-B).

    fig = plot_induced_packing()                               # keys, 4 bits, N_r = 32, lane 5
    fig = plot_induced_packing(tensor="v", lane=0)             # values (ldmatrix.trans)
    fig = plot_warp_partition(warps_n=4, tile_n=64)            # Fig. 6
"""

from __future__ import annotations

import numpy as np

from kvq.reference import fragments as fr
from kvq.reference.bitdecoding import P_N, BitDecodingConfig

from .common import new_axes

__all__ = ["lane_cells", "plot_induced_packing", "plot_warp_partition"]

_EMPTY = "#eeeeee"        # cells other lanes hold
_MAX_WARPS = 32           # a thread block holds at most 1024 threads = 32 warps


def _default_cfg() -> BitDecodingConfig:
    # N_r = 8 x 1 x 4 = 32; k_group = 32 because channel-wise groups must divide N_r (it plays no part here)
    return BitDecodingConfig(bits=4, warps_n=1, k_group=32, v_group=32)


def _check(cfg, tensor, lane):
    if cfg is None:
        cfg = _default_cfg()
    if not isinstance(cfg, BitDecodingConfig):
        raise ValueError(f"cfg must be a BitDecodingConfig or None; got {type(cfg).__name__}")
    if tensor not in ("k", "v"):
        raise ValueError(f"tensor must be 'k' (keys) or 'v' (values); got {tensor!r}")
    if isinstance(lane, (bool, np.bool_)) or not isinstance(lane, (int, np.integer)) or not 0 <= lane < fr.LANES:
        raise ValueError(f"lane must be an int in [0, {fr.LANES - 1}]; got {lane!r}")
    return cfg, int(lane)


def lane_cells(cfg=None, tensor="k", lane=5) -> np.ndarray:
    """Every value ``lane`` holds in one load slice of a page, and where the Residual Kernel packs it.

    Returns an ``(n, 5)`` int64 array of rows ``(token, channel, word_row, word_col, slot)``, with the
    channel and word column relative to the slice. Keys: the slice is the 32 channels of one
    non-transposed ``ldmatrix.x4`` (matrix m = channels 8m..8m+7), loaded once per tile i of warp w
    (tokens ``w 8R + 8i ..``); lane L gets ``ldmatrix(L, m, h)`` = (row, col) of each tile, so
    n = 8 (four registers, two halves) x R x W_n. Values: the slice is the 8R channels of word-column
    block u = 0; each 16-token k-tile kk is loaded with ``ldmatrix.x2.trans`` (matrix m = tokens
    16kk + 8m ..), lane L gets ``ldmatrix(L, m, h, trans=True)`` of each of the R channel tiles, so
    n = 4 x R x N_r / 16.
    """
    cfg, lane = _check(cfg, tensor, lane)
    R = cfg.per_word
    rows = []
    if tensor == "k":
        for w in range(cfg.warps_n):
            for m in range(4):
                for h in range(2):
                    row, col = fr.ldmatrix(lane, m, h)                 # (token in tile, channel in matrix m)
                    ch = 8 * m + col
                    for i in range(R):                                 # R tiles of 8 tokens -> one word
                        rows.append((w * P_N * R + P_N * i + row, ch, P_N * w + row, ch, i))
    else:
        u = 0
        for kk in range(cfg.n_r // 16):
            for m in range(2):
                for h in range(2):
                    row, col = fr.ldmatrix(lane, m, h, trans=True)     # (token in matrix m, channel in tile)
                    t = 16 * kk + 8 * m + row
                    for i in range(R):                                 # R channel tiles -> one word
                        rows.append((t, P_N * (u * R + i) + col, t, P_N * u + col, i))
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def _word_colors(n: int) -> np.ndarray:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return np.array([cmap(j % cmap.N)[:3] for j in range(n)])       # (n, 3)


def _grid(ax, rows, cols, every=8):
    """Thin white cell borders, thick ones every ``every`` cells (the 8x8 ldmatrix matrices)."""
    if rows * cols <= 64 * 64:
        for x in np.arange(-0.5, cols, 1.0):
            ax.axvline(x, color="white", lw=1.6 if (x + 0.5) % every == 0 else 0.4)
        for y in np.arange(-0.5, rows, 1.0):
            ax.axhline(y, color="white", lw=1.6 if (y + 0.5) % every == 0 else 0.4)


def plot_induced_packing(cfg=None, tensor="k", ax=None, lane=5):
    """BitDecoding Fig. 5 for kvq's layout: what one lane holds and where its packed words land.

    Left: the ``(N_r, slice)`` FP16 tile of one page (keys: N_r tokens x the 32 channels of one
    ``ldmatrix.x4``; values: N_r tokens x the 8R channels of one word-column block). The cells ``lane``
    receives from ``ldmatrix`` are coloured by the word they are packed into and labelled with their
    slot i (bits ``[beta i, beta i + beta)``); cells other lanes hold are grey. Right: the uint16 word
    matrix of that slice (keys ``(8 W_n, 32)``, values ``(N_r, 8)``), the lane's words in the same
    colours. Thick lines mark 8x8 blocks, the matrices one ``ldmatrix`` moves. Cells come from
    :func:`lane_cells`.

    cfg: a ``BitDecodingConfig`` (default 4 bits, W_n = 1, so N_r = 32); tensor: "k" or "v";
    lane: 0..31; ax: Axes whose area the two panels subdivide (its frame is hidden), or None for a new
    Figure. Returns the Figure; ``host.child_axes`` are ``[tile, words]``, and the tile's image holds
    one RGB colour per cell.
    """
    from matplotlib.patches import ConnectionPatch, Patch

    cfg, lane = _check(cfg, tensor, lane)
    cells = lane_cells(cfg, tensor, lane)                              # (n, 5)
    R = cfg.per_word
    name = "K" if tensor == "k" else "V"
    if tensor == "k":
        tile_shape, word_shape = (cfg.n_r, 32), (P_N * cfg.warps_n, 32)
    else:
        tile_shape, word_shape = (cfg.n_r, P_N * R), (cfg.n_r, P_N)
    words = sorted({(int(r), int(c)) for r, c in cells[:, 2:4]})       # the lane's words, in order
    index = {wc: j for j, wc in enumerate(words)}
    colors = _word_colors(len(words))                                  # (n_words, 3)

    tile_rgb = np.tile(np.array([int(_EMPTY[i:i + 2], 16) / 255 for i in (1, 3, 5)]), (*tile_shape, 1))
    word_rgb = np.tile(tile_rgb[0, 0], (*word_shape, 1))
    for t, c, wr, wc, _ in cells:
        tile_rgb[t, c] = colors[index[wr, wc]]
    for (wr, wc), j in index.items():
        word_rgb[wr, wc] = colors[j]

    # geometry in cell units: tile | gap | words; the figure follows the cell counts
    gap, cell = 7.0, 0.2
    total_w = tile_shape[1] + gap + word_shape[1]
    total_h = max(tile_shape[0], word_shape[0])
    figsize = (min(16.0, cell * total_w + 1.5), min(16.0, cell * total_h + 3.4))
    fig, host = new_axes(ax, figsize=figsize, layout=None)
    if ax is None:
        fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=0.94)   # the title above
    host.set_axis_off()
    x0, x1, y0, y1 = 0.06, 0.97, 0.2, 0.86                             # panel area (host fractions)
    sx, sy = (x1 - x0) / total_w, (y1 - y0) / total_h

    def panel(col0, shape):
        h = shape[0] * sy
        return host.inset_axes([x0 + col0 * sx, y0 + (y1 - y0 - h) / 2, shape[1] * sx, h])

    p_tile, p_words = panel(0, tile_shape), panel(tile_shape[1] + gap, word_shape)
    for p, rgb in ((p_tile, tile_rgb), (p_words, word_rgb)):
        rows, cols = rgb.shape[:2]
        p.imshow(rgb, interpolation="nearest", aspect="auto", extent=(-0.5, cols - 0.5, rows - 0.5, -0.5))
        _grid(p, rows, cols)
        p.tick_params(labelsize=6, length=0)
        p.xaxis.tick_top()
        p.xaxis.set_label_position("top")
        step = max(8, rows // 8)
        p.set_yticks(range(0, rows, step) if rows > 16 else range(rows))
        p.set_xticks(range(0, cols, 8) if cols > 8 else range(cols))

    small = cells.shape[0] <= 256 and tile_shape[0] <= 64
    if small:                                                          # slot i in every held cell
        fs = 6 if tile_shape[0] <= 32 else 4.5
        for t, c, _, _, i in cells:
            p_tile.text(c, t, str(i), ha="center", va="center", fontsize=fs, color="white")
        for (wr, wc), j in index.items():
            p_words.text(wc, wr, str(j), ha="center", va="center", fontsize=fs, color="white")

    load = "ldmatrix.x4" if tensor == "k" else "ldmatrix.x2.trans"
    p_tile.set_title(f"FP16 {name} page slice {tile_shape}: the {cells.shape[0]} values lane {lane} "
                     f"receives\n({load}); colour = word, digit = slot i", fontsize=8)
    p_tile.set_ylabel("token t")
    p_tile.set_xlabel("channel c" + (" (one ldmatrix.x4: 4 matrices of 8)" if tensor == "k"
                                     else f" (R = {R} tiles of 8)"), fontsize=7)
    wname = "k_words" if tensor == "k" else "v_words"
    p_words.set_title(f"{wname} slice {word_shape} uint16: the lane's {len(words)} words\n"
                      f"(number = word, as in the legend)", fontsize=8)
    p_words.yaxis.tick_right()
    p_words.yaxis.set_label_position("right")
    p_words.set_ylabel("word row" + (" 8 w + g" if tensor == "k" else " t"), fontsize=7)
    p_words.set_xlabel("word col" + (" c" if tensor == "k" else " 8 u + g"), fontsize=7)

    con = ConnectionPatch(xyA=(1.0, 0.5), coordsA=p_tile.transAxes, xyB=(0.0, 0.5), coordsB=p_words.transAxes,
                          arrowstyle="-|>", mutation_scale=14, lw=1.5, color="#444444", shrinkA=4, shrinkB=4)
    host.add_artist(con)
    mid = x0 + (tile_shape[1] + gap / 2) * sx
    host.text(mid, (y0 + y1) / 2 + 0.03, f"quantize,\npack {R} codes\nper word", transform=host.transAxes,
              ha="center", va="bottom", fontsize=7)

    rule = ("word (8w + g, c), slot i  <-  K[w 8R + 8i + g, c]" if tensor == "k"
            else "word (t, 8u + g), slot i  <-  V[t, 8(uR + i) + g]")
    host.set_title(f"BitDecoding induced layout, {name}: {cfg.bits}-bit, R = {R} codes per word, "
                   f"W_n = {cfg.warps_n}, N_r = {cfg.n_r}, lane {lane} (g = {lane >> 2})\n{rule}",
                   loc="left", fontsize=9)
    if len(words) <= 16:
        handles = []
        for (wr, wc), j in index.items():
            src = cells[(cells[:, 2] == wr) & (cells[:, 3] == wc)]
            src = src[np.argsort(src[:, 4])]
            label = f"{j}: ({wr}, {wc}) <- " + " ".join(f"{name}[{t},{c}]" for t, c in src[:, :2])
            handles.append(Patch(facecolor=colors[j], label=label))
        host.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=2 if R <= 4 else 1,
                    fontsize=6, frameon=False, title=f"word: (row, col) <- slots 0..{R - 1}", title_fontsize=7)
    return fig


def plot_warp_partition(warps_n=4, tile_n=64, ax=None, tile_m=16):
    """BitDecoding Fig. 6 / Algorithm 1 as a schematic: one key tile split across W_n warps along N.

    Top (registers, per warp): the tile of ``tile_n`` keys, warp w owning keys
    ``[w T_n / W_n, (w + 1) T_n / W_n)`` (it dequantizes and multiplies only those), and the scores
    ``S = Q K^T`` (T_m x T_n) in the same split, with W_m = 1 (one warp row: decode has few queries).
    Bottom (shared memory, per block): ``sTMP`` (W_n row maxima, reduced to ``m_new``) and ``sAcc``
    (T_m x T_n), where ``P = exp(S - m_new)`` is written by every warp and read back with ``ldmatrix``
    for ``O = P' V + diag(e^(m - m_new)) O``.

    warps_n: 1..32; tile_n: a positive multiple of warps_n; tile_m: rows of the Q tile (16 = the M of
    mma.m16n8k16); ax: Axes to draw into, or None for a new Figure. Returns the Figure. Patches carry
    gids: ``"warp{w}"`` (key slices), ``"S{w}"`` (score slices), ``"sTMP{w}"``, ``"sAcc"``.
    """
    from matplotlib import colormaps
    from matplotlib.patches import FancyArrowPatch, Rectangle

    for name, v in (("warps_n", warps_n), ("tile_n", tile_n), ("tile_m", tile_m)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    if warps_n > _MAX_WARPS:
        raise ValueError(f"warps_n={warps_n}: a thread block holds at most {_MAX_WARPS} warps")
    if tile_n % warps_n:
        raise ValueError(f"tile_n={tile_n} must be a multiple of warps_n={warps_n} (equal slices per warp)")
    W = tile_n // warps_n
    fig, ax = new_axes(ax, figsize=(11.0, 6.2))
    ax.set_axis_off()
    cmap = colormaps["tab10" if warps_n <= 10 else "tab20"]
    color = [cmap(w % cmap.N) for w in range(warps_n)]
    fs = 8 if warps_n <= 8 else 6
    X0, WID = 0.0, 16.0                                          # the key axis: tile_n keys over WID units
    dx = WID / warps_n

    def box(x, y, w, h, gid, fc, label=None, **kw):
        r = Rectangle((x, y), w, h, facecolor=fc, edgecolor="black", lw=0.8, gid=gid, **kw)
        ax.add_patch(r)
        if label:
            ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fs)
        return r

    def arrow(a, b, text=None, off=(0.15, 0.0), **kw):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, lw=1.0, color="#333333", **kw))
        if text:
            ax.text((a[0] + b[0]) / 2 + off[0], (a[1] + b[1]) / 2 + off[1], text, fontsize=7, va="center")

    # memory levels
    ax.add_patch(Rectangle((-6.5, 3.1), 30.0, 5.6, facecolor="#f3f7fb", edgecolor="none", zorder=-2))
    ax.add_patch(Rectangle((-6.5, -2.6), 30.0, 5.3, facecolor="#fbf5ee", edgecolor="none", zorder=-2))
    ax.text(-6.3, 8.5, "registers (each warp its own)", fontsize=8, style="italic", va="top")
    ax.text(-6.3, 2.5, "shared memory (one per block)", fontsize=8, style="italic", va="top")

    # K tile split across warps, scores in the same split
    for w in range(warps_n):
        label = f"warp {w}\nkeys {w * W}..{(w + 1) * W - 1}" if warps_n <= 8 else f"{w}"
        box(X0 + w * dx, 6.4, dx, 1.4, f"warp{w}", color[w], label, alpha=0.85)
        box(X0 + w * dx, 3.9, dx, 1.4, f"S{w}", color[w], f"S[:, {w * W}:{(w + 1) * W}]" if warps_n <= 8 else "",
            alpha=0.45)
        arrow((X0 + (w + 0.5) * dx, 6.4), (X0 + (w + 0.5) * dx, 5.3))
    ax.text(X0 + WID / 2, 8.05, f"K_j tile: T_n = {tile_n} keys, W_n = {warps_n} warps along N, "
            f"{W} keys each (dequantize, then mma)", ha="center", fontsize=9)
    ax.text(X0 + WID + 0.3, 4.6, f"S = Q K^T\n({tile_m} x {tile_n})", fontsize=8, va="center")
    box(-5.8, 3.9, 4.2, 1.4, "Q", "#dddddd", f"Q_i ({tile_m} x d)\nW_m = 1")
    arrow((-1.6, 4.6), (X0 - 0.05, 4.6))

    # sTMP: one row maximum per warp, then the tile's max
    sw = min(1.2, 10.0 / warps_n)
    sx0 = X0 + WID / 2 - warps_n * sw / 2
    for w in range(warps_n):
        box(sx0 + w * sw, 1.3, sw, 0.8, f"sTMP{w}", color[w], f"m{w}" if warps_n <= 16 else None, alpha=0.85)
        arrow((X0 + (w + 0.5) * dx, 3.9), (sx0 + (w + 0.5) * sw, 2.1))
    ax.text(sx0 - 0.3, 1.7, f"sTMP (W_n = {warps_n}):\nrowmax of each\nwarp's slice", ha="right",
            va="center", fontsize=7)
    ax.text(sx0 + warps_n * sw + 0.4, 1.7, "m_new = max(m, max_w sTMP[w])\nbroadcast back to every warp",
            va="center", fontsize=7)

    # sAcc: P of the whole tile, re-read with ldmatrix for P' V
    box(X0, -1.9, WID, 1.6, "sAcc", "none", None, hatch="//")
    for w in range(warps_n):                                     # each warp's columns of P, lightly
        ax.add_patch(Rectangle((X0 + w * dx, -1.9), dx, 1.6, facecolor=color[w], alpha=0.25, edgecolor="black",
                               lw=0.6, ls="--", zorder=-1))
    ax.text(X0 + WID / 2, -1.1, f"sAcc ({tile_m} x {tile_n}): P = exp(S - m_new) from every warp",
            ha="center", va="center", fontsize=8, bbox=dict(facecolor="white", edgecolor="none", alpha=0.8))
    arrow((X0 + WID + 0.2, 3.9), (X0 + WID + 0.2, -0.3), "tiled_copy_r2s(P)", off=(0.2, 0.4))
    box(X0 + WID + 2.4, -1.6, 3.4, 1.0, "O", "#dddddd", f"O ({tile_m} x d)")
    arrow((X0 + WID, -1.1), (X0 + WID + 2.4, -1.1))
    ax.text(X0 + WID + 3.9, -2.0, "tiled_copy_s2r (ldmatrix),\nO = P' V + diag(e^(m - m_new)) O",
            ha="center", va="top", fontsize=7)

    ax.set_xlim(-6.6, 23.6)
    ax.set_ylim(-3.3, 8.8)
    ax.set_title("BitDecoding Fig. 6 / Algorithm 1: warps along N, cooperative softmax through shared memory",
                 fontsize=9)
    return fig
