"""kvq.fast.<backend>.quant against kvq.reference.quant, bit for bit (numerics contract, DESIGN.md section 2).

Every case runs the reference on NumPy and the fast tier on torch (through the interpreter on the CPU,
on CUDA with ``pytest -m gpu``) and compares codes, scale / min bits and dequantized bits. The axes:
layout (last / middle / first axis) x bits (2, 3, 4, 8) x symmetric x value kind (cases.KINDS);
input dtype, metadata dtype and output dtype rotate over the cases so that each kind meets each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvq.fast as F
from kvq.reference import quant as RQ

from .cases import (DTYPES, KINDS, LAYOUTS, assert_bits_equal, make_input, meta_for, shape_for,
                    to_torch)

BITS = (2, 3, 4, 8)
OUTS = ("float16", "bfloat16", "float32")
_TORCH_OUT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_TORCH_META = {np.float16: torch.float16, np.float32: torch.float32}


def _quant(backend):
    return F.backend_module("quant", backend)


def run_quantize_case(mod, device, layout, bits, symmetric, kind, dtype, meta, out, seed=0):
    """Quantize and dequantize one case with both tiers and compare every stored bit."""
    shape, axis, G = shape_for(layout, device)
    x_t, x_np = make_input(kind, shape, axis, G, bits, symmetric, dtype, device, seed=seed)
    c_r, s_r, m_r = RQ.quantize(x_np, bits, G, axis, meta, symmetric=symmetric)
    c_f, s_f, m_f = mod.quantize(x_t, bits, G, axis, meta, symmetric=symmetric)
    assert c_f.dtype == torch.uint8 and c_f.device.type == device
    assert s_f.dtype == _TORCH_META[meta] and m_f.dtype == _TORCH_META[meta]
    assert_bits_equal(c_f, c_r, "codes")
    assert_bits_equal(s_f, s_r, "scale")
    assert_bits_equal(m_f, m_r, "mn")
    d_r = RQ.dequantize(c_r, s_r, m_r, G, axis, out)
    d_f = mod.dequantize(c_f, s_f, m_f, G, axis, out)
    assert d_f.dtype == _TORCH_OUT[out]
    assert_bits_equal(d_f, d_r, f"dequantized ({out})")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_dequantize(fast_target, layout, bits, symmetric, kind):
    backend, device = fast_target
    li, bi, si, ki = LAYOUTS.index(layout), BITS.index(bits), int(symmetric), KINDS.index(kind)
    dtype = DTYPES[(li + bi + 2 * si + ki) % 3]
    out = OUTS[(li + 2 * bi + si + ki) % 3]
    meta = meta_for(kind, li + bi + si)
    run_quantize_case(_quant(backend), device, layout, bits, symmetric, kind, dtype, meta, out,
                      seed=li * 100 + bi * 10 + si + 1000 * ki)


@pytest.mark.parametrize("out", OUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dequantize_any_codes(fast_target, layout, out):
    """Dequantize takes any uint8 code (0..255) with any float16 / float32 metadata, as the reference does."""
    backend, device = fast_target
    shape, axis, G = shape_for(layout, device)
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 256, size=shape).astype(np.uint8)
    mshape = list(shape)
    mshape[axis] //= G
    scale = (rng.standard_normal(mshape) * 0.1).astype(np.float16)       # negative scales too
    mn = (rng.standard_normal(mshape) * 4).astype(np.float32)             # mixed metadata dtypes
    d_r = RQ.dequantize(codes, scale, mn, G, axis, out)
    d_f = _quant(backend).dequantize(torch.from_numpy(codes).to(device), torch.from_numpy(scale).to(device),
                                     torch.from_numpy(mn).to(device), G, axis, out)
    assert_bits_equal(d_f, d_r, f"dequantized ({out})")


@pytest.mark.parametrize("variant", ["ties-bf16-2bit", "normal-fp32-3bit"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("layout", ["last", "middle"])
def test_chunked_groups(fast_target, monkeypatch, layout, symmetric, variant):
    """Groups too large for one tile (two passes over the input) give the same bits (Triton only)."""
    backend, device = fast_target
    if backend != "triton":
        pytest.skip("tile sizes are a Triton backend detail")
    from kvq.fast.triton import packing as TP
    from kvq.fast.triton import quant as TQ
    monkeypatch.setattr(TQ, "MAX_SINGLE", 8)           # any group over 8 elements is chunked ...
    monkeypatch.setattr(TQ, "TILE", 8)                 # ... in chunks of 8 / PER bytes (rows)
    monkeypatch.setattr(TQ, "TILE_COLS", 8)            # ... or 8 elements (columns)
    kind, dt, bits = variant.split("-")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    bits = int(bits[0])
    shape, axis = ((3, 64), -1) if layout == "last" else ((2, 64, 3), 1)
    x_t, x_np = make_input(kind, shape, axis, 32, bits, symmetric, dtype, device, seed=5)
    c_r, s_r, m_r = RQ.quantize(x_np, bits, 32, axis, symmetric=symmetric)
    c_f, s_f, m_f = TQ.quantize(x_t, bits, 32, axis, symmetric=symmetric)
    assert_bits_equal(c_f, c_r, "codes")
    assert_bits_equal(s_f, s_r, "scale")
    assert_bits_equal(m_f, m_r, "mn")
    if bits == 2:
        from kvq.reference import packing as RP
        p_f, _, _ = TP.quantize_pack(x_t, bits, 32, axis, symmetric=symmetric)
        assert_bits_equal(p_f, RP.pack(c_r, bits, axis), "packed")


def test_whole_axis_group(fast_target):
    """group_size=None quantizes the whole axis as one group."""
    backend, device = fast_target
    x_t, x_np = to_torch(np.random.default_rng(3).standard_normal((6, 50)).astype(np.float32),
                         torch.float16, device)
    for axis in (0, 1):
        c_r, s_r, m_r = RQ.quantize(x_np, 4, None, axis)
        c_f, s_f, m_f = _quant(backend).quantize(x_t, 4, None, axis)
        assert_bits_equal(c_f, c_r, "codes")
        assert_bits_equal(s_f, s_r, "scale")
        assert_bits_equal(m_f, m_r, "mn")


@pytest.mark.parametrize("pattern", ["alternate", "neg_first", "neg_last", "all_neg"])
def test_mixed_sign_zero_group(fast_target, pattern):
    """Groups of +0.0 and -0.0 only: every stored bit agrees, the scale included.

    The max of {-0.0, +0.0} has a sign that depends on reduction order, so the contract adds +0.0
    to both the min and the scale (``numerics.canonical_zero``): both are +0.0 in every tier.
    """
    backend, device = fast_target
    x = np.zeros((4, 8), np.float32)
    if pattern == "alternate":
        x[:, 1::2] = -0.0
    elif pattern == "neg_first":
        x[:, :4] = -0.0
    elif pattern == "neg_last":
        x[:, 4:] = -0.0
    else:
        x[:] = -0.0
    x_t, x_np = to_torch(x, torch.float32, device)
    c_r, s_r, m_r = RQ.quantize(x_np, 2, 8)
    assert not np.signbit(s_r).any() and not np.signbit(m_r).any()
    c_f, s_f, m_f = _quant(backend).quantize(x_t, 2, 8)
    assert_bits_equal(c_f, c_r, "codes")
    assert_bits_equal(m_f, m_r, "mn")
    assert_bits_equal(s_f, s_r, "scale")
    d_f = _quant(backend).dequantize(c_f, s_f, m_f, 8, -1, "float32")
    assert_bits_equal(d_f, RQ.dequantize(c_r, s_r, m_r, 8, -1, "float32"), "dequantized")


# ----------------------------------------------------------------------------------------------------
# bad input: the same error types, and messages that name the problem as the reference does


def _x(device, dtype=torch.float32, shape=(4, 16)):
    return torch.from_numpy(np.random.default_rng(0).standard_normal(shape).astype(np.float32)).to(dtype).to(device)


def test_errors(fast_target):
    backend, device = fast_target
    Q = _quant(backend)
    x = _x(device)
    with pytest.raises(ValueError, match="bits=5 is not supported"):
        Q.quantize(x, 5, 8)
    with pytest.raises(ValueError, match="does not divide"):
        Q.quantize(x, 2, 5)
    with pytest.raises(ValueError, match="out of range"):
        Q.quantize(x, 2, 4, axis=2)
    with pytest.raises(ValueError, match="empty"):
        Q.quantize(x[:0], 2, 4)
    with pytest.raises(ValueError, match="meta_dtype"):
        Q.quantize(x, 2, 8, meta_dtype=np.float64)
    for bad in (x.double(), x.to(torch.int32)):
        with pytest.raises(TypeError, match="dtype"):
            Q.quantize(bad, 2, 8)
    with pytest.raises(TypeError, match="torch.Tensor"):
        Q.quantize(x.cpu().numpy(), 2, 8)
    c, s, m = Q.quantize(x, 2, 8)
    with pytest.raises(TypeError, match="uint8"):
        Q.dequantize(c.to(torch.int32), s, m, 8)
    with pytest.raises(ValueError, match="shape"):
        Q.dequantize(c, s[:, :1], m, 8)
    with pytest.raises(ValueError, match="does not divide"):
        Q.dequantize(c, s, m, 5)
    with pytest.raises(ValueError, match="out_dtype"):
        Q.dequantize(c, s, m, 8, -1, "int8")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_non_finite(fast_target, bad, symmetric):
    """NaN / inf: ValueError with validation on (as the reference); with it off the group's scale is NaN."""
    backend, device = fast_target
    Q = _quant(backend)
    x_np = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    x_np[1, 9] = bad                                                       # group (1, 1) of groups of 8
    with pytest.raises(ValueError, match="non-finite"):
        RQ.quantize(x_np, 4, 8, symmetric=symmetric)
    x = torch.from_numpy(x_np).to(torch.float16).to(device)
    with pytest.raises(ValueError, match="non-finite"):
        Q.quantize(x, 4, 8, symmetric=symmetric)
    with F.validation(False):
        c, s, m = Q.quantize(x, 4, 8, symmetric=symmetric)
    s = s.cpu().float().numpy()
    assert np.isnan(s[1, 1])
    clean = x_np.copy()
    clean[1, 8:] = 0.0
    c_r, s_r, m_r = RQ.quantize(clean.astype(np.float16), 4, 8, symmetric=symmetric)
    ok = np.ones(s.shape, bool)
    ok[1, 1] = False
    np.testing.assert_array_equal(s[ok], s_r.astype(np.float32)[ok])
    assert int(c.max()) < 16                                               # codes stay in range


