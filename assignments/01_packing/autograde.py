"""Autograder of assignment 1 (packing): the submission's ``pack`` / ``unpack`` against
``kvq.reference.packing`` on randomized codes (fixed seeds), worked examples, edge cases and errors.

    python assignments/01_packing/autograde.py               # grades starter.py
    python assignments/01_packing/autograde.py --solution    # grades solutions/01_packing.py
    python assignments/01_packing/autograde.py --file my.py  # grades any file
"""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import grading  # noqa: E402

from kvq.reference import packing as ref  # noqa: E402

SHAPES = [(16,), (3, 8), (2, 4, 12), (2, 3, 8, 4), (1, 1, 128)]


def check_array(what, got, want):
    """Assert ``got`` equals ``want`` exactly (type, shape, dtype, every element); name the first difference."""
    assert isinstance(got, np.ndarray), f"{what}: expected a numpy array, got {type(got).__name__}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    bad = np.argwhere(got != want)
    if bad.size:
        i = tuple(int(j) for j in bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {got.size} elements differ; first at index {i}: "
                             f"got {int(got[i])} (0b{int(got[i]):08b}), expected {int(want[i])} "
                             f"(0b{int(want[i]):08b})")


def expect_error(what, exc, fn, *args, **kw):
    """Assert ``fn(*args, **kw)`` raises ``exc`` (NotImplementedError passes through to the harness)."""
    try:
        fn(*args, **kw)
    except NotImplementedError:
        raise
    except exc:
        return
    except Exception as e:
        raise AssertionError(f"{what}: raised {type(e).__name__} ({e}), expected {exc.__name__}") from None
    raise AssertionError(f"{what}: returned normally, expected {exc.__name__} (the reference refuses it)")


def random_cases(bits, seed):
    """(codes, axis) pairs: every axis of every shape, lengths along the axis made a multiple of 8/bits."""
    rng = np.random.default_rng(seed)
    per = 8 // bits
    for shape in SHAPES:
        for axis in range(-len(shape), len(shape)):
            s = list(shape)
            s[axis] = per * int(rng.integers(1, 6))
            yield rng.integers(0, 2 ** bits, size=s, dtype=np.uint8), axis


def _pack_part(bits):
    def part(sub):
        for codes, axis in random_cases(bits, seed=bits):
            check_array(f"pack(codes of shape {codes.shape}, bits={bits}, axis={axis})",
                        sub.pack(codes, bits, axis=axis), ref.pack(codes, bits, axis=axis))
    part.__doc__ = f"{bits}-bit codes: bytes identical to kvq.reference.packing.pack on every axis"
    return part


def part_byte_order(sub):
    """The worked examples of book/numerics.md: first code in the low bits."""
    got = sub.pack(np.array([1, 2, 3, 0], np.uint8), 2)
    check_array("pack([1, 2, 3, 0], bits=2)", got, np.array([0b00_11_10_01], np.uint8))
    got = sub.pack(np.array([0xA, 0x3], np.uint8), 4)
    check_array("pack([0xA, 0x3], bits=4)", got, np.array([0x3A], np.uint8))
    got = sub.pack(np.array([[1, 0, 0, 0, 0, 0, 0, 3]], np.uint8), 2, axis=-1)
    check_array("pack([[1, 0, 0, 0, 0, 0, 0, 3]], bits=2)", got, np.array([[1, 0b11_00_00_00]], np.uint8))


def part_unpack(sub):
    """unpack(reference bytes) gives back the codes, on every axis, for 2 and 4 bits."""
    for bits in (2, 4):
        for codes, axis in random_cases(bits, seed=10 + bits):
            packed = ref.pack(codes, bits, axis=axis)
            got = sub.unpack(packed, bits, codes.shape[axis], axis=axis)
            check_array(f"unpack(bytes of shape {packed.shape}, bits={bits}, n={codes.shape[axis]}, axis={axis})",
                        got, ref.unpack(packed, bits, axis=axis))


