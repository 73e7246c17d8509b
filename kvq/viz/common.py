"""Shared helpers for kvq.viz: a Figure without pyplot, and shape checks that name the problem.

Every ``plot_*`` function takes ``ax=None``. Without one it builds a ``matplotlib.figure.Figure``
with an Agg canvas attached (so ``fig.savefig`` works) and never touches ``matplotlib.pyplot``,
whose global figure registry would leak figures in long-running notebooks and servers.

    fig, ax = new_axes(None, figsize=(6, 4))        # a fresh Figure and one Axes
    fig, ax = new_axes(ax)                          # the caller's Axes and its (root) Figure
    k = as_array("k", k, ndim=2)                    # ValueError naming the argument and its shape

Every figure has a title, labelled axes (with units where the quantity has one) and, where it has a
legend, a legend outside the data area, so that it covers nothing:

    set_title(ax, title, "KL divergence against context length")   # the caller's title, else a default
    legend_outside(ax)                                              # right of the Axes
    legend_outside(ax, "below", ncol=2)                             # under the x label (long labels)
"""

from __future__ import annotations

import numpy as np


def new_figure(figsize=(6.4, 4.8), layout="constrained"):
    """A ``Figure`` with a ``FigureCanvasAgg`` attached (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def root_figure(ax):
    """The top-level Figure of ``ax`` (``ax.figure`` may be a SubFigure)."""
    try:
        return ax.get_figure(root=True)  # matplotlib >= 3.10
    except TypeError:
        fig = ax.figure
        while hasattr(fig, "figure") and fig.figure is not fig and fig.figure is not None:
            fig = fig.figure
        return fig


def new_axes(ax, figsize=(6.4, 4.8), layout="constrained"):
    """``(figure, ax)``: the caller's Axes, or a new Figure with one Axes when ``ax`` is None."""
    if ax is None:
        fig = new_figure(figsize, layout)
        return fig, fig.add_subplot()
    if not hasattr(ax, "figure") or not hasattr(ax, "plot"):
        raise TypeError(f"ax must be a matplotlib Axes or None, got {type(ax).__name__}")
    return root_figure(ax), ax


def set_title(ax, title, default: str, **kwargs):
    """Title ``ax`` with ``title``; when it is None, keep a title the Axes already has (a caller's, or
    a previous call's on the same Axes), else use ``default``. ``kwargs`` go to ``ax.set_title``."""
    if title is None:
        if ax.get_title():
            return ax.title
        title = default
    return ax.set_title(str(title), **kwargs)


def _below_offset_points(ax) -> float:
    """Points between the bottom of ``ax`` and a legend placed below it: tick, pad, tick labels, label
    pad, the x label (if any), a margin; sizes from rcParams and the label's own font."""
    from matplotlib import rcParams
    from matplotlib.font_manager import FontProperties

    tick = FontProperties(size=rcParams["xtick.labelsize"]).get_size_in_points()
    label = ax.xaxis.label.get_fontsize() if ax.xaxis.label.get_text() else 0.0
    return (rcParams["xtick.major.size"] + rcParams["xtick.major.pad"] + 1.25 * tick
            + rcParams["axes.labelpad"] + 1.25 * label + 4.0)


def legend_outside(ax, where: str = "right", **kwargs):
    """A legend of ``ax`` placed outside the Axes, so that it covers no data; returns the Legend.

    where="right": to the right of the Axes, top-aligned (short labels, few entries).
    where="below": centred under the x label (long labels; pass ``ncol``).
    where="above": left-aligned just above the Axes (a title then needs ``pad``).
    With ``layout="constrained"`` (``new_figure``'s default) the Axes shrink to make room; figures
    laid out by hand leave the margin themselves. ``kwargs`` go to ``ax.legend`` (fontsize, ncol,
    handles, title, ...). ``frameon`` defaults to False: outside the Axes a frame only adds clutter.
    """
    from matplotlib.transforms import ScaledTranslation

    kwargs.setdefault("frameon", False)
    if where == "right":
        kwargs.update(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    elif where == "above":
        kwargs.update(loc="lower left", bbox_to_anchor=(0.0, 1.01), borderaxespad=0.0)
    elif where == "below":
        fig = root_figure(ax)
        down = ScaledTranslation(0.0, -_below_offset_points(ax) / 72.0, fig.dpi_scale_trans)
        kwargs.update(loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=ax.transAxes + down,
                      borderaxespad=0.0)
    else:
        raise ValueError(f"where must be 'right', 'below' or 'above'; got {where!r}")
    return ax.legend(**kwargs)


def as_array(name: str, x, ndim: int | tuple[int, ...], *, numeric: bool = True) -> np.ndarray:
    """``np.asarray(x)`` checked to have ``ndim`` dimensions (an int or a tuple of allowed ones)."""
    a = np.asarray(x)
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if a.ndim not in allowed:
        want = " or ".join(f"{n}-D" for n in allowed)
        raise ValueError(f"{name} must be {want}; got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{name} is empty (shape {a.shape})")
    if numeric and not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
        raise ValueError(f"{name} must be numeric; got dtype {a.dtype}")
    return a


def check_codes(name: str, codes: np.ndarray, bits: int = 2) -> np.ndarray:
    """Unpacked b-bit codes: integer dtype, every value in ``[0, 2**bits)``."""
    if not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"{name} must hold unpacked integer codes (uint8); got dtype {codes.dtype}")
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi >= 2**bits:
        raise ValueError(f"{name} must hold unpacked {bits}-bit codes in [0, {2**bits - 1}]; "
                         f"found values in [{lo}, {hi}] (pass unpacked codes, not packed bytes)")
    return codes


def check_top(top, n: int, name: str = "top") -> int:
    """``top`` as an int in ``[0, n]``."""
    if isinstance(top, bool) or not isinstance(top, (int, np.integer)):
        raise ValueError(f"{name} must be an int or None; got {top!r}")
    if not 0 <= int(top) <= n:
        raise ValueError(f"{name}={top} is outside [0, {n}]")
    return int(top)
