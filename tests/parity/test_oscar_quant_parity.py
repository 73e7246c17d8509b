"""OSCAR's quantizer pieces, fast against reference, bit for bit (numerics contract, DESIGN.md section 2).

``kvq.fast.<backend>.quant.quantile`` / ``percentile_clip`` against ``kvq.reference.quant``, and the fused
token quantizer ``kvq.fast.<backend>.oscar_quant.quantize_tokens`` (Triton and CuPy) against
``kvq.reference.rotations.quantize_tokens`` + ``packing.pack`` (what the OSCAR cache stores). Odd shapes,
fp16 / bf16 / fp32 input, ties, constant rows, huge / tiny values, NaN / inf, G in {32, 64, 128}, clip
ratios {1.0, 0.96, 0.92}. CPU: the Triton interpreter; GPU: ``pytest -m gpu``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvq.fast as F
from kvq.reference import packing as RP
from kvq.reference import quant as RQ
from kvq.reference import rotations as RR

from .cases import as_bits, assert_bits_equal, to_torch, values

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _quant(backend):
    if "quantile" in F.NOT_YET_IMPLEMENTED.get(backend, {}).get("quant", {}):
        pytest.skip(f"{backend}: quantile / percentile_clip are listed in NOT_YET_IMPLEMENTED")
    return F.backend_module("quant", backend)


def _oscar_quant(backend):
    """The backend's own fused token quantizer: kvq.fast.<backend>.oscar_quant."""
    import importlib
    return importlib.import_module(f"kvq.fast.{backend}.oscar_quant")


def _rows(kind: str, shape, seed: int) -> np.ndarray:
    """float32 values whose rows (last axis) stress the quantile: ties, constants, zeros, extremes."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return (3 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "ties":                                   # few distinct values, many equal order statistics
        return (rng.integers(-3, 4, size=shape) * 0.5).astype(np.float32)
    if kind == "const":                                  # constant rows, +0.0 / -0.0 rows, one varying row
        x = np.repeat((3 * rng.standard_normal(shape[:-1] + (1,))).astype(np.float32), shape[-1], axis=-1)
        flat = x.reshape(-1, shape[-1])
        flat[0::4] = 0.0
        flat[1::4] = -0.0
        flat[2::4, ::3] = -0.0                           # most of the row zero: tau can be 0
        return x
    if kind == "huge":
        return rng.uniform(-6e4, 6e4, size=shape).astype(np.float32)
    if kind == "huge32":
        return (1e30 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "tiny":
        return (1e-6 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "denorm32":
        return (1e-39 * rng.standard_normal(shape)).astype(np.float32)
    raise ValueError(kind)


# (shape, axis, value kind, input dtype); rows of odd lengths (1, 5, 33, 96, 129) and odd row counts
QCASES = [
    ((3, 5, 96), -1, "normal", "fp16"),
    ((7, 129), 1, "ties", "bf16"),
    ((33, 5), 0, "const", "fp32"),
    ((2, 17, 3), 1, "huge", "fp16"),
    ((5, 64), -1, "huge32", "fp32"),
    ((4, 1, 40), -1, "tiny", "fp16"),
    ((6, 33), -1, "denorm32", "fp32"),
    ((9, 1), -1, "normal", "fp32"),
]
RHOS = (1.0, 0.96, 0.92, 0.5, 1e-9)


def _case(i):
    shape, axis, kind, dt = QCASES[i]
    x_t, x_np = to_torch(_rows(kind, shape, seed=i), DTYPES[dt], "cpu")
    return x_t, x_np, axis


@pytest.mark.parametrize("i", range(len(QCASES)), ids=[f"{c[2]}-{c[3]}-{'x'.join(map(str, c[0]))}" for c in QCASES])
def test_quantile(fast_target, i):
    backend, device = fast_target
    Q = _quant(backend)
    x_t, x_np, axis = _case(i)
    for rho in RHOS:
        t_f = Q.quantile(x_t.to(device), rho, axis)
        assert t_f.dtype == torch.float32 and t_f.device.type == device
        assert_bits_equal(t_f, RQ.quantile(x_np, rho, axis), f"quantile rho={rho}")


@pytest.mark.parametrize("i", range(len(QCASES)), ids=[f"{c[2]}-{c[3]}-{'x'.join(map(str, c[0]))}" for c in QCASES])
def test_percentile_clip(fast_target, i):
    backend, device = fast_target
    Q = _quant(backend)
    x_t, x_np, axis = _case(i)
    for rho in (1.0, 0.96, 0.92):
        c_f, t_f = Q.percentile_clip(x_t.to(device), rho, axis)
        c_r, t_r = RQ.percentile_clip(x_np, rho, axis)
        assert c_f.dtype == torch.float32 and c_f.is_contiguous()
        assert_bits_equal(t_f, t_r, f"tau rho={rho}")
        assert_bits_equal(c_f, c_r, f"clipped rho={rho}")


def _numpy_quantile(a: np.ndarray, rho) -> np.ndarray:
    """The quantile rule on NumPy's sort (NaN last): what the fast tier computes with validation off."""
    from kvq.fast import common as C
    from kvq.reference import numerics as nx

    s = np.sort(a, axis=-1)
    lo, hi, frac = C.quantile_index(a.shape[-1], rho)
    return nx.add(s[:, lo], nx.mul(np.float32(frac), nx.sub(s[:, hi], s[:, lo])))


