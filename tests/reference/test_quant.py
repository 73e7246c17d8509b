"""kvq.reference.quant against the contract: worked examples, properties, edge cases and bad input."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvq.reference import quant


def test_worked_example_2bit():
    # one group: mn = -1, mx = 2 -> scale = 3/3 = 1; codes = rint(x + 1)
    x = np.array([[-1.0, 0.5, 1.5, 2.0, -0.5, 0.0, 1.0, 0.25]], np.float32)
    codes, scale, mn = quant.quantize(x, bits=2, group_size=8, axis=-1)
    assert scale.dtype == np.float16 and scale.tolist() == [[1.0]] and mn.tolist() == [[-1.0]]
    # (x + 1) = 0, 1.5, 2.5, 3, 0.5, 1, 2, 1.25 -> half-even: 0, 2, 2, 3, 0, 1, 2, 1
    assert codes.tolist() == [[0, 2, 2, 3, 0, 1, 2, 1]]
    xh = quant.dequantize(codes, scale, mn, 8, axis=-1, out_dtype=np.float32)
    assert xh.tolist() == [[-1.0, 1.0, 1.0, 2.0, -1.0, 0.0, 1.0, 0.0]]


def test_per_channel_and_per_token_groups():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((2, 3, 64, 16)).astype(np.float16)     # (B, H, T, D)
    # per-channel keys: groups of 32 tokens along axis 2
    codes, scale, mn = quant.quantize(k, 2, 32, axis=2)
    assert codes.shape == k.shape and scale.shape == (2, 3, 2, 16)
    kf = k.astype(np.float32)
    np.testing.assert_array_equal(mn, kf.reshape(2, 3, 2, 32, 16).min(axis=3).astype(np.float16))
    # per-token values: groups of 8 channels along the last axis
    codes, scale, mn = quant.quantize(k, 4, 8, axis=-1)
    assert scale.shape == (2, 3, 64, 2)
    np.testing.assert_array_equal(mn, kf.reshape(2, 3, 64, 2, 8).min(axis=-1).astype(np.float16))


def test_group_along_axis_equals_moving_axis_last():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 40, 5)).astype(np.float32)
    c1, s1, m1 = quant.quantize(x, 3, 20, axis=1)
    c2, s2, m2 = quant.quantize(np.ascontiguousarray(np.moveaxis(x, 1, -1)), 3, 20, axis=-1)
    np.testing.assert_array_equal(c1, np.moveaxis(c2, -1, 1))
    np.testing.assert_array_equal(s1, np.moveaxis(s2, -1, 1))
    np.testing.assert_array_equal(m1, np.moveaxis(m2, -1, 1))


def test_constant_group_has_zero_scale_and_dequantizes_to_stored_min():
    x = np.full((2, 8), 0.1, np.float32)            # fp16(0.1) != 0.1: x - mn_s != 0 but scale is 0
    codes, scale, mn = quant.quantize(x, 2, 8)
    assert np.all(scale == 0) and np.all(codes == 0)
    xh = quant.dequantize(codes, scale, mn, 8, out_dtype=np.float32)
    np.testing.assert_array_equal(xh, np.full((2, 8), np.float32(np.float16(0.1))))


def test_negative_zero_min_is_canonical():
    x = np.array([[-0.0, 0.0, 0.0, 0.0]], np.float32)
    _, scale, mn = quant.quantize(x, 2, 4)
    assert not np.signbit(mn).any() and scale[0, 0] == 0


def test_ties_round_half_to_even():
    # mn = 0, mx = 3 * 2^-4 -> scale = 2^-4; x / scale hits k + 0.5 exactly
    s = np.float32(2 ** -4)
    x = np.array([[0.0, 0.5 * s, 1.5 * s, 2.5 * s, 3 * s, 1 * s, 2 * s, 0.0]], np.float32)
    codes, scale, _ = quant.quantize(x, 2, 8)
    assert scale[0, 0] == s
    assert codes.tolist() == [[0, 0, 2, 2, 3, 1, 2, 0]]


def test_symmetric_variant():
    x = np.array([[-7.0, -3.5, 0.0, 2.5, 7.0, 1.0, -1.0, 0.5]], np.float32)
    codes, scale, mn = quant.quantize(x, 4, 8, symmetric=True)
    assert scale[0, 0] == 1.0 and mn[0, 0] == -8.0            # q = 7, off = 8
    # rint(x): -7, -4 (tie to even), 0, 2 (tie), 7, 1, -1, 0 (tie) ; +8
    assert codes.tolist() == [[1, 4, 8, 10, 15, 9, 7, 8]]
    xh = quant.dequantize(codes, scale, mn, 8, out_dtype=np.float32)
    assert xh.tolist() == [[-7.0, -4.0, 0.0, 2.0, 7.0, 1.0, -1.0, 0.0]]


def test_fp32_metadata_and_bf16_output():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 32)) * 1e5).astype(np.float32)
    with pytest.raises(ValueError, match="overflows float16"):
        quant.quantize(x, 4, 16)
    codes, scale, mn = quant.quantize(x, 4, 16, meta_dtype=np.float32)
    assert scale.dtype == np.float32
    xb = quant.dequantize(codes, scale, mn, 16, out_dtype="bfloat16")
    assert xb.dtype == np.float32 and np.all(xb.view(np.uint32) & 0xFFFF == 0)


def test_tiny_range_uses_subnormal_fp16_scale():
    x = np.array([[0.0, 1e-7, 2e-7, 3e-7]], np.float32)
    codes, scale, mn = quant.quantize(x, 2, 4)
    assert 0 < scale[0, 0] < np.finfo(np.float16).tiny      # subnormal
    assert codes.max() <= 3


def test_percentile_clip_matches_numpy_linear_quantile():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    xc, tau = quant.percentile_clip(x, 0.96)
    want = np.quantile(np.abs(x).astype(np.float64), 0.96, axis=-1)
    np.testing.assert_allclose(tau, want, rtol=1e-6)
    assert np.all(np.abs(xc) <= tau[:, None])
    # ratio 1 keeps the max, so nothing is clipped
    np.testing.assert_array_equal(quant.percentile_clip(x, 1.0)[0], x)


def test_quantile_rule_worked_example():
    a = np.array([[4.0, 1.0, 3.0, 2.0]], np.float32)      # sorted 1, 2, 3, 4; h = 3 * 0.5 = 1.5
    assert quant.quantile(a, 0.5)[0] == np.float32(2.5)
    with pytest.raises(ValueError, match="rho"):
        quant.quantile(a, 0.0)


@pytest.mark.parametrize("bad, match", [
    (dict(bits=5), "bits=5"),
    (dict(group_size=3), "does not divide"),
    (dict(group_size=0), "group_size"),
    (dict(axis=2), "axis=2"),
    (dict(meta_dtype=np.float64), "meta_dtype"),
])
def test_bad_arguments(bad, match):
    args = dict(bits=2, group_size=4, axis=-1, meta_dtype=np.float16)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        quant.quantize(np.zeros((2, 8), np.float32), **args)


def test_bad_inputs():
    with pytest.raises(TypeError, match="float64"):
        quant.quantize(np.zeros((2, 8)), 2, 4)
    with pytest.raises(ValueError, match="empty"):
        quant.quantize(np.zeros((0, 8), np.float32), 2, 4)
    x = np.zeros((2, 8), np.float32)
    x[1, 3] = np.nan
    with pytest.raises(ValueError, match="1 NaN"):
        quant.quantize(x, 2, 4)
    x[1, 3] = np.inf
    with pytest.raises(ValueError, match="1 inf"):
        quant.quantize(x, 2, 4)
    codes, scale, mn = quant.quantize(np.ones((2, 8), np.float32), 2, 4)
    with pytest.raises(ValueError, match="scale has shape"):
        quant.dequantize(codes, scale[:1], mn, 4)
    with pytest.raises(TypeError, match="uint8"):
        quant.dequantize(codes.astype(np.int32), scale, mn, 4)


finite_f16 = hnp.arrays(
    np.float16, hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=8).map(lambda s: s[:-1] + (16,)),
    elements=st.floats(-1000, 1000, width=16, allow_nan=False, allow_infinity=False))


@settings(max_examples=60, deadline=None)
@given(x=finite_f16, bits=st.sampled_from([2, 3, 4, 8]), G=st.sampled_from([4, 8, 16]),
       symmetric=st.booleans())
def test_error_at_most_half_step_and_deterministic(x, bits, G, symmetric):
    codes, scale, mn = quant.quantize(x, bits, G, axis=-1, symmetric=symmetric)
    codes2, scale2, mn2 = quant.quantize(x, bits, G, axis=-1, symmetric=symmetric)
    assert np.array_equal(codes, codes2) and np.array_equal(scale.view(np.uint16), scale2.view(np.uint16))
    xh = quant.dequantize(codes, scale, mn, G, axis=-1, out_dtype=np.float32).astype(np.float64)
    s = np.repeat(scale.astype(np.float64), G, axis=-1)
    m = np.repeat(mn.astype(np.float64), G, axis=-1)
    xf = x.astype(np.float64)
    # inside the representable range [mn_s, mn_s + qmax*scale_s] the error is at most half a step,
    # up to the fp32 rounding of the quotient and of the dequantization (a few ulps of |x|)
    q = (2 ** bits - 1) if not symmetric else (2 ** (bits - 1) - 1)
    lo, hi = (m, m + (2 ** bits - 1) * s) if not symmetric else (-q * s, q * s)
    inside = (xf >= lo) & (xf <= hi)
    slack = 4 * np.finfo(np.float32).eps * (np.abs(xf) + np.abs(m) + s)
    err = np.abs(xh - xf)
    assert np.all(err[inside] <= s[inside] / 2 + slack[inside])
    # outside (metadata rounding moved the range), the code saturates at the nearest end
    assert np.all(codes <= 2 ** bits - 1)


@settings(max_examples=40, deadline=None)
@given(x=finite_f16, bits=st.sampled_from([2, 4, 8]))
def test_requantizing_dequantized_values_is_stable(x, bits):
    """Dequantized values lie on the group's grid, so quantizing them again gives the same codes."""
    codes, scale, mn = quant.quantize(x, bits, 16, axis=-1)
    xh = quant.dequantize(codes, scale, mn, 16, axis=-1, out_dtype=np.float32)
    codes2, scale2, mn2 = quant.quantize(xh, bits, 16, axis=-1)
    same_meta = (scale2 == scale) & (mn2 == mn)                  # (..., n_groups)
    same_meta = np.repeat(same_meta, 16, axis=-1)
    assert np.array_equal(codes2[same_meta], codes[same_meta])