@pytest.mark.parametrize("case", ["scale", "min", "sym-min"])
def test_metadata_overflow(fast_target, case):
    """A scale or min beyond float16 raises, naming it, as the reference does; float32 metadata works."""
    backend, device = fast_target
    Q = _quant(backend)
    x_np = np.random.default_rng(2).uniform(0, 1, (2, 8)).astype(np.float32)
    if case == "scale":
        x_np[:, 0], x_np[:, 1] = -6e4, 6e4        # scale = 1.2e5 / 3 = 4e4 (fits) at 2 bits...
        x_np[:, 1] = 2.6e5                        # ... 3.2e5 / 3 > 65504: scale overflows
        kw, name = {}, "scale"
    elif case == "min":
        x_np[:, 0] = -7e4                         # min overflows; scale = 7e4 / 255 fits
        kw, name = {"bits": 8}, "min"
    else:
        x_np[:, 0] = 1e5                          # symmetric 8-bit: scale 787 fits, min = -128 * 787 does not
        kw, name = {"bits": 8, "symmetric": True}, "min"
    bits = kw.pop("bits", 2)
    with pytest.raises(ValueError, match=f"{name} overflows float16"):
        RQ.quantize(x_np, bits, 8, **kw)
    x = torch.from_numpy(x_np).to(device)
    with pytest.raises(ValueError, match=f"{name} overflows float16"):
        Q.quantize(x, bits, 8, **kw)
    c_r, s_r, m_r = RQ.quantize(x_np, bits, 8, meta_dtype=np.float32, **kw)
    c_f, s_f, m_f = Q.quantize(x, bits, 8, meta_dtype=np.float32, **kw)
    assert_bits_equal(c_f, c_r, "codes")
    assert_bits_equal(s_f, s_r, "scale")
    assert_bits_equal(m_f, m_r, "mn")
