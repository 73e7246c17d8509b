"""kvq.reference.fragments against the PTX ISA: mma.m16n8k16 (.f16 A / B, .f32 C / D) and ldmatrix.m8n8.

The expected layouts below are typed from the PTX ISA's figures (section "Matrix Fragments for
mma.m16n8k16 with floating point type", Figures 79 / 81 / 83 in PTX ISA 9.0; section "Warp-level matrix
load instruction: ldmatrix", its address table and Figure 104), cell by cell as the figures draw them,
not computed from the formulas under test. A cell ``T5:b2`` reads "lane 5 holds it as b2".
Then: each map is a bijection, the owner functions invert it, vectorized calls equal scalar ones, bad
arguments raise ValueError, and ldmatrix composed with the mma maps delivers exactly the A and B
fragments (the fact BitDecoding section IV-A(1) builds on).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvq.reference import fragments as F
from kvq.reference.fragments import (
    LANES,
    OPERAND_SHAPES,
    ldmatrix,
    ldmatrix_owner,
    ldmatrix_row_lane,
    mma_a,
    mma_a_owner,
    mma_b,
    mma_b_owner,
    mma_c,
    mma_c_owner,
    table,
)

MAPS = {"a": (mma_a, mma_a_owner, 8), "b": (mma_b, mma_b_owner, 4), "c": (mma_c, mma_c_owner, 4)}

# ----------------------------------------------------------------------------------------------------
# The PTX ISA figures, typed cell by cell. Rows top to bottom, columns left to right; "|" marks the
# boundary between the 8-column halves of A.

FIGURE_A = """
T0:a0  T0:a1  T1:a0  T1:a1  T2:a0  T2:a1  T3:a0  T3:a1  | T0:a4  T0:a5  T1:a4  T1:a5  T2:a4  T2:a5  T3:a4  T3:a5
T4:a0  T4:a1  T5:a0  T5:a1  T6:a0  T6:a1  T7:a0  T7:a1  | T4:a4  T4:a5  T5:a4  T5:a5  T6:a4  T6:a5  T7:a4  T7:a5
T8:a0  T8:a1  T9:a0  T9:a1  T10:a0 T10:a1 T11:a0 T11:a1 | T8:a4  T8:a5  T9:a4  T9:a5  T10:a4 T10:a5 T11:a4 T11:a5
T12:a0 T12:a1 T13:a0 T13:a1 T14:a0 T14:a1 T15:a0 T15:a1 | T12:a4 T12:a5 T13:a4 T13:a5 T14:a4 T14:a5 T15:a4 T15:a5
T16:a0 T16:a1 T17:a0 T17:a1 T18:a0 T18:a1 T19:a0 T19:a1 | T16:a4 T16:a5 T17:a4 T17:a5 T18:a4 T18:a5 T19:a4 T19:a5
T20:a0 T20:a1 T21:a0 T21:a1 T22:a0 T22:a1 T23:a0 T23:a1 | T20:a4 T20:a5 T21:a4 T21:a5 T22:a4 T22:a5 T23:a4 T23:a5
T24:a0 T24:a1 T25:a0 T25:a1 T26:a0 T26:a1 T27:a0 T27:a1 | T24:a4 T24:a5 T25:a4 T25:a5 T26:a4 T26:a5 T27:a4 T27:a5
T28:a0 T28:a1 T29:a0 T29:a1 T30:a0 T30:a1 T31:a0 T31:a1 | T28:a4 T28:a5 T29:a4 T29:a5 T30:a4 T30:a5 T31:a4 T31:a5
T0:a2  T0:a3  T1:a2  T1:a3  T2:a2  T2:a3  T3:a2  T3:a3  | T0:a6  T0:a7  T1:a6  T1:a7  T2:a6  T2:a7  T3:a6  T3:a7
T4:a2  T4:a3  T5:a2  T5:a3  T6:a2  T6:a3  T7:a2  T7:a3  | T4:a6  T4:a7  T5:a6  T5:a7  T6:a6  T6:a7  T7:a6  T7:a7
T8:a2  T8:a3  T9:a2  T9:a3  T10:a2 T10:a3 T11:a2 T11:a3 | T8:a6  T8:a7  T9:a6  T9:a7  T10:a6 T10:a7 T11:a6 T11:a7
T12:a2 T12:a3 T13:a2 T13:a3 T14:a2 T14:a3 T15:a2 T15:a3 | T12:a6 T12:a7 T13:a6 T13:a7 T14:a6 T14:a7 T15:a6 T15:a7
T16:a2 T16:a3 T17:a2 T17:a3 T18:a2 T18:a3 T19:a2 T19:a3 | T16:a6 T16:a7 T17:a6 T17:a7 T18:a6 T18:a7 T19:a6 T19:a7
T20:a2 T20:a3 T21:a2 T21:a3 T22:a2 T22:a3 T23:a2 T23:a3 | T20:a6 T20:a7 T21:a6 T21:a7 T22:a6 T22:a7 T23:a6 T23:a7
T24:a2 T24:a3 T25:a2 T25:a3 T26:a2 T26:a3 T27:a2 T27:a3 | T24:a6 T24:a7 T25:a6 T25:a7 T26:a6 T26:a7 T27:a6 T27:a7
T28:a2 T28:a3 T29:a2 T29:a3 T30:a2 T30:a3 T31:a2 T31:a3 | T28:a6 T28:a7 T29:a6 T29:a7 T30:a6 T30:a7 T31:a6 T31:a7
"""

# B is K x N = 16 x 8: column n is held by lanes 4n..4n+3, two consecutive k per register.
FIGURE_B = """
T0:b0  T4:b0  T8:b0  T12:b0 T16:b0 T20:b0 T24:b0 T28:b0
T0:b1  T4:b1  T8:b1  T12:b1 T16:b1 T20:b1 T24:b1 T28:b1
T1:b0  T5:b0  T9:b0  T13:b0 T17:b0 T21:b0 T25:b0 T29:b0
T1:b1  T5:b1  T9:b1  T13:b1 T17:b1 T21:b1 T25:b1 T29:b1
T2:b0  T6:b0  T10:b0 T14:b0 T18:b0 T22:b0 T26:b0 T30:b0
T2:b1  T6:b1  T10:b1 T14:b1 T18:b1 T22:b1 T26:b1 T30:b1
T3:b0  T7:b0  T11:b0 T15:b0 T19:b0 T23:b0 T27:b0 T31:b0
T3:b1  T7:b1  T11:b1 T15:b1 T19:b1 T23:b1 T27:b1 T31:b1
T0:b2  T4:b2  T8:b2  T12:b2 T16:b2 T20:b2 T24:b2 T28:b2
T0:b3  T4:b3  T8:b3  T12:b3 T16:b3 T20:b3 T24:b3 T28:b3
T1:b2  T5:b2  T9:b2  T13:b2 T17:b2 T21:b2 T25:b2 T29:b2
T1:b3  T5:b3  T9:b3  T13:b3 T17:b3 T21:b3 T25:b3 T29:b3
T2:b2  T6:b2  T10:b2 T14:b2 T18:b2 T22:b2 T26:b2 T30:b2
T2:b3  T6:b3  T10:b3 T14:b3 T18:b3 T22:b3 T26:b3 T30:b3
T3:b2  T7:b2  T11:b2 T15:b2 T19:b2 T23:b2 T27:b2 T31:b2
T3:b3  T7:b3  T11:b3 T15:b3 T19:b3 T23:b3 T27:b3 T31:b3
"""

FIGURE_C = """
T0:c0  T0:c1  T1:c0  T1:c1  T2:c0  T2:c1  T3:c0  T3:c1
T4:c0  T4:c1  T5:c0  T5:c1  T6:c0  T6:c1  T7:c0  T7:c1
T8:c0  T8:c1  T9:c0  T9:c1  T10:c0 T10:c1 T11:c0 T11:c1
T12:c0 T12:c1 T13:c0 T13:c1 T14:c0 T14:c1 T15:c0 T15:c1
T16:c0 T16:c1 T17:c0 T17:c1 T18:c0 T18:c1 T19:c0 T19:c1
T20:c0 T20:c1 T21:c0 T21:c1 T22:c0 T22:c1 T23:c0 T23:c1
T24:c0 T24:c1 T25:c0 T25:c1 T26:c0 T26:c1 T27:c0 T27:c1
T28:c0 T28:c1 T29:c0 T29:c1 T30:c0 T30:c1 T31:c0 T31:c1
T0:c2  T0:c3  T1:c2  T1:c3  T2:c2  T2:c3  T3:c2  T3:c3
T4:c2  T4:c3  T5:c2  T5:c3  T6:c2  T6:c3  T7:c2  T7:c3
T8:c2  T8:c3  T9:c2  T9:c3  T10:c2 T10:c3 T11:c2 T11:c3
T12:c2 T12:c3 T13:c2 T13:c3 T14:c2 T14:c3 T15:c2 T15:c3
T16:c2 T16:c3 T17:c2 T17:c3 T18:c2 T18:c3 T19:c2 T19:c3
T20:c2 T20:c3 T21:c2 T21:c3 T22:c2 T22:c3 T23:c2 T23:c3
T24:c2 T24:c3 T25:c2 T25:c3 T26:c2 T26:c3 T27:c2 T27:c3
T28:c2 T28:c3 T29:c2 T29:c3 T30:c2 T30:c3 T31:c2 T31:c3
"""

# ldmatrix Figure 104: one 8x8 matrix of 16-bit elements as stored (row-major); "T5:h1" = lane 5, half 1.
FIGURE_LDMATRIX = """
T0:h0  T0:h1  T1:h0  T1:h1  T2:h0  T2:h1  T3:h0  T3:h1
T4:h0  T4:h1  T5:h0  T5:h1  T6:h0  T6:h1  T7:h0  T7:h1
T8:h0  T8:h1  T9:h0  T9:h1  T10:h0 T10:h1 T11:h0 T11:h1
T12:h0 T12:h1 T13:h0 T13:h1 T14:h0 T14:h1 T15:h0 T15:h1
T16:h0 T16:h1 T17:h0 T17:h1 T18:h0 T18:h1 T19:h0 T19:h1
T20:h0 T20:h1 T21:h0 T21:h1 T22:h0 T22:h1 T23:h0 T23:h1
T24:h0 T24:h1 T25:h0 T25:h1 T26:h0 T26:h1 T27:h0 T27:h1
T28:h0 T28:h1 T29:h0 T29:h1 T30:h0 T30:h1 T31:h0 T31:h1
"""

# A: (row, col) of a0..a7 for four lanes, read off Figure 79.
A_LANES = {
    0: [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9)],
    1: [(0, 2), (0, 3), (8, 2), (8, 3), (0, 10), (0, 11), (8, 10), (8, 11)],
    4: [(1, 0), (1, 1), (9, 0), (9, 1), (1, 8), (1, 9), (9, 8), (9, 9)],
    31: [(7, 6), (7, 7), (15, 6), (15, 7), (7, 14), (7, 15), (15, 14), (15, 15)],
}

# ldmatrix: (row, col) of the stored matrix that halves 0, 1 of a lane's register receive.
LDMATRIX_LANES = {0: [(0, 0), (0, 1)], 5: [(1, 2), (1, 3)], 31: [(7, 6), (7, 7)]}
LDMATRIX_TRANS_LANES = {0: [(0, 0), (1, 0)], 5: [(2, 1), (3, 1)], 31: [(6, 7), (7, 7)]}

# ldmatrix address table: which lanes hold addr0-addr7 (matrix 0), addr8-addr15 (matrix 1), ...
ADDRESS_TABLE = {1: [range(0, 8)], 2: [range(0, 8), range(8, 16)],
                 4: [range(0, 8), range(8, 16), range(16, 24), range(24, 32)]}


def parse_figure(text: str) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(lane, i): (row, col)}`` from a grid of ``T{lane}:{letter}{i}`` cells."""
    out = {}
    rows = [line.replace("|", " ").split() for line in text.strip().splitlines()]
    for r, cells in enumerate(rows):
        for c, cell in enumerate(cells):
            lane, i = map(int, re.fullmatch(r"T(\d+):[abch](\d)", cell).groups())
            assert (lane, i) not in out, f"figure lists {cell} twice"
            out[lane, i] = (r, c)
    return out