def test_quantile_non_finite(fast_target):
    """The reference's quantile takes inf (ordered) and refuses NaN (rule 8, issue 36: a sort puts NaN last,
    as the largest value); the fast one gives the same bits and the same error, and with validation off
    sorts NaN last, as NumPy does."""
    from kvq.fast import common as C

    from .cases import assert_same_error

    backend, device = fast_target
    Q = _quant(backend)
    x = np.random.default_rng(4).standard_normal((6, 24)).astype(np.float32)
    x[2, 5] = np.inf
    x[3, 7] = -np.inf
    x[4, 2:4] = [np.inf, -np.inf]
    x[5, :] = np.inf
    x_t = torch.from_numpy(x).to(device)
    for rho in (1.0, 0.96, 0.5, 0.1, 1e-9):
        fast, ref = Q.quantile(x_t, rho, -1).cpu().numpy(), RQ.quantile(x, rho, -1)
        # a NaN's payload is the platform's (NumPy on x86: inf - inf = 0xffc00000; a GPU: 0x7fffffff):
        # NaN where the reference has NaN, the same bits everywhere else
        nan = np.isnan(ref)
        assert np.array_equal(np.isnan(fast), nan), f"quantile rho={rho}: NaN positions differ"
        assert_bits_equal(torch.from_numpy(fast[~nan]), ref[~nan], f"quantile rho={rho}")
    xn = x.copy()
    xn[0, 3] = np.nan
    xn[1, :20] = np.nan
    xn_t = torch.from_numpy(xn).to(device)
    assert_same_error(lambda: RQ.quantile(xn, 0.5, -1), lambda: Q.quantile(xn_t, 0.5, -1))
    with C.validation(False):
        for rho in (1.0, 0.96, 0.5, 0.1, 1e-9):
            fast, want = Q.quantile(xn_t, rho, -1).cpu().numpy(), _numpy_quantile(xn, rho)
            nan = np.isnan(want)
            assert np.array_equal(np.isnan(fast), nan), f"quantile rho={rho}, validation off: NaN positions"
            assert_bits_equal(torch.from_numpy(fast[~nan]), want[~nan], f"quantile rho={rho}, validation off")
    with pytest.raises(ValueError, match="non-finite"):
        RQ.percentile_clip(xn, 0.96)
    with pytest.raises(ValueError, match="non-finite"):
        Q.percentile_clip(xn_t, 0.96)


def test_long_rows_sorted_by_torch(fast_target, monkeypatch):
    """Rows longer than MAX_SORT take torch.sort: the same bits."""
    backend, device = fast_target
    Q = _quant(backend)
    monkeypatch.setattr(Q, "MAX_SORT", 16)
    x_t, x_np, axis = _case(0)
    assert_bits_equal(Q.quantile(x_t.to(device), 0.96, axis), RQ.quantile(x_np, 0.96, axis), "quantile")
    c_f, t_f = Q.percentile_clip(x_t.to(device), 0.92, axis)
    c_r, t_r = RQ.percentile_clip(x_np, 0.92, axis)
    assert_bits_equal(t_f, t_r, "tau")
    assert_bits_equal(c_f, c_r, "clipped")
    O = _oscar_quant(backend)
    q_f, s_f, m_f = O.quantize_tokens(x_t.to(device), 0.92, 32)
    c_r, s_r, m_r = RR.quantize_tokens(x_np, 0.92, 32)
    assert_bits_equal(q_f, RP.pack(c_r, 2, -1), "packed")
    assert_bits_equal(s_f, s_r, "scale")
    assert_bits_equal(m_f, m_r, "mn")


