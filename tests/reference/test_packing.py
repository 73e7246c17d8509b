"""kvq.reference.packing: rule 6 of the contract, KIVI's int32 layout, round trips, bad input."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.reference import packing, quant


def test_first_code_in_low_bits():
    codes = np.array([1, 2, 3, 0], np.uint8)
    # 1 | 2 << 2 | 3 << 4 | 0 << 6 = 0b00111001
    assert packing.pack(codes, 2).tolist() == [0b00111001]
    assert packing.pack(np.array([0xA, 0x5], np.uint8), 4).tolist() == [0x5A]
    assert packing.pack(np.array([7, 200], np.uint8), 8).tolist() == [7, 200]


def kivi_int32_words(codes, bits):
    """KIVI's packing, built from its documented rule: 32/b codes per int32 word, code j of a word
    at bits [b*j, b*j + b). Written with Python integers, independently of kvq's implementation."""
    per = 32 // bits
    words = []
    for start in range(0, len(codes), per):
        w = 0
        for j, c in enumerate(codes[start:start + per]):
            w |= int(c) << (bits * j)
        words.append(w)
    return np.array(words, dtype=np.uint32).astype(np.int32)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bytes_equal_kivi_int32_words_little_endian(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2 ** bits, size=(5, 64)).astype(np.uint8)
    for row in codes:
        words = kivi_int32_words(row, bits)
        as_bytes = words.astype("<i4").view(np.uint8)
        np.testing.assert_array_equal(packing.pack(row, bits), as_bytes)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_pack_along_any_axis_equals_pack_along_last(axis):
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 4, size=(8, 12, 16)).astype(np.uint8)
    p = packing.pack(codes, 2, axis=axis)
    moved = np.ascontiguousarray(np.moveaxis(codes, axis, -1))
    np.testing.assert_array_equal(np.moveaxis(p, axis, -1), packing.pack(moved, 2, axis=-1))
    np.testing.assert_array_equal(packing.unpack(p, 2, axis=axis), codes)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 5), nbytes=st.integers(1, 9), seed=st.integers(0, 2 ** 32 - 1))
def test_round_trip(bits, rows, nbytes, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2 ** bits, size=(rows, nbytes * (8 // bits))).astype(np.uint8)
    p = packing.pack(codes, bits)
    assert p.shape == (rows, nbytes) and p.dtype == np.uint8
    np.testing.assert_array_equal(packing.unpack(p, bits), codes)
    # and every byte value unpacks and repacks to itself
    allbytes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(packing.pack(packing.unpack(allbytes, bits), bits), allbytes)


def test_quantize_pack_and_unpack_dequantize_compose():
    rng = np.random.default_rng(9)
    v = rng.standard_normal((2, 2, 8, 32)).astype(np.float16)
    p, s, m = packing.quantize_pack(v, 2, 32, axis=-1)
    c, s2, m2 = quant.quantize(v, 2, 32, axis=-1)
    np.testing.assert_array_equal(p, packing.pack(c, 2, axis=-1))
    assert p.shape == (2, 2, 8, 8)
    np.testing.assert_array_equal(
        packing.unpack_dequantize(p, s, m, 2, 32, axis=-1),
        quant.dequantize(c, s2, m2, 32, axis=-1))


def test_bad_input():
    with pytest.raises(ValueError, match="bits=3"):
        packing.pack(np.zeros(8, np.uint8), 3)
    with pytest.raises(ValueError, match="bits=3"):
        packing.quantize_pack(np.zeros(8, np.float32), 3, 8)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        packing.pack(np.zeros(6, np.uint8), 2)
    with pytest.raises(ValueError, match="out of range for 2 bits"):
        packing.pack(np.array([0, 1, 2, 4], np.uint8), 2)
    with pytest.raises(TypeError, match="uint8"):
        packing.pack(np.zeros(4, np.int64), 2)
    with pytest.raises(TypeError, match="uint8"):
        packing.unpack(np.zeros(4, np.int8), 2)
