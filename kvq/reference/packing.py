"""b-bit codes <-> uint8 bytes (numerics contract rule 6), and quantize+pack in one call.

A byte holds ``8 // b`` codes; the i-th code of a byte sits in bits ``[b*i, b*i + b)`` (first code in
the low bits). Codes are packed along one axis: keys along tokens, values along channels. This is
byte for byte KIVI's layout of int32 words (code j at bits ``[b*j, b*j+b)``) on a little-endian
machine; ``tests/reference/test_packing.py`` shows it.

    packed = pack(codes, bits=2, axis=-1)             # (..., n) uint8 codes -> (..., n // 4) bytes
    codes2 = unpack(packed, bits=2, axis=-1)          # and back
    packed, scale, mn = quantize_pack(v, 2, 128, -1)  # v: (B, H, T, D), per-token values
"""

from __future__ import annotations

import numpy as np

from . import numerics as nx
from .quant import dequantize, quantize

PACK_BITS = (2, 4, 8)

__all__ = ["pack", "unpack", "quantize_pack", "unpack_dequantize"]


def check_pack_bits(bits):
    """Bits a uint8 container can hold a whole number of: 2, 4, 8 (3 gets its own message)."""
    if bits == 3:
        raise ValueError("bits=3 codes cannot be packed into uint8 containers (3 does not divide 8); "
                         "pack supports 2, 4, 8")
    return nx.check_bits(bits, PACK_BITS)


def pack(codes, bits: int, axis: int = -1) -> np.ndarray:
    """Pack uint8 codes in ``[0, 2**bits)`` into bytes along ``axis`` (length must be a multiple of 8/bits)."""
    bits = check_pack_bits(bits)
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"codes have dtype {codes.dtype}; expected uint8")
    axis = nx.normalize_axis(axis, codes.ndim)
    per = 8 // bits
    n = codes.shape[axis]
    if n % per:
        raise ValueError(f"codes.shape[{axis}]={n} is not a multiple of {per} ({bits}-bit codes per byte)")
    if codes.size and int(codes.max()) >= 2 ** bits:
        raise ValueError(f"codes contain {int(codes.max())}, out of range for {bits} bits "
                         f"(max {2 ** bits - 1})")
    c = np.moveaxis(codes, axis, -1)
    c = c.reshape(c.shape[:-1] + (n // per, per)).astype(np.uint16)   # (..., bytes, codes per byte)
    shifts = (np.arange(per, dtype=np.uint16) * bits)
    packed = np.bitwise_or.reduce(c << shifts, axis=-1).astype(np.uint8)
    return np.ascontiguousarray(np.moveaxis(packed, -1, axis))


def unpack(packed, bits: int, axis: int = -1) -> np.ndarray:
    """Inverse of :func:`pack`: uint8 bytes -> uint8 codes, ``8 // bits`` times longer along ``axis``."""
    bits = check_pack_bits(bits)
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed has dtype {packed.dtype}; expected uint8")
    axis = nx.normalize_axis(axis, packed.ndim)
    per = 8 // bits
    p = np.moveaxis(packed, axis, -1)[..., None]                      # (..., bytes, 1)
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    codes = (p >> shifts) & np.uint8(2 ** bits - 1)                   # (..., bytes, per)
    codes = codes.reshape(p.shape[:-2] + (p.shape[-2] * per,)).astype(np.uint8)
    return np.ascontiguousarray(np.moveaxis(codes, -1, axis))


def quantize_pack(x, bits: int, group_size, axis: int = -1, meta_dtype=np.float16, *, symmetric: bool = False):
    """:func:`~kvq.reference.quant.quantize` then :func:`pack` along the same axis.

    Returns ``(packed, scale, mn)``; ``packed`` has ``x.shape[axis] * bits // 8`` bytes along ``axis``.
    """
    check_pack_bits(bits)
    codes, scale, mn = quantize(x, bits, group_size, axis, meta_dtype, symmetric=symmetric)
    return pack(codes, bits, axis), scale, mn


def unpack_dequantize(packed, scale, mn, bits: int, group_size, axis: int = -1, out_dtype=np.float16):
    """:func:`unpack` then :func:`~kvq.reference.quant.dequantize`: the values a packed cache represents."""
    return dequantize(unpack(packed, bits, axis), scale, mn, group_size, axis, out_dtype)
