"""Argument checks for the reference tier's public functions (issue 36: a clear error naming the argument).

The configurations check their fields in ``__post_init__`` (:mod:`kvq.reference.state`); these are their
twins for plain function arguments. Each returns the value in its canonical form (an ``int``, a ``float``,
an ndarray) or raises ValueError / TypeError whose message starts with the argument's name::

    n = checks.int_arg(n, "n", lo=1)
    x = checks.real_array(x, "x", ndim=2, finite=True)

A bool is never an int or a real number here (``True`` as a length is a bug, not a 1), and a string is never
a number. NumPy scalars are accepted where Python's are.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["int_arg", "real_arg", "bool_arg", "real_array", "int_array", "choice_arg"]


def int_arg(v, name: str, lo: int | None = None, hi: int | None = None, *, optional: bool = False):
    """``v`` as an int in [lo, hi] (either bound may be None), or None when ``optional``."""
    if optional and v is None:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be {'None or ' if optional else ''}an int, got {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        raise ValueError(f"{name} must be an int {rng}, got {v}")
    return v


def real_arg(v, name: str, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False,
             hi_open: bool = False, optional: bool = False):
    """``v`` as a finite float in [lo, hi] (open ends where asked), or None when ``optional``."""
    if optional and v is None:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be {'None or ' if optional else ''}a real number, got {v!r}")
    f = float(v)
    ok = (math.isfinite(f) and (f > lo if lo_open else f >= lo) and (f < hi if hi_open else f <= hi))
    if not ok:
        raise ValueError(f"{name} must be a finite real number in {'(' if lo_open else '['}{lo}, {hi}"
                         f"{')' if hi_open else ']'}, got {v!r}")
    return f


def bool_arg(v, name: str) -> bool:
    """``v`` as a bool (True / False; NumPy's bool too): 0, 1, "yes" and None are refused."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {v!r}")
    return bool(v)


def choice_arg(v, name: str, choices):
    """``v`` if it is one of ``choices`` (compared with ==, types checked first: True is not 1)."""
    for c in choices:
        if type(v) is type(c) and v == c:
            return v
    raise ValueError(f"{name}={v!r} is not supported; choose one of {tuple(choices)}")


def _shape_text(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def real_array(x, name: str, *, ndim: int | None = None, min_ndim: int | None = None, shape=None,
               finite: bool = False, dtypes=None, empty: bool = True) -> np.ndarray:
    """``x`` as a real floating ndarray (no copy where it already is one).

    ``ndim`` / ``min_ndim``: the number of dimensions; ``shape``: a tuple whose None entries match any
    size; ``finite``: NaN / inf refused; ``dtypes``: the allowed dtype names (default float16 / float32 /
    float64); ``empty``: whether a zero-size array is accepted. Integers, bools, complex numbers, strings
    and objects are refused with a TypeError naming the dtype.
    """
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    a = np.asarray(x) if not isinstance(x, np.ndarray) else x
    allowed = tuple(dtypes) if dtypes is not None else ("float16", "float32", "float64")
    if a.dtype.kind != "f" or a.dtype.name not in allowed:
        raise TypeError(f"{name} must be a real floating array ({' / '.join(allowed)}), got dtype {a.dtype}")
    _check_shape(a, name, ndim, min_ndim, shape, empty)
    if finite and a.size and not np.all(np.isfinite(a)):
        n_nan, n_inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
        raise ValueError(f"{name} contains non-finite values ({n_nan} NaN, {n_inf} inf)")
    return a


def int_array(x, name: str, *, ndim: int | None = None, min_ndim: int | None = None, shape=None,
              lo: int | None = None, hi: int | None = None, empty: bool = True) -> np.ndarray:
    """``x`` as an integer ndarray (bool refused) whose values lie in [lo, hi]."""
    if x is None:
        raise TypeError(f"{name} must be an integer array, got None")
    a = np.asarray(x) if not isinstance(x, np.ndarray) else x
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    _check_shape(a, name, ndim, min_ndim, shape, empty)
    if a.size and ((lo is not None and a.min() < lo) or (hi is not None and a.max() > hi)):
        raise ValueError(f"{name} holds values outside [{lo}, {hi}] (min {a.min()}, max {a.max()})")
    return a


def _check_shape(a: np.ndarray, name: str, ndim, min_ndim, shape, empty: bool) -> None:
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {_shape_text(a.shape)}")
    if min_ndim is not None and a.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {_shape_text(a.shape)}")
    if shape is not None:
        if a.ndim != len(shape) or any(w is not None and s != w for s, w in zip(a.shape, shape)):
            want = _shape_text("*" if w is None else w for w in shape)
            raise ValueError(f"{name} must have shape {want}, got {_shape_text(a.shape)}")
    if not empty and a.size == 0:
        raise ValueError(f"{name} is empty (shape {_shape_text(a.shape)})")