def test_quantile_refuses_nan_and_orders_inf():
    """Rule 8 (issue 36): NaN has no place in a sort; NumPy would put it last, as the largest value,
    and tau would silently move. inf is ordered and stays accepted."""
    a = np.array([[1.0, 2.0, 3.0, np.nan]], np.float32)
    with pytest.raises(ValueError, match=r"a contains 1 NaN value\(s\).*quantile"):
        quant.quantile(a, 0.5)
    with pytest.raises(ValueError, match="2 NaN"):
        quant.quantile(np.array([np.nan, 1, np.nan], np.float16), 1.0, axis=0)
    b = np.array([[1.0, 2.0, 3.0, np.inf]], np.float32)
    assert quant.quantile(b, 0.5)[0] == np.float32(2.5)
    assert quant.quantile(b, 0.9)[0] == np.inf                          # 3 + 0.7 (inf - 3)
    assert np.isnan(quant.quantile(b, 1.0)[0])                          # inf + 0 (inf - inf): IEEE, not finite
    # argument errors keep their order: a bad ratio is reported before the NaN
    with pytest.raises(ValueError, match="rho"):
        quant.quantile(a, 2.0)
    with pytest.raises(ValueError, match="non-finite"):                  # percentile_clip: NaN and inf
        quant.percentile_clip(b, 0.9)


def test_ratio_must_be_a_real_number():
    """Issue 36: a quantile ratio True is not 1, a string is not a number; the error names the argument."""
    a = np.array([[4.0, 1.0, 3.0, 2.0]], np.float32)
    for bad in (True, np.bool_(True), "0.5", None, 1j):
        with pytest.raises(TypeError, match="rho must be a real number"):
            quant.quantile(a, bad)
        with pytest.raises(TypeError, match="ratio must be a real number"):
            quant.percentile_clip(a, bad)
    with pytest.raises(ValueError, match=r"quantile ratio ratio=1\.5 must lie in \(0, 1\]"):
        quant.percentile_clip(a, 1.5)
    assert quant.quantile(a, np.float64(0.5))[0] == np.float32(2.5)      # NumPy scalars are real numbers
