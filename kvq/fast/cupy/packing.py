"""CuPy backend: b-bit codes <-> uint8 bytes, and quantize+pack / unpack+dequantize as single kernels.

Mirrors ``kvq.reference.packing`` bit for bit (rule 6: 8/b codes per byte, the i-th code in bits
[b*i, b*i + b), packed along the quantization axis: keys along tokens, values along channels).

    from kvq.fast.cupy.packing import quantize_pack, unpack_dequantize
    packed, scale, mn = quantize_pack(v, 2, 128, axis=-1)            # v: (B, H, T, D), per-token values
    v_hat = unpack_dequantize(packed, scale, mn, 2, 128, axis=-1)

``quantize_pack`` and ``unpack_dequantize`` are the kernels of ``quant.py`` run with PB = bits, so the
codes never touch global memory. When the group size is not a multiple of the codes per byte (a
byte would straddle two groups, e.g. G = 6 at 2 bits) they fall back to two kernels, same bits.
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast import common as C
from kvq.reference import numerics as nx
from kvq.reference.packing import PACK_BITS, check_pack_bits
from kvq.reference.quant import check_groups

from . import _loader as L
from . import quant as Q

__all__ = ["pack", "unpack", "quantize_pack", "unpack_dequantize"]

_SRC = "quant.cu"
_THREADS = 256


def launch_pack(codes, bits: int, axis: int, unpack: bool):
    """pack (codes -> bytes) or unpack (bytes -> codes) along ``axis``; one byte per thread."""
    src = codes.contiguous()
    outer, n, inner = C.axis_view(tuple(src.shape), axis)
    per = 8 // bits
    shape = list(src.shape)
    shape[axis] = n * per if unpack else n // per
    out = torch.empty(shape, dtype=torch.uint8, device=src.device)
    nbytes = src.numel() if unpack else out.numel()
    if nbytes:
        fn = L.kernel(_SRC, f"{'unpack' if unpack else 'pack'}_codes<{bits}>")
        L.run(fn, (L.grid_1d(nbytes, _THREADS),), (_THREADS,),
              (src, out, np.int64(nbytes), np.int64(inner)), src.device)
    return out


def _check_multiple(n: int, axis: int, bits: int) -> None:
    per = 8 // bits
    if n % per:
        raise ValueError(f"codes.shape[{axis}]={n} is not a multiple of {per} ({bits}-bit codes per byte)")


def pack(codes, bits: int, axis: int = -1):
    """Mirrors `kvq.reference.packing.pack`: uint8 codes in ``[0, 2**bits)`` -> bytes along ``axis``.

    Differences: torch CUDA tensors; the range check (codes < 2**bits) reads the codes and runs only
    while ``kvq.fast.validation`` is on; without it, out-of-range codes are masked to ``bits`` bits.
    """
    bits = check_pack_bits(bits)
    C.check_codes(codes)
    axis = nx.normalize_axis(axis, codes.dim())
    _check_multiple(codes.shape[axis], axis, bits)
    if C.validation_enabled() and codes.numel():
        top = int(codes.max())
        if top >= 2 ** bits:
            raise ValueError(f"codes contain {top}, out of range for {bits} bits (max {2 ** bits - 1})")
    return launch_pack(codes, bits, axis, unpack=False)


def unpack(packed, bits: int, axis: int = -1):
    """Mirrors `kvq.reference.packing.unpack`: bytes -> uint8 codes, ``8 // bits`` times longer along ``axis``.

    Differences: torch CUDA tensors.
    """
    bits = check_pack_bits(bits)
    C.check_codes(packed, "packed")
    axis = nx.normalize_axis(axis, packed.dim())
    return launch_pack(packed, bits, axis, unpack=True)


def quantize_pack(x, bits: int, group_size, axis: int = -1, meta_dtype=np.float16, *, symmetric: bool = False):
    """Mirrors `kvq.reference.packing.quantize_pack`: ``(packed, scale, mn)`` from one fused kernel.

    Same bits as ``quantize`` then ``pack``. Differences: torch CUDA tensors; NaN / inf input is
    detected from the metadata (see ``kvq.fast.cupy.quant.quantize``); two kernels instead of one when
    ``group_size`` is not a multiple of ``8 // bits``.
    """
    check_pack_bits(bits)
    axis, bits, G, mdt = C.quant_args(x, bits, group_size, axis, meta_dtype, allow_cpu=False,
                                      pack_bits=PACK_BITS)
    per = 8 // bits
    if x.shape[axis] % per or G % per:                 # the reference's order: quantize, then pack
        codes, scale, mn = Q.quantize(x, bits, G, axis, meta_dtype, symmetric=symmetric)
        return pack(codes, bits, axis), scale, mn
    packed, scale, mn = Q.launch_quantize(x, bits, G, axis, mdt, symmetric, bits)
    C.check_meta(x, scale, mn)
    return packed, scale, mn


def unpack_dequantize(packed, scale, mn, bits: int, group_size, axis: int = -1, out_dtype=np.float16):
    """Mirrors `kvq.reference.packing.unpack_dequantize`: the values a packed cache represents, one kernel.

    Same bits as ``unpack`` then ``dequantize``. Differences: torch CUDA tensors; bf16 output is a
    torch.bfloat16 tensor; two kernels when ``group_size`` is not a multiple of ``8 // bits``.
    """
    bits = check_pack_bits(bits)
    C.check_codes(packed, "packed")
    axis = nx.normalize_axis(axis, packed.dim())
    per = 8 // bits
    codes_shape = list(packed.shape)
    codes_shape[axis] *= per
    G = check_groups(tuple(codes_shape), axis, group_size, "codes")
    C.check_meta_shapes(tuple(codes_shape), scale, mn, G, axis)
    odt = Q.out_dtype_of(out_dtype)
    if G % per:
        return Q.launch_dequantize(launch_pack(packed, bits, axis, unpack=True), scale, mn, G, axis, odt, 8)
    return Q.launch_dequantize(packed, scale, mn, G, axis, odt, bits)