def part_round_trip(sub):
    """unpack(pack(codes)) == codes with your own two functions, including non-contiguous input."""
    rng = np.random.default_rng(20)
    for bits in (2, 4):
        for codes, axis in random_cases(bits, seed=30 + bits):
            back = sub.unpack(sub.pack(codes, bits, axis=axis), bits, codes.shape[axis], axis=axis)
            check_array(f"unpack(pack(codes of shape {codes.shape}, bits={bits}, axis={axis}))", back, codes)
        codes = rng.integers(0, 2 ** bits, size=(16, 8), dtype=np.uint8).T     # (8, 16), Fortran order
        check_array(f"pack(transposed (non-contiguous) codes, bits={bits}, axis=0)",
                    sub.pack(codes, bits, axis=0), ref.pack(codes, bits, axis=0))


def part_edges(sub):
    """All-zero codes, all-max codes, a single byte, empty arrays."""
    for bits in (2, 4):
        per = 8 // bits
        for name, fill in (("all-zero", 0), ("all-max", 2 ** bits - 1)):
            for shape, axis in (((per,), 0), ((3, 2 * per), 1), ((4 * per, 5), 0)):
                codes = np.full(shape, fill, np.uint8)
                want = ref.pack(codes, bits, axis=axis)
                check_array(f"pack({name} codes of shape {shape}, bits={bits}, axis={axis})",
                            sub.pack(codes, bits, axis=axis), want)
                check_array(f"unpack(pack({name} codes of shape {shape}), bits={bits}, axis={axis})",
                            sub.unpack(want, bits, shape[axis], axis=axis), codes)
        empty = np.zeros((0, 2 * per), np.uint8)
        check_array(f"pack(empty codes of shape {empty.shape}, bits={bits}, axis=1)",
                    sub.pack(empty, bits, axis=1), ref.pack(empty, bits, axis=1))


def part_errors(sub):
    """The reference's refusals: unsupported bits, odd lengths, out-of-range codes, dtype, axis, n."""
    ok = np.zeros((2, 8), np.uint8)
    for bits in (1, 3, 5):
        expect_error(f"pack(codes, bits={bits})", ValueError, sub.pack, ok, bits)
        expect_error(f"unpack(bytes, bits={bits}, n=8)", ValueError, sub.unpack, ok, bits, 8)
    expect_error("pack(6 codes, bits=2; 6 is not a multiple of 4)", ValueError,
                 sub.pack, np.zeros((2, 6), np.uint8), 2)
    expect_error("pack(3 codes, bits=4; 3 is odd)", ValueError, sub.pack, np.zeros(3, np.uint8), 4)
    expect_error("pack(codes containing 4, bits=2)", ValueError, sub.pack, np.array([0, 4, 0, 0], np.uint8), 2)
    expect_error("pack(codes containing 16, bits=4)", ValueError, sub.pack, np.array([16, 0], np.uint8), 4)
    expect_error("pack(int64 codes, bits=2)", TypeError, sub.pack, np.zeros(8, np.int64), 2)
    expect_error("unpack(int32 bytes, bits=2, n=8)", TypeError, sub.unpack, np.zeros(2, np.int32), 2, 8)
    expect_error("pack(2-d codes, bits=2, axis=2)", ValueError, sub.pack, ok, 2, axis=2)
    expect_error("pack(2-d codes, bits=2, axis=-3)", ValueError, sub.pack, ok, 2, axis=-3)
    expect_error("unpack(2 bytes, bits=2, n=7)", ValueError, sub.unpack, np.zeros(2, np.uint8), 2, 7)
    expect_error("unpack(2 bytes, bits=4, n=8)", ValueError, sub.unpack, np.zeros(2, np.uint8), 4, 8)


PARTS = [
    ("byte order (worked examples)", 2, part_byte_order),
    ("pack 2-bit vs reference, every axis", 3, _pack_part(2)),
    ("pack 4-bit vs reference, every axis", 3, _pack_part(4)),
    ("unpack vs reference", 3, part_unpack),
    ("round trip, non-contiguous input", 2, part_round_trip),
    ("edge cases: zero, max, single byte, empty", 2, part_edges),
    ("errors where the reference refuses", 2, part_errors),
]

if __name__ == "__main__":
    raise SystemExit(grading.main(PARTS, pathlib.Path(__file__).parent))