# ----------------------------------------------------------------------------------------------------
# Against the PTX ISA figures


def test_constants():
    assert LANES == 32
    assert OPERAND_SHAPES == {"a": (16, 16), "b": (16, 8), "c": (16, 8)}


@pytest.mark.parametrize("operand,figure", [("a", FIGURE_A), ("b", FIGURE_B), ("c", FIGURE_C)])
def test_mma_matches_ptx_figure(operand, figure):
    expected = parse_figure(figure)
    fn, _, n = MAPS[operand]
    assert len(expected) == LANES * n                       # every (lane, i) drawn exactly once
    for (lane, i), rc in expected.items():
        assert fn(lane, i) == rc, (operand, lane, i)
    t = table(operand)
    assert t.shape == (LANES, n, 2)
    assert {(lane, i): tuple(t[lane, i]) for lane in range(LANES) for i in range(n)} == expected


@pytest.mark.parametrize("lane", sorted(A_LANES))
def test_mma_a_lanes_literal(lane):
    assert [mma_a(lane, i) for i in range(8)] == A_LANES[lane]
    assert [tuple(rc) for rc in table("a")[lane]] == A_LANES[lane]


def test_mma_b_and_c_spot_checks():
    # BitDecoding Fig. 3a (B): T0 holds k = 0, 1 (register 0) and 8, 9 (register 1) of column n = 0.
    assert [mma_b(0, i) for i in range(4)] == [(0, 0), (1, 0), (8, 0), (9, 0)]
    assert [mma_b(5, i) for i in range(4)] == [(2, 1), (3, 1), (10, 1), (11, 1)]
    assert [mma_b(31, i) for i in range(4)] == [(6, 7), (7, 7), (14, 7), (15, 7)]
    assert [mma_c(0, i) for i in range(4)] == [(0, 0), (0, 1), (8, 0), (8, 1)]
    assert [mma_c(6, i) for i in range(4)] == [(1, 4), (1, 5), (9, 4), (9, 5)]
    assert [mma_c(31, i) for i in range(4)] == [(7, 6), (7, 7), (15, 6), (15, 7)]