def test_tl_sort_path_under_the_interpreter(fast_target, monkeypatch):
    """The interpreter selects order statistics by rank (quant.INTERP_RANK); the GPU path, tl.sort, gives
    the same bits under the interpreter too (slow there: one small case)."""
    backend, device = fast_target
    Q = _quant(backend)
    if device != "cpu":
        pytest.skip("on the GPU every test already runs tl.sort")
    monkeypatch.setattr(Q, "INTERP_RANK", False)
    x_t, x_np = to_torch(_rows("ties", (3, 40), seed=2), torch.float16, device)
    assert_bits_equal(Q.quantile(x_t, 0.92, -1), RQ.quantile(x_np, 0.92, -1), "quantile")
    c_f, t_f = Q.percentile_clip(x_t, 0.96, -1)
    c_r, t_r = RQ.percentile_clip(x_np, 0.96, -1)
    assert_bits_equal(c_f, c_r, "clipped")
    x_t, x_np = to_torch(_rows("normal", (3, 64), seed=3), torch.bfloat16, device)
    c_r, s_r, m_r = RR.quantize_tokens(x_np, 0.92, 32)
    q_f, s_f, m_f = _oscar_quant(backend).quantize_tokens(x_t, 0.92, 32)
    assert_bits_equal(q_f, RP.pack(c_r, 2, -1), "packed")
    assert_bits_equal(s_f, s_r, "scale")
    assert_bits_equal(m_f, m_r, "mn")


# ----------------------------------------------------------------------------------------------------
# the fused token quantizer


def _token_input(kind, shape, G, dtype, seed):
    if kind == "ties":                                    # ties after scaling (exact at clip = 1.0)
        v = values("ties", shape, -1, G, 2, False, seed)
    else:
        v = _rows(kind, shape, seed)
    return to_torch(v, dtype, "cpu")


TOKEN_KINDS = [("normal", "fp16", "float16"), ("ties", "bf16", "float16"), ("const", "fp32", "float32"),
               ("huge", "fp32", "float16"), ("tiny", "fp16", "float16"), ("huge32", "fp32", "float32"),
               ("denorm32", "bf16", "float32"), ("normal", "bf16", "float32"), ("ties", "fp32", "float32")]


@pytest.mark.parametrize("clip", [1.0, 0.96, 0.92])
@pytest.mark.parametrize("G", [32, 64, 128])
def test_quantize_tokens(fast_target, G, clip):
    backend, device = fast_target
    O = _oscar_quant(backend)
    gi, ci = (32, 64, 128).index(G), (1.0, 0.96, 0.92).index(clip)
    kind, dt, meta = TOKEN_KINDS[3 * gi + ci]
    shape = (2, 3, 5, 128) if device == "cpu" else (3, 5, 129, 128)          # odd token counts
    x_t, x_np = _token_input(kind, shape, G, DTYPES[dt], seed=10 * gi + ci)
    x_t = x_t.to(device)
    c_r, s_r, m_r = RR.quantize_tokens(x_np, clip, G, 2, meta)
    q_f, s_f, m_f = O.quantize_tokens(x_t, clip, G, 2, meta)
    assert q_f.dtype == torch.uint8 and tuple(q_f.shape) == shape[:-1] + (32,)
    assert_bits_equal(q_f, RP.pack(c_r, 2, -1), f"packed ({kind}, {dt})")
    assert_bits_equal(s_f, s_r, "scale")
    assert_bits_equal(m_f, m_r, "mn")
    c_f, s_f2, m_f2 = O.quantize_tokens(x_t, clip, G, 2, meta, packed=False)
    assert_bits_equal(c_f, c_r, "codes (unpacked)")
    assert np.array_equal(as_bits(s_f2), as_bits(s_r)) and np.array_equal(as_bits(m_f2), as_bits(m_r))


@pytest.mark.parametrize("D,G,bits,packed", [(96, 32, 2, True), (160, 32, 4, True), (64, 64, 8, True),
                                            (40, 8, 3, False), (36, 6, 2, True), (256, 128, 2, True)])
def test_quantize_tokens_shapes_and_bits(fast_target, D, G, bits, packed):
    """Head dims that are not powers of two, G = D, other bit widths, a byte straddling two groups."""
    backend, device = fast_target
    O = _oscar_quant(backend)
    x_t, x_np = to_torch(_rows("normal", (7, D), seed=D + bits), torch.float16, device)
    c_r, s_r, m_r = RR.quantize_tokens(x_np, 0.92, G, bits)
    q_f, s_f, m_f = O.quantize_tokens(x_t, 0.92, G, bits, packed=packed)
    assert_bits_equal(q_f, RP.pack(c_r, bits, -1) if packed else c_r, "codes")
    assert_bits_equal(s_f, s_r, "scale")
    assert_bits_equal(m_f, m_r, "mn")


