"""Issue 36, item 4: the fast tiers saturate fp16 dequantization at +-65504 (contract rule 3) as the
reference does, bit for bit, and item 9: their boundary checks give the reference's errors.

Groups that hold +-65504 have a scale rounded up to fp16, so the top code times the scale plus the min
can exceed the fp16 range: the reference's ``numerics.to_out`` saturates such values to +-65504 (NaN
and inf pass), and so must every kernel that rounds a dequantized value to fp16: ``quant.dequantize``
(rows and columns kernels), ``packing.unpack_dequantize``, ``higgs.dequantize``, BitDecoding's
``dequantize_page`` and the fused BitDecoding decode (its fp16 operands of ``tl.dot`` / ``mma``; the
CUDA kernel's one-fma path must route such pages to its fp32 path, tests/fast/test_bitdecoding_fma_rule).

Targets: ``fast_target`` (Triton under the interpreter on the CPU; Triton and CuPy on the GPU with
``pytest -m gpu``).
"""

from __future__ import annotations

import importlib
import types

import numpy as np
import pytest
import torch

from kvq.fast import common as C
from kvq.reference import bitdecoding as RB
from kvq.reference import higgs as RG
from kvq.reference import numerics as nx
from kvq.reference import packing as RP
from kvq.reference import quant as RQ

from .cases import assert_bits_equal, assert_same_error
from .tolerance import check_close

F16_MAX = 65504.0
_TORCH_OUT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _fast(module: str, backend: str):
    return importlib.import_module(f"kvq.fast.{backend}.{module}")


