"""Walsh-Hadamard rotations: the normalized Sylvester matrix and a fast transform in a fixed order.

Used by HIGGS (``higgs.py``: each group of 1024 values is rotated so its entries are about N(0, 1))
and by rotation-based methods that need the dense matrix (``oscar.py``).

    >>> from kvq.reference.hadamard import hadamard_matrix, fwht
    >>> x = np.arange(4, dtype=np.float32)
    >>> np.allclose(fwht(x), x @ hadamard_matrix(4))
    True

Definitions (the fast tier mirrors both):

* ``hadamard_matrix(d)`` is Sylvester's recursion ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``,
  times ``1/sqrt(d)``, so it is symmetric and orthogonal (``H @ H = I``).
* ``fwht(x)`` computes ``x @ hadamard_matrix(d)`` with ``log2(d)`` butterfly stages. **The butterfly
  order is part of the contract**: stage ``s = 0, 1, ..., log2(d) - 1`` uses stride ``h = 2**s``; for
  every block start ``j`` (a multiple of ``2h``) and every ``i`` in ``[j, j + h)`` it replaces
  ``(a, b) = (x[i], x[i + h])`` by ``(a + b, a - b)``, each one rounded fp32 addition / subtraction.
  Within a stage the pairs are independent, so the order inside a stage does not matter; the stage
  order does. After the last stage every entry is multiplied once (one rounded fp32 multiply) by
  ``fwht_scale(d) = float32(1 / sqrt(d))``; when ``log2(d)`` is even that constant is a power of two
  and the product is exact. A GPU kernel that does the same stages in the same order, without FMA, is
  bit-identical to this function.
"""

from __future__ import annotations

import math

import numpy as np

from . import numerics as nx

__all__ = ["is_power_of_two", "hadamard_matrix", "fwht_scale", "fwht"]


def is_power_of_two(d) -> bool:
    """True if ``d`` is a positive integer power of two (1, 2, 4, ...)."""
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
        return False
    d = int(d)
    return d >= 1 and (d & (d - 1)) == 0


def _check_dim(d) -> int:
    if not is_power_of_two(d):
        raise ValueError(f"Hadamard dimension must be a power of two (1, 2, 4, ...), got {d!r}")
    return int(d)


def fwht_scale(d: int) -> np.float32:
    """The normalization ``float32(1 / sqrt(d))`` applied once after the last butterfly stage.

    ``1 / sqrt(d)`` is computed in Python floats and rounded once to fp32; the fast tier receives this
    same fp32 constant from the host, so both tiers multiply by identical bits.
    """
    return nx.f32(1.0 / math.sqrt(_check_dim(d)))


def hadamard_matrix(d: int) -> np.ndarray:
    """The normalized Sylvester-Hadamard matrix of order ``d`` (a power of two), float32, (d, d).

    ``H[i, j] = (-1) ** popcount(i & j) / sqrt(d)``; symmetric, and ``H @ H`` is the identity up to
    fp32 rounding. Raises ValueError when ``d`` is not a power of two.
    """
    d = _check_dim(d)
    h = np.ones((1, 1), dtype=np.int8)                       # (1, 1): H_1 = [1]
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])                      # (2n, 2n): Sylvester's recursion
    # entries are exactly +-1, so the product is one rounding of +-scale: all entries have |H| = scale
    return nx.mul(h.astype(np.float32), fwht_scale(d))


def fwht(x, axis: int = -1) -> np.ndarray:
    """Normalized fast Walsh-Hadamard transform of ``x`` along ``axis``, in the fixed butterfly order.

    ``x``: float16 / float32 array whose ``axis`` has a power-of-two length ``d``. Returns a new fp32
    array of the same shape equal to ``x @ hadamard_matrix(d)`` along that axis (up to rounding; the
    rounding itself is fixed by the stage order described in the module docstring). The transform is
    its own inverse: ``fwht(fwht(x))`` is ``x`` up to a few fp32 roundings.
    """
    a = nx.as_f32(x, "x")
    axis = nx.normalize_axis(axis, a.ndim)
    d = _check_dim(a.shape[axis])
    y = np.moveaxis(a, axis, -1).copy()                      # (..., d), fp32, our own copy
    lead = y.shape[:-1]
    h = 1
    while h < d:                                             # stage s: stride h = 2**s
        blocks = y.reshape(*lead, d // (2 * h), 2, h)        # (..., d/2h, 2, h): [block, half, i]
        a_half = blocks[..., 0, :].copy()                    # x[i]      for i in [j, j + h)
        b_half = blocks[..., 1, :]                           # x[i + h]
        blocks[..., 0, :] = nx.add(a_half, b_half)           # a + b
        blocks[..., 1, :] = nx.sub(a_half, b_half)           # a - b
        y = blocks.reshape(*lead, d)
        h *= 2
    y = nx.mul(y, fwht_scale(d))                             # one rounded multiply, after the stages
    return np.ascontiguousarray(np.moveaxis(y, -1, axis))
