"""Triton fused decode over the OSCAR cache's quantized pages (OSCAR section 4, "Decoding Attention
Kernel"; App. B, DecodeStep): the INT-b history is read packed, never materialized.

The history tokens of sequence b live in pages ``table[b, j]`` of the pool (token j * Pg + slot), one
row per token and KV head: codes packed along channels (D * bits / 8 bytes), a scale and a min per
group of G channels. One kernel (``_pages_kernel``) splits the history of every (batch, kv head) into
ranges of tokens, unpacks and dequantizes the keys and values in registers and runs flash-decoding with
an online softmax for all the query rows of the KV head at once (GQA: the G_q = H_q / H_kv query heads
times T_q tokens); the FP16 sink and recent window are read in place, as two segments of the
FP16-baseline partial kernel of ``kvq.fast.triton.attention``; the log-sum-exp merge kernel there
combines every partial: four attention launches per decode (pages, sink, window, merge), in the partial
layout of ``kvq.fast.triton.paged``. ``rotate_heads`` rotates the query and the output (one launch each).

    from kvq.fast.triton import oscar                     # oscar.decode_attention calls into here
    out, lse = oscar.decode_attention(cfg, calib, st, q)

Numerics (the query is rotated, ``q R_K``, fp32). ``precise`` (fp32 q: an fp32 output to meet, or a
group size under 16): keys and values are dequantized in registers as the reference does
(``code * scale + mn`` in fp32), scores by IEEE fp32 dots in a pairwise tree of 16-channel chunks,
``P @ V`` an IEEE fp32 dot, accurate exp. Otherwise (fp16 / bf16 q) the tensor cores take the codes
(exact in fp16) against fp32 factors split into hi + lo fp16 halves (``paged.split_dot``): per group g,
``s += scale_t,g (q_g @ codes_g) + mn_t,g sum(q_g)`` with q_g in ``Knobs.k_terms`` parts (3: ~33
bits, beyond fp32's 24), and ``acc[:, g] += (p * scale_g) @ codes_g + p @ mn_g`` with P in ``Knobs.v_terms`` parts (1:
rounded once, as the FP16 flash-decoding kernel does; fine for an fp16 / bf16 output); the lse keeps
about fp32 accuracy either way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvq.fast import common as C
from kvq.reference import oscar as RO

from kvq.fast.common import cdiv as _cdiv, next_pow2 as _np2  # host grid arithmetic
from . import attention as A
from .paged import codes_to, split_dot
from . import _launch as L
from .quant import OUT_KIND, store_out, unpack_last, interpreting

_check_knob = functools.partial(C.check_knob, "triton.oscar_decode")     # ValueError naming triton.oscar_decode.Knobs.<field>
_is_int = C.is_int


@dataclass(frozen=True)
class Knobs:
    """The launch knobs of ``decode``'s page kernel (None: the built-in choice), for tuning runs on the GPU.
    Immutable and hashable (``plan`` is cached per knobs); the rules behind the defaults:
    ``lab/2026-11-22-oscar-decode/KNOBS.md`` (section "Triton")."""

    num_warps: int | None = 4            # warps per program (None: 4)                         KNOBS.md#triton
    waves: float = 3                     # target programs per SM over the page grid          KNOBS.md#triton
    block_t: int | None = None           # history tokens per inner step (power of two >= 16) KNOBS.md#triton
    k_terms: int = 3                     # parts of q in the key dots (3: ~33 bits)           KNOBS.md#triton
    v_terms: int = 1                     # parts of P * scale in P @ V (1: rounded once)      KNOBS.md#triton
    num_stages: int | None = None        # software-pipelining depth (None: 2)                KNOBS.md#triton

    def __post_init__(self):
        C.check_launch_knobs("triton.oscar_decode", self)             # num_warps, waves, block_t, num_stages
        _check_knob(_is_int(self.k_terms) and self.k_terms in (1, 2, 3), "k_terms", self.k_terms, "1, 2 or 3")
        _check_knob(_is_int(self.v_terms) and self.v_terms in (1, 2, 3), "v_terms", self.v_terms, "1, 2 or 3")


#: the defaults
DEFAULT_KNOBS = Knobs()

#: the fewest keys per split of the FP16 sink and window (the partial kernel's precise path): one block of
#: keys, so that the few hundred FP16 tokens spread over several programs per (batch, kv head) instead of one
#: program each (lab/2026-11-30-planned-append/NOTE.md: at 1 x 32K, 8 programs took ~31 us per segment)
TAIL_MIN_KEYS = 32

#: the smallest K extent (reduction length) of a tensor-core ``tl.dot`` here: the fp16 operands derived
#: from 8-bit loads (the packed codes) make Triton (3.6, NVIDIA mma v2) pick the operand layout of
#: kWidth = 8, which spans 4 lanes x 8 = 32 along K; with K = 16 that layout wraps (lanes 2, 3 of a quad
#: repeat lanes 0, 1) and the single k16 mma sums half of the products twice and drops the other half
#: (wrong on the GPU, exact in the interpreter). So P @ V runs on tiles of at least KMIN tokens and the
#: key dot on groups padded to KMIN channels, the padding masked to zero.
KMIN = tl.constexpr(32)


# ---------------------------------------------------------------------------------------------------
# the page kernel


@triton.jit
def _token_rows(tab_ptr, b, n, tmask, N_TAB, H_KV, hk, PG: tl.constexpr):
    """Pool rows (int64) of history tokens n (BT,) of sequence b, KV head hk: page ``table[b, n // Pg]``,
    slot ``n % Pg``; row r holds the token's codes at ``r * (D * bits / 8)``, its metadata at ``r * D / G``."""
    pid = tl.load(tab_ptr + b * N_TAB + n // PG, mask=tmask, other=0)
    pid = tl.maximum(pid, 0).to(tl.int64)
    return (pid * H_KV + hk) * PG + n % PG


@triton.jit
def _dequant(c_ptr, s_ptr, m_ptr, row, tmask, dc, CB: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr):
    """Channels ``dc`` (N,) of the tokens at pool rows ``row`` (BT,), fp32 (BT, N): ``code * scale + mn``,
    the reference's dequantization (the GPU may contract it into one FMA: the kernel keeps FMA on for
    its IEEE dots, and one rounding less inside a dot product is within the tolerance rule)."""
    PER: tl.constexpr = 8 // BITS
    NG: tl.constexpr = CB * PER // G
    m2 = tmask[:, None]
    byte = tl.load(c_ptr + row[:, None] * CB + (dc // PER)[None, :], mask=m2, other=0).to(tl.int32)
    code = (byte >> ((dc % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
    gi = row[:, None] * NG + (dc // G)[None, :]
    sc = tl.load(s_ptr + gi, mask=m2, other=0.0).to(tl.float32)
    mn = tl.load(m_ptr + gi, mask=m2, other=0.0).to(tl.float32)
    return code.to(tl.float32) * sc + mn


@triton.jit
def _group(c_ptr, s_ptr, m_ptr, row, tmask, g, CB: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
           BT: tl.constexpr, GK: tl.constexpr):
    """Group g of the tokens at pool rows ``row`` (BT,): codes as fp16 (BT, GK) (exact; GK >= G columns,
    the G channels of the group, then zeros: a dot's K extent padded to ``KMIN``), scale and min (BT,)
    fp32. Masked tokens and the padding columns load no byte (code 0)."""
    PER: tl.constexpr = 8 // BITS
    NG: tl.constexpr = CB * PER // G
    GB: tl.constexpr = G // PER
    GKB: tl.constexpr = GK // PER
    jb = tl.arange(0, GKB)
    byte = tl.load(c_ptr + row[:, None] * CB + g * GB + jb[None, :], mask=tmask[:, None] & (jb < GB)[None, :],
                   other=0).to(tl.int32)
    codes = codes_to(unpack_last(byte, BT, GKB, PER, BITS), tl.float16, True)
    sc = tl.load(s_ptr + row * NG + g, mask=tmask, other=0.0).to(tl.float32)
    mn = tl.load(m_ptr + row * NG + g, mask=tmask, other=0.0).to(tl.float32)
    return codes, sc, mn


@triton.jit
def _tree_scores(q_ptrs, rmask, sq_d, kc_ptr, ks_ptr, km_ptr, row, tmask, LO: tl.constexpr, N: tl.constexpr,
                 CB: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr):
    """Precise q k over channel chunks [16 LO, 16 (LO + N)): IEEE fp32 dots of 16 channels of exactly
    dequantized keys, summed as a pairwise tree (BLOCK_M, BT)."""
    if N == 1:
        dc = LO * 16 + tl.arange(0, 16)
        qc = tl.load(q_ptrs + dc[None, :] * sq_d, mask=rmask[:, None], other=0.0)
        kt = _dequant(kc_ptr, ks_ptr, km_ptr, row, tmask, dc, CB, G, BITS)                  # (BT, 16)
        r = tl.dot(qc, tl.trans(kt), input_precision="ieee")
    else:
        r = (_tree_scores(q_ptrs, rmask, sq_d, kc_ptr, ks_ptr, km_ptr, row, tmask, LO, N // 2, CB, G, BITS)
             + _tree_scores(q_ptrs, rmask, sq_d, kc_ptr, ks_ptr, km_ptr, row, tmask, LO + N // 2, N // 2, CB, G,
                            BITS))
    return r


@triton.jit
def _split_scores(q_ptrs, rmask, sq_d, kc_ptr, ks_ptr, km_ptr, row, tmask, CB: tl.constexpr, G: tl.constexpr,
                  BITS: tl.constexpr, BT: tl.constexpr, BLOCK_M: tl.constexpr, TERMS: tl.constexpr,
                  SHIFT: tl.constexpr):
    """Tensor-core q k (BLOCK_M, BT): per group g, ``scale_g (q_g @ codes_g^T) + mn_g sum(q_g)``; q_g (fp32)
    goes through the dot as TERMS fp16 parts against the exact fp16 codes. The dot's K extent (channels)
    is GK = max(G, KMIN): a group of 16 channels is padded with zero columns of q and of the codes."""
    PER: tl.constexpr = 8 // BITS
    NG: tl.constexpr = CB * PER // G
    if G < KMIN:
        GK: tl.constexpr = KMIN
    else:
        GK: tl.constexpr = G
    ck = tl.arange(0, GK)
    cmask = ck < G
    s = tl.zeros((BLOCK_M, BT), tl.float32)
    for g in tl.static_range(NG):
        dg = g * G + ck
        qg = tl.load(q_ptrs + dg[None, :] * sq_d, mask=rmask[:, None] & cmask[None, :], other=0.0)  # (BLOCK_M, GK)
        codes, sc, mn = _group(kc_ptr, ks_ptr, km_ptr, row, tmask, g, CB, G, BITS, BT, GK)     # (BT, GK)
        s += (split_dot(qg, tl.trans(codes), tl.float16, TERMS, SHIFT) * sc[None, :]
              + tl.sum(qg, axis=1)[:, None] * mn[None, :])
    return s


@triton.jit
def _split_pv(p, vc_ptr, vs_ptr, vm_ptr, row, tmask, LO: tl.constexpr, N: tl.constexpr, CB: tl.constexpr,
              G: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr, BLOCK_M: tl.constexpr,
              TERMS: tl.constexpr, SHIFT: tl.constexpr):
    """Tensor-core p v over the groups [LO, LO + N), (BLOCK_M, N * G) in channel order: group g's
    columns are ``(p * scale_g) @ codes_g + p @ mn_g``, the groups joined pairwise (a tree)."""
    if N == 1:
        codes, sc, mn = _group(vc_ptr, vs_ptr, vm_ptr, row, tmask, LO, CB, G, BITS, BT, G)       # (BT, G)
        r = (split_dot(p * sc[None, :], codes, tl.float16, TERMS, SHIFT)
             + tl.sum(p * mn[None, :], axis=1)[:, None])
    else:
        lo = _split_pv(p, vc_ptr, vs_ptr, vm_ptr, row, tmask, LO, N // 2, CB, G, BITS, BT, BLOCK_M, TERMS, SHIFT)
        hi = _split_pv(p, vc_ptr, vs_ptr, vm_ptr, row, tmask, LO + N // 2, N // 2, CB, G, BITS, BT, BLOCK_M,
                       TERMS, SHIFT)
        r = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_M, N * G))         # [lo | hi]
    return r


@triton.jit
def _history_block(q_ptrs, rmask, sq_d, m_i, l_i, acc, n0, end, b, hk, H_KV, N_TAB, qk_scale,
                   kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, tab_ptr,
                   D: tl.constexpr, G: tl.constexpr, PG: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr,
                   BLOCK_M: tl.constexpr, PRECISE: tl.constexpr, LIBDEVICE: tl.constexpr,
                   K_TERMS: tl.constexpr, V_TERMS: tl.constexpr, SHIFT: tl.constexpr):
    """History tokens [n0, n0 + BT) (masked at ``end``): one online-softmax update of (m_i, l_i, acc).

    The tensor-core path works on a tile of BK = max(BT, KMIN) token lanes (lanes >= BT masked: no load,
    score -inf, p = 0), so that P @ V never runs a K extent under KMIN (see ``KMIN``); the precise path's
    IEEE fp32 dots take BK = BT."""
    CB: tl.constexpr = D * BITS // 8
    if PRECISE or BT >= KMIN:
        BK: tl.constexpr = BT
    else:
        BK: tl.constexpr = KMIN
    lane = tl.arange(0, BK)
    n = n0 + lane
    tmask = (lane < BT) & (n < end)
    row = _token_rows(tab_ptr, b, n, tmask, N_TAB, H_KV, hk, PG)
    if PRECISE:
        s = _tree_scores(q_ptrs, rmask, sq_d, kc_ptr, ks_ptr, km_ptr, row, tmask, 0, D // 16, CB, G, BITS)
    else:
        s = _split_scores(q_ptrs, rmask, sq_d, kc_ptr, ks_ptr, km_ptr, row, tmask, CB, G, BITS, BK, BLOCK_M,
                          K_TERMS, SHIFT)
    s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))
    m_new, alpha, p, l_i = A.softmax_step(s, m_i, l_i, PRECISE, LIBDEVICE, True)
    if PRECISE:
        v = _dequant(vc_ptr, vs_ptr, vm_ptr, row, tmask, tl.arange(0, D), CB, G, BITS)           # (BT, D)
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = _split_pv(p, vc_ptr, vs_ptr, vm_ptr, row, tmask, 0, D // G, CB, G, BITS, BK, BLOCK_M, V_TERMS,
                       SHIFT)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# Fused decode over the OSCAR history pages.
# Computes: for the G_q * T_q query rows of kv head (b, hk) (row m -> query head hk*G_q + m // T_q, token
#   m % T_q; q rotated, fp32) and the history tokens [sp*TPS, min((sp+1)*TPS, NH)) of sequence b: each
#   token's key and value rows (page table[b, n // Pg], slot n % Pg; codes packed along channels, scale
#   and min per group of G channels) are unpacked and dequantized in registers, s = q k * scale, online
#   softmax, acc += p v, in blocks of BT tokens. Writes the un-normalized (acc, m, l) of split sp at
#   partial slot sp. Scores stay in natural units (s * scale, the reference's rounding; exp2 of
#   (s - m) * log2 e on the fast path), so no rounding of log2 e or ln 2 reaches m and the lse.
# Grid: (B * H_kv, n_splits, cdiv(G_q * T_q, BLOCK_M)); BLOCK_M >= 16 rows (tl.dot), padded and masked.
# Bytes: reads each history token's K / V codes (2 D bits / 8) and metadata (4 D / G meta values) once per
#   row block, plus the queries; writes rows * n_splits * (D + 2) fp32.
@triton.jit(do_not_specialize=["T_Q", "M", "NH", "TPS", "S_TOTAL", "N_TAB"])
def _pages_kernel(q_ptr, kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, tab_ptr, o_ptr, m_ptr, l_ptr,
                  sq_b, sq_h, sq_t, sq_d, H_Q, H_KV, T_Q, M, NH, TPS, S_TOTAL, N_TAB, qk_scale,
                  G_Q: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PG: tl.constexpr, BITS: tl.constexpr,
                  BT: tl.constexpr, BLOCK_M: tl.constexpr, PRECISE: tl.constexpr, TIGHT: tl.constexpr,
                  NBLK: tl.constexpr, K_TERMS: tl.constexpr, V_TERMS: tl.constexpr, SHIFT: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    mb = tl.program_id(2)
    LIBDEVICE: tl.constexpr = TIGHT                    # TIGHT <=> compiled for the GPU
    b, hk, h, t, rmask, q_ptrs = A.query_rows(q_ptr, bh, mb, H_KV, sq_b, sq_h, sq_t, T_Q, M, G_Q, BLOCK_M)
    start = sp * TPS
    end = tl.minimum(start + TPS, NH)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # the first block of a split always holds a token (start < NH), so m_i is finite from then on
    if TIGHT:
        for n0 in range(start, end, BT):
            m_i, l_i, acc = _history_block(q_ptrs, rmask, sq_d, m_i, l_i, acc, n0, end, b, hk, H_KV, N_TAB,
                                           qk_scale, kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, tab_ptr,
                                           D, G, PG, BITS, BT, BLOCK_M, PRECISE, LIBDEVICE, K_TERMS, V_TERMS,
                                           SHIFT)
    else:                                              # interpreter: constexpr trip count, masked
        for it in range(0, NBLK):
            m_i, l_i, acc = _history_block(q_ptrs, rmask, sq_d, m_i, l_i, acc, start + it * BT, end, b, hk,
                                           H_KV, N_TAB, qk_scale, kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr,
                                           vm_ptr, tab_ptr, D, G, PG, BITS, BT, BLOCK_M, PRECISE, LIBDEVICE,
                                           K_TERMS, V_TERMS, SHIFT)
    A.store_split(o_ptr, m_ptr, l_ptr, b, h, t, H_Q, T_Q, S_TOTAL, sp, acc, m_i, l_i, rmask,
                   tl.arange(0, D), D)


# ---------------------------------------------------------------------------------------------------
# launch


@dataclass(frozen=True)
class Plan:
    """The page kernel's launch (``plan``): ``BT`` history tokens per inner step, ``tps`` tokens per split,
    ``n_split`` splits, warps and pipelining stages, and the numerics knobs it takes."""

    BT: int
    tps: int
    n_split: int
    warps: int
    stages: int
    k_terms: int
    v_terms: int


def plan(NH: int, base_programs: int, sms: int, *, precise: bool, interp: bool,
         knobs: Knobs | None = None) -> Plan:
    """The page kernel's launch plan for ``NH`` history tokens, ``base_programs`` programs per split
    (B x H_kv x query blocks) on ``sms`` SMs; ``precise``: the IEEE fp32 path (32 tokens a step);
    ``interp``: the interpreter (one stage). Arithmetic only (runs on the CPU), cached per arguments."""
    knobs = DEFAULT_KNOBS if knobs is None else knobs
    if not isinstance(knobs, Knobs):
        raise TypeError(f"knobs must be a kvq.fast.triton.oscar_decode.Knobs or None, got {type(knobs).__name__}")
    return _plan(int(NH), int(base_programs), int(sms), bool(precise), bool(interp), knobs)


@functools.lru_cache(maxsize=1024)
def _plan(NH, base_programs, sms, precise, interp, knobs) -> Plan:
    """plan's cached body (every argument given, so that one key names one call shape)."""
    BT, tps, n_split = _history_splits(NH, 32 if precise else (knobs.block_t or 64), base_programs, sms,
                                       knobs.waves)
    return Plan(BT, tps, n_split, knobs.num_warps or 4, (knobs.num_stages or 2) if not interp else 1,
                int(knobs.k_terms), int(knobs.v_terms))


def _history_splits(NH: int, bt_max: int, base_programs: int, sms: int, waves: float = 3):
    """``(BT, tokens per split, splits)``: about ``waves`` waves of programs over the ``sms`` SMs, splits
    of whole blocks of BT tokens (bt_max, smaller for a short history, at least 16)."""
    want = max(1, _cdiv(int(waves * sms), base_programs))
    BT = max(16, min(bt_max, _np2(_cdiv(max(NH, 1), want))))
    if NH == 0:
        return BT, 0, 0
    blocks = _cdiv(NH, BT)
    tps = _cdiv(blocks, min(want, blocks)) * BT
    return BT, tps, _cdiv(NH, tps)


def decode(cfg, st, qr, *, scale=None, precise: bool = True, out_dtype=torch.float32, R_out=None,
           knobs: Knobs | None = None):
    """Attention of the rotated query ``qr`` (B, H_q, T_q, D) fp32 over an OSCAR cache ``st``
    (``kvq.fast.caches.oscar.OSCARTensorState``): the INT-b history through the fused page kernel, the FP16
    sink and window (the state's fp16 buffers, read in place: two segments) through the FP16-baseline partial
    kernel in its precise mode, one log-sum-exp merge. Returns ``(out, lse)``, out in the rotated frame (``R_out`` None:
    the merge writes ``out_dtype``) or times ``R_out`` (``rotate_heads``' kernel: float64 sums, the caller's
    R_V^T (D, D) or (H_R, D, D), float32 or float64, the fp32 merge rounded to ``out_dtype`` after the
    rotation), rounded once, lse fp32. ``precise``: the exact-dequantization IEEE fp32 path (for an fp32
    output); else tensor cores. ``knobs``: the page kernel's launch knobs (None: the defaults), planned by
    ``plan``. The launches are planned once per call shape (``decode_plan``) and, once they hold their
    compiled kernels, take device addresses (``_launch``)."""
    knobs = DEFAULT_KNOBS if knobs is None else knobs
    if not isinstance(knobs, Knobs):
        raise TypeError(f"knobs must be a kvq.fast.triton.oscar_decode.Knobs or None, got {type(knobs).__name__}")
    B, H, D = st.shape
    A.check_d(D)
    sc = C.softmax_scale(scale, D)
    R3 = None if R_out is None else _heads_R(R_out, qr)
    tensors = (qr, *_state_tensors(st)) + (() if R3 is None else (R3,))
    ptrs = tuple(map(L.PTR, tensors))
    dev = qr.device
    p = _decode_plan(cfg, st.shape, st.length, tuple(qr.shape), qr.stride(), tuple(map(L.DTYPE, tensors)),
                     (st.sink_k.stride(), st.sink_v.stride(), st.win_k.stride(), st.win_v.stride()),
                     st.table.shape[1], bool(precise), out_dtype, None if R3 is None else R3.shape[0], dev,
                     L.device_index(dev), L.aligned(ptrs), knobs)
    dev_index = p.dev_index
    stream = p.stream()
    buf = p.scratch(dev)
    o_part, m_part, l_part, o32 = p.regions(buf, stream)
    out = torch.empty(tuple(qr.shape), dtype=out_dtype, device=dev)
    lse = torch.empty(tuple(qr.shape[:3]), dtype=torch.float32, device=dev)
    oview = out.view(torch.int16) if out_dtype == torch.bfloat16 else out
    if stream is not None:                     # addresses
        a, oa, la = ptrs, oview.data_ptr(), lse.data_ptr()
    else:                                      # tensors (Triton's dispatch)
        a, oa, la = tensors, oview, lse
    q, kc, ks, km, vc, vs, vm, tab, sk, sv, wk, wv = a[:12]
    parts = (o_part, m_part, l_part)
    if p.pages is not None:
        p.pages((q, kc, ks, km, vc, vs, vm, tab, *parts, *p.pages_ints, sc), stream, dev_index)
    for la_, which, ints in p.fp16:
        k, v = (sk, sv) if which == 0 else (wk, wv)
        la_((q, k, v, *parts, *ints, sc), stream, dev_index)
    if p.rot_out is None:
        p.merge((*parts, oa, la, *p.merge_ints), stream, dev_index)
    else:
        p.merge((*parts, o32, la, *p.merge_ints), stream, dev_index)
        p.rot_out((o32, a[12], oa, *p.rot_ints), stream, dev_index)
    p.settle(stream)
    return out, lse


def _state_tensors(st) -> tuple:
    """The state's tensors a decode reads, in the order ``decode`` takes them."""
    return (st.k_codes, st.k_scale, st.k_mn, st.v_codes, st.v_scale, st.v_mn, st.table, st.sink_k, st.sink_v,
            st.win_k, st.win_v)


#: decode plans kept (least recently used dropped): a model step attends every layer at one length, so its
#: layers share one plan (as kvq.fast.triton.paged)
PLAN_CACHE_SIZE = 256


class DecodePlan(L.Plan):
    """Every launch of one ``decode`` call, planned once per call shape: the page kernel's (``pages``, None
    without history tokens), the partial kernel's over the sink and the window (``fp16``: (launch, 0 sink /
    1 window, integer arguments) per non-empty segment), the merge's, and the output rotation's
    (``rot_out``, None without one), with their integer arguments. Its scratch (``_launch.Plan``): the
    partials o (rows, S, D), m and l (rows, S), then the merged fp32 output where it is rotated after the
    merge."""

    __slots__ = ("rows", "S", "pages", "pages_ints", "fp16", "merge", "merge_ints", "rot_out", "rot_ints")


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _decode_plan(cfg, shape, T, q_shape, q_strides, dtypes, fp16_strides, n_table, precise, out_dtype, r_heads, dev,
                 dev_index, aligned, knobs: Knobs) -> DecodePlan:
    """decode's launches for a cache of ``shape`` holding T tokens (a function of its arguments only:
    ``dtypes`` are q's, the state tensors' of ``_state_tensors`` and R's; ``fp16_strides`` the sink's K and V
    and the window's K and V strides; ``r_heads`` R's heads, None without the rotation back)."""
    B, H, D = shape
    _, H_q, T_q, _ = q_shape
    G, bits = cfg.group_size, cfg.bits
    c = RO.counts(cfg, T)
    NH = c["n_hist"]
    precise = precise or G < 16                        # tl.dot takes groups of >= 16 channels
    G_q = H_q // H
    M = G_q * T_q
    BLOCK_M, m_blocks = A.row_blocks(G_q, T_q)
    base = B * H * m_blocks
    interp = interpreting()
    lp = plan(NH, base, A.sm_count(dev), precise=precise, interp=interp, knobs=knobs)
    BT, tps, n_split = lp.BT, lp.tps, lp.n_split
    S = n_split
    fp16 = []
    for which, n in ((0, c["n_sink"]), (1, c["n_win"])):       # (B, H, S0 / W, D) fp16 buffers, contiguous
        if n == 0:
            continue
        k_str, v_str = fp16_strides[2 * which], fp16_strides[2 * which + 1]
        kps, ns, (block_n, warps, stages) = A.segment_split(n, D, base, torch.float32, dev, min_keys=TAIL_MIN_KEYS)
        ints = (*q_strides, *k_str, *v_str, H_q, H, T_q, n, M, kps, 0, S)
        fp16.append([A.planned_partial((B * H, ns, m_blocks), G_q=G_q, D=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
                                       warps=warps, stages=stages, kps=kps, fast=aligned), which, ints])
        S += ns
    for f in fp16:                                     # the partial slots: S_TOTAL, then this segment's first
        ints = f[2]
        f[2] = ints[:-2] + (S, ints[-1])
    fp16 = tuple(tuple(f) for f in fp16)
    rows = B * H_q * T_q
    pages = None
    pages_ints = ()
    if n_split:
        pages_ints = (*q_strides, H_q, H, T_q, M, NH, tps, S, n_table)
        pages = L.Launch(_pages_kernel, (B * H, n_split, m_blocks),
                         dict(G_Q=G_q, D=D, G=G, PG=cfg.page_size, BITS=bits, BT=BT, BLOCK_M=BLOCK_M,
                              PRECISE=precise, TIGHT=not interp, NBLK=tps // BT if interp else 0,
                              K_TERMS=lp.k_terms, V_TERMS=lp.v_terms, SHIFT=2048.0),
                         dict(num_warps=lp.warps, num_stages=lp.stages), aligned)
    rot_out = None
    rot_ints = ()
    merge_dtype = out_dtype
    if r_heads is not None:                            # a launch of this plan's own: its fp32 input lies in
        merge_dtype = torch.float32                    # the plan's buffer, at an offset of the plan's alignment
        rot_out, rot_ints = _rotation(q_shape, C.contiguous_strides(q_shape), False, r_heads, out_dtype, aligned)
    merge = A.planned_merge(rows, S, D, merge_dtype, aligned)
    n_o, n_s = rows * S * D, rows * S
    n_x = rows * D if r_heads is not None else 0
    offsets = (0, n_o, n_o + n_s, n_o + 2 * n_s)
    shapes = ((rows, S, D), (rows, S), (rows, S), tuple(q_shape) if r_heads is not None else None)
    launches = tuple(x for x in (pages, *(f[0] for f in fp16), merge, rot_out) if x is not None)
    return DecodePlan(dev_index=dev_index, rows=rows, S=S, pages=pages, pages_ints=pages_ints, fp16=fp16,
                      merge=merge, merge_ints=(S, D), rot_out=rot_out, rot_ints=rot_ints, launches=launches,
                      n_buf=n_o + 2 * n_s + n_x, offsets=offsets, shapes=shapes)


# Query-side rotation (the decode's q and output rotations: a few rows).
# Computes: y[b, h, t, :] = x[b, h, t, :] R[h // RATIO] with the D products summed in float64 (chunks of
#   BLOCK_I input channels: each chunk's products summed by tl.sum, the chunks added in order), rounded to
#   fp32 and then to the output dtype (rule 3, ``store_out``); R float32 or float64 (H_R, D, D) contiguous,
#   read as float64.
# Grid: (B * H_q * T, cdiv(D, BLOCK_J)): one row and BLOCK_J output channels per program.
# Bytes: reads the row and D x BLOCK_J of R (L2-resident across rows), writes BLOCK_J outputs.
@triton.jit
def _rotate_heads_kernel(x_ptr, r_ptr, o_ptr, H_Q, T, RATIO, sx_b, sx_h, sx_t, sx_d,
                         D: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
                         OUT_KIND: tl.constexpr, BF16_BITS: tl.constexpr):
    row = tl.program_id(0)
    t = row % T
    h = (row // T) % H_Q
    b = row // (T * H_Q)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    jm = j < D
    xrow = x_ptr + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h + t.to(tl.int64) * sx_t
    rb = r_ptr + (h // RATIO).to(tl.int64) * D * D
    acc = tl.zeros((BLOCK_J,), tl.float64)
    for i0 in tl.static_range(0, D, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        im = i < D
        if BF16_BITS:                                  # the interpreter: bf16 as int16 bits, widened exactly
            xb = tl.load(xrow + i * sx_d, mask=im, other=0)
            xi = ((xb.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            xi = tl.load(xrow + i * sx_d, mask=im, other=0.0).to(tl.float32)
        r = tl.load(rb + i[:, None] * D + j[None, :], mask=im[:, None] & jm[None, :], other=0.0)
        acc += tl.sum(xi.to(tl.float64)[:, None] * r.to(tl.float64), axis=0)
    store_out(o_ptr + row.to(tl.int64) * D + j, acc.to(tl.float32), jm, OUT_KIND)


def rotate_heads(x: torch.Tensor, R: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x R`` for a query-side tensor x (B, H_q, T, D) float16 / bfloat16 / float32 (any strides): head h
    times ``R[h // (H_q / H_R)]`` (R float64 or float32 (D, D) or (H_R, D, D) on x's device; float32 is read
    as float64), float64 sums rounded to fp32 and then to ``out_dtype`` (rule 3), contiguous: one launch
    (the decode's q and output rotations; the CuPy kernel is ``kvq.fast.cupy.oscar_decode.rotate_heads``),
    planned once per call shape (``_rotation_launch``).
    ValueError unless R is float64 or float32 (D, D) or (H_R, D, D) with H_q % H_R == 0 and D <= 256."""
    R3 = _heads_R(R, x)
    out = torch.empty(tuple(x.shape), dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    bits = x.dtype == torch.bfloat16 and interpreting()
    tensors = (x.view(torch.int16) if bits else x, R3, out.view(torch.int16) if out_dtype == torch.bfloat16 else out)
    ptrs = tuple(map(L.PTR, tensors))
    dev_index = L.device_index(x.device)
    la, ints = _rotation_launch(tuple(x.shape), x.stride(), x.dtype, bits, R3.shape[0], R3.dtype, out_dtype,
                                dev_index, L.aligned(ptrs))
    stream = L.current_stream(dev_index) if la.compiled is not None else None
    la((ptrs if stream is not None else tensors) + ints, stream, dev_index)
    return out


def _heads_R(R: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """R as a contiguous (H_R, D, D) for the rows of x (B, H_q, T, D); ValueError unless R is float64 or
    float32 (D, D) or (H_R, D, D) with H_q % H_R == 0 and D <= 256."""
    Hq, D = x.shape[1], x.shape[3]
    R3 = R if R.dim() == 3 else R.unsqueeze(0)
    if (R3.dtype not in (torch.float64, torch.float32) or tuple(R3.shape[1:]) != (D, D) or Hq % R3.shape[0]
            or D > 256):
        raise ValueError(f"rotate_heads takes float64 or float32 R (D, D) or (H_R, D, D) with H_q % H_R == 0 "
                         f"and D <= 256; got R {tuple(R.shape)} {R.dtype} for x {tuple(x.shape)}")
    return R3.contiguous()


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _rotation_launch(x_shape, x_strides, x_dtype, bits, r_heads, r_dtype, out_dtype, dev_index, aligned) -> tuple:
    """``_rotation``'s launch kept per call shape: x (``x_shape``, ``x_strides``, ``x_dtype``), R of ``r_heads``
    heads in ``r_dtype``, ``out_dtype``, device ``dev_index``; ``aligned``: x, R and out are all 16-byte
    aligned (what the kept kernel was specialized on)."""
    return _rotation(x_shape, x_strides, bits, r_heads, out_dtype, aligned)


def _rotation(x_shape, x_strides, bits, r_heads, out_dtype, aligned) -> tuple:
    """``(launch, integer arguments)`` of ``_rotate_heads_kernel`` over x of ``x_shape`` / ``x_strides``
    (``bits``: bf16 x as int16 bits, the interpreter) with R of ``r_heads`` heads into ``out_dtype``; ``aligned``:
    the launch may keep its compiled kernel. Its arguments: (x, R, out, *ints)."""
    B, Hq, T, D = x_shape
    BJ = min(_np2(D), 32)
    la = L.Launch(_rotate_heads_kernel, (B * Hq * T, _cdiv(D, BJ)),
                  dict(D=D, BLOCK_I=min(_np2(D), 64), BLOCK_J=BJ, OUT_KIND=OUT_KIND[out_dtype], BF16_BITS=bits),
                  dict(num_warps=2), aligned)
    return la, (Hq, T, Hq // r_heads, *x_strides)
