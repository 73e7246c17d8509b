"""Shared helpers for kvq.viz: a Figure without pyplot, and shape checks that name the problem.

Every ``plot_*`` function takes ``ax=None``. Without one it builds a ``matplotlib.figure.Figure``
with an Agg canvas attached (so ``fig.savefig`` works) and never touches ``matplotlib.pyplot``,
whose global figure registry would leak figures in long-running notebooks and servers.

    fig, ax = new_axes(None, figsize=(6, 4))        # a fresh Figure and one Axes
    fig, ax = new_axes(ax)                          # the caller's Axes and its (root) Figure
    k = as_array("k", k, ndim=2)                    # ValueError naming the argument and its shape
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
