"""Tensor-core fragment layouts: which lane of a warp holds which matrix element (BitDecoding III-B, IV-A).

BitDecoding (paper 004, section III-B "Challenge 1" and Fig. 3a; section IV-A(1) and Fig. 5) builds on
one fact: after ``ldmatrix``, every thread of a warp holds its values in the *interleaved* register
layout that ``mma`` expects, so a thread that quantizes and packs only its own registers produces a
low-bit layout that unpacks straight back into that register layout. This file is the map itself, as
plain integer functions, following the PTX ISA (NVIDIA, "Parallel Thread Execution ISA"):

* section "Matrix Fragments for mma.m16n8k16 with floating point type" (anchor
  ``#warp-level-matrix-fragment-mma-16816-float``; Figures 79, 81, 83 in PTX ISA 9.0): A is 16x16
  ``.f16`` (four ``.f16x2`` registers, a0..a7), B is 16x8 ``.f16`` (two registers, b0..b3), C / D is
  16x8 ``.f32`` (four registers, c0..c3);
* section "Warp-level matrix load instruction: ldmatrix" (anchor
  ``#warp-level-matrix-instructions-ldmatrix``; the address table and Figure 104):
  ``ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16``.

Both sections name a lane's coordinates ``groupID = lane >> 2`` (its row group, 0..7) and
``threadID_in_group = lane % 4`` (0..3). "Elements low to high": element ``i`` of a 16-bit fragment lives
in register ``i // 2``, half ``i % 2`` (half 0 = bits 0..15). Every function is vectorized: arguments
are Python ints or NumPy integer arrays, broadcast together; all-scalar calls return Python ints,
otherwise ``int64`` arrays. Out-of-range arguments raise ``ValueError``.

    >>> from kvq.reference.fragments import mma_b, mma_b_owner, table
    >>> mma_b(5, 2), mma_b_owner(10, 1)                 # lane 5 holds b2 = B[10, 1]
    ((10, 1), (5, 2))
    >>> table("a").shape                                # (lane, i, (row, col))
    (32, 8, 2)
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "LANES",
    "OPERAND_SHAPES",
    "mma_a",
    "mma_b",
    "mma_c",
    "mma_a_owner",
    "mma_b_owner",
    "mma_c_owner",
    "ldmatrix",
    "ldmatrix_owner",
    "ldmatrix_row_lane",
    "table",
]

LANES = 32
"""Threads in a warp."""

OPERAND_SHAPES = {"a": (16, 16), "b": (16, 8), "c": (16, 8)}
"""(rows, cols) of each ``mma.m16n8k16`` operand: A is M x K, B is K x N, C / D is M x N."""

_ELEMENTS = {"a": 8, "b": 4, "c": 4}  # fragment elements per lane: a0..a7, b0..b3, c0..c3


# ----------------------------------------------------------------------------------------------------
# Argument handling: ints or integer arrays, range-checked, broadcast


def _ints(name: str, x, hi: int, why: str = ""):
    """``x`` as an int64 array with every value in ``[0, hi)``; ValueError naming ``name`` otherwise."""
    a = np.asarray(x)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must be an int or an integer array; got {x!r} (dtype {a.dtype})")
    a = a.astype(np.int64)
    if a.size and (a.min() < 0 or a.max() >= hi):
        bad = a[(a < 0) | (a >= hi)].flat[0]
        raise ValueError(f"{name} = {bad} is out of range: {name} must lie in [0, {hi - 1}]{why}")
    return a


def _args(*named, why: str = ""):
    """Validate ``(name, value, hi)`` triples (range ``[0, hi)``) and broadcast them together.

    Returns ``(scalar, arrays)``: ``scalar`` is True when every value is 0-d (results become ints).
    """
    arrays = [_ints(name, x, hi, why) for name, x, hi in named]
    scalar = all(a.ndim == 0 for a in arrays)
    try:
        arrays = np.broadcast_arrays(*arrays)
    except ValueError as e:
        shapes = ", ".join(f"{name} {np.shape(x)}" for name, x, _ in named)
        raise ValueError(f"arguments do not broadcast together: {shapes}") from e
    return scalar, arrays


def _out(scalar: bool, *arrays):
    """Python ints for all-scalar calls, else int64 arrays (fresh, writable)."""
    if scalar:
        return tuple(int(a) for a in arrays)
    return tuple(np.array(a, dtype=np.int64) for a in arrays)


def _trans(trans) -> bool:
    if not isinstance(trans, (bool, np.bool_)):
        raise ValueError(f"trans must be a bool; got {trans!r}")
    return bool(trans)


# ----------------------------------------------------------------------------------------------------
# mma.m16n8k16 (.f16 A / B, .f32 C / D): (lane, i) -> (row, col)


def mma_a(lane, i):
    """Element of A (16x16, M x K, ``.f16``) that ``lane`` holds as ``a{i}`` (register ``i // 2``).

    PTX: ``row = groupID`` for i in {0, 1, 4, 5}, ``groupID + 8`` otherwise;
    ``col = threadID_in_group * 2 + (i & 1)`` for i < 4, plus 8 for i >= 4. So register 0 covers the
    top-left 8x8 block, register 1 the bottom-left, register 2 the top-right, register 3 the bottom-right.

    lane: 0..31, i: 0..7 (ints or integer arrays, broadcast). Returns ``(row, col)``.
    """
    scalar, (lane, i) = _args(("lane", lane, LANES), ("i", i, 8))
    group, tig = lane >> 2, lane % 4                  # groupID, threadID_in_group
    row = group + 8 * ((i // 2) % 2)                  # i in {2, 3, 6, 7}: lower half
    col = tig * 2 + (i & 1) + 8 * (i // 4)            # i >= 4: right half
    return _out(scalar, row, col)


def mma_b(lane, i):
    """Element of B (16x8, K x N, ``.f16``) that ``lane`` holds as ``b{i}`` (register ``i // 2``).

    PTX: ``row (k) = threadID_in_group * 2 + (i & 1)`` for i < 2, plus 8 for i >= 2; ``col (n) =
    groupID``. A lane holds one column of B: two consecutive k in each register (BitDecoding Fig. 3a).

    lane: 0..31, i: 0..3. Returns ``(row, col)`` = ``(k, n)``.
    """
    scalar, (lane, i) = _args(("lane", lane, LANES), ("i", i, 4))
    group, tig = lane >> 2, lane % 4
    row = tig * 2 + (i & 1) + 8 * (i // 2)
    col = group
    return _out(scalar, row, col)


def mma_c(lane, i):
    """Element of C / D (16x8, M x N, ``.f32``, one value per register) that ``lane`` holds as ``c{i}``.

    PTX: ``row = groupID`` for i < 2, ``groupID + 8`` otherwise; ``col = threadID_in_group * 2 + (i & 1)``.

    lane: 0..31, i: 0..3. Returns ``(row, col)``.
    """
    scalar, (lane, i) = _args(("lane", lane, LANES), ("i", i, 4))
    group, tig = lane >> 2, lane % 4
    row = group + 8 * (i // 2)
    col = tig * 2 + (i & 1)
    return _out(scalar, row, col)


# ----------------------------------------------------------------------------------------------------
# Inverses: (row, col) -> (lane, i)


def mma_a_owner(row, col):
    """The ``(lane, i)`` holding ``A[row, col]`` (row 0..15, col 0..15); inverse of :func:`mma_a`."""
    scalar, (row, col) = _args(("row", row, 16), ("col", col, 16))
    lane = 4 * (row % 8) + (col % 8) // 2
    i = (col & 1) + 2 * (row // 8) + 4 * (col // 8)
    return _out(scalar, lane, i)


def mma_b_owner(row, col):
    """The ``(lane, i)`` holding ``B[row, col]`` (row = k 0..15, col = n 0..7); inverse of :func:`mma_b`."""
    scalar, (row, col) = _args(("row", row, 16), ("col", col, 8))
    lane = 4 * col + (row % 8) // 2
    i = (row & 1) + 2 * (row // 8)
    return _out(scalar, lane, i)


def mma_c_owner(row, col):
    """The ``(lane, i)`` holding ``C[row, col]`` (row 0..15, col 0..7); inverse of :func:`mma_c`."""
    scalar, (row, col) = _args(("row", row, 16), ("col", col, 8))
    lane = 4 * (row % 8) + col // 2
    i = (col & 1) + 2 * (row // 8)
    return _out(scalar, lane, i)


# ----------------------------------------------------------------------------------------------------
# ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16


def ldmatrix(lane, m, half, trans=False):
    """Element ``(row, col)`` of stored 8x8 matrix ``m`` that ``lane`` receives in half ``half`` of
    destination register ``m``.

    The matrix is stored row-major in shared memory, one 16-byte row per address (see
    :func:`ldmatrix_row_lane`). PTX: "each thread in a warp loads fragments of a row, with thread 0
    receiving the first fragment in its register r ... a group of four threads loads an entire row":
    ``row = lane >> 2``, ``col = 2 * (lane % 4) + half``. With ``.trans`` the matrix is delivered
    column-major, i.e. transposed: ``row = 2 * (lane % 4) + half``, ``col = lane >> 2``. The map is the
    same for every matrix m of an ``.x2`` / ``.x4`` load; matrix m lands in register m.

    lane: 0..31, m: 0..3, half: 0..1. Returns ``(row, col)``, each 0..7.
    """
    trans = _trans(trans)
    scalar, (lane, _m, half) = _args(("lane", lane, LANES), ("m", m, 4), ("half", half, 2))
    a, b = lane >> 2, 2 * (lane % 4) + half           # (row, col) of the non-transposed load
    return _out(scalar, b, a) if trans else _out(scalar, a, b)


def ldmatrix_owner(row, col, trans=False):
    """The ``(lane, half)`` that receives element ``(row, col)`` of a stored 8x8 matrix; inverse of
    :func:`ldmatrix` within one matrix (the register is the matrix index)."""
    trans = _trans(trans)
    scalar, (row, col) = _args(("row", row, 8), ("col", col, 8))
    if trans:
        row, col = col, row                           # .trans delivers the transpose
    lane = 4 * row + col // 2
    half = col % 2
    return _out(scalar, lane, half)


def ldmatrix_row_lane(m, row, num):
    """The lane whose shared-memory address supplies row ``row`` of matrix ``m`` in an ``.x{num}`` load.

    PTX address table: threads 0-7 give addr0-addr7 (the rows of the first matrix), threads 8-15 the
    rows of the second, and so on, so ``lane = 8 * m + row``; lanes 0-7 are used for .x1, 0-15 for .x2,
    all 32 for .x4 (on sm_75 and below the other lanes must still hold valid addresses).

    m: 0..num-1, row: 0..7, num: 1, 2 or 4 (a plain int). Returns the lane.
    """
    if isinstance(num, (bool, np.bool_)) or not isinstance(num, (int, np.integer)) or num not in (1, 2, 4):
        raise ValueError(f"num must be 1, 2 or 4 (ldmatrix .x1 / .x2 / .x4); got {num!r}")
    num = int(num)
    scalar, (m, row) = _args(("m", m, num), ("row", row, 8), why=f" (ldmatrix .x{num} loads {num} matrices)")
    return _out(scalar, 8 * m + row)[0]


# ----------------------------------------------------------------------------------------------------
# Whole tables


def table(operand: str) -> np.ndarray:
    """``(32, n, 2)`` int64 array: ``table(op)[lane, i] = (row, col)`` of ``mma_{op}(lane, i)``.

    operand: "a" (n = 8), "b" (n = 4) or "c" (n = 4). Handy for figures (``kvq.viz.fragments``).
    """
    fn = {"a": mma_a, "b": mma_b, "c": mma_c}.get(operand) if isinstance(operand, str) else None
    if fn is None:
        raise ValueError(f"operand must be 'a', 'b' or 'c'; got {operand!r}")
    lane = np.arange(LANES)[:, None]                  # (32, 1)
    i = np.arange(_ELEMENTS[operand])[None, :]        # (1, n)
    row, col = fn(lane, i)                            # (32, n) each
    return np.stack([row, col], axis=-1)              # (32, n, 2)