def test_ldmatrix_matches_ptx_figure():
    expected = parse_figure(FIGURE_LDMATRIX)
    assert len(expected) == 64
    for m in range(4):                                      # same map for every matrix of .x2 / .x4
        for (lane, half), (r, c) in expected.items():
            assert ldmatrix(lane, m, half) == (r, c)
            assert ldmatrix(lane, m, half, trans=True) == (c, r)   # .trans: column-major delivery


@pytest.mark.parametrize("trans,lanes", [(False, LDMATRIX_LANES), (True, LDMATRIX_TRANS_LANES)])
def test_ldmatrix_lanes_literal(trans, lanes):
    for lane, rcs in lanes.items():
        assert [ldmatrix(lane, 0, h, trans=trans) for h in (0, 1)] == rcs
        assert [ldmatrix_owner(r, c, trans=trans) for r, c in rcs] == [(lane, 0), (lane, 1)]


@pytest.mark.parametrize("num", [1, 2, 4])
def test_ldmatrix_address_table(num):
    for m, lanes in enumerate(ADDRESS_TABLE[num]):
        assert [ldmatrix_row_lane(m, row, num) for row in range(8)] == list(lanes)
    assert ldmatrix_row_lane(np.arange(num)[:, None], np.arange(8), num).ravel().tolist() == list(range(8 * num))


