"""Triton decode over the paged streaming cache shared by ``kivi`` and ``kitty`` (``kvq.reference.paged``).

The state, its routing and its quantize+pack steps are ``kvq.fast.caches.paged`` (shared with the CuPy
backend), run here with the bit-exact Triton kernels (``OPS``); this module adds the decode kernels.

    st = init(cfg, codec, batch=8, kv_heads=8, head_dim=128)       # on the current CUDA device
    append(cfg, codec, st, k, v)                                    # k, v: (B, H_kv, T_new, D) fp16
    out, lse = decode_attention(cfg, codec, st, q)                  # one fused kernel for the bulk

decode_attention: the tokens ``[S, S + NF)`` whose key AND value are both quantized (NF = min(key
pages * G, quantized values); key page j and value page j cover the same tokens) run through ONE
fused kernel that reads the packed pages through the page tables, unpacks and dequantizes them in
registers and does flash-decoding with an online softmax: ``_tokens_kernel`` for fp16 q with at most 8
query rows per kv head (decode; the cache's tokens on the MMA's M side, the query rows on N, so no row
padding), ``_fused_kernel`` for the rest (query rows on M, in blocks of at least 16); the few others
(sink, key Q-buffer, value window / Q-buffer, and the mixed tokens where only one of K / V is
quantized: at most S + G + R + G) are gathered by one kernel (``_gather_tail_kernel``, bit-exact
dequantization) into one small fp32 segment and run through the FP16-baseline partial kernel of
``kvq.fast.triton.attention`` in its precise (fp32) mode; all partials are merged by its log-sum-exp
merge kernel: four launches per decode (gather, fused, tail partial, merge), and a cast of q to fp32 first
for bf16 q (and for fp16 q on the exact fp32 path).

Fused-kernel numerics (fp16 / bf16 q; both kernels): per page, ``s = (q * scale) @ codes + q @ mn`` and
``p @ v = (p * scale_t) @ codes + p @ mn_t``: the codes are exact in fp16 (converted by the 0x6400
magic-number trick), the fp32 factors go through the tensor cores as hi + lo halves (row-scaled, so
nothing overflows fp16), so the result is close to fp32 accuracy; fp32 q takes an IEEE fp32 path.
``Knobs`` holds the launch knobs for GPU tuning runs (benchmarks/bench_kivi_kitty.py sweeps them);
``plan`` turns them, the configuration and the shape into the launch (arithmetic only: it runs on the CPU).
``codes_to`` and ``split_dot`` are the device helpers ``kvq.fast.triton.oscar_decode`` shares.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvq.fast import common as C
from kvq.fast.caches import paged as _paged
from kvq.fast.caches.codecs import Ops
from kvq.fast.caches.paged import (PagedState, append, counts, dequantize_cache, init,  # noqa: F401
                             max_pages, meta_dtype, quantize_values, segment_bounds)

from kvq.fast.common import cdiv as _cdiv  # host grid arithmetic
from . import _flush as W
from . import _launch as L
from . import attention as A
from . import packing as P
from . import quant as Q
from .quant import unpack_last

#: the bit-exact Triton kernels the shared paged cache (``kvq.fast.caches.paged``) quantizes and packs with, and
#: its single-kernel pool writers (``_flush``: key pages, evicted values, a decode token's whole append)
OPS = Ops("triton", Q, P, Q.interpreting, key_flush=W.flush_key_pages, value_evict=W.evict_values,
          token_append=W.append_token)

LOG2E = 1.4426950408889634


_check_knob = functools.partial(C.check_knob, "triton.paged")     # ValueError naming triton.paged.Knobs.<field>
_is_int = C.is_int


@dataclass(frozen=True)
class TokensKnobs:
    """The launch knobs of ``_tokens_kernel`` (cache tokens on the MMA's M side), the fused decode of fp16 q
    with at most 8 query rows per kv head; the timings behind the defaults:
    ``lab/2026-11-29-triton-decode/TOKENS.md`` (``TOKENS.md`` below)."""

    num_warps: int = 2                   # warps per program                                 TOKENS.md
    waves: float = 4                     # at most this many programs per SM over the grid    TOKENS.md
    block_t: int = 128                   # tokens per online-softmax step (at most G)         TOKENS.md
    num_stages: int = 2                  # software-pipelining depth                         TOKENS.md
    maxnreg: int | None = None           # registers per thread at most (None: the compiler's) TOKENS.md

    def __post_init__(self):
        C.check_launch_knobs("triton.paged.TokensKnobs", self)  # num_warps, waves, block_t, num_stages
        _check_knob(self.maxnreg is None or (_is_int(self.maxnreg) and 24 <= self.maxnreg <= 255), "maxnreg",
                    self.maxnreg, "None or an int in [24, 255]")
        _check_knob(self.num_warps is not None and self.block_t is not None and self.num_stages is not None,
                    "tokens", self, "TokensKnobs with num_warps, block_t and num_stages given")


@dataclass(frozen=True)
class Knobs:
    """The launch knobs of the fused decode kernel (None: the built-in choice), for tuning runs on the GPU.
    Immutable and hashable (``plan`` is cached per knobs); the rules and the timings behind the defaults:
    ``lab/2026-11-22-kivi-kitty-decode/KNOBS.md`` (section "Triton"; ``KNOBS.md#triton`` below), and for
    ``waves`` ``lab/2026-11-29-triton-decode/NOTE.md`` (section "waves")."""

    num_warps: int | None = 4            # warps per program (None: 4, 8 for wide tiles)     KNOBS.md#triton
    waves: float = 2                     # at most this many programs per SM over the grid    2026-11-29-triton-decode/NOTE.md#waves
    block_t: int | None = None           # tokens per inner step (a power of two >= 16)       KNOBS.md#triton
    split_p: bool = False                # P @ V with P as hi + lo (True) or rounded once     KNOBS.md#triton
    k_terms: int = 2                     # parts of q * scale in the key dot (2: ~22 bits)    KNOBS.md#triton
    num_stages: int | None = None        # software-pipelining depth (None: 2)                KNOBS.md#triton
    words: bool = True                   # fp16 q unpacks codes from 32-bit words             KNOBS.md#triton
    tokens: TokensKnobs | None = TokensKnobs()   # _tokens_kernel where it applies (None: never)  TOKENS.md
    tail_keys: int = 32                  # fewest tail tokens per split of the fp32 tail       TOKENS.md

    def __post_init__(self):
        C.check_launch_knobs("triton.paged", self)             # num_warps, waves, block_t, num_stages
        _check_knob(isinstance(self.split_p, bool), "split_p", self.split_p, "True or False")
        _check_knob(_is_int(self.k_terms) and self.k_terms in (1, 2, 3), "k_terms", self.k_terms, "1, 2 or 3")
        _check_knob(isinstance(self.words, bool), "words", self.words, "True or False")
        _check_knob(self.tokens is None or isinstance(self.tokens, TokensKnobs), "tokens", self.tokens,
                    "None or a kvq.fast.triton.paged.TokensKnobs")
        _check_knob(_is_int(self.tail_keys) and self.tail_keys > 0, "tail_keys", self.tail_keys, "a positive int")


#: the defaults
DEFAULT_KNOBS = Knobs()


@dataclass(frozen=True)
class Plan:
    """The fused kernel's launch (``plan``): ``n_split`` splits of ``pps`` pages, ``BT`` tokens per inner
    step, warps and pipelining stages, whether key / value codes are unpacked from 32-bit words, and the
    numerics knobs the kernel takes (``split_p``, ``k_terms``)."""

    n_split: int
    pps: int
    BT: int
    warps: int
    stages: int
    k_words: bool
    v_words: bool
    split_p: bool
    k_terms: int
    rows: int = 0           # > 0: _tokens_kernel with this many (padded) query rows; 0: _fused_kernel
    maxnreg: int | None = None


def plan(NP: int, G: int, D: int, n_base: int, sms: int, *, precise: bool, magic: bool, interp: bool,
         k_bits: int, v_bits: int, ngv: int, m: int = 16, knobs: Knobs | None = None) -> Plan:
    """The fused kernel's launch plan for ``NP`` pages of ``G`` tokens, head dim ``D``, ``n_base`` programs
    per split (B x H_kv x query blocks) on ``sms`` SMs; ``precise``: the IEEE fp32 path; ``magic``: fp16 q
    on the tensor cores; ``interp``: the interpreter (one stage); key / value code bits and value groups per
    row (``ngv``), ``m`` query rows per kv head. Arithmetic only (runs on the CPU), cached per arguments.
    fp16 q with codes in words, one value group per token and at most 8 rows takes ``_tokens_kernel``
    (``knobs.tokens``; ``Plan.rows`` 4 or 8), the rest ``_fused_kernel``. The splits: as many as keep the
    fused grid within ``knobs.waves`` programs per SM, at least one (lab/2026-11-29-triton-decode/NOTE.md#waves:
    the kernel holds two programs per SM, so a grid of at most two per SM runs in one round)."""
    knobs = DEFAULT_KNOBS if knobs is None else knobs
    if not isinstance(knobs, Knobs):
        raise TypeError(f"knobs must be a kvq.fast.triton.paged.Knobs or None, got {type(knobs).__name__}")
    return _plan(int(NP), int(G), int(D), int(n_base), int(sms), bool(precise), bool(magic), bool(interp),
                 int(k_bits), int(v_bits), int(ngv), int(m), knobs)


def _splits(NP: int, waves: float, sms: int, n_base: int):
    """``(splits, pages per split)``: as many splits as keep the grid within ``waves`` programs per SM."""
    if not NP:
        return 0, 0
    want = max(1, int(waves * sms) // n_base)
    pps = _cdiv(NP, min(want, NP))
    return _cdiv(NP, pps), pps


@functools.lru_cache(maxsize=1024)
def _plan(NP, G, D, n_base, sms, precise, magic, interp, k_bits, v_bits, ngv, m, knobs) -> Plan:
    """plan's cached body (every argument given, so that one key names one call shape)."""
    tk = knobs.tokens
    bt = min(G, tk.block_t) if tk is not None else 0
    if (tk is not None and magic and knobs.words and m <= 8 and ngv == 1 and G % bt == 0
            and (bt * k_bits) % 32 == 0 and (D * v_bits) % 32 == 0 and (G * k_bits // 8) % 4 == 0):
        n_split, pps = _splits(NP, tk.waves, sms, n_base)
        return Plan(n_split, pps, bt, tk.num_warps, tk.num_stages if not interp else 1, True, True, False,
                    2, 4 if m <= 4 else 8, tk.maxnreg)
    n_split, pps = _splits(NP, knobs.waves, sms, n_base)
    BT = min(G, 32) if precise else min(G, knobs.block_t or 128)
    warps = knobs.num_warps or (4 if (precise or BT * D <= 8192) else 8)
    # codes unpacked from 32-bit words, two per operation (fp16 q): rows of whole words
    words = magic and knobs.words
    k_words = bool(words and (G * k_bits // 8) % 4 == 0 and (BT * k_bits) % 32 == 0)
    v_words = bool(words and ngv == 1 and (D * v_bits) % 32 == 0)
    stages = (knobs.num_stages or 2) if not interp else 1
    return Plan(n_split, pps, BT, warps, stages, k_words, v_words, bool(knobs.split_p), int(knobs.k_terms))


# ---------------------------------------------------------------------------------------------------
# the fused decode kernel


@triton.jit
def _key_codes(kc_ptr, kh_ptr, ki_ptr, kbase, hbase, dc, c0,
               DC: tl.constexpr, BT: tl.constexpr, GB: tl.constexpr, K_BITS: tl.constexpr,
               KITTY: tl.constexpr, DB_HIGH: tl.constexpr):
    """Key codes (int32) of channels ``dc`` (DC,) and tokens [c0, c0 + BT) of one page, (DC, BT): packed
    bytes (DC, BT / PER) unpacked in registers; Kitty (Algorithm 1): low | high[idx] << 2 where idx < D_boost."""
    PER: tl.constexpr = 8 // K_BITS
    NB: tl.constexpr = BT // PER
    jb = c0 // PER + tl.arange(0, NB)
    byte = tl.load(kc_ptr + (kbase + dc[:, None]) * GB + jb[None, :]).to(tl.int32)
    code = unpack_last(byte, DC, NB, PER, K_BITS)
    if KITTY:
        if DB_HIGH > 0:
            idx = tl.load(ki_ptr + kbase + dc).to(tl.int32)
            boosted = idx < DB_HIGH
            hrow = tl.minimum(idx, DB_HIGH - 1)
            hb = tl.load(kh_ptr + (hbase + hrow[:, None]) * GB + jb[None, :], mask=boosted[:, None],
                         other=0).to(tl.int32)
            code = code | (unpack_last(hb, DC, NB, 4, 2) << 2)
    return code


@triton.jit
def _key_words(kc_ptr, kh_ptr, ki_ptr, kbase, hbase, dc, c0,
               DC: tl.constexpr, BT: tl.constexpr, GB: tl.constexpr, K_BITS: tl.constexpr,
               KITTY: tl.constexpr, DB_HIGH: tl.constexpr):
    """Key codes of channels ``dc`` and tokens [c0, c0 + BT) of one page as fp16 (DC, BT), the tokens in
    the order of ``_word_order``: 32-bit words of the packed rows, two codes per operation; Kitty
    (Algorithm 1) ORs the boosted channels' high plane in, shifted by 2, word by word."""
    NW: tl.constexpr = BT * K_BITS // 32
    jw = c0 * K_BITS // 32 + tl.arange(0, NW)
    w = tl.load(kc_ptr.to(tl.pointer_type(tl.int32)) + (kbase + dc[:, None]) * (GB // 4) + jw[None, :])
    if KITTY:
        if DB_HIGH > 0:
            idx = tl.load(ki_ptr + kbase + dc).to(tl.int32)
            boosted = idx < DB_HIGH
            hrow = tl.minimum(idx, DB_HIGH - 1)
            hw = tl.load(kh_ptr.to(tl.pointer_type(tl.int32)) + (hbase + hrow[:, None]) * (GB // 4) + jw[None, :],
                         mask=boosted[:, None], other=0)
            # word of 4-bit codes from the two 2-bit planes: per 2-bit field i, low | high << 2, as the
            # pairs the magic conversion takes (field i of the low plane and of the high plane)
            return _kitty_words_f16(w, hw, DC, NW)
    return _word_codes_f16(w, DC, NW, K_BITS)


@triton.jit
def _kitty_words_f16(w, hw, R: tl.constexpr, NW: tl.constexpr):
    """As ``_word_codes_f16`` for 2-bit fields, each code ``low | high << 2`` (Algorithm 1)."""
    sh = tl.arange(0, 8) * 2
    lo = (w[:, :, None] >> sh[None, None, :]) & 0x00030003
    hi = (hw[:, :, None] >> sh[None, None, :]) & 0x00030003
    x = lo | (hi << 2) | 0x64006400
    pair = tl.join(x.to(tl.int16), (x >> 16).to(tl.int16))
    return tl.reshape(pair, (R, NW * 16)).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _key_tile(kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, kbase, hbase, dc, c0,
              DC: tl.constexpr, BT: tl.constexpr, GB: tl.constexpr, K_BITS: tl.constexpr,
              KITTY: tl.constexpr, DB_HIGH: tl.constexpr):
    """Keys of channels ``dc`` and tokens [c0, c0 + BT) of one page, fp32 (DC, BT): code * scale + mn."""
    code = _key_codes(kc_ptr, kh_ptr, ki_ptr, kbase, hbase, dc, c0, DC, BT, GB, K_BITS, KITTY, DB_HIGH)
    ks = tl.load(ks_ptr + kbase + dc).to(tl.float32)
    km = tl.load(km_ptr + kbase + dc).to(tl.float32)
    return code.to(tl.float32) * ks[:, None] + km[:, None]


@triton.jit
def codes_to(code, DT: tl.constexpr, MAGIC: tl.constexpr):
    """Integer codes (< 1024) to DT exactly. MAGIC (fp16): the bits 0x6400 | code are the half 1024 + code,
    minus 1024 (exact): an OR and a half subtraction instead of an int -> float conversion (quarter rate)."""
    if MAGIC:
        r = (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    else:
        r = code.to(DT)
    return r


@triton.jit
def _word_order(N: tl.constexpr, BITS: tl.constexpr):
    """The order in which ``_word_codes_f16`` lays out N codes of one row: column n holds code
    ``tok(n) = (n // 2P) * 2P + (n // 2) % P + P * (n % 2)`` of the row, P = 16 / BITS (a word holds 2P)."""
    P: tl.constexpr = 16 // BITS
    n = tl.arange(0, N)
    return (n // (2 * P)) * (2 * P) + (n // 2) % P + P * (n % 2)


@triton.jit
def _word_codes_f16(w, R: tl.constexpr, NW: tl.constexpr, BITS: tl.constexpr):
    """(R, NW) int32 words of packed BITS-bit codes (rule 6, little-endian bytes) -> (R, NW * 32 / BITS)
    fp16 codes, exact, in the order of ``_word_order``. Two codes per 32-bit operation: the mask
    0x00030003 (2 bits) picks code k and code k + P of a word into the two 16-bit halves, OR 0x6400 makes
    each half the fp16 1024 + code, and one packed half subtraction removes the 1024."""
    P: tl.constexpr = 16 // BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) * 0x00010001
    sh = tl.arange(0, P) * BITS
    x = ((w[:, :, None] >> sh[None, None, :]) & MASK) | 0x64006400          # (R, NW, P)
    pair = tl.join(x.to(tl.int16), (x >> 16).to(tl.int16))                 # (R, NW, P, 2)
    return tl.reshape(pair, (R, NW * P * 2)).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def split_dot(a, b_codes, DT: tl.constexpr, TERMS: tl.constexpr = 2, SHIFT: tl.constexpr = 2048.0):
    """a (fp32, (M, K)) @ b (small integer codes, exact in DT) on tensor cores with ~fp32 accuracy: each
    row of a is scaled by its max |a| (no fp16 overflow), split into TERMS parts rounded to DT (each
    residual scaled by SHIFT = 2^(DT's mantissa bits + 1) before rounding, so it stays a normal number),
    one dot per part accumulated in fp32, and scaled back. TERMS = 2 carries ~22 bits of a in fp16."""
    amax = tl.max(tl.abs(a), axis=1)
    r = tl.where(amax > 0.0, amax, 1.0)
    an = a * (1.0 / r)[:, None]
    hi = an.to(DT)
    res = tl.dot(hi, b_codes)
    if TERMS >= 2:
        r1 = (an - hi.to(tl.float32)) * SHIFT
        mid = r1.to(DT)
        low = tl.dot(mid, b_codes)
        if TERMS >= 3:
            lo = ((r1 - mid.to(tl.float32)) * SHIFT).to(DT)
            low = low + tl.dot(lo, b_codes) * (1.0 / SHIFT)
        res = res + low * (1.0 / SHIFT)
    return res * r[:, None]


@triton.jit
def _tree_qk(q_ptrs, rmask, sq_d, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, kbase, hbase, c0, tmask,
             LO: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, GB: tl.constexpr, K_BITS: tl.constexpr,
             KITTY: tl.constexpr, DB_HIGH: tl.constexpr):
    """q k over channel chunks [16 LO, 16 (LO + N)) as a pairwise tree of 16-channel IEEE dots."""
    if N == 1:
        dc = LO * 16 + tl.arange(0, 16)
        qc = tl.load(q_ptrs + dc[None, :] * sq_d, mask=rmask[:, None], other=0.0).to(tl.float32)
        kt = _key_tile(kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, kbase, hbase, dc, c0, 16, BT, GB,
                       K_BITS, KITTY, DB_HIGH)
        r = tl.dot(qc, kt, input_precision="ieee")
    else:
        r = (_tree_qk(q_ptrs, rmask, sq_d, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, kbase, hbase, c0, tmask,
                      LO, N // 2, BT, GB, K_BITS, KITTY, DB_HIGH)
             + _tree_qk(q_ptrs, rmask, sq_d, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, kbase, hbase, c0, tmask,
                        LO + N // 2, N // 2, BT, GB, K_BITS, KITTY, DB_HIGH))
    return r


@triton.jit
def _page_block(q, q_ptrs, rmask, sq_d, m_i, l_i, acc, j, c0, j_end, b, hk, H_KV, NF, N_TAB, qk_scale,
                kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, kt_ptr, vt_ptr,
                D: tl.constexpr, G: tl.constexpr, BT: tl.constexpr, K_BITS: tl.constexpr,
                V_BITS: tl.constexpr, NGV: tl.constexpr, KITTY: tl.constexpr, DB_HIGH: tl.constexpr,
                PRECISE: tl.constexpr, LIBDEVICE: tl.constexpr, DT: tl.constexpr,
                MAGIC: tl.constexpr, SPLIT_P: tl.constexpr,
                K_TERMS: tl.constexpr, SHIFT: tl.constexpr, K_WORDS: tl.constexpr, V_WORDS: tl.constexpr):
    """Tokens [c0, c0 + BT) of page j (post-sink token index j * G + c0 + i): one online-softmax update;
    none when ``j >= j_end`` (the interpreter's fixed trip count runs past the split's last page)."""
    GB: tl.constexpr = G * K_BITS // 8
    VB: tl.constexpr = D * V_BITS // 8
    VPER: tl.constexpr = 8 // V_BITS
    valid = j < j_end                           # a scalar: masks only the scalar loads of the page ids
    kpid = tl.load(kt_ptr + b * N_TAB + j, mask=valid, other=0).to(tl.int64)
    vpid = tl.load(vt_ptr + b * N_TAB + j, mask=valid, other=0).to(tl.int64)
    kpid = tl.maximum(kpid, 0)
    vpid = tl.maximum(vpid, 0)
    if K_WORDS:
        tok = c0 + _word_order(BT, K_BITS)      # the key tile's column order (values and masks follow it)
    else:
        tok = c0 + tl.arange(0, BT)
    # compared on blocks: a scalar comparison broadcast into a mask is int32 under Triton's interpreter,
    # which Triton 3.9 refuses as a load mask ("mask has unsupported dtype")
    tmask = ((j * G + tok) < NF) & ((j + 0 * tok) < j_end)
    kbase = (kpid * H_KV + hk) * D
    hbase = (kpid * H_KV + hk) * DB_HIGH
    d = tl.arange(0, D)
    # scores (BLOCK_M, BT)
    if PRECISE:
        s = _tree_qk(q_ptrs, rmask, sq_d, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, kbase, hbase, c0, tmask,
                     0, D // 16, BT, GB, K_BITS, KITTY, DB_HIGH)
    else:
        # s = sum_d (q_d scale_d) code_dt + sum_d q_d mn_d: codes are exact in q's dtype, q * scale
        # goes through the tensor cores as hi + lo (fp32-like accuracy), no per-element dequantization
        if K_WORDS:
            kcodes = _key_words(kc_ptr, kh_ptr, ki_ptr, kbase, hbase, d, c0, D, BT, GB, K_BITS, KITTY, DB_HIGH)
        else:
            kcodes = codes_to(_key_codes(kc_ptr, kh_ptr, ki_ptr, kbase, hbase, d, c0, D, BT, GB, K_BITS, KITTY,
                                          DB_HIGH), DT, MAGIC)
        ks = tl.load(ks_ptr + kbase + d).to(tl.float32)
        km = tl.load(km_ptr + kbase + d).to(tl.float32)
        s = (split_dot(q * ks[None, :], kcodes, DT, K_TERMS, SHIFT)
             + tl.sum(q * km[None, :], axis=1)[:, None])
    s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))
    m_new, alpha, p, l_i = A.softmax_step(s, m_i, l_i, PRECISE, LIBDEVICE)
    # values (BT, D) of the same tokens: value page j, slots c0 .. c0 + BT
    vrow = (vpid * H_KV + hk) * G + tok
    if V_WORDS:
        # one group per token, codes in the channel order of _word_order (acc is kept in that order)
        vw = tl.arange(0, VB // 4)
        vword = tl.load(vc_ptr.to(tl.pointer_type(tl.int32)) + vrow[:, None] * (VB // 4) + vw[None, :],
                        mask=tmask[:, None], other=0)
        vs = tl.load(vs_ptr + vrow, mask=tmask, other=0.0).to(tl.float32)
        vm = tl.load(vm_ptr + vrow, mask=tmask, other=0.0).to(tl.float32)
        pv = (split_dot(p * vs[None, :], _word_codes_f16(vword, BT, VB // 4, V_BITS), DT, 2 if SPLIT_P else 1,
                         SHIFT) + tl.sum(p * vm[None, :], axis=1)[:, None])
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc
    vb = tl.arange(0, VB)
    vbyte = tl.load(vc_ptr + vrow[:, None] * VB + vb[None, :], mask=tmask[:, None], other=0).to(tl.int32)
    vcode = unpack_last(vbyte, BT, VB, VPER, V_BITS)
    if NGV == 1 and not PRECISE:
        # one group per token: p v = (p * scale_t) codes + sum_t p_t mn_t, codes exact in q's dtype
        vs = tl.load(vs_ptr + vrow, mask=tmask, other=0.0).to(tl.float32)
        vm = tl.load(vm_ptr + vrow, mask=tmask, other=0.0).to(tl.float32)
        pv = (split_dot(p * vs[None, :], codes_to(vcode, DT, MAGIC), DT, 2 if SPLIT_P else 1, SHIFT)
                  + tl.sum(p * vm[None, :], axis=1)[:, None])
    else:
        if NGV == 1:
            vs = tl.load(vs_ptr + vrow, mask=tmask, other=0.0).to(tl.float32)[:, None]
            vm = tl.load(vm_ptr + vrow, mask=tmask, other=0.0).to(tl.float32)[:, None]
        else:
            gi = d // (D // NGV)
            vs = tl.load(vs_ptr + vrow[:, None] * NGV + gi[None, :], mask=tmask[:, None],
                         other=0.0).to(tl.float32)
            vm = tl.load(vm_ptr + vrow[:, None] * NGV + gi[None, :], mask=tmask[:, None],
                         other=0.0).to(tl.float32)
        v = vcode.to(tl.float32) * vs + vm
        if PRECISE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            vh = v.to(DT)
            pv = split_dot(p, vh, DT, 2, SHIFT) + split_dot(p, (v - vh.to(tl.float32)).to(DT), DT, 2, SHIFT)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# Fused paged decode over quantized pages (KIVI / Kitty).
# Computes: for the G_q * T_q query rows of kv head (b, hk) (row m -> query head hk*G_q + m // T_q,
#   token m % T_q) and the pages [sp*PPS, min((sp+1)*PPS, NP)) of sequence b: key page k_table[b, j]
#   (packed along tokens, (D, G*bits/8) bytes; Kitty: low plane | high plane row idx[c] << 2) and value
#   page v_table[b, j] (packed along channels, (G, D*bits/8) bytes) are unpacked and dequantized in
#   registers (code * scale + mn, fp32), then s = q k * scale, online softmax, acc += p v. Tokens of
#   post-sink index >= NF are masked. Writes the un-normalized (acc, m, l) of split sp (m in natural units).
# Grid: (B * H_kv, n_splits, cdiv(G_q * T_q, BLOCK_M)); BLOCK_M >= 16 rows (tl.dot), padded and masked.
# Bytes: reads each packed K / V page and its metadata once per row block, plus the queries; writes
#   rows * n_splits * (D + 2) fp32.
@triton.jit(do_not_specialize=["T_Q", "M", "NF", "NP", "PPS", "S_TOTAL", "N_TAB"])
def _fused_kernel(q_ptr, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, kt_ptr, vt_ptr,
                  o_ptr, m_ptr, l_ptr, sq_b, sq_h, sq_t, sq_d,
                  H_Q, H_KV, T_Q, M, NF, NP, PPS, S_TOTAL, N_TAB, qk_scale,
                  G_Q: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BT: tl.constexpr,
                  K_BITS: tl.constexpr, V_BITS: tl.constexpr, NGV: tl.constexpr, KITTY: tl.constexpr,
                  DB_HIGH: tl.constexpr, BLOCK_M: tl.constexpr, PRECISE: tl.constexpr, TIGHT: tl.constexpr,
                  NPPS: tl.constexpr, MAGIC: tl.constexpr, SPLIT_P: tl.constexpr,
                  K_TERMS: tl.constexpr, SHIFT: tl.constexpr, K_WORDS: tl.constexpr, V_WORDS: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    mb = tl.program_id(2)
    LIBDEVICE: tl.constexpr = TIGHT
    NSUB: tl.constexpr = G // BT
    b, hk, h, t, rmask, q_ptrs = A.query_rows(q_ptr, bh, mb, H_KV, sq_b, sq_h, sq_t, T_Q, M, G_Q, BLOCK_M)
    d = tl.arange(0, D)
    if PRECISE:
        q = tl.zeros((BLOCK_M, 16), tl.float32)            # unused: the precise path loads q in chunks
    else:
        q = tl.load(q_ptrs + d[None, :] * sq_d, mask=rmask[:, None], other=0.0).to(tl.float32)
    DT: tl.constexpr = q_ptr.dtype.element_ty
    p_start = sp * PPS
    p_end = tl.minimum(p_start + PPS, NP)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    if TIGHT:
        for j in range(p_start, p_end):
            for c in tl.static_range(NSUB):
                m_i, l_i, acc = _page_block(q, q_ptrs, rmask, sq_d, m_i, l_i, acc, j, c * BT, p_end, b, hk,
                                            H_KV, NF, N_TAB, qk_scale, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr,
                                            vc_ptr, vs_ptr, vm_ptr, kt_ptr, vt_ptr, D, G, BT, K_BITS, V_BITS,
                                            NGV, KITTY, DB_HIGH, PRECISE, LIBDEVICE, DT, MAGIC, SPLIT_P,
                                            K_TERMS, SHIFT, K_WORDS, V_WORDS)
    else:                                                   # interpreter: constexpr trip count, masked
        for it in range(0, NPPS):
            j = p_start + it
            for c in tl.static_range(NSUB):
                m_i, l_i, acc = _page_block(q, q_ptrs, rmask, sq_d, m_i, l_i, acc, j, c * BT, p_end, b, hk,
                                            H_KV, NF, N_TAB, qk_scale, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr,
                                            vc_ptr, vs_ptr, vm_ptr, kt_ptr, vt_ptr, D, G, BT, K_BITS, V_BITS,
                                            NGV, KITTY, DB_HIGH, PRECISE, LIBDEVICE, DT, MAGIC, SPLIT_P,
                                            K_TERMS, SHIFT, K_WORDS, V_WORDS)
    if not PRECISE:
        m_i = m_i * 0.6931471805599453                    # log2 units -> natural
    if V_WORDS:
        dst = _word_order(D, V_BITS)                     # acc's channel order (see _page_block)
    else:
        dst = d
    A.store_split(o_ptr, m_ptr, l_ptr, b, h, t, H_Q, T_Q, S_TOTAL, sp, acc, m_i, l_i, rmask, dst, D)

# Fused paged decode over quantized pages (KIVI / Kitty), cache tokens on the MMA's M side (fp16 q; key and
# value codes unpacked from 32-bit words; one value group per token; at most NR query rows per kv head).
# Computes: what _fused_kernel computes, transposed: per page, qs = q * scale_k (D, NR) is scaled per row
#   by its max |.|, split into hi and lo fp16 halves interleaved as the columns of one (D, 2 NR) operand,
#   and for each step of BT tokens s^T = codes^T (BT, D) @ [hi | lo] (BT, 2 NR) on the tensor cores, then
#   s = (hi + lo / SHIFT) * max + q . mn_k; online softmax over the step's tokens (rows); the values as
#   acc^T (D, NR) += codes_v^T (D, BT) @ (p * scale_v)^T (BT, NR) (rounded once to fp16, per row scaled by its
#   max) and vb (NR) += p . mn_v. No query-row padding on M: the rows are the MMA's N (8 or 16).
# Grid: (B * H_kv, n_splits); each program walks the pages [sp*PPS, min((sp+1)*PPS, NP)) of (b, kv head).
# Bytes: reads each packed K / V page and its metadata once, plus the queries; writes NR (D + 2) fp32 per
#   program.
@triton.jit(do_not_specialize=["T_Q", "M", "NF", "NP", "PPS", "S_TOTAL", "N_TAB"])
def _tokens_kernel(q_ptr, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, kt_ptr, vt_ptr,
                   o_ptr, m_ptr, l_ptr, sq_b, sq_h, sq_t, sq_d,
                   H_Q, H_KV, T_Q, M, NF, NP, PPS, S_TOTAL, N_TAB, qk_scale,
                   G_Q: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BT: tl.constexpr,
                   K_BITS: tl.constexpr, V_BITS: tl.constexpr, KITTY: tl.constexpr, DB_HIGH: tl.constexpr,
                   NR: tl.constexpr, TIGHT: tl.constexpr, NPPS: tl.constexpr, SHIFT: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = bh // H_KV
    hk = bh % H_KV
    rows = tl.arange(0, NR)                 # row n: query head hk * G_q + n // T_q, token n % T_q (GQA)
    rmask = rows < M
    h = hk * G_Q + rows // T_Q
    t = rows % T_Q
    q_off = b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h + t.to(tl.int64) * sq_t
    d = tl.arange(0, D)
    qt = tl.load(q_ptr + q_off[None, :] + d[:, None] * sq_d, mask=rmask[None, :], other=0.0).to(tl.float32)
    p_start = sp * PPS
    p_end = tl.minimum(p_start + PPS, NP)
    m_i = tl.full((NR,), float("-inf"), tl.float32)
    l_i = tl.zeros((NR,), tl.float32)
    vb = tl.zeros((NR,), tl.float32)
    acc = tl.zeros((D, NR), tl.float32)
    if TIGHT:
        for j in range(p_start, p_end):
            m_i, l_i, vb, acc = _tokens_page(qt, m_i, l_i, vb, acc, j, p_end, b, hk, H_KV, NF, N_TAB, qk_scale,
                                             kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, kt_ptr,
                                             vt_ptr, D, G, BT, K_BITS, V_BITS, KITTY, DB_HIGH, NR, SHIFT)
    else:                                                   # interpreter: constexpr trip count, masked
        for it in range(0, NPPS):
            m_i, l_i, vb, acc = _tokens_page(qt, m_i, l_i, vb, acc, p_start + it, p_end, b, hk, H_KV, NF, N_TAB,
                                             qk_scale, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr,
                                             vm_ptr, kt_ptr, vt_ptr, D, G, BT, K_BITS, V_BITS, KITTY, DB_HIGH, NR,
                                             SHIFT)
    m_i = m_i * 0.6931471805599453                        # log2 units -> natural
    acc = acc + vb[None, :]
    # acc^T's rows are channels in the order of _word_order (the value codes' unpacking)
    grow = ((b * H_Q + h) * T_Q + t).to(tl.int64) * S_TOTAL + sp
    dst = _word_order(D, V_BITS)
    tl.store(o_ptr + grow[None, :] * D + dst[:, None], acc, mask=rmask[None, :])
    tl.store(m_ptr + grow, m_i, mask=rmask)
    tl.store(l_ptr + grow, l_i, mask=rmask)


@triton.jit
def _tokens_page(qt, m_i, l_i, vb, acc, j, j_end, b, hk, H_KV, NF, N_TAB, qk_scale,
                 kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, kt_ptr, vt_ptr,
                 D: tl.constexpr, G: tl.constexpr, BT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                 KITTY: tl.constexpr, DB_HIGH: tl.constexpr, NR: tl.constexpr, SHIFT: tl.constexpr):
    """Page j of _tokens_kernel (none when ``j >= j_end``): its key operand once, then G / BT online-softmax
    steps of BT tokens."""
    GB: tl.constexpr = G * K_BITS // 8
    VB: tl.constexpr = D * V_BITS // 8
    valid = j < j_end
    kpid = tl.maximum(tl.load(kt_ptr + b * N_TAB + j, mask=valid, other=0).to(tl.int64), 0)
    vpid = tl.maximum(tl.load(vt_ptr + b * N_TAB + j, mask=valid, other=0).to(tl.int64), 0)
    kbase = (kpid * H_KV + hk) * D
    hbase = (kpid * H_KV + hk) * DB_HIGH
    d = tl.arange(0, D)
    ks = tl.load(ks_ptr + kbase + d).to(tl.float32)
    km = tl.load(km_ptr + kbase + d).to(tl.float32)
    # the key operand (D, 2 NR): column 2n the hi half of row n's q * scale_k / max, 2n + 1 its lo half * SHIFT
    a = qt * ks[:, None]
    amax = tl.max(tl.abs(a), axis=0)
    r = tl.where(amax > 0.0, amax, 1.0)
    an = a * (1.0 / r)[None, :]
    hi = an.to(tl.float16)
    lo = ((an - hi.to(tl.float32)) * SHIFT).to(tl.float16)
    qop = tl.reshape(tl.join(hi, lo), (D, 2 * NR))
    bias = tl.sum(qt * km[:, None], axis=0)                                    # (NR,) q . mn_k
    vw = tl.arange(0, VB // 4)
    for c in tl.static_range(G // BT):
        tok = c * BT + _word_order(BT, K_BITS)             # the key codes' token order (values follow it)
        tmask = ((j * G + tok) < NF) & ((j + 0 * tok) < j_end)
        kcodes = _key_words(kc_ptr, kh_ptr, ki_ptr, kbase, hbase, d, c * BT, D, BT, GB, K_BITS, KITTY, DB_HIGH)
        s2 = tl.dot(tl.trans(kcodes), qop)                                  # (BT, 2 NR) fp32
        s_hi, s_lo = tl.split(tl.reshape(s2, (BT, NR, 2)))
        s = ((s_hi + s_lo * (1.0 / SHIFT)) * r[None, :] + bias[None, :]) * qk_scale
        s = tl.where(tmask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])                                     # (BT, NR)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
        vrow = (vpid * H_KV + hk) * G + tok
        vword = tl.load(vc_ptr.to(tl.pointer_type(tl.int32)) + vrow[:, None] * (VB // 4) + vw[None, :],
                        mask=tmask[:, None], other=0)
        vs = tl.load(vs_ptr + vrow, mask=tmask, other=0.0).to(tl.float32)
        vm = tl.load(vm_ptr + vrow, mask=tmask, other=0.0).to(tl.float32)
        pv = p * vs[:, None]                                                # (BT, NR)
        pmax = tl.max(tl.abs(pv), axis=0)
        pr = tl.where(pmax > 0.0, pmax, 1.0)
        pn = (pv * (1.0 / pr)[None, :]).to(tl.float16)
        vcodes = _word_codes_f16(vword, BT, VB // 4, V_BITS)                # (BT, D), channels in word order
        acc = acc * alpha[None, :] + tl.dot(tl.trans(vcodes), pn) * pr[None, :]
        vb = vb * alpha + tl.sum(p * vm[:, None], axis=0)
    return m_i, l_i, vb, acc


# Gather the tail of the decode: the tokens the fused kernel does not cover (the sink and the post-sink
# tokens [NF, T - S)), fp32 K / V rows in token order.
# Computes: row u < NS is sink token u; row u >= NS is post-sink token p = NF + u - NS, whose key comes
#   from key page k_table[b, p // G] slot p % G (code * scale + mn, two rounded fp32 ops: bit-exact with
#   the reference's dequantize; Kitty: low | high[idx] << 2) when p < KQ, else from the key Q-buffer
#   (p - KQ); its value from value page v_table[b, p // G] slot p % G when p < VQ, the value Q-buffer
#   (p - VQ) when p < VQ + NVB, else the window ring buffer slot p % R.
# Grid: (B * H_kv, cdiv(NT, BT)); tile (BT tokens, D channels), gathers within one page row.
# Bytes: reads NT rows of K and V (packed or FP16) per (b, kv head), writes 2 NT D fp32.
@triton.jit(do_not_specialize=["NS", "NF", "NT", "KQ", "VQ", "NVB"])    # the counts move with the length
def _gather_tail_kernel(sk_ptr, sv_ptr, kb_ptr, vb_ptr, vw_ptr, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr,
                        vc_ptr, vs_ptr, vm_ptr, kt_ptr, vt_ptr, ok_ptr, ov_ptr,
                        H_KV, S, NS, NF, NT, KQ, VQ, NVB, R1, N_TAB, G,
                        D: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, NGV: tl.constexpr,
                        KITTY: tl.constexpr, DB_HIGH: tl.constexpr, BT: tl.constexpr):
    bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = bh // H_KV
    hk = bh % H_KV
    u = blk * BT + tl.arange(0, BT)
    d2 = tl.arange(0, D)[None, :]
    umask = u < NT
    k = _tail_keys(sk_ptr, kb_ptr, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, kt_ptr, b, hk, H_KV, u, umask, d2,
                   S, NS, NF, KQ, N_TAB, G, D, K_BITS, KITTY, DB_HIGH)
    v = _tail_values(sv_ptr, vb_ptr, vw_ptr, vc_ptr, vs_ptr, vm_ptr, vt_ptr, b, hk, H_KV, u, umask, d2,
                     S, NS, NF, VQ, NVB, R1, N_TAB, G, D, V_BITS, NGV)
    out = ((bh.to(tl.int64) * NT + u) * D)[:, None] + d2
    tl.store(ok_ptr + out, k, mask=umask[:, None])
    tl.store(ov_ptr + out, v, mask=umask[:, None])


@triton.jit
def _tail_keys(sk_ptr, kb_ptr, kc_ptr, kh_ptr, ki_ptr, ks_ptr, km_ptr, kt_ptr, b, hk, H_KV, u, umask, d2,
               S, NS, NF, KQ, N_TAB, G, D: tl.constexpr, K_BITS: tl.constexpr, KITTY: tl.constexpr,
               DB_HIGH: tl.constexpr):
    """fp32 keys of tail rows ``u`` (rows where ``umask`` is False: 0) at channels ``d2`` (1, C) of D: the
    sink token u < NS, else post-sink token p = NF + u - NS from its key page (p < KQ: code * scale + mn,
    two rounded fp32 ops, Kitty's high bits joined) or the key Q-buffer (``_gather_tail_kernel``'s rows)."""
    bh64 = (b * H_KV + hk).to(tl.int64)
    is_sink = (u < NS) & umask
    post = (u >= NS) & umask
    pp = tl.maximum(NF + u - NS, 0)
    page = pp // G
    slot = pp % G
    k = tl.load(sk_ptr + ((bh64 * S + u) * D)[:, None] + d2, mask=is_sink[:, None], other=0.0).to(tl.float32)
    in_kp = post & (pp < KQ)
    in_kb = post & (pp >= KQ)
    kb = tl.load(kb_ptr + ((bh64 * G + (pp - KQ)) * D)[:, None] + d2, mask=in_kb[:, None], other=0.0)
    k = tl.where(in_kb[:, None], kb.to(tl.float32), k)
    PER: tl.constexpr = 8 // K_BITS
    GB = G * K_BITS // 8
    kpid = tl.maximum(tl.load(kt_ptr + b * N_TAB + page, mask=in_kp, other=0), 0).to(tl.int64)
    kbase = (kpid * H_KV + hk) * D
    m2 = in_kp[:, None]
    byte = tl.load(kc_ptr + (kbase[:, None] + d2) * GB + (slot // PER)[:, None], mask=m2, other=0).to(tl.int32)
    code = (byte >> ((slot % PER) * K_BITS)[:, None]) & ((1 << K_BITS) - 1)
    if KITTY:
        if DB_HIGH > 0:
            idx = tl.load(ki_ptr + kbase[:, None] + d2, mask=m2, other=DB_HIGH).to(tl.int32)
            boosted = idx < DB_HIGH
            hrow = tl.minimum(idx, DB_HIGH - 1)
            hb = tl.load(kh_ptr + ((kpid * H_KV + hk) * DB_HIGH)[:, None] * GB + hrow * GB + (slot // 4)[:, None],
                         mask=m2 & boosted, other=0).to(tl.int32)
            code = code | (((hb >> ((slot % 4) * 2)[:, None]) & 3) << 2)
    ks = tl.load(ks_ptr + kbase[:, None] + d2, mask=m2, other=0.0).to(tl.float32)
    km = tl.load(km_ptr + kbase[:, None] + d2, mask=m2, other=0.0).to(tl.float32)
    return tl.where(m2, code.to(tl.float32) * ks + km, k)


@triton.jit
def _tail_values(sv_ptr, vb_ptr, vw_ptr, vc_ptr, vs_ptr, vm_ptr, vt_ptr, b, hk, H_KV, u, umask, d2,
                 S, NS, NF, VQ, NVB, R1, N_TAB, G, D: tl.constexpr, V_BITS: tl.constexpr, NGV: tl.constexpr):
    """fp32 values of tail rows ``u`` (rows where ``umask`` is False: 0) at channels ``d2`` (1, C) of D: the
    sink token u < NS, else post-sink token p = NF + u - NS from its value page (p < VQ), the value
    Q-buffer (p < VQ + NVB) or the window ring slot p % R (``_gather_tail_kernel``'s rows)."""
    bh64 = (b * H_KV + hk).to(tl.int64)
    is_sink = (u < NS) & umask
    post = (u >= NS) & umask
    pp = tl.maximum(NF + u - NS, 0)
    page = pp // G
    slot = pp % G
    v = tl.load(sv_ptr + ((bh64 * S + u) * D)[:, None] + d2, mask=is_sink[:, None], other=0.0).to(tl.float32)
    in_vp = post & (pp < VQ)
    in_vb = post & (pp >= VQ) & (pp < VQ + NVB)
    in_vw = post & (pp >= VQ + NVB)
    vb = tl.load(vb_ptr + ((bh64 * G + (pp - VQ)) * D)[:, None] + d2, mask=in_vb[:, None], other=0.0)
    v = tl.where(in_vb[:, None], vb.to(tl.float32), v)
    vw = tl.load(vw_ptr + ((bh64 * R1 + pp % R1) * D)[:, None] + d2, mask=in_vw[:, None], other=0.0)
    v = tl.where(in_vw[:, None], vw.to(tl.float32), v)
    VPER: tl.constexpr = 8 // V_BITS
    VB: tl.constexpr = D * V_BITS // 8
    vpid = tl.maximum(tl.load(vt_ptr + b * N_TAB + page, mask=in_vp, other=0), 0).to(tl.int64)
    vrow = (vpid * H_KV + hk) * G + slot
    n2 = in_vp[:, None]
    vbyte = tl.load(vc_ptr + vrow[:, None] * VB + d2 // VPER, mask=n2, other=0).to(tl.int32)
    vcode = (vbyte >> ((d2 % VPER) * V_BITS)) & ((1 << V_BITS) - 1)
    gi = d2 // (D // NGV)
    vs = tl.load(vs_ptr + vrow[:, None] * NGV + gi, mask=n2, other=0.0).to(tl.float32)
    vm = tl.load(vm_ptr + vrow[:, None] * NGV + gi, mask=n2, other=0.0).to(tl.float32)
    return tl.where(n2, vcode.to(tl.float32) * vs + vm, v)


def gather_tail(cfg, codec, st: PagedState, NF: int):
    """K, V fp32 (B, H, NT, D) of the tokens outside the fused range: the sink, then post-sink tokens
    [NF, T - S) in token order (one kernel; bit-exact with the reference's dequantize)."""
    B, H, D = st.shape
    c = counts(cfg, st.length)
    NT = c["n_sink"] + (c["post"] - NF)
    ok = torch.empty((B, H, NT, D), dtype=torch.float32, device=st.device)
    ov = torch.empty_like(ok)
    if NT == 0:
        return ok, ov
    kp = codec.kernel_arrays(cfg, st)
    ints, consts = _gather_ints(cfg, kp, st.shape, st.length, st.k_table.shape[1], NF)
    _gather_tail_kernel[(B * H, _cdiv(NT, consts["BT"]))](
        *_gather_tensors(kp, st), ok, ov, *ints, **consts, num_warps=4, enable_fp_fusion=False)
    return ok, ov


def _gather_ints(cfg, kp: dict, shape, T: int, n_table: int, NF: int):
    """``_gather_tail_kernel``'s integer arguments and constexprs for a cache of ``shape`` (B, H_kv, D)
    holding T tokens, page tables ``n_table`` wide, ``NF`` of its tokens fused."""
    B, H, D = shape
    c = counts(cfg, T)
    S, G, R = cfg.sink, cfg.group_size, cfg.residual
    NS = c["n_sink"]
    NT = NS + (c["post"] - NF)
    ints = (H, S, NS, NF, NT, c["n_kpages"] * G, c["n_vq"], c["n_vbuf"], max(R, 1), n_table, G)
    consts = dict(D=D, K_BITS=kp["bits"], V_BITS=cfg.v_bits, NGV=D // cfg.v_group(D), KITTY=kp["kitty"],
                  DB_HIGH=kp["d_boost"], BT=32)
    return ints, consts


def _gather_tensors(kp: dict, st: PagedState) -> tuple:
    """``_gather_tail_kernel``'s state tensors (an empty one replaced by the key Q-buffer: never read)."""
    dummy = st.k_buf
    return (st.sink_k if st.sink_k.numel() else dummy, st.sink_v if st.sink_v.numel() else dummy, st.k_buf,
            st.v_buf if st.v_buf.numel() else dummy, st.v_win if st.v_win.numel() else dummy, kp["codes"],
            kp["high"], kp["idx"], kp["scale"], kp["mn"], st.v_codes, st.v_scale, st.v_mn, st.k_table, st.v_table)


#: decode plans kept (least recently used dropped): a model step attends every layer at one length, so its
#: layers share one plan, and a generation moves on by one token per step (as kvq.fast.cupy.paged)
PLAN_CACHE_SIZE = 256


class DecodePlan(L.Plan):
    """Every launch of one decode call, planned once per call shape (``decode_plan``). ``fallback``: the
    configuration is not the fused kernel's (dequantize and attend); else the fused kernel's ``Plan``
    (``lp``), ``NF`` fused tokens, ``NT`` tail tokens (gathered into fp32 for the FP16 partial kernel), ``S_TOTAL``
    partial slots per query row over ``rows`` rows, ``q_float`` (the fused kernel takes q cast to fp32: the
    exact path) and ``tail_q_float`` (the tail's partial kernel takes q cast to fp32: bf16 q), and the
    kernels' ``_launch.Launch``es with their integer arguments (``gather`` / ``fused`` / ``tail`` None where
    there is no work; ``merge``). Its scratch (``_launch.Plan``): the o, m and l partials and the gathered
    tail's K and V."""

    __slots__ = ("fallback", "NF", "NT", "S_TOTAL", "rows", "q_float", "tail_q_float", "lp",
                 "gather", "gather_ints", "fused", "fused_ints", "fused_scale", "tail",
                 "tail_ints", "merge", "merge_ints")


def decode_plan(cfg, codec, st: PagedState, q, kp: dict | None = None, knobs: Knobs | None = None,
                ) -> DecodePlan:
    """The launch plan of ``decode_attention(cfg, codec, st, q, knobs=knobs)``: computed once per
    (configuration, cache shape, length, table width and dtypes, q's dtype, shape and strides, device,
    alignment, knobs) and reused (an LRU of PLAN_CACHE_SIZE plans). It holds every launch's grid,
    constexprs, options and integer arguments; its launches keep their compiled kernels after their first
    call (``_launch``), so a call fills in only the tensors and the scale, and a plan of a new length takes
    the kernels an earlier plan compiled (the lengths are not specialized on). ``kp``: the codec's kernel arrays
    of ``st`` where the caller has them; ``knobs``: a ``Knobs`` (None: the defaults)."""
    knobs = DEFAULT_KNOBS if knobs is None else knobs
    if not isinstance(knobs, Knobs):
        raise TypeError(f"knobs must be a kvq.fast.triton.paged.Knobs or None, got {type(knobs).__name__}")
    kp = codec.kernel_arrays(cfg, st) if kp is None else kp
    tensors = (q, *_gather_tensors(kp, st))
    return _plan_of(cfg, st, q, kp, tensors, tuple(map(L.PTR, tensors)), knobs)


def _plan_of(cfg, st: PagedState, q, kp: dict, tensors: tuple, ptrs: tuple, knobs: Knobs) -> DecodePlan:
    """decode_plan's lookup, given q and the state's tensors (``_gather_tensors``) and their addresses."""
    dev = q.device
    return _decode_plan(cfg, st.shape, st.length, tuple(q.shape), q.stride(), tuple(map(L.DTYPE, tensors)), dev,
                        L.device_index(dev), kp["bits"], bool(kp["kitty"]), int(kp["d_boost"]),
                        st.k_table.shape[1], L.aligned(ptrs), knobs)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _decode_plan(cfg, shape, T, q_shape, q_strides, dtypes, dev, dev_index, k_bits, kitty, db, n_table, aligned,
                 knobs: Knobs) -> DecodePlan:
    """decode_plan's cached body: a function of its arguments only (``dtypes``: q's, then the state
    tensors' of ``_gather_tensors``)."""
    B, H, D = shape
    if not fused_ok(cfg, D):
        return DecodePlan(fallback=True)
    q_dtype = dtypes[0]
    _, H_q, T_q, _ = q_shape
    c = counts(cfg, T)
    G = cfg.group_size
    NF = min(c["n_kpages"] * G, c["n_vq"])
    NP = -(-NF // G)
    interp = Q.interpreting()
    # the exact fp32 path also where a tensor-core dot would reduce over 16 elements on the GPU (G or D
    # = 16): Triton 3.6 lays out such byte-fed operands for K >= 32 on sm_90 and adds half the products
    # twice (found in kvq.fast.triton.oscar_decode); the interpreter's dots are exact
    precise = (q_dtype == torch.float32 or (interp and q_dtype == torch.bfloat16)
               or (not interp and min(G, D) < 32))
    q_float = precise and q_dtype != torch.float32
    G_q = H_q // H
    M = G_q * T_q
    BLOCK_M, m_blocks = A.row_blocks(G_q, T_q)
    sms = A.sm_count(dev)
    magic = q_dtype == torch.float16 and not precise
    kp = {"bits": k_bits, "kitty": kitty, "d_boost": db}
    # the fused kernel's launch: splits of about knobs.waves programs per SM, tiles, warps (plan)
    lp = plan(NP, G, D, B * H * m_blocks, sms, precise=precise, magic=magic, interp=interp,
              k_bits=k_bits if NP else 0, v_bits=cfg.v_bits, ngv=D // cfg.v_group(D), m=M, knobs=knobs)
    n_split, pps = lp.n_split, lp.pps
    # the rest: sink + tokens [S + NF, T), one fp32 segment gathered by one kernel, its splits after the
    # fused kernel's n_split partial slots
    NT = c["n_sink"] + c["post"] - NF
    S_TOTAL = n_split
    gather = tail = None
    gather_ints = tail_ints = ()
    tail_q_float = False
    # the tail gathered into fp32 for the FP16 partial kernel (reading it where it lies, in the fused kernel's
    # launch or a kernel of its own, cost more GPU time: lab/2026-11-29-fused-tail/NOTE.md)
    if NT > 0:
        gather_ints, gconsts = _gather_ints(cfg, kp, shape, T, n_table, NF)
        gather = L.Launch(_gather_tail_kernel, (B * H, _cdiv(NT, gconsts["BT"])), gconsts,
                          dict(num_warps=4, enable_fp_fusion=False), aligned)
        kps, n, (block_n, warps, stages) = A.segment_split(NT, D, B * H * m_blocks, torch.float32, dev,
                                                           knobs.tail_keys)
        # fp16 q as it is (the precise partial widens it exactly as it loads it: no cast launch); bf16 as fp32
        tail_q_float = q_dtype == torch.bfloat16
        q_str = C.contiguous_strides(q_shape) if tail_q_float else q_strides
        kv_str = (H * NT * D, NT * D, D, 1)
        S_TOTAL = n_split + n
        tail_ints = (*q_str, *kv_str, *kv_str, H_q, H, T_q, NT, M, kps, S_TOTAL, n_split)
        tail = A.planned_partial((B * H, n, m_blocks), G_q=G_q, D=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
                                 warps=warps, stages=stages, kps=kps, fast=aligned)
    rows = B * H_q * T_q
    fused = None
    fused_ints = ()
    if n_split:
        qs = C.contiguous_strides(q_shape) if q_float else q_strides
        fused_ints = (*qs, H_q, H, T_q, M, NF, NP, pps, S_TOTAL, n_table)
        common = dict(G_Q=G_q, D=D, G=G, BT=lp.BT, K_BITS=k_bits, V_BITS=cfg.v_bits, KITTY=kitty, DB_HIGH=db,
                      TIGHT=not interp, NPPS=pps if interp else 0)
        opts = dict(num_warps=lp.warps, num_stages=lp.stages)
        if lp.rows:
            if lp.maxnreg:
                opts["maxnreg"] = lp.maxnreg
            fused = L.Launch(_tokens_kernel, (B * H, n_split), dict(common, NR=lp.rows, SHIFT=2048.0), opts,
                             aligned)
        else:
            fused = L.Launch(_fused_kernel, (B * H, n_split, m_blocks),
                             dict(common, NGV=D // cfg.v_group(D), BLOCK_M=BLOCK_M, PRECISE=precise, MAGIC=magic,
                                  SPLIT_P=lp.split_p, K_TERMS=lp.k_terms, K_WORDS=lp.k_words, V_WORDS=lp.v_words,
                                  SHIFT=2048.0 if (q_dtype == torch.float16 and not q_float) else 256.0),
                             opts, aligned)
    merge = A.planned_merge(rows, S_TOTAL, D, q_dtype, aligned)
    # one fp32 buffer per call: the partials o (rows, S, D), m and l (rows, S), then the tail's K and V
    n_o, n_s, n_t = rows * S_TOTAL * D, rows * S_TOTAL, (0 if gather is None else B * H * NT * D)
    offsets = (0, n_o, n_o + n_s, n_o + 2 * n_s, n_o + 2 * n_s + n_t)
    tail_kv = (B, H, NT, D) if gather is not None else None
    shapes = ((rows, S_TOTAL, D), (rows, S_TOTAL), (rows, S_TOTAL), tail_kv, tail_kv)
    return DecodePlan(fallback=False, dev_index=dev_index, NF=NF, NT=NT, S_TOTAL=S_TOTAL, rows=rows,
                      n_buf=n_o + 2 * n_s + 2 * n_t, offsets=offsets, shapes=shapes,
                      launches=tuple(x for x in (gather, fused, tail, merge) if x is not None),
                      q_float=q_float, tail_q_float=tail_q_float, lp=lp,
                      gather=gather, gather_ints=gather_ints, fused=fused, fused_ints=fused_ints,
                      fused_scale=LOG2E if (n_split and not precise) else 1.0, tail=tail, tail_ints=tail_ints,
                      merge=merge, merge_ints=(S_TOTAL, D))


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def fused_ok(cfg, D: int) -> bool:
    """Whether the fused kernel takes this configuration (else decode dequantizes the whole cache)."""
    return _pow2(D) and D <= 256 and _pow2(cfg.group_size) and cfg.group_size <= 1024


def decode_attention(cfg, codec, st: PagedState, q, *, scale=None, knobs: Knobs | None = None):
    """Attention of q (B, H_q, T_q, D) over the cache: ``(out in q's dtype, lse fp32)``, by the cached
    launch plan of this call's shape (``decode_plan``); ``knobs``: the fused kernel's launch knobs (None:
    the defaults), planned by ``plan``. Once a plan's launches hold their compiled kernels, a call hands
    them device addresses (``_launch``); before that, and where they may not be used, tensors through
    Triton's dispatch."""
    if knobs is not None and not isinstance(knobs, Knobs):
        raise TypeError(f"knobs must be a kvq.fast.triton.paged.Knobs or None, got {type(knobs).__name__}")
    _paged.check_q(codec, st, q)
    B, H, D = st.shape
    sc = C.softmax_scale(scale, D)
    dev = q.device
    out = torch.empty(tuple(q.shape), dtype=q.dtype, device=dev)
    lse = torch.empty(tuple(q.shape[:3]), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse
    kp = codec.kernel_arrays(cfg, st)
    tensors = (q, *_gather_tensors(kp, st))
    ptrs = tuple(map(L.PTR, tensors))
    p = _plan_of(cfg, st, q, kp, tensors, ptrs, DEFAULT_KNOBS if knobs is None else knobs)
    if p.fallback:
        K, V = dequantize_cache(cfg, codec, st)
        o, ls = A.decode_attention(q.float(), [(K, V)], scale=sc)
        return o.to(q.dtype), ls
    dev_index = p.dev_index
    stream = p.stream()
    buf = p.scratch(dev)
    o_part, m_part, l_part, tk, tv = p.regions(buf, stream)
    oview = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    # q as fp32 for the exact path and for bf16 q's tail (one contiguous copy, alive until the launches)
    q32 = _cast(q) if (p.q_float or p.tail_q_float) else None
    qk = q32 if p.q_float else q
    qf = q32 if p.tail_q_float else q
    if stream is not None:                     # addresses
        a, oa, la = ptrs, oview.data_ptr(), lse.data_ptr()
        qk = ptrs[0] if qk is q else qk.data_ptr()
        qf = ptrs[0] if qf is q else qf.data_ptr()
    else:                                      # tensors (Triton's dispatch)
        a, oa, la = tensors, oview, lse
    g = a[1:]                                  # the state: sink, buffers, window, key pool, value pool, tables
    if p.gather is not None:
        p.gather((*g, tk, tv, *p.gather_ints), stream, dev_index)
    if p.fused is not None:
        p.fused((qk, *g[5:], o_part, m_part, l_part, *p.fused_ints, sc * p.fused_scale), stream, dev_index)
    if p.tail is not None:
        p.tail((qf, tk, tv, o_part, m_part, l_part, *p.tail_ints, sc), stream, dev_index)
    p.merge((o_part, m_part, l_part, oa, la, *p.merge_ints), stream, dev_index)
    p.settle(stream)
    return out, lse


def _cast(q):
    """q as contiguous fp32 (the plan's strides for the fp32 paths)."""
    return q.to(torch.float32, memory_format=torch.contiguous_format)