def _t(a: np.ndarray, device: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def extreme_groups(n_rows: int = 8, G: int = 8, seed: int = 0) -> np.ndarray:
    """(n_rows * 2, G) fp16 rows, each a group: +-65504 beside ordinary values, full-range groups,
    constant groups at the limits, and random rows with one extreme."""
    rng = np.random.default_rng(seed)
    fixed = [
        [0, 65504, 1, 2] + [3] * (G - 4),
        [-65504, 0, 1, 2] + [3] * (G - 4),
        [-65504, 65504] + [0] * (G - 2),
        [65504] * G,
        [-65504] * G,
        [65504, 60000] + [61000] * (G - 2),
    ]
    rnd = [list(rng.uniform(-65504, 65504, G - 1)) + [65504 * (-1) ** i] for i in range(2 * n_rows - len(fixed))]
    return np.array(fixed + rnd, np.float32).astype(np.float16)


def _layout(x: np.ndarray, layout: str):
    """(rows, G) groups as an array and the axis its groups run along: "last" (rows kernel), "middle"
    (columns kernel: groups of G along axis 1 of a (2, G, rows / 2) array)."""
    if layout == "last":
        return x, -1
    r, G = x.shape
    return np.ascontiguousarray(x.reshape(2, r // 2, G).transpose(0, 2, 1)), 1


# ---------------------------------------------------------------------------------------------------
# quant.dequantize, packing.unpack_dequantize


@pytest.mark.parametrize("out", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["last", "middle"])
def test_dequantize_saturates_as_the_reference(fast_target, layout, bits, out):
    backend, device = fast_target
    Q = _fast("quant", backend)
    x, axis = _layout(extreme_groups(), layout)
    c_r, s_r, m_r = RQ.quantize(x, bits, 8, axis)
    c_f, s_f, m_f = Q.quantize(_t(x, device), bits, 8, axis)
    assert_bits_equal(c_f, c_r, "codes")
    assert_bits_equal(s_f, s_r, "scale")
    assert_bits_equal(m_f, m_r, "mn")
    d_r = RQ.dequantize(c_r, s_r, m_r, 8, axis, out)
    d_f = Q.dequantize(c_f, s_f, m_f, 8, axis, out)
    assert d_f.dtype == _TORCH_OUT[out]
    assert_bits_equal(d_f, d_r, f"dequantized ({out})")
    if out == "float16":
        assert np.isfinite(d_r).all() and bool(torch.isfinite(d_f).all())
        if bits < 8:                                                  # the fp32 values do leave the range
            assert (np.abs(RQ.dequantize(c_r, s_r, m_r, 8, axis, np.float32)) > F16_MAX).any()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("layout", ["last", "middle"])
def test_unpack_dequantize_saturates_as_the_reference(fast_target, layout, bits):
    backend, device = fast_target
    P = _fast("packing", backend)
    x, axis = _layout(extreme_groups(seed=1), layout)
    p_r, s_r, m_r = RP.quantize_pack(x, bits, 8, axis)
    p_f, s_f, m_f = P.quantize_pack(_t(x, device), bits, 8, axis)
    assert_bits_equal(p_f, p_r, "packed")
    d_r = RP.unpack_dequantize(p_r, s_r, m_r, bits, 8, axis, np.float16)
    d_f = P.unpack_dequantize(p_f, s_f, m_f, bits, 8, axis, np.float16)
    assert np.isfinite(d_r).all()
    assert_bits_equal(d_f, d_r, "unpack_dequantize (float16)")


def test_hand_made_metadata_negative_nan_inf(fast_target):
    """dequantize takes any metadata: a negative overflow saturates to -65504; NaN stays NaN and inf
    stays inf (never silently finite), bit for bit with the reference where finite."""
    backend, device = fast_target
    Q = _fast("quant", backend)
    codes = np.array([[3, 3, 0, 1], [3, 2, 1, 0], [3, 0, 1, 2]], np.uint8)
    scale = np.array([[-30000.0], [np.nan], [np.inf]], np.float32)
    mn = np.array([[0.0], [0.0], [1.0]], np.float32)
    d_r = RQ.dequantize(codes, scale, mn, 4, out_dtype=np.float16)
    d_f = Q.dequantize(_t(codes, device), _t(scale, device), _t(mn, device), 4, out_dtype=np.float16)
    np.testing.assert_array_equal(d_r[0].astype(np.float32), [-F16_MAX, -F16_MAX, 0, -30000])
    got = d_f.cpu().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(d_r)) and np.isnan(d_r[1]).all()
    assert np.array_equal(np.isinf(got), np.isinf(d_r)) and np.isinf(d_r[2, [0, 2, 3]]).all()
    fin = np.isfinite(d_r)
    assert np.array_equal(got.view(np.uint16)[fin], d_r.view(np.uint16)[fin])


def test_nan_input_stays_nan_with_validation_off(fast_target):
    """With validation off a NaN group quantizes to a NaN scale and dequantizes to NaN, not to 65504."""
    backend, device = fast_target
    Q = _fast("quant", backend)
    x = extreme_groups()
    x[2, 3] = np.nan
    with C.validation(False):
        c_f, s_f, m_f = Q.quantize(_t(x, device), 2, 8)
        d = Q.dequantize(c_f, s_f, m_f, 8, out_dtype=np.float16).cpu().numpy()
    assert np.isnan(d[2]).all()
    assert np.isfinite(np.delete(d, 2, axis=0)).all()


# ---------------------------------------------------------------------------------------------------
# HIGGS, BitDecoding


def test_higgs_dequantize_fp16_saturates(fast_target):
    backend, device = fast_target
    G = _fast("higgs", backend)
    cfg = RG.HiggsConfig(d=2, n=16, group_size=64)
    x = np.zeros((3, 64), np.float16)
    x[0, 0] = 65504
    x[1] = 65504
    x[2, ::2] = -65504
    idx, scale = RG.quantize(cfg, x)
    d_r = RG.dequantize(cfg, idx, scale, 64, out_dtype=np.float16)
    assert np.isfinite(d_r).all()
    assert (np.abs(RG.dequantize(cfg, idx, scale, 64, out_dtype=np.float32)) > F16_MAX).any()
    d_f = G.dequantize(cfg, _t(idx, device), _t(scale, device), 64, out_dtype=np.float16)
    assert_bits_equal(d_f, d_r, "higgs dequantize (float16)")


def _bd_cfg(bits, k_mode, device):
    """Small pages under the interpreter; the paper's configurations (D = 128) on the GPU."""
    if device == "cpu":
        n_r = RB.residual_block_size(bits, 1)
        return RB.BitDecodingConfig(bits=bits, k_mode=k_mode, warps_n=1, v_group=64, max_tokens=4 * n_r,
                                    k_group=min(32, n_r) if k_mode == "channel" else 64), 64
    return RB.CONFIGS[f"BitDecoding-K{k_mode[0].upper()}{bits}"], 128


def extreme_page(cfg, D, lead=(), seed=0) -> np.ndarray:
    """A (*lead, N_r, D) fp16 page: N(0, 1) with a token and a channel of 65504, two single extremes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, cfg.n_r, D)).astype(np.float32)
    x[..., 0, :] = 65504.0
    x[..., :, 5] = 65504.0
    x[..., 3, 7], x[..., 9, 2] = -65504.0, 65504.0
    return x.astype(np.float16)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("k_mode", ["channel", "tensor"])
def test_bitdecoding_dequantize_page_saturates(fast_target, bits, k_mode):
    backend, device = fast_target
    BD = _fast("bitdecoding", backend)
    cfg, D = _bd_cfg(bits, k_mode, device)
    k, v = extreme_page(cfg, D, (2,), 1), extreme_page(cfg, D, (2,), 2)
    kw, kp = RB.pack_keys(cfg, k)
    vw, vp = RB.pack_values(cfg, v)
    K, V = RB.dequantize_page(cfg, kw, kp, vw, vp)
    assert np.isfinite(K).all() and np.isfinite(V).all() and (K == np.float16(F16_MAX)).any()
    fkw, fkp = BD.pack_keys(cfg, _t(k, device))
    fvw, fvp = BD.pack_values(cfg, _t(v, device))
    assert_bits_equal(fkw, kw, "k_words")
    assert_bits_equal(fkp, kp, "k_params")
    fK, fV = BD.dequantize_page(cfg, fkw, fkp, fvw, fvp)
    assert_bits_equal(fK, K, "K page")
    assert_bits_equal(fV, V, "V page")


def _state_to_torch(st, device):
    fields = {n: torch.from_numpy(np.ascontiguousarray(a)).to(device) for n, a in st.arrays().items()}
    return types.SimpleNamespace(**fields, length=st.length, next_page=st.next_page, shape=tuple(st.shape))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("k_mode", ["channel", "tensor"])
def test_bitdecoding_fused_decode_over_saturated_pages(fast_target, bits, k_mode):
    """The issue: the Triton decode returned NaN over a page holding 65504 (inf fp16 operands). The fused
    decode attends the saturated operands: finite, within contract rule 7 of the reference."""
    backend, device = fast_target
    BDD = _fast("bitdecoding_decode", backend)
    cfg, D = _bd_cfg(bits, k_mode, device)
    B, H = 1, 2
    st = RB.init(cfg, B, H, D)
    k = np.broadcast_to(extreme_page(cfg, D, (), 3), (B, H, cfg.n_r, D))
    v = np.broadcast_to(extreme_page(cfg, D, (), 4), (B, H, cfg.n_r, D))
    RB.append(cfg, st, np.ascontiguousarray(k), np.ascontiguousarray(v))
    rng = np.random.default_rng(5)
    q32 = (rng.standard_normal((B, 2 * H, 1, D)) * 1e-5).astype(np.float32)
    q = torch.from_numpy(q32).to(torch.float16).to(device)
    fs = _state_to_torch(st, device)
    assert BDD.supported(cfg, fs, q)
    out, lse = BDD.decode(cfg, fs, q)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    qr = q.cpu().float().numpy()
    o64, l64 = RB.decode_attention(cfg, st, qr.astype(np.float64))
    o32, l32 = RB.decode_attention(cfg, st, qr)
    check_close(out, o64, o32, torch.float16, "out")
    check_close(lse, l64, l32, torch.float32, "lse")


# ---------------------------------------------------------------------------------------------------
# item 9: the fast boundary gives the reference's errors


def test_quantile_refuses_nan_as_the_reference(fast_target):
    backend, device = fast_target
    Q = _fast("quant", backend)
    a = np.array([[1.0, 2.0, 3.0, np.nan], [4.0, np.nan, 5.0, 6.0]], np.float32)
    assert_same_error(lambda: RQ.quantile(a, 0.5), lambda: Q.quantile(_t(a, device), 0.5))
    with C.validation(False):                                    # off: NaN sorts last, as NumPy's sort
        tau = Q.quantile(_t(a, device), 0.5).cpu().numpy()
    assert tau[0] == np.float32(2.5) and tau[1] == np.float32(5.5)
    b = np.array([[1.0, 2.0, 3.0, np.inf]], np.float32)
    assert_bits_equal(Q.quantile(_t(b, device), 0.5), RQ.quantile(b, 0.5), "quantile with inf")


def test_higgs_errors_are_the_references(fast_target):
    backend, device = fast_target
    G = _fast("higgs", backend)
    for shape in ((2, 3), (5,), (4, 12)):
        xg = np.ones(shape, np.float32)
        assert_same_error(lambda: RG.group_sum_of_squares(xg), lambda: G.group_sum_of_squares(_t(xg, device)))
    grid = RG.load_grid(2, 16)
    for v, g in ((np.zeros((3, 3), np.float32), grid), (np.zeros((3, 2), np.float32), np.zeros((0, 2), np.float32))):
        assert_same_error(lambda: RG.nearest(v, g), lambda: G.nearest(_t(v, device), g))
    with pytest.raises(TypeError, match="float32"):
        G.nearest(_t(np.zeros((3, 2)), device), grid)
    with pytest.raises(TypeError, match="float32"):
        RG.nearest(np.zeros((3, 2)), grid)


def test_a_cpu_tensor_error_names_the_interpreter():
    """Issue 36: 'x is on cpu; expected a CUDA device' now says how Triton takes CPU tensors."""
    with pytest.raises(ValueError, match=r"x is on cpu; expected a CUDA device .*TRITON_INTERPRET=1"):
        C.check_tensor(torch.zeros(2), "x")
    with pytest.raises(ValueError, match=r"x is on cpu; expected a CUDA device .*interpreter"):
        C.check_float(torch.zeros(2), "x")


# ---------------------------------------------------------------------------------------------------
# attention outputs: the merge's last rounding to fp16 saturates too (a softmax average of values at
# +-65504 may round past it in fp32: its fp16 weights need not sum to exactly 1)


def test_fast_to_out_saturates_as_the_reference():
    x = np.array([7e4, -7e4, 65519.0, 65520.0, -65536.0, np.nan, np.inf, -np.inf, 1.5, 0.0, -0.0], np.float32)
    for dt in ("float16", "float32"):
        got = C.to_out(torch.from_numpy(x), dt)
        assert got.dtype == _TORCH_OUT[dt]
        assert_bits_equal(got, nx.to_out(x, dt), f"to_out {dt}")
    got = C.to_out(torch.from_numpy(x), torch.bfloat16).float().numpy()   # bf16: a plain rounding (NaN payloads
    assert np.array_equal(got, nx.to_out(x, "bfloat16"), equal_nan=True)  # differ between torch and NumPy)


def test_fast_decode_query_nan_is_refused_while_validating(fast_target):
    """Rule 8 at the fast decode's boundary, as the reference: NaN / inf in q raise while validation is on (a
    device read). With validation off (a model's hot path) the other rows are unaffected; the NaN row is NaN on
    Triton, while CuPy's kernels (whose running max skips NaN scores) may give it zeros: what validation
    catches."""
    backend, device = fast_target
    K = _fast("kivi", backend)
    from kvq.reference import kivi as RK
    cfg = RK.KIVIConfig(group_size=32, residual=16, max_tokens=128)
    st = K.init(cfg, 1, 2, 64, device=device)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(1, 2, 70, 64, generator=g).half().to(device)
    K.append(cfg, st, kv, kv.clone())
    q = torch.randn(1, 4, 1, 64, generator=g).half().to(device)
    q[0, 1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"q contains non-finite values \(1 NaN, 0 inf\)"):
        K.decode_attention(cfg, st, q)
    with C.validation(False):
        out, _ = K.decode_attention(cfg, st, q)
    assert bool(torch.isfinite(out[0, 0]).all()) and bool(torch.isfinite(out[0, 2:]).all())
    if backend == "triton":
        assert bool(torch.isnan(out[0, 1]).all())