def test_quantize_tokens_matches_the_cache_bytes(fast_target):
    """The bytes the reference OSCAR cache writes into its pages for a token, from the fused kernel."""
    backend, device = fast_target
    O = _oscar_quant(backend)
    from kvq.reference import oscar as RO
    cfg = RO.OSCARConfig(sink=0, window=1, group_size=32, page_size=4, max_tokens=8)
    calib = RO.identity_calibration(64, clip_k=0.96, clip_v=0.92)
    st = RO.init(cfg, batch=1, kv_heads=2, head_dim=64)
    rng = np.random.default_rng(9)
    k = rng.standard_normal((1, 2, 5, 64)).astype(np.float16)
    v = rng.standard_normal((1, 2, 5, 64)).astype(np.float16)
    RO.append(cfg, calib, st, k, v)                                      # tokens 0..3 go to page 0
    pid = st.table[0, 0]
    for x, clip, codes, scale, mn in ((k, 0.96, st.k_codes, st.k_scale, st.k_mn),
                                      (v, 0.92, st.v_codes, st.v_scale, st.v_mn)):
        q_f, s_f, m_f = O.quantize_tokens(torch.from_numpy(x[0, :, :4]).to(device), clip, 32)
        assert_bits_equal(q_f, codes[pid], "page codes")
        assert_bits_equal(s_f, scale[pid], "page scale")
        assert_bits_equal(m_f, mn[pid], "page min")


# ----------------------------------------------------------------------------------------------------
# bad input


def test_errors(fast_target):
    backend, device = fast_target
    Q = _quant(backend)
    O = _oscar_quant(backend)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)).to(device)
    for fn in (Q.quantile, Q.percentile_clip):
        for bad in (0.0, 1.5, -0.1):
            with pytest.raises(ValueError, match="must lie in"):
                fn(x, bad)
        with pytest.raises(ValueError, match="empty axis"):
            fn(x[:, :0], 0.5)
        with pytest.raises(ValueError, match="out of range"):
            fn(x, 0.5, 2)
        for bad in (x.double(), x.to(torch.int32)):
            with pytest.raises(TypeError, match="dtype"):
                fn(bad, 0.5)
        with pytest.raises(TypeError, match="torch.Tensor"):
            fn(x.cpu().numpy(), 0.5)
    with pytest.raises(ValueError, match="must lie in"):
        O.quantize_tokens(x, 1.2, 32)
    with pytest.raises(ValueError, match="bits=3 codes cannot be packed"):
        O.quantize_tokens(x, 0.96, 32, 3)
    with pytest.raises(ValueError, match="bits=5 is not supported"):
        O.quantize_tokens(x, 0.96, 32, 5, packed=False)
    with pytest.raises(ValueError, match="does not divide"):
        O.quantize_tokens(x, 0.96, 48)
    with pytest.raises(ValueError, match="meta_dtype"):
        O.quantize_tokens(x, 0.96, 32, 2, "float64")
    with pytest.raises(ValueError, match="not a multiple of 4"):
        O.quantize_tokens(x[:, :6], 0.96, 6)
    with pytest.raises(ValueError, match="empty"):
        O.quantize_tokens(x[:, :0], 0.96, 32)
    with pytest.raises(TypeError, match="dtype"):
        O.quantize_tokens(x.double(), 0.96, 32)
    with pytest.raises(ValueError, match="overflows float16"):
        O.quantize_tokens(x * 1e5, 1.0, 32)
    with pytest.raises(ValueError, match="overflows float16"):
        RR.quantize_tokens(x.cpu().numpy() * 1e5, 1.0, 32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_quantize_tokens_non_finite(fast_target, bad):
    """NaN / inf raise as in the reference, also where the clip would have cut an inf to tau; with
    validation off the group's scale comes back NaN."""
    backend, device = fast_target
    O = _oscar_quant(backend)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    x[1, 40] = bad
    with pytest.raises(ValueError, match="non-finite"):
        RR.quantize_tokens(x, 0.92, 32)
    x_t = torch.from_numpy(x).to(torch.float16).to(device)
    with pytest.raises(ValueError, match="non-finite"):
        O.quantize_tokens(x_t, 0.92, 32)
    with F.validation(False):
        _, s, _ = O.quantize_tokens(x_t, 0.92, 32)
    s = s.float().cpu()
    assert torch.isnan(s[1, 1]) and torch.isfinite(s[[0, 2]]).all() and torch.isfinite(s[1, 0])
