"""Tensor-core fragment layouts drawn as the PTX ISA and BitDecoding draw them (BitDecoding Fig. 3a).

One ``mma.m16n8k16`` operand (A 16x16, B 16x8, or C / D 16x8) as a grid: every cell names the lane that
holds it and the fragment element it is, ``T5`` / ``b2`` for "lane 5 holds it as b2", coloured by lane.
Lanes of one row group (``groupID = lane >> 2``) share a hue; ``threadID_in_group = lane % 4`` sets the
shade. Thick lines mark the 8x8 blocks, which are the matrices an ``ldmatrix`` load moves. The map is
``kvq.reference.fragments.table`` (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point
type").

    from kvq.viz.fragments import plot_fragment_layout
    fig = plot_fragment_layout("b")                      # BitDecoding Fig. 3a: matrix B
    fig.savefig("fragments_b.png", dpi=150)
"""

from __future__ import annotations

import numpy as np

from kvq.reference.fragments import LANES, OPERAND_SHAPES, table

from .common import new_axes

__all__ = ["plot_fragment_layout"]

_AXES = {"a": ("m", "k"), "b": ("k", "n"), "c": ("m", "n")}  # (row, col) names: A is M x K, B K x N, C M x N
_DTYPE = {"a": ".f16", "b": ".f16", "c": ".f32"}


def _lane_colors() -> np.ndarray:
    """``(32, 3)`` RGB colour per lane: hue by ``groupID`` (8 hues), shade by ``threadID_in_group``."""
    from matplotlib import colormaps

    out = np.empty((LANES, 3))
    for lane in range(LANES):
        group, tig = lane >> 2, lane % 4
        cmap = colormaps["tab20b" if group < 5 else "tab20c"]   # 5 hues x 4 shades each
        out[lane] = cmap(4 * (group % 5) + tig)[:3]
    return out


def plot_fragment_layout(operand="b", ax=None, title=None):
    """Draw the register fragment layout of one ``mma.m16n8k16`` operand, like BitDecoding Fig. 3a.

    operand: "a" (16x16 ``.f16``, a0..a7 in four registers), "b" (16x8 ``.f16``, b0..b3 in two
    registers) or "c" (16x8 ``.f32`` accumulator C / D, c0..c3).
    ax: Axes to draw into, or None for a new Figure (Agg canvas, no pyplot).
    title: the Axes title; default names the instruction and the operand.
    Returns the Figure. The Axes carries one text per cell, ``"T{lane}\\n{operand}{i}"``, placed at
    ``(col, row)`` in data coordinates (row 0 at the top).
    """
    if not isinstance(operand, str) or operand not in OPERAND_SHAPES:
        raise ValueError(f"operand must be 'a', 'b' or 'c'; got {operand!r}")
    rows, cols = OPERAND_SHAPES[operand]
    t = table(operand)                                        # (32, n, 2): (row, col) of (lane, i)
    n = t.shape[1]
    lane_of = np.empty((rows, cols), dtype=np.int64)          # (rows, cols)
    elem_of = np.empty((rows, cols), dtype=np.int64)
    lane_of[t[..., 0], t[..., 1]] = np.arange(LANES)[:, None]
    elem_of[t[..., 0], t[..., 1]] = np.arange(n)[None, :]

    fig, ax = new_axes(ax, figsize=(0.62 * cols + 1.2, 0.5 * rows + 1.0))
    colors = _lane_colors()                                    # (32, 3)
    ax.imshow(colors[lane_of], interpolation="nearest", extent=(-0.5, cols - 0.5, rows - 0.5, -0.5),
              aspect="auto")
    luminance = colors @ np.array([0.299, 0.587, 0.114])      # (32,)
    fontsize = 6 if cols > 8 else 7
    for (r, c), lane in np.ndenumerate(lane_of):
        ax.text(c, r, f"T{lane}\n{operand}{elem_of[r, c]}", ha="center", va="center", fontsize=fontsize,
                color="white" if luminance[lane] < 0.5 else "black")

    # thin cell borders, thick borders around the 8x8 blocks (one ldmatrix matrix each)
    for x in np.arange(-0.5, cols, 1.0):
        ax.axvline(x, color="white", lw=2.0 if (x + 0.5) % 8 == 0 else 0.5)
    for y in np.arange(-0.5, rows, 1.0):
        ax.axhline(y, color="white", lw=2.0 if (y + 0.5) % 8 == 0 else 0.5)

    row_name, col_name = _AXES[operand]
    ax.set_xticks(range(cols))
    ax.set_yticks(range(rows))
    ax.tick_params(labelsize=7, length=0)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.set_xlabel(f"col ({col_name})")
    ax.set_ylabel(f"row ({row_name})")
    if title is None:
        title = (f"mma.m16n8k16 fragment layout: matrix {operand.upper()} ({rows}x{cols} {_DTYPE[operand]}), "
                 f"{n} elements per lane")
    ax.set_title(title, fontsize=9, pad=18)
    return fig
