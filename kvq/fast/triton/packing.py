"""Triton packing: b-bit codes <-> uint8 bytes, and quantize+pack / unpack+dequantize fused in one kernel.

Mirrors ``kvq.reference.packing`` byte for byte (numerics contract rule 6): a byte holds ``8 // b``
codes, the i-th in bits ``[b*i, b*i + b)``, packed along one axis (keys along tokens, values along
channels). ``quantize_pack`` and ``unpack_dequantize`` run the kernels of ``kvq.fast.triton.quant``
with ``PER = 8 // b`` codes per byte, so the unpacked codes never touch memory.

    packed, scale, mn = quantize_pack(v, bits=2, group_size=128, axis=-1)   # v: (B, H, T, D) CUDA
    v_hat = unpack_dequantize(packed, scale, mn, 2, 128, axis=-1)
    codes = unpack(packed, bits=2, axis=-1)
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvq.fast import common as C
from kvq.reference import numerics as nx
from kvq.reference.packing import check_pack_bits
from kvq.reference.quant import check_groups

from kvq.fast.common import cdiv as _cdiv  # host grid arithmetic
from . import quant as Q

__all__ = ["pack", "unpack", "quantize_pack", "unpack_dequantize"]

BLOCK = 1024        # output bytes (pack) / input bytes (unpack) per program


# Pack: byte (o, j, i) = OR_k code(o, j*PER + k, i) << (BITS*k), codes seen as (outer, n, inner).
# Grid: (cdiv(outer * n/PER * inner, BLOCK),); tile (BLOCK bytes, PER codes).
# Bytes: reads outer*n*inner codes, writes 1/PER of that.
@triton.jit
def _pack_kernel(c_ptr, p_ptr, NB, INNER, TOTAL, BITS: tl.constexpr, PER: tl.constexpr,
                 BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)     # flat byte index
    i = e % INNER
    t = e // INNER
    jb = t % NB
    o = t // NB
    k = tl.arange(0, PER)
    src = ((o * NB + jb) * PER)[:, None] + k[None, :]                  # (outer, n) index of each code
    mask = e < TOTAL
    c = tl.load(c_ptr + src * INNER + i[:, None], mask=mask[:, None], other=0).to(tl.int32)
    c = c & ((1 << BITS) - 1)
    byte = tl.sum(c << (k[None, :] * BITS), axis=1)
    tl.store(p_ptr + e, byte.to(tl.uint8), mask=mask)


# Unpack: code (o, j*PER + k, i) = (byte (o, j, i) >> (BITS*k)) & (2**BITS - 1).
# Grid: (cdiv(outer * n/PER * inner, BLOCK),); tile (BLOCK bytes, PER codes).
# Bytes: reads outer*n/PER*inner bytes, writes PER times that.
@triton.jit
def _unpack_kernel(p_ptr, c_ptr, NB, INNER, TOTAL, BITS: tl.constexpr, PER: tl.constexpr,
                   BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i = e % INNER
    t = e // INNER
    jb = t % NB
    o = t // NB
    k = tl.arange(0, PER)
    mask = e < TOTAL
    byte = tl.load(p_ptr + e, mask=mask, other=0).to(tl.int32)
    c = (byte[:, None] >> (k[None, :] * BITS)) & ((1 << BITS) - 1)
    dst = ((o * NB + jb) * PER)[:, None] + k[None, :]
    tl.store(c_ptr + dst * INNER + i[:, None], c.to(tl.uint8), mask=mask[:, None])


def pack_launch(codes: torch.Tensor, bits: int, axis: int) -> torch.Tensor:
    codes = codes.contiguous()
    per = 8 // bits
    outer, n, inner = C.axis_view(tuple(codes.shape), axis)
    shape = tuple(codes.shape)
    out = torch.empty(shape[:axis] + (n // per,) + shape[axis + 1:], dtype=torch.uint8, device=codes.device)
    total = out.numel()
    if total:
        _pack_kernel[(_cdiv(total, BLOCK),)](codes, out, n // per, inner, total, BITS=bits, PER=per,
                                                   BLOCK=BLOCK, num_warps=4)
    return out


def pack(codes, bits: int, axis: int = -1):
    """Mirrors `kvq.reference.packing.pack`: uint8 codes in ``[0, 2**bits)`` -> bytes along ``axis``.

    Differences: torch uint8 tensors in and out. The range check on the codes (a device reduction and
    a synchronization) runs while ``kvq.fast.validation`` is on; with it off, codes are masked to
    ``bits`` bits.
    """
    bits = check_pack_bits(bits)
    C.check_codes(codes, allow_cpu=Q.interpreting())
    axis = nx.normalize_axis(axis, codes.dim())
    per = 8 // bits
    n = codes.shape[axis]
    if n % per:
        raise ValueError(f"codes.shape[{axis}]={n} is not a multiple of {per} ({bits}-bit codes per byte)")
    if C.validation_enabled() and codes.numel():
        top = int(codes.max())
        if top >= 2 ** bits:
            raise ValueError(f"codes contain {top}, out of range for {bits} bits (max {2 ** bits - 1})")
    return pack_launch(codes, bits, axis)


def unpack(packed, bits: int, axis: int = -1):
    """Mirrors `kvq.reference.packing.unpack`: uint8 bytes -> uint8 codes, ``8 // bits`` times longer along ``axis``.

    Differences: torch uint8 tensors in and out.
    """
    bits = check_pack_bits(bits)
    C.check_codes(packed, "packed", allow_cpu=Q.interpreting())
    axis = nx.normalize_axis(axis, packed.dim())
    packed = packed.contiguous()
    per = 8 // bits
    outer, nb, inner = C.axis_view(tuple(packed.shape), axis)
    shape = tuple(packed.shape)
    out = torch.empty(shape[:axis] + (nb * per,) + shape[axis + 1:], dtype=torch.uint8, device=packed.device)
    total = packed.numel()
    if total:
        _unpack_kernel[(_cdiv(total, BLOCK),)](packed, out, nb, inner, total, BITS=bits, PER=per,
                                                     BLOCK=BLOCK, num_warps=4)
    return out


def quantize_pack(x, bits: int, group_size, axis: int = -1, meta_dtype=np.float16, *, symmetric: bool = False):
    """Mirrors `kvq.reference.packing.quantize_pack`: quantize and pack along the same axis in ONE kernel.

    Returns ``(packed, scale, mn)``. Differences: torch tensors (see ``kvq.fast.triton.quant.quantize``
    for NaN / inf handling). One kernel whenever ``8 // bits`` divides the group size (every practical
    case); otherwise (e.g. 2-bit codes in groups of 6) quantize and pack run as two kernels.
    """
    bits = check_pack_bits(bits)
    axis, bits, G, meta = C.quant_args(x, bits, group_size, axis, meta_dtype, allow_cpu=Q.interpreting())
    per = 8 // bits
    n = x.shape[axis]
    if n % per:
        raise ValueError(f"codes.shape[{axis}]={n} is not a multiple of {per} ({bits}-bit codes per byte)")
    if G % per == 0:
        packed, scale, mn = Q.launch_quantize(x, bits, G, axis, meta, symmetric, per=per)
        C.check_meta(x, scale, mn)
        return packed, scale, mn
    codes, scale, mn = Q.launch_quantize(x, bits, G, axis, meta, symmetric, per=1)
    C.check_meta(x, scale, mn)
    return pack_launch(codes, bits, axis), scale, mn


def unpack_dequantize(packed, scale, mn, bits: int, group_size, axis: int = -1, out_dtype=np.float16):
    """Mirrors `kvq.reference.packing.unpack_dequantize`: unpack and dequantize in ONE kernel.

    Differences: torch tensors in and out; bf16 output is a torch.bfloat16 tensor. Two kernels (unpack,
    then dequantize) when ``8 // bits`` does not divide the group size.
    """
    bits = check_pack_bits(bits)
    axis, allow, out = Q.dequant_args(packed, scale, mn, group_size, axis, out_dtype, name="packed")
    per = 8 // bits
    cshape = list(packed.shape)
    cshape[axis] *= per
    G = check_groups(tuple(cshape), axis, group_size, "codes")
    C.check_meta_shapes(tuple(cshape), scale, mn, G, axis, allow_cpu=allow)
    if G % per == 0:
        return Q.launch_dequantize(packed, scale, mn, bits, G, axis, out, per=per)
    codes = unpack(packed, bits, axis)
    return Q.launch_dequantize(codes, scale, mn, 8, G, axis, out, per=1)
