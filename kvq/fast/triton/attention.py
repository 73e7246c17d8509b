"""Triton FP16 flash-decoding: attention of a few query tokens over KV-cache segments, split along keys.

Mirrors ``kvq.reference.attention`` (``partial_attention``, ``merge``, ``decode_attention``) within the
tolerance of numerics contract rule 7 (order-dependent reductions are not bit-exact). This is the
FP16 baseline that the quantized decode kernels are compared against (flash-decoding, Dao et al.
2023): every (batch, kv head) is split along the sequence into chunks, each program reads its K / V
chunk once for all ``G_q * T_q`` query rows of that kv head (GQA), and a second kernel merges the
chunks of all segments by log-sum-exp.

    out, lse = decode_attention(q, [(k_sink, v_sink), (k_recent, v_recent)])   # q (B, H_q, T_q, D)
    o, lse = partial_attention(q, k, v)
    o, lse = merge([(o1, lse1), (o2, lse2)])

Numerics: fp32 accumulation everywhere. fp16 / bf16 inputs: scores scaled by scale * log2(e) in one
multiply and exponentiated with exp2; ``P @ V`` with P rounded to the input dtype (tensor cores, as
flash attention does). fp32 inputs: IEEE fp32 dot products (no TF32), accurate exp / log (libdevice),
P kept in fp32. Partial outputs and lse stay fp32 until the merge; the output is rounded once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvq.fast import common as C
from kvq.reference.attention import pairs_arg

from kvq.fast.common import cdiv as _cdiv, next_pow2 as _np2  # host grid arithmetic
from . import _launch as L
from .quant import OUT_KIND, store_out, interpreting

__all__ = ["partial_attention", "merge", "decode_attention"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_SM_COUNT = {}


@triton.jit
def _ld(ptrs, mask, BF16_BITS: tl.constexpr):
    """Load a K / V / q tile; BF16_BITS (interpreter only, whose bf16 dot is wrong): bf16 given as int16
    bits, widened exactly to fp32."""
    if BF16_BITS:
        b = tl.load(ptrs, mask=mask, other=0)
        x = ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """Accurate exp: libdevice's on the GPU (tl.exp is ex2.approx there), NumPy's in the interpreter."""
    if LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    """Accurate natural log (libdevice on the GPU)."""
    if LIBDEVICE:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _tree_dot(q_ptrs, rmask, sq_d, k_rows, cmask, sk_d, LO: tl.constexpr, N: tl.constexpr,
              BF16_BITS: tl.constexpr):
    """q k^T over the channel chunks [16 LO, 16 (LO + N)), as a pairwise tree of 16-channel IEEE dots."""
    if N == 1:
        dc = LO * 16 + tl.arange(0, 16)
        qc = _ld(q_ptrs + dc[None, :] * sq_d, rmask[:, None], BF16_BITS).to(tl.float32)   # fp16 q: exact
        kc = _ld(k_rows + dc[None, :] * sk_d, cmask[:, None], BF16_BITS).to(tl.float32)   # fp16 K: exact
        r = tl.dot(qc, tl.trans(kc), input_precision="ieee")
    else:
        r = (_tree_dot(q_ptrs, rmask, sq_d, k_rows, cmask, sk_d, LO, N // 2, BF16_BITS)
             + _tree_dot(q_ptrs, rmask, sq_d, k_rows, cmask, sk_d, LO + N // 2, N // 2, BF16_BITS))
    return r


@triton.jit
def softmax_step(s, m_i, l_i, PRECISE: tl.constexpr, LIBDEVICE: tl.constexpr, NAT2: tl.constexpr = False):
    """One online-softmax step over a block of scores s (BLOCK_M, N) (masked keys at -inf): returns
    ``(m_new, alpha, p, l_new)``, alpha = exp(m_i - m_new) rescaling the running sums. PRECISE: natural
    units, accurate exp; NAT2: natural units, exp as exp2 of (s - m) log2(e) (the log2(e) rounding
    touches only the differences, not the maximum); else s is in log2 units, exp2. (Shared with the
    quantized decode kernels.)"""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if PRECISE:
        alpha = _exp(m_i - m_new, LIBDEVICE)
        p = _exp(s - m_new[:, None], LIBDEVICE)
    elif NAT2:
        alpha = tl.exp2((m_i - m_new) * 1.4426950408889634)
        p = tl.exp2((s - m_new[:, None]) * 1.4426950408889634)
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def query_rows(q_ptr, bh, mb, H_KV, sq_b, sq_h, sq_t, T_Q, M, G_Q: tl.constexpr, BLOCK_M: tl.constexpr):
    """The query rows of program (bh, mb): row m of kv head (b, hk) is query head hk * G_q + m // T_q,
    token m % T_q (GQA). Returns ``(b, hk, h, t, rmask, q_ptrs)``, q_ptrs (BLOCK_M, 1) at channel 0."""
    b = bh // H_KV
    hk = bh % H_KV
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    h = hk * G_Q + rows // T_Q
    t = rows % T_Q
    q_off = b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h + t.to(tl.int64) * sq_t
    return b, hk, h, t, rmask, q_ptr + q_off[:, None]


@triton.jit
def store_split(o_ptr, m_ptr, l_ptr, b, h, t, H_Q, T_Q, S_TOTAL, split, acc, m_i, l_i, rmask, cols,
                 D: tl.constexpr):
    """Store one split's un-normalized (acc, m, l) at partial slot ``split`` of rows (b, h, t): o (rows,
    S_TOTAL, D) with acc's columns at channels ``cols``, m and l (rows, S_TOTAL)."""
    grow = ((b * H_Q + h) * T_Q + t).to(tl.int64) * S_TOTAL + split               # (row, split) index
    tl.store(o_ptr + grow[:, None] * D + cols[None, :], acc, mask=rmask[:, None])
    tl.store(m_ptr + grow, m_i, mask=rmask)
    tl.store(l_ptr + grow, l_i, mask=rmask)


