"""CuPy OSCAR token quantizer (OSCAR App. A.5): per-token percentile clip, then per-token asymmetric
INT-b codes in groups of G channels, packed along channels, in ONE raw CUDA kernel per call.

Mirrors ``kvq.reference.rotations.quantize_tokens`` (re-exported as ``kvq.reference.oscar.quantize_tokens``,
what the OSCAR cache calls) followed by the cache's ``packing.pack(codes, bits, axis=-1)``: the same
bits under the numerics contract (DESIGN.md section 2). The CuPy mirror of
``kvq.fast.triton.oscar_quant``: ``oscar_quant_rows`` of ``oscar.cu``, one block per token row (bitonic
sort of the row's |x| in shared memory, the clip, a warp per group for min / max, quant.cu's encoder).

    from kvq.fast.cupy.oscar_quant import quantize_tokens
    packed, scale, mn = quantize_tokens(k_rot, clip=0.96, group_size=128)          # k_rot: (B, H, T, D)
    codes, scale, mn = quantize_tokens(k_rot, 0.96, 128, packed=False)             # the reference's format
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast import common as C

from . import _loader as L
from . import quant as Q
from .packing import launch_pack

__all__ = ["quantize_tokens"]

MAX_FUSED = 2048        # longest token row of the fused kernel (OSCAR_MAX_TOKEN in oscar.cu)


def _launch(x: torch.Tensor, clip, G: int, bits: int, meta: torch.dtype, per: int):
    """Run the fused kernel on contiguous ``x`` (..., D); ``per`` codes per byte (a byte may straddle
    two groups: each code uses its own group's scale)."""
    shape = tuple(x.shape)
    D = shape[-1]
    R = x.numel() // D
    lo, hi, frac = Q.quantile_index(D, clip)
    q = torch.empty(shape[:-1] + (D // per,), dtype=torch.uint8, device=x.device)
    scale = torch.empty(shape[:-1] + (D // G,), dtype=meta, device=x.device)
    mn = torch.empty_like(scale)
    if R == 0:
        return q, scale, mn
    bs = Q.pow2_ceil(D)
    fn = L.kernel("oscar.cu", f"oscar_quant_rows<{L.DT[x.dtype]}>")
    L.run(fn, (L.grid_1d(R, 1),), (Q.sort_threads(bs),),
          (x, q, scale, mn, np.int64(R), np.int32(D), np.int32(G), np.int32(bs), np.int32(lo), np.int32(hi),
           np.float32(frac), np.int32(bits), np.int32(per), np.int32(meta == torch.float16)), x.device)
    return q, scale, mn


def quantize_tokens(x_rot, clip: float, group_size: int, bits: int = 2, meta_dtype="float16", *,
                    packed: bool = True):
    """Mirrors `kvq.reference.rotations.quantize_tokens`, fused with the cache's packing along channels.

    (``kvq.reference.oscar.quantize_tokens`` is the same function, re-exported; the OSCAR cache calls
    it and then ``packing.pack(codes, bits, axis=-1)``.)

    Per token (row of D channels): ``tau`` = the ``clip``-quantile of ``|x|`` (``quant.percentile_clip``),
    ``x`` clipped to ``[-tau, tau]``, then asymmetric ``bits``-bit codes in groups of ``group_size``
    channels (``quant.quantize(..., axis=-1)``): one kernel, the same bits as the reference.

    Returns ``(packed, scale, mn)``: ``packed`` (..., D * bits // 8) uint8 = ``packing.pack(codes, bits,
    axis=-1)`` of the reference's codes (what the OSCAR cache stores); scale, mn (..., D // G) in the
    metadata dtype. Differences: torch CUDA tensors (float16 / bfloat16 / float32); packed by default
    (``packed=False`` returns the reference's unpacked uint8 codes (..., D)); packing needs bits in
    (2, 4, 8) and D a multiple of 8 // bits, as ``packing.pack`` does. NaN / inf raise ValueError
    (detected from the metadata, like ``quant.quantize``) while ``kvq.fast.validation`` is on; with it
    off the group's scale is NaN. Rows longer than ``MAX_FUSED`` (or ``quant.MAX_SORT``) run as
    percentile_clip, then quantize (+ pack): two or three kernels.
    """
    x, D, G, bits, meta, per = C.token_quant_args(x_rot, clip, group_size, bits, meta_dtype, packed)
    axis = x.dim() - 1
    if D > min(MAX_FUSED, Q.MAX_SORT):                                  # rows too long for one block
        C.check_finite(x)
        xc, _ = Q.percentile_clip(x, clip, -1)
        fused = per > 1 and G % per == 0
        q, scale, mn = Q.launch_quantize(xc, bits, G, axis, meta, False, bits if fused else 8)
        if per > 1 and not fused:
            q = launch_pack(q, bits, axis, unpack=False)
    else:
        q, scale, mn = _launch(x, clip, G, bits, meta, per)
    C.check_meta(x, scale, mn)
    return q, scale, mn
