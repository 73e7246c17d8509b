"""kvq.fast.<backend>.packing against kvq.reference.packing, byte for byte.

pack / unpack on random codes; quantize_pack and unpack_dequantize (one fused kernel each in the
Triton backend) over layouts x bits (2, 4, 8) x symmetric x value kinds; the unfused fallback where
8 // bits does not divide the group size; bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvq.fast as F
from kvq.reference import packing as RP
from kvq.reference import quant as RQ

from .cases import DTYPES, LAYOUTS, assert_bits_equal, make_input, meta_for, random_codes, shape_for, to_torch

PACK_BITS = (2, 4, 8)
PACK_KINDS = ("normal", "ties", "const", "tiny16", "negzero")
OUTS = ("float16", "bfloat16", "float32")


def _packing(backend):
    return F.backend_module("packing", backend)


@pytest.mark.parametrize("bits", PACK_BITS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pack_unpack(fast_target, layout, bits):
    backend, device = fast_target
    P = _packing(backend)
    shape, axis, _ = shape_for(layout, device)
    c_t, c_np = random_codes(shape, bits, device, seed=bits)
    p_r = RP.pack(c_np, bits, axis)
    p_f = P.pack(c_t, bits, axis)
    assert p_f.dtype == torch.uint8
    assert_bits_equal(p_f, p_r, "packed")
    assert_bits_equal(P.unpack(p_f, bits, axis), RP.unpack(p_r, bits, axis), "unpacked")
    # every byte value unpacks like the reference
    all_bytes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    assert_bits_equal(P.unpack(torch.from_numpy(all_bytes).to(device), bits, 0), RP.unpack(all_bytes, bits, 0),
                      "unpacked bytes")


@pytest.mark.parametrize("kind", PACK_KINDS)
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("bits", PACK_BITS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_pack_unpack_dequantize(fast_target, layout, bits, symmetric, kind):
    backend, device = fast_target
    P = _packing(backend)
    li, bi, si, ki = LAYOUTS.index(layout), PACK_BITS.index(bits), int(symmetric), PACK_KINDS.index(kind)
    dtype = DTYPES[(li + 2 * bi + si + ki) % 3]
    out = OUTS[(li + bi + 2 * si + ki) % 3]
    meta = meta_for(kind, li + bi + si + 1)
    shape, axis, G = shape_for(layout, device)
    x_t, x_np = make_input(kind, shape, axis, G, bits, symmetric, dtype, device, seed=li + 10 * bi + 100 * ki)
    p_r, s_r, m_r = RP.quantize_pack(x_np, bits, G, axis, meta, symmetric=symmetric)
    p_f, s_f, m_f = P.quantize_pack(x_t, bits, G, axis, meta, symmetric=symmetric)
    assert_bits_equal(p_f, p_r, "packed")
    assert_bits_equal(s_f, s_r, "scale")
    assert_bits_equal(m_f, m_r, "mn")
    d_r = RP.unpack_dequantize(p_r, s_r, m_r, bits, G, axis, out)
    d_f = P.unpack_dequantize(p_f, s_f, m_f, bits, G, axis, out)
    assert_bits_equal(d_f, d_r, f"unpack_dequantize ({out})")


@pytest.mark.parametrize("axis", [-1, 0])
def test_groups_not_multiple_of_codes_per_byte(fast_target, axis):
    """2-bit codes in groups of 6: a byte spans two groups (the Triton backend runs two kernels here)."""
    backend, device = fast_target
    P = _packing(backend)
    shape = (5, 12) if axis == -1 else (12, 5)
    x_t, x_np = make_input("normal", shape, axis, 6, 2, False, torch.float16, device, seed=4)
    p_r, s_r, m_r = RP.quantize_pack(x_np, 2, 6, axis)
    p_f, s_f, m_f = P.quantize_pack(x_t, 2, 6, axis)
    assert_bits_equal(p_f, p_r, "packed")
    assert_bits_equal(s_f, s_r, "scale")
    assert_bits_equal(m_f, m_r, "mn")
    assert_bits_equal(P.unpack_dequantize(p_f, s_f, m_f, 2, 6, axis, "bfloat16"),
                      RP.unpack_dequantize(p_r, s_r, m_r, 2, 6, axis, "bfloat16"), "unpack_dequantize")


def test_matches_quantize_then_pack(fast_target):
    """The fused kernel equals the fast quantize followed by the fast pack."""
    backend, device = fast_target
    P = _packing(backend)
    Q = F.backend_module("quant", backend)
    shape, axis, G = shape_for("middle", device)
    x_t, _ = make_input("normal", shape, axis, G, 4, False, torch.bfloat16, device, seed=9)
    c, s, m = Q.quantize(x_t, 4, G, axis)
    p, s2, m2 = P.quantize_pack(x_t, 4, G, axis)
    assert torch.equal(P.pack(c, 4, axis), p) and torch.equal(s, s2) and torch.equal(m, m2)
    assert torch.equal(P.unpack_dequantize(p, s, m, 4, G, axis, "float32"),
                       Q.dequantize(c, s, m, G, axis, "float32"))


def test_errors(fast_target):
    backend, device = fast_target
    P = _packing(backend)
    codes = torch.zeros((4, 16), dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="cannot be packed"):
        P.pack(codes, 3)
    with pytest.raises(ValueError, match="not supported"):
        P.pack(codes, 5)
    with pytest.raises(ValueError, match="not a multiple"):
        P.pack(codes[:, :6], 2)
    with pytest.raises(ValueError, match="out of range"):
        P.pack(codes + 4, 2)
    with pytest.raises(TypeError, match="uint8"):
        P.pack(codes.to(torch.int32), 2)
    with pytest.raises(TypeError, match="uint8"):
        P.unpack(codes.to(torch.int32), 2)
    with pytest.raises(ValueError, match="cannot be packed"):
        P.unpack(codes, 3)
    x, _ = to_torch(np.ones((4, 16), np.float32), torch.float32, device)
    with pytest.raises(ValueError, match="cannot be packed"):
        P.quantize_pack(x, 3, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        P.quantize_pack(x[:, :6], 2, 3)
    with pytest.raises(ValueError, match="does not divide"):
        P.quantize_pack(x, 2, 5)
    with pytest.raises(TypeError, match="dtype"):
        P.quantize_pack(x.double(), 2, 8)
    p, s, m = P.quantize_pack(x, 2, 8)
    with pytest.raises(ValueError, match="shape"):
        P.unpack_dequantize(p, s[:, :1], m, 2, 8)
    with pytest.raises(TypeError, match="uint8"):
        P.unpack_dequantize(p.to(torch.int32), s, m, 2, 8)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        P.quantize_pack(x, 2, 8)
    with F.validation(False):
        _, s, _ = P.quantize_pack(x, 2, 8)
    assert bool(torch.isnan(s[1, 0]))


def test_reference_rejects_the_same(fast_target):
    """The reference raises the same errors for the cases above (the fast messages mirror them)."""
    codes = np.zeros((4, 16), np.uint8)
    with pytest.raises(ValueError, match="cannot be packed"):
        RP.pack(codes, 3)
    with pytest.raises(ValueError, match="out of range"):
        RP.pack(codes + 4, 2)
    with pytest.raises(ValueError, match="not a multiple"):
        RP.quantize_pack(np.ones((4, 6), np.float32), 2, 3)
    with pytest.raises(ValueError, match="shape"):
        p, s, m = RP.quantize_pack(np.ones((4, 16), np.float32), 2, 8)
        RQ.dequantize(RP.unpack(p, 2), s[:, :1], m, 8)
