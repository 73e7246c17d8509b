"""Triton group quantizer: affine (min-max) and symmetric quantize / dequantize along any axis.

Mirrors ``kvq.reference.quant`` bit for bit under the numerics contract (DESIGN.md section 2): the
same fp32 operations in the same order, IEEE round-to-nearest division, no FMA contraction
(``enable_fp_fusion=False``), round-half-to-even by the magic-number add (``numerics.rint_magic``),
metadata rounded to fp16 with round-to-nearest-even, fp16 output saturated at +-65504 (``sat_f16``,
``numerics.to_out``). The kernels here also serve
``kvq.fast.triton.packing``: a kernel with ``PER = 8 // bits > 1`` packs the codes of ``PER``
consecutive elements along the axis into one byte as it stores them (quantize_pack, one kernel), or
unpacks them as it loads them (unpack_dequantize, one kernel).

    codes, scale, mn = quantize(k, bits=2, group_size=128, axis=2)      # k: (B, H_kv, T, D) CUDA tensor
    k_hat = dequantize(codes, scale, mn, group_size=128, axis=2, out_dtype=torch.float16)

Layouts. A contiguous tensor is seen as (outer, n, inner) around the axis (groups of G along n):
  * last axis (inner == 1, e.g. per-token values, groups of G contiguous channels): a program takes
    a 2-D tile of BLOCK_R groups x next_pow2(G) elements; bytes are packed / unpacked in registers
    with ``tl.split`` / ``tl.join``;
  * other axes (inner > 1, e.g. per-channel keys with axis=2, groups of G tokens): a program takes
    one group of G rows x BLOCK_I inner columns as a 3-D tile (G // PER, PER, BLOCK_I), loads
    coalesced along inner and reduces over the strided dimension; the PER rows that share a byte
    sit on their own axis.
Groups too large for one tile (next_pow2(G) > MAX_SINGLE, e.g. ``group_size=None`` on a long axis)
are processed in chunks: a first pass for min / max, a second for the codes (the input is read twice).

Division. The divisions that set the scale use ``tl.div_rn``. The per-element ``(x - mn_s) / scale_s``
uses, on the GPU, ``x * (1 / scale_s)`` refined by two Markstein corrections with FMAs (``_div``):
the same correctly rounded quotient at a fraction of ``div.rn``'s cost, for scales in
[2**-96, 2**120]; a program whose groups have other nonzero scales uses ``tl.div_rn``. Under the
interpreter (whose ``tl.fma`` rounds twice) ``tl.div_rn`` is used throughout.

Quantiles (``quantile``, ``percentile_clip``: OSCAR App. A.5). A program sorts BLOCK_R whole rows
(``tl.sort``, a bitonic network: exact, values are only moved) and interpolates between two order
statistics with the reference's three rounded fp32 operations. Rows longer than MAX_SORT are sorted
by ``torch.sort`` instead (also exact) and interpolated by torch's fp32 elementwise ops.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from kvq.fast.common import cdiv as _cdiv, next_pow2 as _np2  # host grid arithmetic
from kvq.fast import common as C
from kvq.reference import numerics as nx
from kvq.reference.quant import check_groups
from kvq.reference.quant import check_ratio as check_quantile_ratio

__all__ = ["quantize", "dequantize", "quantile", "percentile_clip"]

TILE = 4096                 # elements per program (rows layout)
TILE_COLS = 8192            # elements per program (columns layout)
MAX_SINGLE = 8192           # largest next_pow2(G) held in registers in one pass
MAX_SORT = 4096            # longest row sorted in one program (quantile / percentile_clip)
INTERP_TILE = 1 << 20     # ... under the interpreter (rank selection: BLOCK_R * BLOCK_S**2)
INTERP_RANK = True        # interpreter: select order statistics by rank (tl.sort is per element there)
COLS_WARPS = 4              # warps per program, columns layout (8 measured 1.5-6x slower on an H100)
OUT_KIND_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


# ----------------------------------------------------------------------------------------------------
# device helpers (numerics contract, one rule each)


@triton.jit
def load_f32(ptrs, mask, IN_BF16: tl.constexpr):
    """Rule 1: load fp16 / fp32 (or bf16 given as int16 bits) and convert exactly to fp32.

    bf16 is widened by hand (bits << 16) because the interpreter's bf16 conversion is not exact.
    """
    if IN_BF16:
        b = tl.load(ptrs, mask=mask, other=0)
        x = ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def sat_f16(x):
    """Rule 3's fp16 saturation (numerics.saturate_f16), before a rounding to fp16: a finite x beyond
    +-65504 becomes +-65504 instead of rounding to inf; NaN (every comparison false) and +-inf pass."""
    x = tl.where((x > 65504.0) & (x < float("inf")), 65504.0, x)
    return tl.where((x < -65504.0) & (x > float("-inf")), -65504.0, x)


#: ``store_out``'s OUT_KIND of an output dtype
OUT_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@triton.jit
def store_out(ptrs, x, mask, OUT_KIND: tl.constexpr):
    """Rule 3 (last step, numerics.to_out): round fp32 to the output dtype, nearest even; 0 fp16
    (saturated at +-65504 by ``sat_f16``), 1 bf16 (int16 bits), 2 fp32.

    bf16 is rounded in integer arithmetic (numerics.round_to_bf16): exact on the GPU and in the
    interpreter, whose own fp32 -> bf16 conversion truncates.
    """
    if OUT_KIND == 0:
        tl.store(ptrs, sat_f16(x).to(tl.float16), mask=mask)
    elif OUT_KIND == 1:
        u = x.to(tl.int32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        tl.store(ptrs, r.to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, x, mask=mask)


@triton.jit
def group_meta(lo, hi, nz, s_ptr, QMAX: tl.constexpr, OFF: tl.constexpr, SYMMETRIC: tl.constexpr):
    """Rule 2: scale and min from the group statistics; returns (scale, mn) stored and as fp32.

    Asymmetric: lo / hi = group min / max; ``mn = lo + 0.0`` (canonical zero);
    ``scale = div_rn(hi - mn, qmax)``. Symmetric: hi = max |x|; ``scale = div_rn(hi, q)``,
    ``mn = canonical(-off * scale_s)``. ``nz`` = sum of ``x * 0`` over the group (0, or NaN when the
    group holds NaN / inf) replaces the scale where it is NaN, so that non-finite input shows in the
    metadata (a select, so finite groups keep their scale bit for bit). The asymmetric scale gets
    ``+ 0.0`` like the min: a group of +0.0 and -0.0 has a max whose sign depends on reduction order.
    """
    meta_ty = s_ptr.dtype.element_ty
    if SYMMETRIC:
        scale = tl.where(nz == 0.0, tl.div_rn(hi, QMAX), nz)
        scale_st = scale.to(meta_ty)
        s32 = scale_st.to(tl.float32)
        mn = (s32 * (-OFF)) + 0.0
        mn_st = mn.to(meta_ty)
        m32 = mn_st.to(tl.float32)
    else:
        mn = lo + 0.0
        scale = tl.where(nz == 0.0, tl.div_rn(hi - mn, QMAX) + 0.0, nz)     # canonical zero
        scale_st = scale.to(meta_ty)
        mn_st = mn.to(meta_ty)
        s32 = scale_st.to(tl.float32)
        m32 = mn_st.to(tl.float32)
    return scale_st, mn_st, s32, m32


@triton.jit
def _div(a, b, r, FAST: tl.constexpr):
    """Rule 4: IEEE round-to-nearest ``a / b`` (``r`` = div_rn(1, b), the group's reciprocal).

    FAST: ``a * r`` refined by two Markstein corrections, ``q += r * fma(-q, b, a)`` (the residual is
    exact with an FMA): correctly rounded whenever ``b``, ``1 / b`` and the residuals are normal
    floats, which the caller guarantees (2**-96 <= b <= 2**120, see ``fast_ok``). Five FMA-unit
    operations instead of a full ``div.rn`` per element. Otherwise ``tl.div_rn``.
    """
    if FAST:
        q = a * r
        q = tl.fma(tl.fma(-q, b, a), r, q)
        q = tl.fma(tl.fma(-q, b, a), r, q)
    else:
        q = tl.div_rn(a, b)
    return q


@triton.jit
def fast_ok(s32, valid):
    """True (one scalar for the program) when every nonzero scale of its groups lies in [2**-96, 2**120],
    the range where ``_div``'s FAST form is exact; tiny or huge scales take ``tl.div_rn``."""
    bad = valid & (s32 != 0.0) & ((s32 < 1.2621774483536189e-29) | (s32 > 1.329227995784916e36))
    return tl.max(bad.to(tl.int32), axis=0) == 0


@triton.jit
def codes_f(x, s32, m32, r32, QMAX: tl.constexpr, OFF: tl.constexpr, SYMMETRIC: tl.constexpr,
             BITS: tl.constexpr, FAST: tl.constexpr):
    """Rule 2: integer codes (int32) from fp32 x and the stored scale / min (broadcast to x's shape).

    Asymmetric: ``clamp(div(x - mn_s, scale_s), 0, qmax)``, rounded half to even by the magic add;
    0 where ``scale_s == 0`` (a select: the NaN of 0/0 never leaks). Symmetric:
    ``clamp(div(x, scale_s), -q, q)``, rounded as sign * rint(|y|), plus ``off``; ``off`` where
    ``scale_s == 0``. Codes are masked to BITS bits so that a NaN group (validation off) stays in range.
    """
    if SYMMETRIC:
        y = _div(x, s32, r32, FAST)
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        a = tl.abs(y)
        r = (a + 12582912.0) - 12582912.0                       # rint_magic: 1.5 * 2**23
        r = tl.where(y < 0.0, -r, r)
        c = tl.where(s32 == 0.0, OFF, r + OFF)
    else:
        y = _div(x - m32, s32, r32, FAST)
        y = tl.minimum(tl.maximum(y, 0.0), QMAX)
        r = (y + 12582912.0) - 12582912.0
        c = tl.where(s32 == 0.0, 0.0, r)
    return c.to(tl.int32) & ((1 << BITS) - 1)


@triton.jit
def group_codes(x, s32, m32, r32, ok, QMAX: tl.constexpr, OFF: tl.constexpr, SYMMETRIC: tl.constexpr,
           BITS: tl.constexpr, FASTDIV: tl.constexpr):
    """Codes with the fast exact division where the program's scales allow it (``ok``), else div_rn.

    FASTDIV is off under the interpreter, whose ``tl.fma`` rounds twice (it is not a fused multiply-add).
    """
    if FASTDIV:
        if ok:
            c = codes_f(x, s32, m32, r32, QMAX, OFF, SYMMETRIC, BITS, True)
        else:
            c = codes_f(x, s32, m32, r32, QMAX, OFF, SYMMETRIC, BITS, False)
    else:
        c = codes_f(x, s32, m32, r32, QMAX, OFF, SYMMETRIC, BITS, False)
    return c


@triton.jit
def _pack_last(c, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, PER: tl.constexpr, BITS: tl.constexpr):
    """(BLOCK_R, BLOCK_G) codes -> (BLOCK_R, BLOCK_G // PER) bytes, code j*PER + k at bits [BITS*k, ..).

    Split / join in registers (each thread holds runs of consecutive codes): no shared memory.
    """
    if PER == 1:
        r = c
    elif PER == 2:
        a, b = tl.split(tl.reshape(c, (BLOCK_R, BLOCK_G // 2, 2)))
        r = a | (b << BITS)
    else:
        e, o = tl.split(tl.reshape(c, (BLOCK_R, BLOCK_G // 4, 2, 2)))   # e: codes 4j, 4j+2; o: 4j+1, 4j+3
        e0, e1 = tl.split(e)
        o0, o1 = tl.split(o)
        r = e0 | (o0 << BITS) | (e1 << (2 * BITS)) | (o1 << (3 * BITS))
    return r


@triton.jit
def unpack_last(byte, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, PER: tl.constexpr, BITS: tl.constexpr):
    """(BLOCK_R, BLOCK_J) bytes -> (BLOCK_R, BLOCK_J * PER) codes (the inverse of ``_pack_last``)."""
    M: tl.constexpr = (1 << (8 // PER)) - 1
    if PER == 1:
        r = byte
    elif PER == 2:
        r = tl.reshape(tl.join(byte & M, (byte >> BITS) & M), (BLOCK_R, BLOCK_J * 2))
    else:
        c0 = byte & M
        c1 = (byte >> BITS) & M
        c2 = (byte >> (2 * BITS)) & M
        c3 = (byte >> (3 * BITS)) & M
        r = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (BLOCK_R, BLOCK_J * 4))
    return r


@triton.jit
def sorted_quantile(key, nnan, N, LO, HI, FRAC, BLOCK_S: tl.constexpr, RANK: tl.constexpr):
    """``quant.quantile`` of each row of ``key`` (BLOCK_R, BLOCK_S): returns tau (BLOCK_R,) fp32.

    ``key`` holds the row's values with NaN and padding replaced by +inf; ``nnan`` (BLOCK_R,) counts
    the NaNs. After the sort the first ``N - nnan`` slots are the row's non-NaN values in order (the
    +inf keys are the largest), and slots ``N - nnan .. N - 1`` stand for the NaNs, which NumPy sorts
    last. ``tau = s[lo] + frac * (s[hi] - s[lo])``: three rounded fp32 ops (the caller launches with
    ``enable_fp_fusion=False``). The sign of a zero order statistic cannot change tau (s[hi] - s[lo]
    is +0.0 or positive, and -0.0 + +0.0 = +0.0).

    RANK (the interpreter's default, ``INTERP_RANK``): select the order statistics by rank instead of
    sorting, ``s[k]`` = the key with ``#{< key} <= k < #{<= key}`` (O(BLOCK_S^2) compares, vectorized
    by NumPy), because the interpreter runs ``tl.sort``'s xor reductions one element at a time in
    Python (~100x slower). Both give the same values: the order statistics of the row.
    """
    if RANK:
        ki = key[:, :, None]
        kj = key[:, None, :]
        less = tl.sum((kj < ki).to(tl.int32), axis=2)                  # (BLOCK_R, BLOCK_S)
        leq = tl.sum((kj <= ki).to(tl.int32), axis=2)
        s_lo = tl.max(tl.where((less <= LO) & (LO < leq), key, float("-inf")), axis=1)
        s_hi = tl.max(tl.where((less <= HI) & (HI < leq), key, float("-inf")), axis=1)
    else:
        # sort the float bit patterns as int32 (made monotone: negative floats flip their magnitude
        # bits): Triton's GPU sort network must not see inf / NaN as floats (its swaps multiply)
        ik = key.to(tl.int32, bitcast=True)
        ik = ik ^ ((ik >> 31) & 0x7FFFFFFF)
        ik = tl.sort(ik, dim=1)
        s = (ik ^ ((ik >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        idx = tl.arange(0, BLOCK_S)[None, :]
        s_lo = tl.max(tl.where(idx == LO, s, float("-inf")), axis=1)
        s_hi = tl.max(tl.where(idx == HI, s, float("-inf")), axis=1)
    n_fin = N - nnan
    s_lo = tl.where(LO >= n_fin, float("nan"), s_lo)
    s_hi = tl.where(HI >= n_fin, float("nan"), s_hi)
    return s_lo + FRAC * (s_hi - s_lo)


@triton.jit
def clip_np(x, t):
    """``np.minimum(np.maximum(x, -t), t)`` bit for bit: NumPy returns its second argument when the two
    compare equal (so +0.0 / -0.0 come out as NumPy's) and propagates a NaN from either argument."""
    nt = -t
    y = tl.where((x > nt) | (x != x), x, nt)
    return tl.where((y < t) | (y != y), y, t)


# ----------------------------------------------------------------------------------------------------
# quantize kernels


# Quantize (and pack) groups of G contiguous elements, last axis (inner == 1), one tile per group row.
# Computes: per group min / max (or max |x|), scale and min rounded to the metadata dtype, the codes,
#   and PER codes per byte (PER = 1: plain uint8 codes), packed in registers by split / join.
# Grid: (cdiv(R, BLOCK_R),), R = number of groups; tile (BLOCK_R, BLOCK_G), BLOCK_G = next_pow2(G).
# Bytes: reads R*G input elements, writes R*G/PER bytes + 2 R metadata values.
@triton.jit
def _quant_last_kernel(x_ptr, q_ptr, s_ptr, m_ptr, R, G,
                       QMAX: tl.constexpr, OFF: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
                       SYMMETRIC: tl.constexpr, IN_BF16: tl.constexpr, FASTDIV: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    NJ = G // PER
    rr = tl.arange(0, BLOCK_R)
    r2 = rr[:, None]
    g2 = tl.arange(0, BLOCK_G)[None, :]
    m = ((r0 + r2) < R) & (g2 < G)
    x = load_f32(x_ptr + r0 * G + (r2 * G + g2), m, IN_BF16)
    if SYMMETRIC:
        lo = tl.zeros((BLOCK_R,), tl.float32)
        hi = tl.max(tl.where(m, tl.abs(x), 0.0), axis=1)
    else:
        lo = tl.min(tl.where(m, x, float("inf")), axis=1)
        hi = tl.max(tl.where(m, x, float("-inf")), axis=1)
    nz = tl.sum(x * 0.0, axis=1)
    scale_st, mn_st, s32, m32 = group_meta(lo, hi, nz, s_ptr, QMAX, OFF, SYMMETRIC)
    r1mask = (r0 + rr) < R
    tl.store(s_ptr + r0 + rr, scale_st, mask=r1mask)
    tl.store(m_ptr + r0 + rr, mn_st, mask=r1mask)
    ok = fast_ok(s32, r1mask)
    c = group_codes(x, s32[:, None], m32[:, None], tl.div_rn(1.0, s32)[:, None], ok, QMAX, OFF, SYMMETRIC, BITS,
               FASTDIV)
    byte = _pack_last(c, BLOCK_R, BLOCK_G, PER, BITS)                 # (BLOCK_R, BLOCK_G // PER)
    j2 = tl.arange(0, BLOCK_G // PER)[None, :]
    tl.store(q_ptr + r0 * NJ + (r2 * NJ + j2), byte.to(tl.uint8), mask=((r0 + r2) < R) & (j2 < NJ))


# Quantize (and pack) groups of G contiguous elements, rows layout (inner == 1), chunked:
#   groups too long for one tile (next_pow2(G) > MAX_SINGLE).
# Computes: per group min / max (or max |x|), scale and min rounded to the metadata dtype, the codes,
#   and stores PER codes per byte (PER = 1: plain uint8 codes).
# Grid: (cdiv(R, BLOCK_R),), R = number of groups; tile (BLOCK_R, BLOCK_J, PER), BLOCK_J * PER >= G.
# Bytes: reads R*G input elements (twice when N_CHUNKS > 1), writes R*G/PER bytes + 2 R metadata values.
@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, m_ptr, R, G,
                       QMAX: tl.constexpr, OFF: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
                       SYMMETRIC: tl.constexpr, IN_BF16: tl.constexpr, FASTDIV: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, N_CHUNKS: tl.constexpr):
    pid = tl.program_id(0)
    r0 = pid.to(tl.int64) * BLOCK_R
    NJ = G // PER                                               # bytes per group
    rr = tl.arange(0, BLOCK_R)
    r3 = rr[:, None, None]
    j3 = tl.arange(0, BLOCK_J)[None, :, None]
    k3 = tl.arange(0, PER)[None, None, :]
    rmask = (r0 + r3) < R
    xb = x_ptr + r0 * G
    if N_CHUNKS == 1:
        m = rmask & (j3 < NJ)
        x = load_f32(xb + (r3 * G + j3 * PER + k3), m, IN_BF16)
        if SYMMETRIC:
            lo = tl.zeros((BLOCK_R,), tl.float32)
            hi = tl.max(tl.max(tl.where(m, tl.abs(x), 0.0), axis=2), axis=1)
        else:
            lo = tl.min(tl.min(tl.where(m, x, float("inf")), axis=2), axis=1)
            hi = tl.max(tl.max(tl.where(m, x, float("-inf")), axis=2), axis=1)
        nz = tl.sum(tl.sum(x * 0.0, axis=2), axis=1)
    else:
        lo = tl.full((BLOCK_R,), float("inf"), tl.float32)
        hi = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        if SYMMETRIC:
            lo = tl.zeros((BLOCK_R,), tl.float32)
            hi = tl.zeros((BLOCK_R,), tl.float32)
        nz = tl.zeros((BLOCK_R,), tl.float32)
        for c in range(N_CHUNKS):
            jj = c * BLOCK_J + j3
            m = rmask & (jj < NJ)
            x = load_f32(xb + (r3 * G + jj * PER + k3), m, IN_BF16)
            if SYMMETRIC:
                hi = tl.maximum(hi, tl.max(tl.max(tl.where(m, tl.abs(x), 0.0), axis=2), axis=1))
            else:
                lo = tl.minimum(lo, tl.min(tl.min(tl.where(m, x, float("inf")), axis=2), axis=1))
                hi = tl.maximum(hi, tl.max(tl.max(tl.where(m, x, float("-inf")), axis=2), axis=1))
            nz += tl.sum(tl.sum(x * 0.0, axis=2), axis=1)
    scale_st, mn_st, s32, m32 = group_meta(lo, hi, nz, s_ptr, QMAX, OFF, SYMMETRIC)
    r1mask = (r0 + rr) < R
    tl.store(s_ptr + r0 + rr, scale_st, mask=r1mask)
    tl.store(m_ptr + r0 + rr, mn_st, mask=r1mask)
    ok = fast_ok(s32, r1mask)
    s3 = s32[:, None, None]
    m3 = m32[:, None, None]
    rc3 = tl.div_rn(1.0, s32)[:, None, None]
    j2 = tl.arange(0, BLOCK_J)[None, :]
    r2 = rr[:, None]
    qb = q_ptr + r0 * NJ
    if N_CHUNKS == 1:
        c = group_codes(x, s3, m3, rc3, ok, QMAX, OFF, SYMMETRIC, BITS, FASTDIV)
        byte = tl.sum(c << (k3 * BITS), axis=2)                 # (BLOCK_R, BLOCK_J)
        tl.store(qb + (r2 * NJ + j2), byte.to(tl.uint8), mask=((r0 + r2) < R) & (j2 < NJ))
    else:
        for c in range(N_CHUNKS):
            jj = c * BLOCK_J + j3
            m = rmask & (jj < NJ)
            x = load_f32(xb + (r3 * G + jj * PER + k3), m, IN_BF16)
            code = group_codes(x, s3, m3, rc3, ok, QMAX, OFF, SYMMETRIC, BITS, FASTDIV)
            byte = tl.sum(code << (k3 * BITS), axis=2)
            jj2 = c * BLOCK_J + j2
            tl.store(qb + (r2 * NJ + jj2), byte.to(tl.uint8), mask=((r0 + r2) < R) & (jj2 < NJ))


# Quantize (and pack) groups of G elements strided by `inner`, columns layout (inner > 1).
# Computes: as the rows kernel, for one group (G elements at stride inner) x BLOCK_I inner columns;
#   PER consecutive codes along the axis share a byte.
# Grid: (outer * n // G * cdiv(inner, BLOCK_I),), column blocks fastest; tile (BLOCK_J, PER, BLOCK_I),
# coalesced along inner.
# Bytes: reads outer*n*inner inputs (twice when N_CHUNKS > 1), writes 1/PER byte each + 2 metadata per G.
@triton.jit
def _quant_cols_kernel(x_ptr, q_ptr, s_ptr, m_ptr, G, INNER, NIB,
                       QMAX: tl.constexpr, OFF: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
                       SYMMETRIC: tl.constexpr, IN_BF16: tl.constexpr, I64: tl.constexpr,
                       FASTDIV: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_I: tl.constexpr,
                       N_CHUNKS: tl.constexpr):
    pid = tl.program_id(0)                                      # column blocks of one group run together
    og = (pid // NIB).to(tl.int64)                              # outer index * n_groups + group index
    i0 = (pid % NIB) * BLOCK_I
    NJ = G // PER
    ii = i0 + tl.arange(0, BLOCK_I)
    i3 = ii[None, None, :]
    j3 = tl.arange(0, BLOCK_J)[:, None, None]
    k3 = tl.arange(0, PER)[None, :, None]
    if I64:
        j3 = j3.to(tl.int64)
    imask = i3 < INNER
    xb = x_ptr + og * G * INNER
    if N_CHUNKS == 1:
        m = imask & (j3 < NJ)
        x = load_f32(xb + ((j3 * PER + k3) * INNER + i3), m, IN_BF16)
        if SYMMETRIC:
            lo = tl.zeros((BLOCK_I,), tl.float32)
            hi = tl.max(tl.max(tl.where(m, tl.abs(x), 0.0), axis=1), axis=0)
        else:
            lo = tl.min(tl.min(tl.where(m, x, float("inf")), axis=1), axis=0)
            hi = tl.max(tl.max(tl.where(m, x, float("-inf")), axis=1), axis=0)
        nz = tl.sum(tl.sum(x * 0.0, axis=1), axis=0)
    else:
        lo = tl.full((BLOCK_I,), float("inf"), tl.float32)
        hi = tl.full((BLOCK_I,), float("-inf"), tl.float32)
        if SYMMETRIC:
            lo = tl.zeros((BLOCK_I,), tl.float32)
            hi = tl.zeros((BLOCK_I,), tl.float32)
        nz = tl.zeros((BLOCK_I,), tl.float32)
        for c in range(N_CHUNKS):
            jj = c * BLOCK_J + j3
            m = imask & (jj < NJ)
            x = load_f32(xb + ((jj * PER + k3) * INNER + i3), m, IN_BF16)
            if SYMMETRIC:
                hi = tl.maximum(hi, tl.max(tl.max(tl.where(m, tl.abs(x), 0.0), axis=1), axis=0))
            else:
                lo = tl.minimum(lo, tl.min(tl.min(tl.where(m, x, float("inf")), axis=1), axis=0))
                hi = tl.maximum(hi, tl.max(tl.max(tl.where(m, x, float("-inf")), axis=1), axis=0))
            nz += tl.sum(tl.sum(x * 0.0, axis=1), axis=0)
    scale_st, mn_st, s32, m32 = group_meta(lo, hi, nz, s_ptr, QMAX, OFF, SYMMETRIC)
    i1mask = ii < INNER
    tl.store(s_ptr + og * INNER + ii, scale_st, mask=i1mask)
    tl.store(m_ptr + og * INNER + ii, mn_st, mask=i1mask)
    ok = fast_ok(s32, i1mask)
    s3 = s32[None, None, :]
    m3 = m32[None, None, :]
    rc3 = tl.div_rn(1.0, s32)[None, None, :]
    j2 = tl.arange(0, BLOCK_J)[:, None]
    if I64:
        j2 = j2.to(tl.int64)
    i2 = ii[None, :]
    qb = q_ptr + og * NJ * INNER
    if N_CHUNKS == 1:
        code = group_codes(x, s3, m3, rc3, ok, QMAX, OFF, SYMMETRIC, BITS, FASTDIV)
        byte = tl.sum(code << (k3 * BITS), axis=1)               # (BLOCK_J, BLOCK_I)
        tl.store(qb + (j2 * INNER + i2), byte.to(tl.uint8), mask=(j2 < NJ) & (i2 < INNER))
    else:
        for c in range(N_CHUNKS):
            jj = c * BLOCK_J + j3
            m = imask & (jj < NJ)
            x = load_f32(xb + ((jj * PER + k3) * INNER + i3), m, IN_BF16)
            code = group_codes(x, s3, m3, rc3, ok, QMAX, OFF, SYMMETRIC, BITS, FASTDIV)
            byte = tl.sum(code << (k3 * BITS), axis=1)
            jj2 = c * BLOCK_J + j2
            tl.store(qb + (jj2 * INNER + i2), byte.to(tl.uint8), mask=(jj2 < NJ) & (i2 < INNER))


# ----------------------------------------------------------------------------------------------------
# dequantize kernels


# Dequantize (and unpack) groups of G contiguous elements, last axis (inner == 1).
# Computes: x = float(code) * scale_s + mn_s (two rounded fp32 ops, no FMA), rounded to the output dtype
#   (fp16 saturated at +-65504: store_out); codes unpacked from bytes in registers by join.
# Grid: (cdiv(R, BLOCK_R), cdiv(G // PER, BLOCK_J)); tile (BLOCK_R, BLOCK_J) bytes -> (BLOCK_R, BLOCK_J*PER).
# Bytes: reads R*G/PER code bytes + 2 R metadata, writes R*G output elements.
@triton.jit
def _dequant_rows_kernel(q_ptr, s_ptr, m_ptr, o_ptr, R, G,
                         BITS: tl.constexpr, PER: tl.constexpr, OUT_KIND: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr):
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    jb = tl.program_id(1) * BLOCK_J
    NJ = G // PER
    rr = tl.arange(0, BLOCK_R)
    r1mask = (r0 + rr) < R
    s32 = tl.load(s_ptr + r0 + rr, mask=r1mask, other=0.0).to(tl.float32)
    m32 = tl.load(m_ptr + r0 + rr, mask=r1mask, other=0.0).to(tl.float32)
    r2 = rr[:, None]
    j2 = jb + tl.arange(0, BLOCK_J)[None, :]
    byte = tl.load(q_ptr + r0 * NJ + (r2 * NJ + j2), mask=((r0 + r2) < R) & (j2 < NJ), other=0).to(tl.int32)
    code = unpack_last(byte, BLOCK_R, BLOCK_J, PER, BITS)
    x = code.to(tl.float32) * s32[:, None] + m32[:, None]
    e2 = jb * PER + tl.arange(0, BLOCK_J * PER)[None, :]
    store_out(o_ptr + r0 * G + (r2 * G + e2), x, ((r0 + r2) < R) & (e2 < G), OUT_KIND)


# Dequantize (and unpack) groups of G elements strided by `inner`, columns layout (inner > 1).
# Computes: as the rows kernel; PER codes along the axis come from one byte.
# Grid: (outer * n // G, cdiv(G // PER, BLOCK_J), cdiv(inner, BLOCK_I)); tile (BLOCK_J, PER, BLOCK_I).
# Bytes: reads outer*n*inner/PER code bytes + 2 metadata per group, writes outer*n*inner outputs.
@triton.jit
def _dequant_cols_kernel(q_ptr, s_ptr, m_ptr, o_ptr, G, INNER,
                         BITS: tl.constexpr, PER: tl.constexpr, OUT_KIND: tl.constexpr, I64: tl.constexpr,
                         BLOCK_J: tl.constexpr, BLOCK_I: tl.constexpr):
    og = tl.program_id(0).to(tl.int64)
    jb = tl.program_id(1) * BLOCK_J
    i0 = tl.program_id(2) * BLOCK_I
    NJ = G // PER
    ii = i0 + tl.arange(0, BLOCK_I)
    i1mask = ii < INNER
    s32 = tl.load(s_ptr + og * INNER + ii, mask=i1mask, other=0.0).to(tl.float32)
    m32 = tl.load(m_ptr + og * INNER + ii, mask=i1mask, other=0.0).to(tl.float32)
    j2 = jb + tl.arange(0, BLOCK_J)[:, None]
    if I64:
        j2 = j2.to(tl.int64)
    i2 = ii[None, :]
    mask2 = (j2 < NJ) & (i2 < INNER)
    byte = tl.load(q_ptr + og * NJ * INNER + (j2 * INNER + i2), mask=mask2, other=0).to(tl.int32)
    k3 = tl.arange(0, PER)[None, :, None]
    code = (byte[:, None, :] >> (k3 * BITS)) & ((1 << (8 // PER)) - 1)
    x = code.to(tl.float32) * s32[None, None, :] + m32[None, None, :]
    offs = (j2[:, None, :] * PER + k3) * INNER + i2[:, None, :]
    store_out(o_ptr + og * G * INNER + offs, x, mask2[:, None, :] & (k3 < PER), OUT_KIND)


# ----------------------------------------------------------------------------------------------------
# quantile / percentile clip kernel


# Per-row quantile of x (or of |x|) along contiguous rows of N elements, and optionally the clip.
# Computes: tau = s[LO] + FRAC * (s[HI] - s[LO]) on the sorted row (tl.sort), three rounded fp32 ops;
#   ABS: of |x| (percentile_clip); CLIP: also o = min(max(x, -tau), tau) as fp32.
# Grid: (cdiv(R, BLOCK_R),); tile (BLOCK_R, BLOCK_S), BLOCK_S = next_pow2(N), padding sorted as +inf.
# Bytes: reads R*N inputs, writes R taus (+ R*N fp32 clipped values with CLIP).
@triton.jit
def _quantile_rows_kernel(x_ptr, t_ptr, o_ptr, R, N, LO, HI, FRAC,
                          ABS: tl.constexpr, CLIP: tl.constexpr, IN_BF16: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, RANK: tl.constexpr):
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    rr = tl.arange(0, BLOCK_R)
    r2 = rr[:, None]
    c2 = tl.arange(0, BLOCK_S)[None, :]
    m = ((r0 + r2) < R) & (c2 < N)
    offs = r0 * N + (r2 * N + c2)
    x = load_f32(x_ptr + offs, m, IN_BF16)
    v = tl.abs(x) if ABS else x
    isn = v != v
    nnan = tl.sum((m & isn).to(tl.int32), axis=1)
    key = tl.where(m & (v == v), v, float("inf"))
    tau = sorted_quantile(key, nnan, N, LO, HI, FRAC, BLOCK_S, RANK)
    tl.store(t_ptr + r0 + rr, tau, mask=(r0 + rr) < R)
    if CLIP:
        tl.store(o_ptr + offs, clip_np(x, tau[:, None]), mask=m)


# ----------------------------------------------------------------------------------------------------
# launchers (shared with packing.py)


def p2(n: int) -> int:
    return _np2(max(int(n), 1))


def _warps(tile: int) -> int:
    return 8 if tile >= 8192 else 4


def launch_quantize(x: torch.Tensor, bits: int, G: int, axis: int, meta: torch.dtype, symmetric: bool,
                    per: int):
    """Run the quantize kernel on contiguous ``x``; ``per`` codes per byte (1: plain codes).

    Returns ``(q, scale, mn)``: q uint8 with ``x.shape[axis] // per`` along ``axis``; metadata in ``meta``.
    """
    x = x.contiguous()
    shape = tuple(x.shape)
    outer, n, inner = C.axis_view(shape, axis)
    qshape = shape[:axis] + (n // per,) + shape[axis + 1:]
    q = torch.empty(qshape, dtype=torch.uint8, device=x.device)
    mshape = C.meta_shape(shape, axis, G)
    scale = torch.empty(mshape, dtype=meta, device=x.device)
    mn = torch.empty(mshape, dtype=meta, device=x.device)
    in_bf16 = x.dtype == torch.bfloat16
    xin = x.view(torch.int16) if in_bf16 else x
    if symmetric:
        qmax, off = float(2 ** (bits - 1) - 1), float(2 ** (bits - 1))
    else:
        qmax, off = float(2 ** bits - 1), 0.0
    NJ = G // per
    BJ = p2(NJ)
    BG = BJ * per
    n_groups = outer * (n // G)
    fast = not interpreting()
    common = dict(QMAX=qmax, OFF=off, BITS=bits, PER=per, SYMMETRIC=bool(symmetric), IN_BF16=in_bf16,
                  FASTDIV=fast, enable_fp_fusion=False)
    if inner == 1:
        if BG <= MAX_SINGLE:
            BR = min(max(1, TILE // BG), p2(n_groups))
            _quant_last_kernel[(_cdiv(n_groups, BR),)](xin, q, scale, mn, n_groups, G, BLOCK_R=BR, BLOCK_G=BG,
                                                            num_warps=_warps(BR * BG), **common)
        else:
            BJc = max(1, TILE // per)
            _quant_rows_kernel[(n_groups,)](xin, q, scale, mn, n_groups, G, BLOCK_R=1, BLOCK_J=BJc,
                                            N_CHUNKS=_cdiv(NJ, BJc), num_warps=_warps(BJc * per), **common)
    else:
        i64 = G * inner >= 2 ** 31
        if BG <= MAX_SINGLE:
            BI = min(p2(inner), max(1, TILE_COLS // BG))
            chunks, BJc = 1, BJ
        else:
            BI = min(p2(inner), 32)
            BJc = max(1, TILE_COLS // (per * BI))
            chunks = _cdiv(NJ, BJc)
        nib = _cdiv(inner, BI)
        _quant_cols_kernel[(n_groups * nib,)](xin, q, scale, mn, G, inner, nib, I64=i64, BLOCK_J=BJc, BLOCK_I=BI,
                                              N_CHUNKS=chunks, num_warps=COLS_WARPS, **common)
    return q, scale, mn


def launch_dequantize(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int, G: int, axis: int,
                      out: torch.dtype, per: int) -> torch.Tensor:
    """Run the dequantize kernel; ``q`` holds ``per`` codes per byte along ``axis`` (1: plain codes)."""
    q, scale, mn = q.contiguous(), scale.contiguous(), mn.contiguous()
    qshape = tuple(q.shape)
    outer, nq, inner = C.axis_view(qshape, axis)
    n = nq * per
    oshape = qshape[:axis] + (n,) + qshape[axis + 1:]
    o = torch.empty(oshape, dtype=out, device=q.device)
    oview = o.view(torch.int16) if out == torch.bfloat16 else o
    NJ = G // per
    n_groups = outer * (n // G)
    kind = OUT_KIND_CODE[out]
    if inner == 1:
        BJ = min(p2(NJ), max(1, TILE // per))
        BR = min(max(1, TILE // (BJ * per)), p2(n_groups))
        grid = (_cdiv(n_groups, BR), _cdiv(NJ, BJ))
        _dequant_rows_kernel[grid](q, scale, mn, oview, n_groups, G, BITS=bits, PER=per, OUT_KIND=kind,
                                   BLOCK_R=BR, BLOCK_J=BJ, num_warps=_warps(BR * BJ * per),
                                   enable_fp_fusion=False)
    else:
        BI = min(p2(inner), 128)
        BJ = min(p2(NJ), max(1, TILE // (per * BI)))
        grid = (n_groups, _cdiv(NJ, BJ), _cdiv(inner, BI))
        _dequant_cols_kernel[grid](q, scale, mn, oview, G, inner, BITS=bits, PER=per, OUT_KIND=kind,
                                   I64=G * inner >= 2 ** 31, BLOCK_J=BJ, BLOCK_I=BI,
                                   num_warps=_warps(BJ * per * BI), enable_fp_fusion=False)
    return o


def use_rank() -> bool:
    """Rank selection instead of tl.sort: under the interpreter only (``INTERP_RANK``)."""
    return bool(INTERP_RANK) and interpreting()


def sort_rows(row_elems: int, rows: int) -> int:
    """Rows per program of a sorting kernel. On the GPU: one. Measured on an H200 (Triton 3.6): with
    16 rows of 64 keys in one program, a row holding an inf / NaN changed the order statistics of the
    other rows (tl.sort of a 2-D tile along dim 1); one row per program gave the reference's bits.
    Under the interpreter a program costs per op, not per element (NumPy runs each op on the whole
    tile): take up to INTERP_TILE (the rank selection holds BLOCK_S times the tile)."""
    if not interpreting():
        return 1
    tile = INTERP_TILE // row_elems
    return min(max(1, tile // row_elems), p2(rows))


def _sort_tile(n: int, rows: int):
    BS = p2(n)
    return sort_rows(BS, rows), BS


def launch_quantile_rows(x: torch.Tensor, n: int, rho, clip: bool):
    """Quantile (of |x| when ``clip``) of each contiguous row of ``n`` elements of contiguous ``x``.

    Returns ``(tau (rows,) fp32, clipped fp32 like x or None)``.
    """
    rows = x.numel() // n
    lo, hi, frac = quantile_index(n, rho)
    tau = torch.empty(rows, dtype=torch.float32, device=x.device)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device) if clip else None
    if rows == 0:
        return tau, out
    if n > MAX_SORT:                                   # torch.sort (exact) + the same three fp32 ops
        xf = x.reshape(rows, n).float()
        v = xf.abs() if clip else xf
        s = torch.sort(v, dim=1).values               # NaN sorts last, as in NumPy
        s_lo, s_hi = s[:, lo], s[:, hi]
        f = torch.tensor(frac, dtype=torch.float32, device=x.device)
        tau.copy_(torch.add(s_lo, torch.mul(f, torch.sub(s_hi, s_lo))))
        if clip:
            t = tau[:, None]
            y = torch.where((xf > -t) | torch.isnan(xf), xf, -t)
            out.copy_(torch.where((y < t) | torch.isnan(y), y, t).reshape(x.shape))
        return tau, out
    in_bf16 = x.dtype == torch.bfloat16
    xin = x.view(torch.int16) if in_bf16 else x
    BR, BS = _sort_tile(n, rows)
    _quantile_rows_kernel[(_cdiv(rows, BR),)](xin, tau, out if clip else tau, rows, n, lo, hi, frac,
                                                    ABS=bool(clip), CLIP=bool(clip), IN_BF16=in_bf16,
                                                    BLOCK_R=BR, BLOCK_S=BS, RANK=use_rank(),
                                                    num_warps=_warps(BR * BS),
                                                    enable_fp_fusion=False)
    return tau, out


def out_dtype_arg(out_dtype) -> torch.dtype:
    """out_dtype (NumPy / torch dtype or string) as a torch dtype, with the reference's error message."""
    if nx.dtype_name(out_dtype) not in nx.OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype!r} is not supported; choose one of {nx.OUT_DTYPES}")
    return C.torch_dtype(out_dtype)


def dequant_args(codes, scale, mn, group_size, axis, out_dtype, *, name="codes"):
    """Validate dequantize arguments like the reference; returns (axis, G, out torch dtype)."""
    allow = interpreting()
    C.check_codes(codes, name, allow_cpu=allow)
    axis = nx.normalize_axis(axis, codes.dim())
    return axis, allow, out_dtype_arg(out_dtype)


# ----------------------------------------------------------------------------------------------------
# public API


def quantize(x, bits: int, group_size, axis: int = -1, meta_dtype=np.float16, *, symmetric: bool = False):
    """Mirrors `kvq.reference.quant.quantize` on a torch tensor; returns ``(codes, scale, mn)``.

    Differences: ``x`` is a torch float16 / bfloat16 / float32 tensor on a CUDA device (the CPU only
    under ``TRITON_INTERPRET=1``); codes are a uint8 tensor, scale / mn torch.float16 or torch.float32
    tensors. NaN / inf input is detected from the metadata (the kernel propagates NaN into the group's
    scale) and raises ValueError while ``kvq.fast.validation`` is on; with validation off the group's
    scale comes back NaN and its codes are unspecified (but in range).
    """
    axis, bits, G, meta = C.quant_args(x, bits, group_size, axis, meta_dtype, allow_cpu=interpreting())
    codes, scale, mn = launch_quantize(x, bits, G, axis, meta, symmetric, per=1)
    C.check_meta(x, scale, mn)
    return codes, scale, mn


def dequantize(codes, scale, mn, group_size, axis: int = -1, out_dtype=np.float16):
    """Mirrors `kvq.reference.quant.dequantize`: ``x_hat = float32(code) * scale_s + mn_s``, rounded to out_dtype.

    float16 output saturates at +-65504 (``numerics.to_out``), in the kernel. Differences: torch
    tensors in and out; ``out_dtype="bfloat16"`` (or torch.bfloat16) returns a torch.bfloat16 tensor
    (the reference returns float32 values that are exactly bf16).
    """
    axis, allow, out = dequant_args(codes, scale, mn, group_size, axis, out_dtype)
    G = check_groups(tuple(codes.shape), axis, group_size, "codes")
    C.check_meta_shapes(tuple(codes.shape), scale, mn, G, axis, allow_cpu=allow)
    return launch_dequantize(codes, scale, mn, 8, G, axis, out, per=1)


def quantile(a, rho: float, axis: int = -1):
    """Mirrors `kvq.reference.quant.quantile`: the ``rho``-quantile along ``axis``, linear interpolation.

    The same rule and op order: the values sorted in fp32, ``h = (n - 1) * rho`` in float64 on the
    host, ``tau = s[lo] + frac * (s[hi] - s[lo])`` as three rounded fp32 operations; NaN input raises
    the reference's ValueError. Differences: ``a`` is a torch float16 / bfloat16 / float32 tensor on a
    CUDA device (the CPU only under ``TRITON_INTERPRET=1``); the result is a torch.float32 tensor (0-d
    for 1-D input); the NaN check costs a read of ``a`` and runs only while ``kvq.fast.validation`` is
    on (with it off NaN sorts last, as in NumPy). One kernel: a program sorts whole rows (``tl.sort``); rows longer than ``MAX_SORT`` are
    sorted by ``torch.sort`` and interpolated by torch's fp32 elementwise ops (the same bits).
    """
    rho = check_quantile_ratio(rho, "rho")                   # the reference's first check: True is not 1
    return C.quantile_rows(a, rho, axis, _launch_quantile_no_nan, clip=False, allow_cpu=interpreting())


def _launch_quantile_no_nan(x: torch.Tensor, n: int, rho, clip: bool):
    """``launch_quantile_rows`` after the NaN check (run once the arguments have passed theirs)."""
    C.check_no_nan(x, "a")
    return launch_quantile_rows(x, n, rho, clip)


def percentile_clip(x, ratio: float, axis: int = -1):
    """Mirrors `kvq.reference.quant.percentile_clip`: ``tau = quantile_ratio(|x|)`` per row along ``axis``, then clip.

    Returns ``(x_clipped, tau)`` as torch.float32 tensors (x's shape; tau without ``axis``), in ONE
    kernel (sort, interpolate, clip). The clip is ``min(max(x, -tau), tau)`` with NumPy's choice
    between equal arguments (the second), so zero signs agree. Differences: torch tensors (see
    :func:`quantile`); NaN / inf raise ValueError while ``kvq.fast.validation`` is on (a full read of
    ``x``); with it off NaN propagates into the clipped values and tau.
    """
    ratio = check_quantile_ratio(ratio, "ratio")             # the reference's first check, its message
    return C.quantile_rows(x, ratio, axis, launch_quantile_rows, clip=True, allow_cpu=interpreting())


quantile_index = C.quantile_index     # host-side, shared with the other backend (kvq.fast.common)
check_ratio = C.check_ratio


@functools.cache
def interpreting() -> bool:
    """True when kvq's Triton kernels run through Triton's CPU interpreter: a fact fixed once per process.

    ``@triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a kernel, i.e. when the kernel's module
    is imported, and returns an ``InterpretedFunction`` (run on the CPU with NumPy) or a ``JITFunction``
    (compiled for the GPU). So the rule is: the variable's value in force when this module is first
    imported decides, for the whole process (every kvq Triton module but ``rotate`` imports it before
    decorating its own kernels). The answer is read from Triton itself, the type of this module's kernels,
    and cached; changing the variable later changes nothing (set it before importing kvq's Triton modules,
    or run a subprocess with its own environment)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import KernelInterface

    kernels = [k for k in globals().values() if isinstance(k, KernelInterface)]
    return any(isinstance(k, InterpretedFunction) for k in kernels)