# ----------------------------------------------------------------------------------------------------
# Bijections and inverses


@pytest.mark.parametrize("operand", ["a", "b", "c"])
def test_mma_is_bijection_and_owner_inverts(operand):
    fn, owner, n = MAPS[operand]
    R, C = OPERAND_SHAPES[operand]
    lane, i = np.meshgrid(np.arange(LANES), np.arange(n), indexing="ij")   # (32, n)
    row, col = fn(lane, i)
    seen = np.zeros((R, C), dtype=int)
    np.add.at(seen, (row, col), 1)
    assert (seen == 1).all()                                # 32 * n == R * C, each element once
    assert LANES * n == R * C
    back_lane, back_i = owner(row, col)
    assert (back_lane == lane).all() and (back_i == i).all()
    rr, cc = np.meshgrid(np.arange(R), np.arange(C), indexing="ij")
    ol, oi = owner(rr, cc)
    r2, c2 = fn(ol, oi)
    assert (r2 == rr).all() and (c2 == cc).all()


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_is_bijection_and_owner_inverts(trans):
    lane, half = np.meshgrid(np.arange(LANES), np.arange(2), indexing="ij")  # (32, 2)
    for m in range(4):
        row, col = ldmatrix(lane, m, half, trans=trans)
        seen = np.zeros((8, 8), dtype=int)
        np.add.at(seen, (row, col), 1)
        assert (seen == 1).all()
        back_lane, back_half = ldmatrix_owner(row, col, trans=trans)
        assert (back_lane == lane).all() and (back_half == half).all()
    rr, cc = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    ol, oh = ldmatrix_owner(rr, cc, trans=trans)
    r2, c2 = ldmatrix(ol, 0, oh, trans=trans)
    assert (r2 == rr).all() and (c2 == cc).all()


