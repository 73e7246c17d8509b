"""Contract rule 3's fp16 saturation (issue 36, item 4): dequantized values beyond the fp16 range become
+-65504, never inf, in every reference path that rounds dequantized values into fp16.

A group that holds the largest fp16 value has a scale rounded up to fp16, so the top code times the
scale (plus the min) can exceed 65504: ``quant.dequantize(*quant.quantize([[0, 65504, 1, 2]], 2, 4), 4,
out_dtype=np.float16)`` gave ``[0, inf, 0, 0]``. The rule: finite values beyond +-65504 saturate to
+-65504 (then within one quantization step of the input, as every other element); NaN stays NaN, inf
stays inf; bf16 and fp32 outputs are unchanged; fp16 values that were finite keep their bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvq.reference import bitdecoding as bd
from kvq.reference import bitdecoding_lanes as bl
from kvq.reference import fragments as fr
from kvq.reference import higgs, packing, quant
from kvq.reference import numerics as nx

F16_MAX = 65504.0
BITS = (2, 3, 4, 8)


def _bits16(a) -> np.ndarray:
    return np.asarray(a, np.float16).view(np.uint16)


# ---------------------------------------------------------------------------------------------------
# numerics.to_out


def test_to_out_saturates_finite_values_only():
    x = np.array([70000.0, -70000.0, 65519.99, 65520.0, -65520.0, 3.0e38, np.inf, -np.inf, np.nan, 1.0,
                  65504.0, -65504.0], np.float32)
    y = nx.to_out(x, np.float16)
    assert y.dtype == np.float16
    want = [F16_MAX, -F16_MAX, F16_MAX, F16_MAX, -F16_MAX, F16_MAX, np.inf, -np.inf, np.nan, 1.0, F16_MAX, -F16_MAX]
    np.testing.assert_array_equal(y.astype(np.float32), np.array(want, np.float32))
    assert np.isnan(y[8])


def test_to_out_keeps_every_finite_fp16_bit():
    """Saturation changes only values that rounded to inf: elsewhere to_out is the plain RNE cast."""
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(100_000).astype(np.float32) * np.float32(3e4),
        rng.uniform(-65520, 65520, 100_000).astype(np.float32),
        np.nextafter(np.float32(65520), np.float32(0)) * np.ones(1, np.float32),
        (rng.standard_normal(10_000) * 1e-6).astype(np.float32),        # fp16 subnormals
    ])
    with np.errstate(over="ignore"):
        plain = x.astype(np.float16)
    fin = np.isfinite(plain)
    y = nx.to_out(x, np.float16)
    assert fin.sum() > 200_000 and (~fin).sum() > 100                # both sides are exercised
    assert np.array_equal(_bits16(y)[fin], plain.view(np.uint16)[fin])
    assert np.array_equal(y[~fin].astype(np.float32), np.copysign(np.float32(F16_MAX), x[~fin]))


def test_to_out_leaves_bf16_and_fp32_alone():
    x = np.array([1.0e5, -3.0e38, np.inf, np.nan], np.float32)
    np.testing.assert_array_equal(nx.to_out(x, np.float32), x)
    np.testing.assert_array_equal(nx.to_out(x, "bfloat16"), nx.round_to_bf16(x))
    assert nx.to_out(x, "bfloat16")[0] > F16_MAX


def test_saturate_f16_is_identity_in_range():
    x = np.array([0.0, -0.0, 1.5, -65504.0, 65504.0, 65510.0], np.float32)
    y = nx.saturate_f16(x)
    assert y.dtype == np.float32 and np.array_equal(y.view(np.uint32)[:5], x.view(np.uint32)[:5])
    assert y[5] == np.float32(F16_MAX) and np.float16(x[5]) == np.float16(F16_MAX)   # same fp16 either way


# ---------------------------------------------------------------------------------------------------
# quant.dequantize / packing.unpack_dequantize


def test_the_issue_example():
    x = np.array([[0, 65504, 1, 2]], np.float16)
    codes, scale, mn = quant.quantize(x, 2, 4)
    assert float(scale[0, 0]) * 3 > F16_MAX                            # the cause: scale rounded up
    y = quant.dequantize(codes, scale, mn, 4, out_dtype=np.float16)
    assert np.isfinite(y).all()
    assert y[0, 1] == np.float16(F16_MAX)
    np.testing.assert_array_equal(y.astype(np.float32), [[0, F16_MAX, 0, 0]])


def _groups_with_extremes():
    """Rows (groups of 8) that hold +-65504 beside ordinary values, the case of the issue and worse."""
    rng = np.random.default_rng(1)
    rows = [
        [0, 65504, 1, 2, 3, 4, 5, 6],
        [-65504, 0, 1, 2, 3, 4, 5, 6],
        [-65504, 65504, 0, 1, -1, 7, 100, -100],
        [65504] * 8,
        [-65504] * 8,
        [65504, 65504, 65504, 65503.9, 60000, 61000, 62000, 63000],
        list(rng.uniform(-65504, 65504, 7)) + [65504],
        list(rng.uniform(-65504, 65504, 7)) + [-65504],
    ]
    return np.array(rows, np.float32).astype(np.float16)


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("bits", BITS)
def test_extreme_groups_dequantize_finite_within_one_step(bits, symmetric):
    """Symmetric groups holding 65504 need float32 metadata (their min -2**(b-1) scale overflows fp16)."""
    x = _groups_with_extremes()
    meta = np.float32 if symmetric else np.float16
    codes, scale, mn = quant.quantize(x, bits, 8, meta_dtype=meta, symmetric=symmetric)
    y = quant.dequantize(codes, scale, mn, 8, out_dtype=np.float16)
    assert np.isfinite(y).all(), (bits, symmetric)
    step = scale.astype(np.float32)                                    # (8, 1): one step per group
    err = np.abs(y.astype(np.float32) - x.astype(np.float32))
    assert (err <= step + 32).all()                                    # + half an fp16 ulp at 65504
    # the fp32 output holds the unsaturated values; fp16 is its saturation, bit for bit
    y32 = quant.dequantize(codes, scale, mn, 8, out_dtype=np.float32)
    assert np.array_equal(_bits16(y), _bits16(nx.to_out(y32, np.float16)))
    if not symmetric and bits < 8:
        assert (np.abs(y32) > F16_MAX).any()                           # the case is really exercised
    if symmetric:                                                      # the refusal that stays (to_meta)
        with pytest.raises(ValueError, match="overflows float16 metadata"):
            quant.quantize(x, bits, 8, symmetric=True)


@pytest.mark.parametrize("bits", BITS)
def test_every_bit_width_issue_rows(bits):
    """The issue says: at every bit width. Per-channel keys too (groups along axis 0)."""
    x = np.array([[0, 65504, 1, 2]] * 8, np.float16).T.copy()           # (4, 8): groups of 4 along axis 0
    codes, scale, mn = quant.quantize(x, bits, 4, axis=0)
    y = quant.dequantize(codes, scale, mn, 4, axis=0, out_dtype=np.float16)
    assert np.isfinite(y).all() and (y[1] == np.float16(F16_MAX)).all()


def test_negative_saturation_and_nan_with_given_metadata():
    """Metadata given by hand (dequantize takes any): a negative overflow saturates to -65504, a NaN
    scale still dequantizes to NaN, an inf scale to inf (never silently finite)."""
    codes = np.array([[3, 3, 0, 1]], np.uint8)
    scale = np.array([[-30000.0]], np.float16)
    mn = np.array([[0.0]], np.float16)
    y = quant.dequantize(codes, scale, mn, 4, out_dtype=np.float16)
    np.testing.assert_array_equal(y.astype(np.float32), [[-F16_MAX, -F16_MAX, 0, -30000]])
    y = quant.dequantize(codes, np.array([[np.nan]], np.float16), mn, 4, out_dtype=np.float16)
    assert np.isnan(y).all()
    y = quant.dequantize(codes, np.array([[np.inf]], np.float32), np.array([[0.0]], np.float32), 4,
                         out_dtype=np.float16)
    assert np.isinf(y[0, :2]).all() and np.isnan(y[0, 2])                # 0 * inf = NaN, as before


def test_bf16_and_fp32_outputs_unchanged():
    x = np.array([[0, 65504, 1, 2]], np.float16)
    codes, scale, mn = quant.quantize(x, 2, 4)
    y32 = quant.dequantize(codes, scale, mn, 4, out_dtype=np.float32)
    want = np.float32(3) * scale.astype(np.float32)[0, 0] + mn.astype(np.float32)[0, 0]
    assert y32[0, 1] == want and want > F16_MAX
    assert quant.dequantize(codes, scale, mn, 4, out_dtype="bfloat16")[0, 1] == nx.round_to_bf16(want)


@pytest.mark.parametrize("bits", (2, 4, 8))
def test_unpack_dequantize_saturates(bits):
    x = _groups_with_extremes()
    packed, scale, mn = packing.quantize_pack(x, bits, 8)
    y = packing.unpack_dequantize(packed, scale, mn, bits, 8, out_dtype=np.float16)
    codes, s2, m2 = quant.quantize(x, bits, 8)
    assert np.isfinite(y).all()
    assert np.array_equal(_bits16(y), _bits16(quant.dequantize(codes, s2, m2, 8, out_dtype=np.float16)))


# ---------------------------------------------------------------------------------------------------
# HIGGS, BitDecoding


def test_higgs_dequantize_fp16_saturates():
    cfg = higgs.HiggsConfig(d=2, n=16, group_size=64)
    x = np.zeros((2, 64), np.float32)
    x[0, 0] = 65504.0
    x[1] = 65504.0
    idx, scale = higgs.quantize(cfg, x.astype(np.float16))
    y32 = higgs.dequantize(cfg, idx, scale, 64, out_dtype=np.float32)
    y16 = higgs.dequantize(cfg, idx, scale, 64, out_dtype=np.float16)
    assert np.isfinite(y16).all()
    assert np.array_equal(_bits16(y16), _bits16(nx.to_out(y32, np.float16)))


def _bd_small(bits, k_mode):
    n_r = bd.residual_block_size(bits, 1)
    return bd.BitDecodingConfig(bits=bits, k_mode=k_mode, warps_n=1, k_group=min(32, n_r) if k_mode == "channel"
                                else 32, v_group=32, max_tokens=4 * n_r)


def _extreme_page(cfg, D=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((cfg.n_r, D)).astype(np.float32)
    x[0, :] = 65504.0                                # a token at the top of the fp16 range
    x[:, 5] = 65504.0                                # a channel likewise
    x[3, 7], x[9, 2] = -65504.0, 65504.0
    return x.astype(np.float16)


@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("k_mode", ("channel", "tensor"))
def test_bitdecoding_page_and_lanes_saturate(bits, k_mode):
    """dequantize_page (the fp16 operands of mma) is finite on a page holding +-65504, and the lane-by-lane
    emulation (ldmatrix, lop3, dequantization) gives each lane the same saturated fp16 bits."""
    cfg = _bd_small(bits, k_mode)
    D = 64
    k, v = _extreme_page(cfg, D, 1), _extreme_page(cfg, D, 2)
    kw, kp = bd.pack_keys(cfg, k)
    vw, vp = bd.pack_values(cfg, v)
    K, V = bd.dequantize_page(cfg, kw, kp, vw, vp)
    assert np.isfinite(K).all() and np.isfinite(V).all()
    assert (K == np.float16(F16_MAX)).any() and (V == np.float16(F16_MAX)).any()
    rows, cols = fr.table("b")[..., 0], fr.table("b")[..., 1]
    R = cfg.per_word
    for i in range(R):
        for kk in range(D // 16):
            got = bl.key_fragments(cfg, kw, kp, 0, i, kk)
            want = K[8 * i + cols, 16 * kk + rows]
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (i, kk)
    for kk in range(cfg.n_r // 16):
        for j in range(D // 8):
            got = bl.value_fragments(cfg, vw, vp, kk, j)
            assert np.array_equal(got.view(np.uint16), V[16 * kk + rows, 8 * j + cols].view(np.uint16)), (kk, j)


def test_bitdecoding_decode_over_extreme_keys_is_finite():
    """The issue: the cache handed the decode inf keys and it raised an error blaming k. Now the packed
    page dequantizes to finite fp16 and the attention output is finite."""
    cfg = _bd_small(2, "channel")
    D = 64
    st = bd.init(cfg, 1, 1, D)
    k = _extreme_page(cfg, D, 3)[None, None]                         # (1, 1, N_r, D): one full page
    v = _extreme_page(cfg, D, 4)[None, None]
    st = bd.append(cfg, st, k, v)
    assert st.length == cfg.n_r and bd.partition(st.length, cfg.n_r) == (cfg.n_r, 0)
    q = np.random.default_rng(5).standard_normal((1, 2, 1, D)).astype(np.float32) * np.float32(1e-6)
    out, lse = bd.decode_attention(cfg, st, q)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    K, V = bd.dequantize(cfg, st)
    assert np.isfinite(K).all() and np.isfinite(V).all()
