"""Reference solution of assignment 1 (packing), written with NumPy only.

    packed = pack(codes, bits=2, axis=-1)
    codes2 = unpack(packed, bits=2, n=codes.shape[-1])
"""

import numpy as np


def _check_bits(bits):
    if isinstance(bits, bool) or bits not in (2, 4):
        raise ValueError(f"bits={bits!r} is not supported; pack takes 2 or 4")
    return int(bits)


def _axis(axis, ndim):
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for {ndim} dimension(s)")
    return axis % ndim


def pack(codes, bits, axis=-1):
    """Pack uint8 codes into bytes along ``axis``, the first code of each byte in the low bits."""
    bits = _check_bits(bits)
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"codes have dtype {codes.dtype}; expected uint8")
    axis = _axis(axis, codes.ndim)
    per = 8 // bits
    c = np.moveaxis(codes, axis, -1)                             # (..., n)
    n = c.shape[-1]
    if n % per:
        raise ValueError(f"length {n} along axis {axis} is not a multiple of {per}")
    if c.size and int(c.max()) >= 1 << bits:
        raise ValueError(f"code {int(c.max())} does not fit in {bits} bits")
    out = np.zeros(c.shape[:-1] + (n // per,), np.uint8)        # (..., n // per)
    for i in range(per):                                         # code i of every byte
        out |= (c[..., i::per] << (bits * i)).astype(np.uint8)
    return np.ascontiguousarray(np.moveaxis(out, -1, axis))


def unpack(packed, bits, n, axis=-1):
    """Inverse of :func:`pack`: ``n`` uint8 codes along ``axis``."""
    bits = _check_bits(bits)
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed has dtype {packed.dtype}; expected uint8")
    axis = _axis(axis, packed.ndim)
    per = 8 // bits
    p = np.moveaxis(packed, axis, -1)                            # (..., bytes)
    if n != p.shape[-1] * per:
        raise ValueError(f"n={n} codes do not match {p.shape[-1]} bytes of {per} codes each")
    out = np.empty(p.shape[:-1] + (n,), np.uint8)
    mask = (1 << bits) - 1
    for i in range(per):
        out[..., i::per] = (p >> (bits * i)) & mask
    return np.ascontiguousarray(np.moveaxis(out, -1, axis))
