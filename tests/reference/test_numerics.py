"""The numerics contract helpers (DESIGN.md section 2), each against an independent derivation."""

import numpy as np
import pytest

from kvq.reference import numerics as nx


def test_rint_is_half_to_even():
    y = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, 2.4999998, 2.5000002], np.float32)
    assert nx.rint(y).tolist() == [0.0, 2.0, 2.0, 4.0, -0.0, -2.0, 2.0, 3.0]


def test_rint_magic_equals_rint_on_every_fp32_below_256():
    # every fp32 value in [0, 256) with a fractional part resolvable at 2^-12 and all exact ties
    y = np.arange(0, 256 * 4096, dtype=np.int64).astype(np.float32) / np.float32(4096)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(nx.rint_magic(y), nx.rint(y))
    # and every representable fp32 just around each tie
    ties = np.arange(256, dtype=np.float32) + np.float32(0.5)
    around = np.concatenate([np.nextafter(ties, 0, dtype=np.float32), ties,
                             np.nextafter(ties, 1000, dtype=np.float32)])
    np.testing.assert_array_equal(nx.rint_magic(around), nx.rint(around))


def test_div_is_ieee_fp32():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(10000).astype(np.float32)
    b = (rng.random(10000) + 0.01).astype(np.float32)
    q = nx.div(a, b)
    assert q.dtype == np.float32
    # correctly rounded: float64 quotient rounded once to fp32 (exact for fp32 inputs: 53 >= 2*24+2)
    np.testing.assert_array_equal(q, (a.astype(np.float64) / b.astype(np.float64)).astype(np.float32))


def test_no_fma_in_dequant_arithmetic():
    # a*b+c rounded twice differs from the fused value for these fp32 numbers
    a, b, c = np.float32(1 + 2 ** -12), np.float32(1 + 2 ** -12), np.float32(-1)
    two_roundings = nx.add(nx.mul(a, b), c)
    fused = np.float32(np.float64(a) * np.float64(b) + np.float64(c))   # a*b exact in float64
    assert two_roundings != fused
    assert two_roundings == np.float32(2 ** -11)


def test_canonical_zero():
    z = nx.canonical_zero(np.array([-0.0, 0.0, -1.5, 2.0], np.float32))
    assert np.signbit(z).tolist() == [False, False, True, False]
    assert z.tolist() == [0.0, 0.0, -1.5, 2.0]


def test_as_f32_refuses_float64_and_ints():
    with pytest.raises(TypeError, match="float64"):
        nx.as_f32(np.zeros(3))
    with pytest.raises(TypeError, match="int"):
        nx.as_f32(np.zeros(3, np.int32))
    x16 = np.array([1.5, -2.25], np.float16)
    assert nx.as_f32(x16).dtype == np.float32


def test_to_meta_rounds_half_even_and_refuses_overflow():
    # 1 + 2^-11 is the midpoint between fp16 1.0 and 1 + 2^-10: ties to even -> 1.0
    assert nx.to_meta(np.float32(1 + 2 ** -11), np.float16) == np.float16(1.0)
    assert nx.to_meta(np.float32(1 + 3 * 2 ** -11), np.float16) == np.float16(1 + 2 ** -9)
    with pytest.raises(ValueError, match="overflows float16"):
        nx.to_meta(np.float32(70000.0), np.float16)
    assert nx.to_meta(np.float32(70000.0), np.float32) == np.float32(70000.0)
    with pytest.raises(ValueError, match="meta_dtype"):
        nx.to_meta(np.float32(1.0), np.float64)


def test_round_to_bf16_matches_definition():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -3.0e38, np.nan], np.float32)
    r = nx.round_to_bf16(x)
    assert r[0] == 1.0
    assert r[1] == 1.0                       # tie, even mantissa stays
    assert r[2] == 1 + 2 ** -6               # tie, odd mantissa rounds up
    assert r[3] == 1 + 2 ** -7               # above the tie rounds up
    assert np.isfinite(r[4]) and abs(float(r[4]) / -3.0e38 - 1) <= 2 ** -9   # half a bf16 ulp
    assert np.isnan(r[5])
    # the result has 16 zero low bits
    assert np.all(r[:5].view(np.uint32) & 0xFFFF == 0)


def test_dtype_name_accepts_spellings():
    for d in (np.float16, "float16", "fp16", "half", np.dtype("float16")):
        assert nx.dtype_name(d) == "float16"
    assert nx.dtype_name("bfloat16") == "bfloat16"
    assert nx.dtype_name(np.float32) == "float32"


def test_check_bits_and_axis_errors():
    with pytest.raises(ValueError, match="bits=5"):
        nx.check_bits(5)
    with pytest.raises(ValueError, match="bits=True"):
        nx.check_bits(True)
    with pytest.raises(ValueError, match="axis=3"):
        nx.normalize_axis(3, 2)
    assert nx.normalize_axis(-1, 4) == 3


def test_arithmetic_helpers_refuse_non_fp32_with_type_error():
    """Public helpers: a float64 operand is a TypeError naming the helper (rule 1), not a bare assert."""
    one = np.float32(1)
    for name, args in (("div", (np.float64(1), one)), ("mul", (one, np.zeros(2))), ("add", (one, np.int32(1))),
                       ("sub", (np.float16(1), one)), ("rint", (np.zeros(2),)), ("rint_magic", (np.float64(1),))):
        with pytest.raises(TypeError, match=f"numerics.{name} takes float32 operands"):
            getattr(nx, name)(*args)


def test_check_no_nan():
    nx.check_no_nan(np.array([1.0, np.inf, -np.inf], np.float32))
    with pytest.raises(ValueError, match="a contains 2 NaN value"):
        nx.check_no_nan(np.array([np.nan, 1.0, np.nan], np.float32), "a")


def test_argument_errors_name_the_argument():
    """Issue 36: normalize_axis's ndim, to_meta / to_out of complex, strings or None, check_bits' name."""
    for bad, err in ((True, TypeError), (2.0, TypeError), ("3", TypeError), (None, TypeError), (-1, ValueError)):
        with pytest.raises(err, match="ndim"):
            nx.normalize_axis(0, bad)
    for bad in (np.ones(4, np.complex64), np.full(4, "a"), None):
        with pytest.raises(TypeError, match="x must be an array of real numbers"):
            nx.to_out(bad, "float16")
        with pytest.raises(TypeError, match="scale must be an array of real numbers"):
            nx.to_meta(bad, "float16", "scale")
    np.testing.assert_array_equal(nx.to_out(np.arange(3), "float16"), np.arange(3, dtype=np.float16))
    with pytest.raises(ValueError, match="k_bits=3 is not supported"):
        nx.check_bits(3, (2, 4, 8), "k_bits")