# ----------------------------------------------------------------------------------------------------
# Vectorized == scalar


def _calls():
    """(function, argument grids, kwargs) for every vectorized function."""
    yield mma_a, (np.arange(32)[:, None], np.arange(8)[None, :]), {}
    yield mma_b, (np.arange(32)[:, None], np.arange(4)[None, :]), {}
    yield mma_c, (np.arange(32)[:, None], np.arange(4)[None, :]), {}
    yield mma_a_owner, (np.arange(16)[:, None], np.arange(16)[None, :]), {}
    yield mma_b_owner, (np.arange(16)[:, None], np.arange(8)[None, :]), {}
    yield mma_c_owner, (np.arange(16)[:, None], np.arange(8)[None, :]), {}
    for trans in (False, True):
        yield ldmatrix, (np.arange(32)[:, None, None], np.arange(4)[None, :, None], np.arange(2)), \
            {"trans": trans}
        yield ldmatrix_owner, (np.arange(8)[:, None], np.arange(8)[None, :]), {"trans": trans}
    yield ldmatrix_row_lane, (np.arange(4)[:, None], np.arange(8)[None, :], 4), {}


CALLS = list(_calls())


@pytest.mark.parametrize("fn,args,kw", CALLS, ids=[fn.__name__ + ("-trans" if kw.get("trans") else "")
                                                   for fn, _, kw in CALLS])
def test_vectorized_equals_scalar(fn, args, kw):
    arrays = [a for a in args if isinstance(a, np.ndarray)]
    extra = [a for a in args if not isinstance(a, np.ndarray)]
    got = fn(*args, **kw)
    got = got if isinstance(got, tuple) else (got,)
    shape = np.broadcast_shapes(*(a.shape for a in arrays))
    for out in got:
        assert isinstance(out, np.ndarray) and out.shape == shape and out.dtype == np.int64
    for idx in np.ndindex(shape):
        scalars = [int(np.broadcast_to(a, shape)[idx]) for a in arrays]
        one = fn(*scalars, *extra, **kw)
        one = one if isinstance(one, tuple) else (one,)
        assert all(type(v) is int for v in one)             # all-scalar calls return Python ints
        assert one == tuple(int(out[idx]) for out in got)


def test_scalar_types_and_broadcasting():
    assert mma_a(np.int32(5), np.uint8(3)) == mma_a(5, 3)
    assert all(type(v) is int for v in mma_a(np.int32(5), np.uint8(3)))
    row, col = mma_b(np.array(5), [0, 1, 2, 3])             # lists broadcast too
    assert row.tolist() == [2, 3, 10, 11] and col.tolist() == [1, 1, 1, 1]
    row, col = mma_c(np.zeros((2, 3), dtype=np.int16), 0)
    assert row.shape == col.shape == (2, 3)
    empty = mma_a(np.array([], dtype=int), 0)
    assert empty[0].shape == (0,)


# ----------------------------------------------------------------------------------------------------
# Bad arguments


