"""Triton OSCAR token quantizer (OSCAR App. A.5): per-token percentile clip, then per-token asymmetric
INT-b codes in groups of G channels, packed along channels, in ONE kernel.

Mirrors ``kvq.reference.rotations.quantize_tokens`` (re-exported as ``kvq.reference.oscar.quantize_tokens``,
what the OSCAR cache calls) followed by the cache's ``packing.pack(codes, bits, axis=-1)``: the same
bits under the numerics contract (DESIGN.md section 2). The module is not named ``oscar.py``: that
name is reserved for the fast mirror of ``kvq.reference.oscar`` (the cache).

    from kvq.fast.triton.oscar_quant import quantize_tokens
    packed, scale, mn = quantize_tokens(k_rot, clip=0.96, group_size=128)          # k_rot: (B, H, T, D)
    codes, scale, mn = quantize_tokens(k_rot, 0.96, 128, packed=False)             # the reference's format
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.fast import common as C

from kvq.fast.common import cdiv as _cdiv  # host grid arithmetic
from . import quant as Q
from .packing import pack_launch

__all__ = ["quantize_tokens"]



# Fused OSCAR token quantizer: one program takes BLOCK_R token rows of D channels.
# Computes: tau = quantile_clip(|x|) per row (tl.sort; RANK: rank selection, interpreter),
#   s[LO] + FRAC * (s[HI] - s[LO]),
#   xc = min(max(x, -tau), tau), per group of G channels mn / mx of xc, scale = div_rn(mx - mn, qmax)
#   and mn rounded to the metadata dtype, codes = clamp(rint((xc - mn_s) / scale_s), 0, qmax), and
#   PER = 8 // BITS consecutive channel codes per byte (PER = 1: plain codes).
# NaN / inf: the group's scale is the sum of x * 0 over the RAW (unclipped) group, so a non-finite input
#   shows in the metadata even where the clip would have made it finite.
# Grid: (cdiv(R, BLOCK_R),); tile (BLOCK_R, BLOCK_NG, BLOCK_J, PER), channel = g*G + j*PER + k.
# Bytes: reads R*D inputs, writes R*D/PER code bytes + 2 R*D/G metadata values.
@triton.jit
def _quantize_tokens_kernel(x_ptr, q_ptr, s_ptr, m_ptr, R, LO, HI, FRAC,
                            D: tl.constexpr, G: tl.constexpr, QMAX: tl.constexpr, BITS: tl.constexpr,
                            PER: tl.constexpr, IN_BF16: tl.constexpr, FASTDIV: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_NG: tl.constexpr, BLOCK_J: tl.constexpr,
                            RANK: tl.constexpr):
    NG: tl.constexpr = D // G
    NJ: tl.constexpr = G // PER
    BLOCK_S: tl.constexpr = BLOCK_NG * BLOCK_J * PER
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    rr = tl.arange(0, BLOCK_R)
    r4 = rr[:, None, None, None]
    g4 = tl.arange(0, BLOCK_NG)[None, :, None, None]
    j4 = tl.arange(0, BLOCK_J)[None, None, :, None]
    k4 = tl.arange(0, PER)[None, None, None, :]
    rmask4 = (r0 + r4) < R
    m = rmask4 & (g4 < NG) & (j4 < NJ)
    x = Q.load_f32(x_ptr + r0 * D + (r4 * D + g4 * G + j4 * PER + k4), m, IN_BF16)
    nz = tl.sum(tl.sum(x * 0.0, axis=3), axis=2)                      # (BLOCK_R, BLOCK_NG): NaN if non-finite
    # percentile clip (quant.percentile_clip): tau from the sorted |x| of the whole row
    a = tl.abs(x)
    nnan = tl.sum(tl.sum(tl.sum((m & (a != a)).to(tl.int32), axis=3), axis=2), axis=1)
    key = tl.reshape(tl.where(m & (a == a), a, float("inf")), (BLOCK_R, BLOCK_S))
    tau = Q.sorted_quantile(key, nnan, D, LO, HI, FRAC, BLOCK_S, RANK)  # (BLOCK_R,)
    xc = Q.clip_np(x, tau[:, None, None, None])
    # per-group asymmetric quantization (quant.quantize, axis=-1)
    lo = tl.min(tl.min(tl.where(m, xc, float("inf")), axis=3), axis=2)
    hi = tl.max(tl.max(tl.where(m, xc, float("-inf")), axis=3), axis=2)
    scale_st, mn_st, s32, m32 = Q.group_meta(lo, hi, nz, s_ptr, QMAX, 0.0, False)
    r2 = rr[:, None]
    g2 = tl.arange(0, BLOCK_NG)[None, :]
    m2 = ((r0 + r2) < R) & (g2 < NG)
    tl.store(s_ptr + r0 * NG + (r2 * NG + g2), scale_st, mask=m2)
    tl.store(m_ptr + r0 * NG + (r2 * NG + g2), mn_st, mask=m2)
    bad = m2 & (s32 != 0.0) & ((s32 < 1.2621774483536189e-29) | (s32 > 1.329227995784916e36))
    ok = tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) == 0        # see quant.fast_ok
    s4 = s32[:, :, None, None]
    c = Q.group_codes(xc, s4, m32[:, :, None, None], tl.div_rn(1.0, s32)[:, :, None, None], ok, QMAX, 0.0, False,
                 BITS, FASTDIV)
    byte = tl.sum(c << (k4 * BITS), axis=3)                           # (BLOCK_R, BLOCK_NG, BLOCK_J)
    r3 = rr[:, None, None]
    g3 = tl.arange(0, BLOCK_NG)[None, :, None]
    j3 = tl.arange(0, BLOCK_J)[None, None, :]
    NB: tl.constexpr = D // PER
    tl.store(q_ptr + r0 * NB + (r3 * NB + g3 * NJ + j3), byte.to(tl.uint8),
             mask=((r0 + r3) < R) & (g3 < NG) & (j3 < NJ))


def _launch(x: torch.Tensor, clip, G: int, bits: int, meta: torch.dtype, per: int):
    """Run the fused kernel on contiguous ``x`` (..., D); ``per`` codes per byte (G % per == 0)."""
    shape = tuple(x.shape)
    D = shape[-1]
    R = x.numel() // D
    lo, hi, frac = Q.quantile_index(D, clip)
    q = torch.empty(shape[:-1] + (D // per,), dtype=torch.uint8, device=x.device)
    scale = torch.empty(shape[:-1] + (D // G,), dtype=meta, device=x.device)
    mn = torch.empty_like(scale)
    if R == 0:
        return q, scale, mn
    in_bf16 = x.dtype == torch.bfloat16
    xin = x.view(torch.int16) if in_bf16 else x
    BNG, BJ = Q.p2(D // G), Q.p2(G // per)
    BS = BNG * BJ * per
    BR = Q.sort_rows(BS, R)
    _quantize_tokens_kernel[(_cdiv(R, BR),)](
        xin, q, scale, mn, R, lo, hi, frac, D=D, G=G, QMAX=float(2 ** bits - 1), BITS=bits, PER=per,
        IN_BF16=in_bf16, FASTDIV=not Q.interpreting(), BLOCK_R=BR, BLOCK_NG=BNG, BLOCK_J=BJ,
        RANK=Q.use_rank(), num_warps=4, enable_fp_fusion=False)
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
    metadata dtype. Differences: torch tensors (float16 / bfloat16 / float32; CUDA, or the CPU under
    ``TRITON_INTERPRET=1``); packed by default (``packed=False`` returns the reference's unpacked uint8
    codes (..., D)); packing needs bits in (2, 4, 8) and D a multiple of 8 // bits, as
    ``packing.pack`` does. NaN / inf raise ValueError (detected from the metadata, like
    ``quant.quantize``) while ``kvq.fast.validation`` is on; with it off the group's scale is NaN.
    Rows longer than ``quant.MAX_SORT`` run as percentile_clip, then (quantize_)pack: two kernels.
    """
    x, D, G, bits, meta, per = C.token_quant_args(x_rot, clip, group_size, bits, meta_dtype, packed, allow_cpu=Q.interpreting())
    if D > Q.MAX_SORT:                                                  # rows too long for one program
        C.check_finite(x)
        xc, _ = Q.percentile_clip(x, clip, -1)
        q, scale, mn = Q.launch_quantize(xc, bits, G, x.dim() - 1, meta, False, per=per if G % per == 0 else 1)
    elif G % per == 0:
        q, scale, mn = _launch(x, clip, G, bits, meta, per)
    else:                                                               # a byte would straddle two groups
        q, scale, mn = _launch(x, clip, G, bits, meta, 1)
    C.check_meta(x, scale, mn)
    if packed and q.shape[-1] == D and per > 1:
        q = pack_launch(q, bits, x.dim() - 1)
    return q, scale, mn