@triton.jit
def _attend_block(q, q_ptrs, rmask, sq_d, k_base, v_base, n0, end, sk_t, sk_d, sv_t, sv_d, qk_scale,
                  m_i, l_i, acc, D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr,
                  BF16_BITS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Keys [n0, n0 + BLOCK_N) (masked at ``end``): one online-softmax update of (m_i, l_i, acc).

    Fast mode (fp16 / bf16): scores in log2 units (``qk_scale`` = scale * log2 e), exp2, P rounded to
    the input dtype for the tensor-core ``P @ V``. PRECISE (fp32 inputs, or fp16 K / V widened exactly as
    they load): IEEE fp32 dots, the score dot split into chunks of 16 channels summed as a pairwise tree (a
    sequential fp32 sum over all D channels is about twice as far from the truth as the reference's NumPy
    matmul), natural units, accurate exp, P in fp32.
    """
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < end
    c64 = cols.to(tl.int64)
    d = tl.arange(0, D)
    if PRECISE:
        s = _tree_dot(q_ptrs, rmask, sq_d, k_base + c64[:, None] * sk_t, cmask, sk_d, 0, D // 16, BF16_BITS)
    else:
        k = _ld(k_base + c64[:, None] * sk_t + d[None, :] * sk_d, cmask[:, None], BF16_BITS)
        s = tl.dot(q, tl.trans(k))
    s = tl.where(cmask[None, :], s * qk_scale, float("-inf"))
    m_new, alpha, p, l_i = softmax_step(s, m_i, l_i, PRECISE, LIBDEVICE)
    v = _ld(v_base + c64[:, None] * sv_t + d[None, :] * sv_d, cmask[:, None], BF16_BITS)
    if PRECISE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")                   # fp16 V: exact
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# Partial attention of one KV split (flash-decoding, split-K).
# Computes: for the G_q * T_q query rows of kv head (b, hk) (row m -> query head hk*G_q + m // T_q,
#   token m % T_q), online softmax over keys [sp*KPS, min((sp+1)*KPS, T_k)) in blocks of BLOCK_N:
#   s = q k^T * scale (times log2 e in fast mode), m = max s, l = sum exp(s - m), acc = sum exp(s - m) v,
#   all fp32. Writes (acc, m, l) of split SPLIT0 + sp (un-normalized; the merge kernel normalizes).
# Grid: (B * H_kv, n_splits, cdiv(G_q * T_q, BLOCK_M)); BLOCK_M >= 16 rows (tl.dot), padded and masked.
# Bytes: reads the segment's K and V once per row block (once when G_q * T_q <= BLOCK_M), the queries,
#   and writes B * H_q * T_q * (D + 2) fp32 values per split.
@triton.jit(do_not_specialize=["T_Q", "T_K", "M", "KPS", "S_TOTAL", "SPLIT0"])
def _partial_kernel(q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr,
                    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
                    H_Q, H_KV, T_Q, T_K, M, KPS, S_TOTAL, SPLIT0, qk_scale,
                    G_Q: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISE: tl.constexpr, TIGHT: tl.constexpr, NBLK: tl.constexpr,
                    BF16_BITS: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    mb = tl.program_id(2)
    LIBDEVICE: tl.constexpr = TIGHT                    # TIGHT <=> compiled for the GPU
    b, hk, h, t, rmask, q_ptrs = query_rows(q_ptr, bh, mb, H_KV, sq_b, sq_h, sq_t, T_Q, M, G_Q, BLOCK_M)
    d = tl.arange(0, D)
    if PRECISE:
        q = tl.zeros((BLOCK_M, 16), tl.float32)        # unused: the precise path loads q in chunks
    else:
        q = _ld(q_ptrs + d[None, :] * sq_d, rmask[:, None], BF16_BITS)
    k_base = k_ptr + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
    v_base = v_ptr + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
    start = sp * KPS
    end = tl.minimum(start + KPS, T_K)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # TIGHT (GPU): loop bounds from the program id. The interpreter (with NumPy 2) cannot take a
    # runtime trip count, so there the loop runs a constexpr NBLK = KPS // BLOCK_N times and the
    # keys past `end` are masked.
    if TIGHT:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, q_ptrs, rmask, sq_d, k_base, v_base, n0, end, sk_t, sk_d, sv_t,
                                          sv_d, qk_scale, m_i, l_i, acc, D, BLOCK_N, PRECISE, BF16_BITS,
                                          LIBDEVICE)
    else:
        for it in range(0, NBLK * BLOCK_N, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, q_ptrs, rmask, sq_d, k_base, v_base, start + it, end, sk_t,
                                          sk_d, sv_t, sv_d, qk_scale, m_i, l_i, acc, D, BLOCK_N, PRECISE,
                                          BF16_BITS, LIBDEVICE)
    # store the split un-normalized: (acc, m, l). The merge weighs splits by exp(m_s - M), exact for
    # close maxima; going through lse_s = m_s + log(l_s) would round lse_s at its magnitude and cost
    # up to an ulp of |lse| in relative weight.
    store_split(o_ptr, m_ptr, l_ptr, b, h, t, H_Q, T_Q, S_TOTAL, SPLIT0 + sp, acc, m_i, l_i, rmask, d, D)


@triton.jit
def _merge_max(m_ptr, row, s0, S, mx, BLOCK_S: tl.constexpr):
    s_off = s0 + tl.arange(0, BLOCK_S)
    ms = tl.load(m_ptr + row * S + s_off, mask=s_off < S, other=float("-inf"))
    return tl.maximum(mx, ms)


@triton.jit
def _merge_acc(o_ptr, m_ptr, l_ptr, row, s0, S, D, M_safe, num, den, BLOCK_S: tl.constexpr,
               BLOCK_D: tl.constexpr, HAS_L: tl.constexpr, LOG2: tl.constexpr, LIBDEVICE: tl.constexpr):
    s_off = s0 + tl.arange(0, BLOCK_S)
    smask = s_off < S
    d = tl.arange(0, BLOCK_D)
    ms = tl.load(m_ptr + row * S + s_off, mask=smask, other=float("-inf"))
    if LOG2:
        w = tl.exp2(ms - M_safe)                                       # 0 for empty partials
    else:
        w = _exp(ms - M_safe, LIBDEVICE)
    if HAS_L:
        ls = tl.load(l_ptr + row * S + s_off, mask=smask, other=0.0)
        wl = w * ls
    else:
        wl = w
    o = tl.load(o_ptr + (row * S + s_off)[:, None] * D + d[None, :], mask=smask[:, None] & (d < D)[None, :],
                other=0.0)
    return num + tl.sum(w[:, None] * o, axis=0), den + wl


# Log-sum-exp merge of S partials per row.
# Computes: M = max_s m_s; w_s = exp(m_s - M) (exp2 when m is in log2 units); o = sum_s w_s o_s /
#   sum_s w_s l_s; lse = M + log(sum_s w_s l_s) (natural log). Partials are either the decode kernel's
#   un-normalized (acc, m, l) or normalized (o, lse) pairs (HAS_L = False: l = 1, m = lse). Rows whose
#   partials are all empty (m = -inf) get o = 0, lse = -inf.
# Grid: (rows,); each program loops over the S partials in blocks of BLOCK_S (twice: max, then sums).
# Bytes: reads rows * S * (D + 2) fp32 values, writes rows * D outputs and rows lse.
@triton.jit(do_not_specialize=["S"])
def _merge_kernel(o_ptr, m_ptr, l_ptr, out_ptr, lse_out_ptr, S, D,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, OUT_KIND: tl.constexpr, HAS_L: tl.constexpr,
                  LOG2: tl.constexpr, TIGHT: tl.constexpr, NSB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    LIBDEVICE: tl.constexpr = TIGHT
    mx = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    # TIGHT (GPU): runtime trip count; the interpreter needs a constexpr one (NSB blocks, masked).
    if TIGHT:
        for s0 in range(0, S, BLOCK_S):
            mx = _merge_max(m_ptr, row, s0, S, mx, BLOCK_S)
    else:
        for s0 in range(0, NSB * BLOCK_S, BLOCK_S):
            mx = _merge_max(m_ptr, row, s0, S, mx, BLOCK_S)
    M = tl.max(mx, axis=0)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    num = tl.zeros((BLOCK_D,), tl.float32)
    den = tl.zeros((BLOCK_S,), tl.float32)
    if TIGHT:
        for s0 in range(0, S, BLOCK_S):
            num, den = _merge_acc(o_ptr, m_ptr, l_ptr, row, s0, S, D, M_safe, num, den, BLOCK_S, BLOCK_D,
                                  HAS_L, LOG2, LIBDEVICE)
    else:
        for s0 in range(0, NSB * BLOCK_S, BLOCK_S):
            num, den = _merge_acc(o_ptr, m_ptr, l_ptr, row, s0, S, D, M_safe, num, den, BLOCK_S, BLOCK_D,
                                  HAS_L, LOG2, LIBDEVICE)
    den_t = tl.sum(den, axis=0)
    empty = den_t == 0.0
    den_safe = tl.where(empty, 1.0, den_t)
    res = tl.where(empty, 0.0, tl.div_rn(num, den_safe))
    d = tl.arange(0, BLOCK_D)
    store_out(out_ptr + row * D + d, res, d < D, OUT_KIND)
    if LOG2:
        lse = M_safe * 0.6931471805599453 + _log(den_safe, LIBDEVICE)
    else:
        lse = M_safe + _log(den_safe, LIBDEVICE)
    tl.store(lse_out_ptr + row, tl.where(empty, float("-inf"), lse))


# ----------------------------------------------------------------------------------------------------
# launch configuration


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4                                       # the interpreter: a few programs per KV head
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _config(D: int, dtype: torch.dtype, device: torch.device):
    """(BLOCK_N, num_warps, num_stages, min keys per split) for head dim D."""
    if device.type != "cuda":
        return 32, 4, 1, 32
    if D <= 64:
        return 128, 4, 3, 256
    if dtype == torch.float32:                         # the precise path: P @ V over 32 keys at a time
        return 32, 4, 2, 256
    if D <= 128:
        return 128, 4, 3, 256
    return 64, 8, 2, 256


def _splits(base_programs: int, T: int, block_n: int, min_keys: int, sms: int):
    """Keys per split and number of splits: about 4 waves of programs over the SMs, >= min_keys each."""
    want = max(1, _cdiv(4 * sms, max(base_programs, 1)))
    want = min(want, max(1, _cdiv(T, min_keys)))
    kps = _cdiv(_cdiv(T, want), block_n) * block_n
    return kps, _cdiv(T, kps)


# ----------------------------------------------------------------------------------------------------
# validation


def check_d(D: int):
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"head dim D={D} is not supported by the Triton decode kernel; it takes powers "
                         f"of two from 16 to 256 (use kvq.reference.attention for others)")


# ----------------------------------------------------------------------------------------------------
# public API


def decode_attention(q, segments, *, scale=None):
    """Mirrors `kvq.reference.attention.decode_attention`: attention of q over KV segments, every key visible.

    Args:
        q: (B, H_q, T_q, D) float16 / bfloat16 / float32 torch tensor (any strides).
        segments: non-empty list of ``(k, v)``, each (B, H_kv, T_i, D) in q's dtype (any strides; T_i
            may be 0). D must be a power of two in [16, 256].
    Returns:
        ``(o, lse)``: o (B, H_q, T_q, D) in q's dtype (the reference returns float32), lse (B, H_q, T_q)
        float32, natural log.
    Differences: torch tensors on a CUDA device (the CPU under ``TRITON_INTERPRET=1``); the result is
    rounded once to q's dtype; inputs are not checked for NaN / inf (a full read of the cache), NaN
    propagates; float64 is refused.
    """
    segments = pairs_arg(segments, "segments", "(k, v)")       # the reference's TypeError for None / a string
    if not segments:
        raise ValueError("decode_attention needs at least one (k, v) segment; got an empty list")
    allow = interpreting()
    for i, seg in enumerate(segments):
        if not isinstance(seg, (tuple, list)) or len(seg) != 2:
            raise ValueError(f"segment {i} must be a pair (k, v); got {type(seg).__name__}")
        try:
            C.check_qkv(q, seg[0], seg[1], allow_cpu=allow)
        except (ValueError, TypeError) as err:
            raise type(err)(f"segment {i}: {err}") from err
    B, H_q, T_q, D = q.shape
    H_kv = segments[0][0].shape[1]
    for i, (k, _) in enumerate(segments):
        if k.shape[1] != H_kv:
            raise ValueError(f"segment {i}: has H_kv={k.shape[1]}, segment 0 has H_kv={H_kv}")
    check_d(D)
    sc = C.softmax_scale(scale, D)
    dev = q.device
    out = torch.empty((B, H_q, T_q, D), dtype=q.dtype, device=dev)
    lse = torch.empty((B, H_q, T_q), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse
    _, m_blocks = row_blocks(H_q // H_kv, T_q)
    plan, S = split_plan(segments, B * H_kv * m_blocks, q.dtype, dev)
    if S == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    rows = B * H_q * T_q
    parts = partial_buffers(rows, S, D, dev)
    precise = q.dtype == torch.float32
    interp = interpreting()
    bits = interp and q.dtype == torch.bfloat16         # the interpreter computes bf16 dots on raw bits:
    precise = precise or bits                           # there bf16 is widened to fp32 in the kernel
    launch_partials(q, plan, parts, S, H_kv, sc, precise, bits)
    merge_launch(*parts, out, lse, rows, S, D, log2=not precise)
    return out, lse


def row_blocks(G_q: int, T_q: int):
    """``(BLOCK_M, blocks)``: the G_q * T_q query rows of a kv head in blocks of BLOCK_M (>= 16 for tl.dot)."""
    M = G_q * T_q
    BLOCK_M = max(16, min(_np2(M), 64))
    return BLOCK_M, _cdiv(M, BLOCK_M)


def partial_buffers(rows: int, S: int, D: int, dev: torch.device):
    """The partial buffers of S splits per row, one fp32 allocation: o (rows, S, D), m and l (rows, S)."""
    part = torch.empty(rows * S * (D + 2), dtype=torch.float32, device=dev)
    return (part[:rows * S * D].view(rows, S, D), part[rows * S * D:rows * S * (D + 1)].view(rows, S),
            part[rows * S * (D + 1):].view(rows, S))


def split_plan(segments, base_programs: int, dtype: torch.dtype, dev: torch.device, s0: int = 0,
               min_keys: int | None = None):
    """Splits of the non-empty (k, v) segments, numbered from partial slot s0: ``(plan, end slot)``, one
    ``(k, v, T, keys per split, splits, first slot, (BLOCK_N, warps, stages))`` per segment; ``min_keys``:
    the fewest keys per split (None: the configuration's, 256 on CUDA)."""
    D = segments[0][0].shape[3]
    plan = []
    S = s0
    for k, v in segments:
        T = k.shape[2]
        if T == 0:
            continue
        kps, n, launch = segment_split(T, D, base_programs, dtype, dev, min_keys)
        plan.append((k, v, T, kps, n, S, launch))
        S += n
    return plan, S


def segment_split(T: int, D: int, base_programs: int, dtype: torch.dtype, dev: torch.device,
                  min_keys: int | None = None):
    """``(keys per split, splits, (BLOCK_N, warps, stages))`` of one segment of T > 0 keys (split_plan's
    rule, from the shape alone)."""
    block_n, warps, stages, min_keys0 = _config(D, dtype, dev)
    min_keys = min_keys0 if min_keys is None else max(int(min_keys), 1)
    kps, n = _splits(base_programs, T, block_n, min_keys, sm_count(dev))
    return kps, n, (block_n, warps, stages)


def launch_partials(q, plan, parts, S: int, H_kv: int, sc: float, precise: bool, bits: bool):
    """Launch the partial kernel of every planned segment into ``parts`` (from :func:`partial_buffers`, S
    slots per row). bits: bf16 q / K / V passed as int16 bits (the interpreter)."""
    B, H_q, T_q, D = q.shape
    G_q = H_q // H_kv
    BLOCK_M, m_blocks = row_blocks(G_q, T_q)
    interp = interpreting()
    qa = q.view(torch.int16) if bits else q
    for k, v, T, kps, n, s0, (block_n, warps, stages) in plan:
        ka, va = (k.view(torch.int16), v.view(torch.int16)) if bits else (k, v)
        L.launch(_partial_kernel, (B * H_kv, n, m_blocks),
            qa, ka, va, *parts, *q.stride(), *k.stride(), *v.stride(),
            H_q, H_kv, T_q, T, G_q * T_q, kps, S, s0, sc if precise else sc * LOG2E,
            G_Q=G_q, D=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, PRECISE=precise, TIGHT=not interp,
            NBLK=kps // block_n if interp else 0, BF16_BITS=bits, num_warps=warps, num_stages=stages)


def merge_launch(o_part, m_part, l_part, out, lse, rows: int, S: int, D: int, log2: bool):
    """Merge (rows, S, D) partials into out (rows, D) and lse (rows,); l_part None: normalized partials."""
    oview = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    has_l = l_part is not None
    consts, options = merge_config(S, D, out.dtype, has_l=has_l, log2=log2)
    L.launch(_merge_kernel, (rows,), o_part, m_part, l_part if has_l else m_part, oview, lse, S, D, **consts, **options)


def merge_config(S: int, D: int, out_dtype: torch.dtype, *, has_l: bool, log2: bool):
    """``(constexprs, options)`` of ``_merge_kernel`` over S partials of head dim D into ``out_dtype``
    (bf16 output is written as int16 bits)."""
    BLOCK_S = min(_np2(S), 16)
    BLOCK_D = _np2(D)
    consts = dict(BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, OUT_KIND=OUT_KIND[out_dtype], HAS_L=has_l, LOG2=log2,
                  TIGHT=not interpreting(), NSB=_cdiv(S, BLOCK_S) if interpreting() else 0)
    return consts, dict(num_warps=4 if BLOCK_D >= 128 else 2)


def planned_partial(grid: tuple, *, G_q: int, D: int, BLOCK_M: int, BLOCK_N: int, warps: int, stages: int,
                    kps: int, fast: bool) -> L.Launch:
    """A planned launch (``_launch.Launch``) of the partial kernel in its precise (fp32) mode over ``grid``
    (B * H_kv, splits, row blocks), ``kps`` keys per split in blocks of BLOCK_N; ``fast``: the plan's tensors
    are 16-byte aligned. Its arguments are ``launch_partials``' (q, k, v, the partials, strides, ints, scale)."""
    interp = interpreting()
    return L.Launch(_partial_kernel, grid,
                    dict(G_Q=G_q, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRECISE=True, TIGHT=not interp,
                         NBLK=kps // BLOCK_N if interp else 0, BF16_BITS=False),
                    dict(num_warps=warps, num_stages=stages), fast)


def planned_merge(rows: int, S: int, D: int, out_dtype: torch.dtype, fast: bool) -> L.Launch:
    """A planned launch of the merge kernel: ``rows`` rows of S un-normalized partials (with l) into
    ``out_dtype``; its arguments are ``merge_launch``'s (o, m, l, out, lse, S, D)."""
    return L.Launch(_merge_kernel, (rows,), *merge_config(S, D, out_dtype, has_l=True, log2=False), fast)


def partial_attention(q, k, v, *, scale=None):
    """Mirrors `kvq.reference.attention.partial_attention`: attention over one segment, with its lse.

    Returns ``(o, lse)``: o (B, H_q, T_q, D) in q's dtype (the reference returns float32), lse
    (B, H_q, T_q) float32, natural log; an empty segment gives o = 0, lse = -inf. Same kernels and
    differences as :func:`decode_attention`.
    """
    return decode_attention(q, [(k, v)], scale=scale)


def merge(partials):
    """Mirrors `kvq.reference.attention.merge`: combine ``(o_i, lse_i)`` over disjoint key segments.

    ``m = max_i lse_i``, ``w_i = exp(lse_i - m)``, ``o = sum_i w_i o_i / sum_i w_i``,
    ``lse = m + log(sum_i w_i)``; rows where every lse is -inf give o = 0, lse = -inf.
    Differences: torch tensors; o comes back in the dtype of the partial o's (the reference returns
    float32), lse float32; the partials' lse are checked for NaN / +inf only while
    ``kvq.fast.validation`` is on, and their o is not checked for NaN / inf.
    """
    partials = pairs_arg(partials, "partials", "(o, lse)")      # the reference's TypeError for None / a string
    os_, lses = C.check_partials(partials, allow_cpu=interpreting())
    shape = tuple(os_[0].shape)
    D = shape[-1]
    rows = math.prod(shape[:-1])
    dev = os_[0].device
    out = torch.empty(shape, dtype=os_[0].dtype, device=dev)
    lse = torch.empty(shape[:-1], dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse
    o_part = torch.stack([o.reshape(rows, D).float() for o in os_], dim=1).contiguous()       # (rows, S, D)
    lse_part = torch.stack([ls.reshape(rows).float() for ls in lses], dim=1).contiguous()     # (rows, S)
    merge_launch(o_part, lse_part, None, out, lse, rows, len(os_), D, log2=False)
    return out, lse