@pytest.mark.parametrize("call,match", [
    (lambda: mma_a(32, 0), "lane = 32"),
    (lambda: mma_a(-1, 0), "lane = -1"),
    (lambda: mma_a(0, 8), "i = 8"),
    (lambda: mma_b(0, 4), "i = 4"),
    (lambda: mma_c(np.array([0, 40]), 0), "lane = 40"),
    (lambda: mma_c(0, -1), "i = -1"),
    (lambda: mma_a_owner(16, 0), "row = 16"),
    (lambda: mma_a_owner(0, 16), "col = 16"),
    (lambda: mma_b_owner(0, 8), "col = 8"),
    (lambda: mma_c_owner(16, 0), "row = 16"),
    (lambda: mma_a(1.0, 0), "integer"),
    (lambda: mma_a(True, 0), "integer"),
    (lambda: mma_b("3", 0), "integer"),
    (lambda: mma_a(np.arange(3), np.arange(2)), "broadcast"),
    (lambda: ldmatrix(32, 0, 0), "lane = 32"),
    (lambda: ldmatrix(0, 4, 0), "m = 4"),
    (lambda: ldmatrix(0, 0, 2), "half = 2"),
    (lambda: ldmatrix(0, 0, 0, trans=1), "trans"),
    (lambda: ldmatrix_owner(8, 0), "row = 8"),
    (lambda: ldmatrix_owner(0, 8, trans=True), "col = 8"),
    (lambda: ldmatrix_owner(0, 0, trans="yes"), "trans"),
    (lambda: ldmatrix_row_lane(0, 0, 3), "num"),
    (lambda: ldmatrix_row_lane(0, 0, 8), "num"),
    (lambda: ldmatrix_row_lane(0, 0, 2.0), "num"),
    (lambda: ldmatrix_row_lane(1, 0, 1), r"m = 1 .*\.x1"),
    (lambda: ldmatrix_row_lane(2, 0, 2), r"m = 2 .*\.x2"),
    (lambda: ldmatrix_row_lane(4, 0, 4), "m = 4"),
    (lambda: ldmatrix_row_lane(0, 8, 4), "row = 8"),
    (lambda: table("d"), "operand"),
    (lambda: table("A"), "operand"),
    (lambda: table(None), "operand"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------------------------------
# ldmatrix composed with mma: the loads deliver the mma fragments


def simulate_ldmatrix(matrices: list[np.ndarray], trans: bool) -> np.ndarray:
    """What ``ldmatrix.m8n8.x{len(matrices)}{.trans}.b16`` leaves in the registers: ``(32, num, 2)``.

    Lane ``ldmatrix_row_lane(m, r, num)`` supplies the address of row ``r`` of matrix ``m``; lane ``l``
    then receives, in half ``h`` of register ``m``, element ``ldmatrix(l, m, h, trans)`` of that matrix,
    read through the row its supplier pointed at.
    """
    num = len(matrices)
    address = {}                                            # lane -> (matrix, row) it points at
    for m in range(num):
        for r in range(8):
            address[ldmatrix_row_lane(m, r, num)] = (m, r)
    supplier = {mr: lane for lane, mr in address.items()}
    regs = np.empty((LANES, num, 2), dtype=matrices[0].dtype)
    for lane in range(LANES):
        for m in range(num):
            for h in range(2):
                r, c = ldmatrix(lane, m, h, trans=trans)
                mm, rr = address[supplier[m, r]]
                regs[lane, m, h] = matrices[mm][rr, c]
    return regs


def fragments(regs: np.ndarray) -> np.ndarray:
    """``(32, num, 2)`` registers -> ``(32, 2 * num)`` fragment elements: element i = register i // 2,
    half i % 2 ("elements low to high")."""
    return regs.reshape(LANES, -1)


def test_ldmatrix_x4_delivers_a_fragment():
    A = np.arange(256, dtype=np.int64).reshape(16, 16)      # (M, K) row-major tile, distinct values
    mats = [A[0:8, 0:8], A[8:16, 0:8], A[0:8, 8:16], A[8:16, 8:16]]   # m0..m3
    frag = fragments(simulate_ldmatrix(mats, trans=False))  # (32, 8)
    for lane in range(LANES):
        for i in range(8):
            assert frag[lane, i] == A[mma_a(lane, i)], (lane, i)
    # the register index is the matrix index: register m of every lane comes from matrix m
    for m in range(4):
        assert set(frag[:, 2 * m:2 * m + 2].ravel()) == set(mats[m].ravel())


def test_ldmatrix_x2_delivers_b_fragment_from_n_by_k_tile():
    Bt = np.arange(128, dtype=np.int64).reshape(8, 16)      # (N, K) row-major: B[k, n] = Bt[n, k]
    frag = fragments(simulate_ldmatrix([Bt[:, 0:8], Bt[:, 8:16]], trans=False))   # (32, 4)
    B = Bt.T                                                # (K, N)
    for lane in range(LANES):
        for i in range(4):
            assert frag[lane, i] == B[mma_b(lane, i)], (lane, i)


def test_ldmatrix_x2_trans_delivers_b_fragment_from_k_by_n_tile():
    B = np.arange(128, dtype=np.int64).reshape(16, 8)       # (K, N) row-major
    frag = fragments(simulate_ldmatrix([B[0:8], B[8:16]], trans=True))  # (32, 4)
    for lane in range(LANES):
        for i in range(4):
            assert frag[lane, i] == B[mma_b(lane, i)], (lane, i)


def test_module_is_numpy_only():
    src = open(F.__file__, encoding="utf-8").read()
    for name in ("torch", "triton", "cupy", "matplotlib"):
        assert f"import {name}" not in src
