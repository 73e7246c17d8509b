"""Triton fused decode attention over the BitDecoding cache (Du et al., section V: the Packing and
Residual Kernels of Fig. 7, with the query transformation of V-A): the packed pages are read as raw
16-bit words in the induced layout, unpacked and dequantized in registers and fed to ``tl.dot``; the FP16
residual rows are attended by the same kernel; one log-sum-exp merge joins the splits.

    from kvq.fast.triton import bitdecoding_decode as BDD
    if BDD.supported(cfg, st, q):                     # st: torch tensors named as BitDecodingState
        out, lse = BDD.decode(cfg, st, q)             # q (B, H_q, T_q, D); out in q's dtype, lse fp32

**What it computes.** ``kvq.reference.bitdecoding.decode_attention``: every cached token is visible;
the ``N_p = L - L mod N_r`` packed tokens of sequence b live in pages ``table[b, j]`` (N_r tokens each),
the last ``L mod N_r`` in rows ``[0, L mod N_r)`` of ``res_k`` / ``res_v``.

**The layout read** (per page and KV head; R = 16 / bits codes per word, W_n warps; see the reference):

    k_words (8 W_n, D)   word (8 w + g, c), slot i  <-  code of K[w 8R + 8 i + g, c]
    v_words (N_r, D / R) word (t, 8 u + g), slot i  <-  code of V[t, 8 (u R + i) + g]

A page is walked in *chunks* of WB warps (BT = 8 R WB tokens, WB a power of two dividing W_n, BT <= 128):
the key words of a chunk are a (8 WB, D) tile, unpacked by broadcasting each word over its R slots
(shift, mask) and reshaping (WB, R, 8, D) -> (BT, D) (token ``w 8R + 8 i + g`` is row-major (w, i, g));
the value words are a (BT, D / R) tile, unpacked as (BT, U, R, 8) -> (BT, D) (channel ``8 (u R + i) + g``
is row-major (u, i, g)). Each word is loaded once (``Knobs(unpack=0)``: gathered per element by index
arithmetic instead). The half2 params are read as one 32-bit word each, at group granularity where the
group covers the chunk (channel-wise keys: one row of D; per-token groups: (BT, D / G), broadcast).

**Kernel.** One program per (split, (b, kv head), block of query rows). The query transformation: the
``g_q = H_q / H_kv`` query heads sharing KV head kv, times T_q tokens, are the M rows of one tile (row
``j T_q + s`` = query head ``kv g_q + j``, token s; padded to BLOCK_M >= 16 for ``tl.dot``, blocks of at
most 64 rows). The chunks of a sequence, ``L // N_r`` pages x ``W_n / WB`` page chunks in token order
then ``cdiv(L mod N_r, BT)`` residual chunks (fp16 rows loaded as they are, masked past the residual's
length), are split into ranges so that the grid holds about ``Knobs.waves`` = 4 programs per SM
(``attention.sm_count``; at least 256 tokens per split on the GPU). Each program runs flash-decoding over
its range and writes fp32 partials (acc, m, l) in ``kvq.fast.triton.attention``'s partial layout
(``_partials``); ``attention.merge_launch`` normalizes: two launches per decode. (The residual is fused
rather than sent through ``attention.launch_partials``: that kernel's fast path works in base-2 units
with one long dot (at 0.98 of the rule-7 bound on residual-only caches under the interpreter), its
precise path needs fp32 copies of the residual and IEEE dots (about 30 us more per decode at B = 1 on an
H100).)

**Numerics.** Dequantization is the contract's, exactly: ``fp16(fp32(code) * scale + mn)`` (saturated
at +-65504, rule 3) with scale and min the fp16 half2 params (the code enters fp32 through the exponent trick, exact; ``code * scale``
is exact in fp32, so an FMA contraction rounds as the separate multiply and add). These are the fp16
operands the reference attends over. Scores ``s = (q @ K^T) * scale`` are summed over channels as a
pairwise tree of 16-channel dots (``Knobs.leaf``), added in IEEE fp32: a single tensor-core dot over
D = 128 chains its k16 steps through the accumulator with truncation, and measured on an H100 at up to
2.0x the rule-7 bound on the lse with an outlier key channel (leaves of 32: 1.6x, of 16: 0.91x); under
the interpreter the tree also replaces its sequential fp32 dot. Scores stay in natural units and the
online softmax takes ``exp2((s - m) log2 e)``, so no rounding of log2 e or ln 2 reaches m and the lse.
- fp16 q: the leaf dots on tensor cores (fp16 x fp16 products exact, fp32 accumulation); ``P @ V``
  with P rounded to fp16 (as FP16 flash-decoding does), fp32 accumulation.
- bf16 q (GPU): each fp16 key leaf split exactly into two bf16 halves K_hi + K_lo (fp16's 11
  significant bits = 8 + 3), ``q @ K_hi^T + q @ K_lo^T`` on tensor cores; ``P @ V`` as for fp16.
- fp32 q (and bf16 q under the interpreter, whose bf16 ``tl.dot`` is wrong: q is widened exactly to
  fp32): the keys' fp16 values widened, IEEE fp32 leaf dots, accurate exp, P kept in fp32, ``P @ V`` a
  pairwise tree of IEEE fp32 dots over 16 tokens (no tensor cores; chunks of one warp).
Every order-dependent reduction is held to contract rule 7 (tests/parity/test_bitdecoding_decode_triton).

**Performance** (H100, D = 128, g_q = 4, T_q = 1, CUDA graphs; FP16 flash-decoding of
``attention.decode_attention`` on the same context for comparison): BitDecoding-KC2, B = 32, L = 4196:
262 us (fp16 q; 164 us with one dot per chunk, ``Knobs(leaf=128)``, outside rule 7 as above) against
191 us for FP16; B = 1: 21 us against 11 us. The kernel is bound by the unpacking and dequantization
in registers (reshapes through shared memory, the per-leaf dequantization), not by the bytes it reads
(75.5 MB of pages there: ~290 GB/s): the faster layouts of the paper (ldmatrix fragments, lop3 half2
dequantization) are not reachable from Triton's tile model as written here.

**Not supported** (``supported`` returns False; use the reference / the unfused path): head dims that
are not powers of two or exceed 256 (``tl.arange`` tiles; the launch is sized for D <= 256), float64 q.
Inputs are trusted: the cache wrapper validates q and the state (shapes, dtypes, devices, a non-empty
cache, NaN / inf) before calling :func:`decode`; the pool tensors and params must be contiguous.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvq.fast import common as C

from kvq.fast.common import cdiv as _cdiv  # host grid arithmetic
from . import attention as A
from . import _launch as L
from .quant import sat_f16, interpreting

__all__ = ["supported", "decode"]

_check_knob = functools.partial(C.check_knob, "triton.bitdecoding_decode")     # ValueError naming triton.bitdecoding_decode.Knobs.<field>
_is_int = C.is_int


@dataclass(frozen=True)
class Knobs:
    """The launch knobs of ``decode`` (None: the built-in choice), for tuning runs on the GPU. Immutable and
    hashable (``plan`` is cached per knobs); the rules and timings behind the defaults:
    ``lab/2026-11-24-bitdecoding/KNOBS.md``."""

    leaf: int | None = None              # channels per dot of the scores' tree (None: 16)   KNOBS.md#leaf
    unpack: int = 1                      # 1 words broadcast by a reshape, 0 gathered        KNOBS.md#unpack
    waves: float = 4                     # target programs per SM                            KNOBS.md#splits
    bt_max: int | None = None            # most tokens per chunk (None: 128, 64 for D > 128) KNOBS.md#chunks
    num_warps: int | None = None         # warps per program (None: 4, 8 for wide tiles)    KNOBS.md#chunks
    num_stages: int | None = None        # software-pipelining depth (None: 2)               KNOBS.md#chunks
    min_tokens: int = 256                # fewest tokens per split on the GPU                KNOBS.md#splits

    def __post_init__(self):
        C.check_launch_knobs("triton.bitdecoding_decode", self)             # num_warps, waves, block_t, num_stages
        _check_knob(self.leaf is None or (_is_int(self.leaf) and self.leaf >= 16 and self.leaf & (self.leaf - 1) == 0),
                    "leaf", self.leaf, "None or a power of two >= 16")
        _check_knob(_is_int(self.unpack) and self.unpack in (0, 1), "unpack", self.unpack, "0 or 1")
        _check_knob(self.bt_max is None or (_is_int(self.bt_max) and self.bt_max > 0), "bt_max", self.bt_max,
                    "None or a positive int")
        _check_knob(_is_int(self.min_tokens) and self.min_tokens > 0, "min_tokens", self.min_tokens,
                    "a positive int")


#: the defaults
DEFAULT_KNOBS = Knobs()

_MODE_FP16, _MODE_BF16, _MODE_FP32 = 0, 1, 2


# ---------------------------------------------------------------------------------------------------
# device helpers: one chunk of a page, unpacked and dequantized


@triton.jit
def _half2(pp, mask):
    """(scale, min) fp32 of the half2 params at int32 pointers ``pp`` (one 32-bit load: scale in the low
    half, min in the high half, little-endian)."""
    x = tl.load(pp, mask=mask, other=0)
    s = (x & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    m = ((x >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return s, m


@triton.jit
def _per_group(pp_rows, mask, NG: tl.constexpr, G: tl.constexpr, BT: tl.constexpr):
    """Params of groups of G channels per token: the (BT, NG) half2 at int32 pointers ``pp_rows`` (BT, 1)
    (group g at ``+ g``), as (BT, 1) when NG == 1 (broadcast by the caller) or spread to (BT, NG G)."""
    if NG == 1:
        s, m = _half2(pp_rows, mask)
    else:
        s, m = _half2(pp_rows + tl.arange(0, NG)[None, :], mask)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BT, NG, G)), (BT, NG * G))
        m = tl.reshape(tl.broadcast_to(m[:, :, None], (BT, NG, G)), (BT, NG * G))
    return s, m


@triton.jit
def _dequant(code, s, m):
    """Rule 3 exactly: ``fp16(fp32(code) * scale + mn)``, saturated at +-65504 before the rounding
    (``quant.sat_f16``, numerics.to_out). The code (< 2^bits) becomes fp32 through the exponent trick
    ``bits(2^23 + code) - 2^23`` (exact; an integer-to-float conversion runs at a fraction of the FMA
    rate and bounded the kernel); ``code * scale`` is exact in fp32, so an FMA contraction rounds as the
    separate multiply and add do."""
    cf = (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return sat_f16(cf * s + m).to(tl.float16)


@triton.jit
def _key_codes(kw_ptr, ph, ch, c, valid, D: tl.constexpr, WN: tl.constexpr, WB: tl.constexpr,
               R: tl.constexpr, BITS: tl.constexpr, DC: tl.constexpr, UNPACK: tl.constexpr):
    """Key codes (BT, DC) int32 of chunk ``ch`` of page-head ``ph`` (int64: page id * H_kv + kv head), at
    channels ``c`` (DC,), token ``w 8R + 8 i + g`` (local to the page) from word row ``8 w + g``, slot i.
    UNPACK 1: the (8 WB, DC) words loaded once, each broadcast over its R slots, (WB, R, 8, DC) reshaped
    to token order; 0: each token's word gathered by index arithmetic (R loads of a word, from cache)."""
    BT: tl.constexpr = WB * R * 8
    M: tl.constexpr = (1 << BITS) - 1
    if UNPACK == 1:
        r = ch * (WB * 8) + tl.arange(0, WB * 8)
        w = tl.load(kw_ptr + (ph * (8 * WN) + r)[:, None] * D + c[None, :], mask=valid, other=0)
        w4 = tl.reshape(w.to(tl.int32) & 0xFFFF, (WB, 1, 8, DC))
        sh = (tl.arange(0, R) * BITS)[None, :, None, None]
        code = tl.reshape((w4 >> sh) & M, (BT, DC))
    else:
        t = ch * BT + tl.arange(0, BT)
        r = (t // (8 * R)) * 8 + t % 8
        w = tl.load(kw_ptr + (ph * (8 * WN) + r)[:, None] * D + c[None, :], mask=valid, other=0)
        code = ((w.to(tl.int32) & 0xFFFF) >> (((t // 8) % R) * BITS)[:, None]) & M
    return code


@triton.jit
def _page_keys(kw_ptr, kp_ptr, ph, ch, c, valid, D: tl.constexpr, NR: tl.constexpr, WN: tl.constexpr,
               WB: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, CHAN: tl.constexpr, KG: tl.constexpr,
               DC: tl.constexpr, UNPACK: tl.constexpr):
    """Dequantized keys (BT, DC) fp16 of a page chunk at channels ``c``. Params (int32 half2 pointer
    ``kp_ptr``): channel-wise (N_r / KG, D) per page-head, tensor-wise (N_r, D / KG)."""
    BT: tl.constexpr = WB * R * 8
    code = _key_codes(kw_ptr, ph, ch, c, valid, D, WN, WB, R, BITS, DC, UNPACK)
    t = ch * BT + tl.arange(0, BT)                                     # token in the page
    if CHAN:
        base = kp_ptr + ph * ((NR // KG) * D)
        if KG % BT == 0:                                               # one group row for the chunk
            s, m = _half2(base + (ch * BT) // KG * D + c, valid)
            s = s[None, :]
            m = m[None, :]
        else:                                                          # contiguous along channels
            s, m = _half2(base + (t // KG)[:, None] * D + c[None, :], valid)
    else:
        NKG: tl.constexpr = D // KG
        if DC == D:
            s, m = _per_group(kp_ptr + ph * (NR * NKG) + t[:, None] * NKG, valid, NKG, KG, BT)
        else:                                                          # a channel chunk (the tree)
            s, m = _half2(kp_ptr + ph * (NR * NKG) + t[:, None] * NKG + (c // KG)[None, :], valid)
    return _dequant(code, s, m)


@triton.jit
def _page_values(vw_ptr, vp_ptr, ph, ch, valid, D: tl.constexpr, NR: tl.constexpr, BT: tl.constexpr,
                 R: tl.constexpr, BITS: tl.constexpr, VG: tl.constexpr, UNPACK: tl.constexpr):
    """Dequantized values (BT, D) fp16 of a page chunk: channel ``8 (u R + i) + g`` of token t from word
    ``(t, 8 u + g)``, slot i. UNPACK 1: the (BT, D / R) words broadcast over their R slots, (BT, U, R, 8)
    reshaped to channel order; 0: gathered by index arithmetic. Params (N_r, D / VG) half2 (int32)."""
    DW: tl.constexpr = D // R
    U: tl.constexpr = DW // 8
    NVG: tl.constexpr = D // VG
    M: tl.constexpr = (1 << BITS) - 1
    t = ch * BT + tl.arange(0, BT)
    if UNPACK == 1:
        j = tl.arange(0, DW)
        w = tl.load(vw_ptr + (ph * NR + t)[:, None] * DW + j[None, :], mask=valid, other=0)
        w4 = tl.reshape(w.to(tl.int32) & 0xFFFF, (BT, U, 1, 8))
        sh = (tl.arange(0, R) * BITS)[None, None, :, None]
        code = tl.reshape((w4 >> sh) & M, (BT, D))
    else:
        c = tl.arange(0, D)
        col = (c // (8 * R)) * 8 + c % 8
        w = tl.load(vw_ptr + (ph * NR + t)[:, None] * DW + col[None, :], mask=valid, other=0)
        code = ((w.to(tl.int32) & 0xFFFF) >> (((c // 8) % R) * BITS)[None, :]) & M
    s, m = _per_group(vp_ptr + ph * (NR * NVG) + t[:, None] * NVG, valid, NVG, VG, BT)
    return _dequant(code, s, m)


@triton.jit
def _keys(SRC: tl.constexpr, kw_ptr, kp_ptr, rk_ptr, ph, ch, rrow, tmask, valid, c, D: tl.constexpr,
          NR: tl.constexpr, WN: tl.constexpr, WB: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
          CHAN: tl.constexpr, KG: tl.constexpr, DC: tl.constexpr, UNPACK: tl.constexpr):
    """Keys (BT, DC) fp16 at channels ``c``: SRC 0 a page chunk (dequantized), 1 residual rows ``rrow``
    (int64 row offsets into res_k, masked by ``tmask``; padding rows are zero)."""
    if SRC == 0:
        k = _page_keys(kw_ptr, kp_ptr, ph, ch, c, valid, D, NR, WN, WB, R, BITS, CHAN, KG, DC, UNPACK)
    else:
        k = tl.load(rk_ptr + rrow[:, None] * D + c[None, :], mask=tmask[:, None], other=0.0)
    return k


@triton.jit
def _kdot(q, k, MODE: tl.constexpr):
    """q @ k^T (BLOCK_M, BT) fp32 for fp16 keys k: fp16 q on tensor cores; bf16 q against the exact
    split k = k_hi + k_lo (two bf16 dots); fp32 q by an IEEE fp32 dot of the widened keys."""
    if MODE == 0:
        r = tl.dot(q, tl.trans(k))
    elif MODE == 1:
        k_hi = k.to(tl.bfloat16)
        k_lo = (k.to(tl.float32) - k_hi.to(tl.float32)).to(tl.bfloat16)
        r = tl.dot(q, tl.trans(k_lo), acc=tl.dot(q, tl.trans(k_hi)))
    else:
        r = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    return r


@triton.jit
def _tree_scores(SRC: tl.constexpr, q_ptrs, rmask, sq_d, kw_ptr, kp_ptr, rk_ptr, ph, ch, rrow, tmask, valid,
                 LO: tl.constexpr, N: tl.constexpr, LEAF: tl.constexpr, D: tl.constexpr, NR: tl.constexpr,
                 WN: tl.constexpr,
                 WB: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, CHAN: tl.constexpr, KG: tl.constexpr,
                 MODE: tl.constexpr, UNPACK: tl.constexpr):
    """Scores (BLOCK_M, BT) over the channel chunks [LEAF LO, LEAF (LO + N)): dots of LEAF channels (q in
    its dtype, fp32 for MODE 2) summed as a pairwise tree."""
    if N == 1:
        c = LO * LEAF + tl.arange(0, LEAF)
        qc = tl.load(q_ptrs + c[None, :] * sq_d, mask=rmask[:, None], other=0.0)
        kc = _keys(SRC, kw_ptr, kp_ptr, rk_ptr, ph, ch, rrow, tmask, valid, c, D, NR, WN, WB, R, BITS, CHAN, KG,
                   LEAF, UNPACK)
        r = _kdot(qc, kc, MODE)
    else:
        r = (_tree_scores(SRC, q_ptrs, rmask, sq_d, kw_ptr, kp_ptr, rk_ptr, ph, ch, rrow, tmask, valid, LO,
                          N // 2, LEAF, D, NR, WN, WB, R, BITS, CHAN, KG, MODE, UNPACK)
             + _tree_scores(SRC, q_ptrs, rmask, sq_d, kw_ptr, kp_ptr, rk_ptr, ph, ch, rrow, tmask, valid,
                            LO + N // 2, N // 2, LEAF, D, NR, WN, WB, R, BITS, CHAN, KG, MODE, UNPACK))
    return r


@triton.jit
def _scores_values(SRC: tl.constexpr, q, q_ptrs, rmask, sq_d, kw_ptr, kp_ptr, vw_ptr, vp_ptr, rk_ptr, rv_ptr,
                   ph, ch, rrow, tmask, valid, D: tl.constexpr, NR: tl.constexpr, WN: tl.constexpr,
                   WB: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, CHAN: tl.constexpr, KG: tl.constexpr,
                   VG: tl.constexpr, MODE: tl.constexpr, LEAF: tl.constexpr, UNPACK: tl.constexpr):
    """Raw scores q K^T (BLOCK_M, BT) fp32 and values (BT, D) fp16 of one chunk of source SRC."""
    BT: tl.constexpr = WB * R * 8
    if LEAF < D:
        s = _tree_scores(SRC, q_ptrs, rmask, sq_d, kw_ptr, kp_ptr, rk_ptr, ph, ch, rrow, tmask, valid, 0,
                         D // LEAF, LEAF, D, NR, WN, WB, R, BITS, CHAN, KG, MODE, UNPACK)
    else:
        k = _keys(SRC, kw_ptr, kp_ptr, rk_ptr, ph, ch, rrow, tmask, valid, tl.arange(0, D), D, NR, WN, WB, R,
                  BITS, CHAN, KG, D, UNPACK)
        s = _kdot(q, k, MODE)
    if SRC == 0:
        v = _page_values(vw_ptr, vp_ptr, ph, ch, valid, D, NR, BT, R, BITS, VG, UNPACK)
    else:
        d = tl.arange(0, D)
        v = tl.load(rv_ptr + rrow[:, None] * D + d[None, :], mask=tmask[:, None], other=0.0)
    return s, v


@triton.jit
def _tree_pv(p, v, N: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """IEEE fp32 ``p @ v`` over N tokens (p (BLOCK_M, N), v (N, D) fp32) as a pairwise tree of 16-token
    dots (the halves split off by reshape / permute / split): no sequential fp32 sum over a whole chunk."""
    if N == 16:
        r = tl.dot(p, v, input_precision="ieee")
    else:
        pa, pb = tl.split(tl.permute(tl.reshape(p, (BLOCK_M, 2, N // 2)), (0, 2, 1)))
        va, vb = tl.split(tl.permute(tl.reshape(v, (2, N // 2, D)), (1, 2, 0)))
        r = _tree_pv(pa, va, N // 2, BLOCK_M, D) + _tree_pv(pb, vb, N // 2, BLOCK_M, D)
    return r


@triton.jit
def _chunk(q, q_ptrs, rmask, sq_d, m_i, l_i, acc, n, end, NPC, RES, b, hk, H_KV, N_TAB, qk_scale,
           kw_ptr, kp_ptr, vw_ptr, vp_ptr, tab_ptr, rk_ptr, rv_ptr, D: tl.constexpr, NR: tl.constexpr,
           WN: tl.constexpr, WB: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, CHAN: tl.constexpr,
           KG: tl.constexpr, VG: tl.constexpr, MODE: tl.constexpr, LEAF: tl.constexpr, UNPACK: tl.constexpr,
           LIBDEVICE: tl.constexpr):
    """Chunk n of sequence b, masked when ``n >= end`` (the interpreter's fixed trip count): a page chunk
    (n < NPC: page ``table[b, n // NCH]``, warps [(n % NCH) WB, + WB)) or residual rows
    ``(n - NPC) BT + [0, BT)`` (those < RES). One online-softmax update of (m_i, l_i, acc)."""
    BT: tl.constexpr = WB * R * 8
    NCH: tl.constexpr = WN // WB
    # valid: a (1,) block, compared on a block, that broadcasts into every load mask and tmask (a scalar
    # comparison broadcast into a mask is int32 under Triton's interpreter, which Triton 3.9 refuses as
    # a load mask: "mask has unsupported dtype"); the scalar page-id load takes the scalar comparison
    valid = (n + tl.zeros((1,), tl.int32)) < end
    lane = tl.arange(0, BT)
    if n < NPC:
        pid = tl.load(tab_ptr + b.to(tl.int64) * N_TAB + n // NCH, mask=n < end, other=0)
        ph = tl.maximum(pid, 0).to(tl.int64) * H_KV + hk              # page-head index (int64)
        tmask = (lane >= 0) & valid
        s, v = _scores_values(0, q, q_ptrs, rmask, sq_d, kw_ptr, kp_ptr, vw_ptr, vp_ptr, rk_ptr, rv_ptr, ph,
                              n % NCH, lane.to(tl.int64), tmask, valid, D, NR, WN, WB, R, BITS, CHAN, KG, VG,
                              MODE, LEAF, UNPACK)
    else:
        tok = (n - NPC) * BT + lane
        tmask = (tok < RES) & valid
        rrow = (b.to(tl.int64) * H_KV + hk) * NR + tok                # rows of res_k / res_v (B, H, N_r, D)
        s, v = _scores_values(1, q, q_ptrs, rmask, sq_d, kw_ptr, kp_ptr, vw_ptr, vp_ptr, rk_ptr, rv_ptr,
                              hk.to(tl.int64), 0, rrow, tmask, valid, D, NR, WN, WB, R, BITS, CHAN, KG, VG, MODE,
                              LEAF, UNPACK)
    s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))
    PRECISE: tl.constexpr = MODE == 2
    m_new, alpha, p, l_i = A.softmax_step(s, m_i, l_i, PRECISE, LIBDEVICE, True)
    if MODE == 2:
        pv = _tree_pv(p, v.to(tl.float32), BT, p.shape[0], D)
    else:
        pv = tl.dot(p.to(tl.float16), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# Fused decode over the BitDecoding cache: packed pages (the Packing Kernel) and the FP16 residual.
# Computes: for the G_q * T_q query rows of kv head (b, hk) (row m -> query head hk*G_q + m // T_q, token
#   m % T_q) and chunks [sp*CPS, min((sp+1)*CPS, NCHUNK)) of sequence b: page chunks n < NPC (page
#   table[b, n // NCH], tokens (n % NCH) BT + [0, BT) of it: key and value words unpacked and dequantized
#   to fp16 in registers), then residual chunks (rows (n - NPC) BT + [0, BT) of res_k / res_v, < RES);
#   s = q K^T * scale, online softmax (natural units, exp2 of (s - m) log2 e), acc += P V. Writes the
#   un-normalized (acc, m, l) of split sp at partial slot sp.
# Grid: (B * H_kv, n_splits, cdiv(G_q * T_q, BLOCK_M)); BLOCK_M >= 16 rows (tl.dot), padded and masked.
# Bytes: reads each packed token's words (2 D bits / 8 bytes for K and V) and half2 params, and the
#   residual rows (4 D bytes each), once per row block, the queries, one table entry per page chunk;
#   writes rows * n_splits * (D + 2) fp32.
@triton.jit(do_not_specialize=["T_Q", "M", "NCHUNK", "NPC", "RES", "CPS", "S_TOTAL", "N_TAB"])
def _decode_kernel(q_ptr, kw_ptr, kp_ptr, vw_ptr, vp_ptr, tab_ptr, rk_ptr, rv_ptr, o_ptr, m_ptr, l_ptr,
                   sq_b, sq_h, sq_t, sq_d, H_Q, H_KV, T_Q, M, NCHUNK, NPC, RES, CPS, S_TOTAL, N_TAB, qk_scale,
                   G_Q: tl.constexpr, D: tl.constexpr, NR: tl.constexpr, WN: tl.constexpr, WB: tl.constexpr,
                   R: tl.constexpr, BITS: tl.constexpr, CHAN: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
                   BLOCK_M: tl.constexpr, MODE: tl.constexpr, LEAF: tl.constexpr, UNPACK: tl.constexpr,
                   TIGHT: tl.constexpr, NBLK: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    mb = tl.program_id(2)
    LIBDEVICE: tl.constexpr = TIGHT                    # TIGHT <=> compiled for the GPU
    b, hk, h, t, rmask, q_ptrs = A.query_rows(q_ptr, bh, mb, H_KV, sq_b, sq_h, sq_t, T_Q, M, G_Q, BLOCK_M)
    d = tl.arange(0, D)
    if LEAF < D:
        q = tl.zeros((BLOCK_M, 16), tl.float32)        # unused: the tree loads q in chunks of LEAF channels
    else:
        q = tl.load(q_ptrs + d[None, :] * sq_d, mask=rmask[:, None], other=0.0)
    start = sp * CPS
    end = tl.minimum(start + CPS, NCHUNK)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # a split's first chunk always holds a token (start < NCHUNK; a residual chunk holds >= 1 row), so
    # m_i is finite from then on and the masked chunks of the interpreter's fixed trip count change
    # nothing (alpha = 1, p = 0)
    if TIGHT:
        for n in range(start, end):
            m_i, l_i, acc = _chunk(q, q_ptrs, rmask, sq_d, m_i, l_i, acc, n, end, NPC, RES, b, hk, H_KV, N_TAB,
                                   qk_scale, kw_ptr, kp_ptr, vw_ptr, vp_ptr, tab_ptr, rk_ptr, rv_ptr, D, NR, WN,
                                   WB, R, BITS, CHAN, KG, VG, MODE, LEAF, UNPACK, LIBDEVICE)
    else:                                              # interpreter: constexpr trip count, masked
        for it in range(0, NBLK):
            m_i, l_i, acc = _chunk(q, q_ptrs, rmask, sq_d, m_i, l_i, acc, start + it, end, NPC, RES, b, hk, H_KV,
                                   N_TAB, qk_scale, kw_ptr, kp_ptr, vw_ptr, vp_ptr, tab_ptr, rk_ptr, rv_ptr, D,
                                   NR, WN, WB, R, BITS, CHAN, KG, VG, MODE, LEAF, UNPACK, LIBDEVICE)
    A.store_split(o_ptr, m_ptr, l_ptr, b, h, t, H_Q, T_Q, S_TOTAL, sp, acc, m_i, l_i, rmask, d, D)


# ---------------------------------------------------------------------------------------------------
# launch


def supported(cfg, st, q) -> bool:
    """Whether :func:`decode` takes this (config, cache, query): bits 2 or 4, keys channel- or
    tensor-wise, any W_n and group sizes the config allows; head dim D a power of two in [16, 256]
    (the config itself requires D to be a multiple of 8 R: 32 at 4 bits, 64 at 2 bits); q float16,
    bfloat16 or float32 with q.shape[3] == D and H_q a multiple of H_kv; the state's words uint16 and
    params float16 on q's device (a CUDA device, or the CPU under ``TRITON_INTERPRET=1``)."""
    try:
        B, H, D = (int(x) for x in st.shape)
        if cfg.bits not in (2, 4) or cfg.k_mode not in ("channel", "tensor"):
            return False
        if D < 16 or D > 256 or D & (D - 1) or D % (8 * cfg.per_word) or D % cfg.v_group:
            return False
        if cfg.k_mode == "tensor" and D % cfg.k_group:
            return False
        if not isinstance(q, torch.Tensor) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False
        if q.dim() != 4 or q.shape[0] != B or q.shape[3] != D or q.shape[1] % H:
            return False
        if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
            return False
        for name, dt in (("k_words", torch.uint16), ("v_words", torch.uint16), ("k_params", torch.float16),
                         ("v_params", torch.float16), ("res_k", torch.float16), ("res_v", torch.float16),
                         ("table", torch.int32)):
            a = getattr(st, name)
            if not isinstance(a, torch.Tensor) or a.dtype != dt or a.device != q.device:
                return False
    except (AttributeError, TypeError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Plan:
    """The launch of ``decode`` (``plan``): leaf channels per score dot, ``WB`` warps and ``BT`` tokens per
    chunk, ``n_pc`` page chunks of ``n_chunks``, ``cps`` chunks per split, ``S`` splits, warps, the unpack
    mode and pipelining stages."""

    leaf: int
    WB: int
    BT: int
    n_pc: int
    n_chunks: int
    cps: int
    S: int
    warps: int
    unpack: int
    stages: int


def plan(per_word: int, warps_n: int, D: int, mode: int, n_pages: int, res: int, n_base: int, BLOCK_M: int,
         sms: int, *, cuda: bool, interp: bool, knobs: Knobs | None = None) -> Plan:
    """The launch plan of ``decode``: ``per_word`` (R) codes per 16-bit word, ``warps_n`` (W_n) warps per
    page, head dim ``D``, q's ``mode`` (_MODE_*), ``n_pages`` full pages and ``res`` residual rows,
    ``n_base`` programs per split (B x H_kv x query blocks) of ``BLOCK_M`` rows, ``sms`` SMs; ``cuda``:
    at least ``knobs.min_tokens`` tokens per split; ``interp``: the interpreter (one stage). Arithmetic
    only (runs on the CPU), cached per arguments."""
    knobs = DEFAULT_KNOBS if knobs is None else knobs
    if not isinstance(knobs, Knobs):
        raise TypeError(f"knobs must be a kvq.fast.triton.bitdecoding_decode.Knobs or None, got "
                        f"{type(knobs).__name__}")
    return _plan(int(per_word), int(warps_n), int(D), int(mode), int(n_pages), int(res), int(n_base),
                 int(BLOCK_M), int(sms), bool(cuda), bool(interp), knobs)


@functools.lru_cache(maxsize=1024)
def _plan(per_word, warps_n, D, mode, n_pages, res, n_base, BLOCK_M, sms, cuda, interp, knobs) -> Plan:
    """plan's cached body (every argument given, so that one key names one call shape)."""
    leaf = 16 if mode == _MODE_FP32 else min(D, int(knobs.leaf or 16))
    WB, BT = _chunking(per_word, warps_n, D, mode, knobs.bt_max)
    n_pc = n_pages * (warps_n // WB)                   # page chunks, then residual chunks
    n_chunks = n_pc + _cdiv(res, BT)
    cps, S = _splits(n_chunks, BT, n_base, sms, cuda, knobs.waves, knobs.min_tokens)
    warps = knobs.num_warps or (8 if BLOCK_M * D >= 64 * 128 or BT * D > 128 * 128 else 4)
    return Plan(leaf, WB, BT, n_pc, n_chunks, cps, S, warps, int(knobs.unpack),
                1 if interp else (knobs.num_stages or 2))


def _chunking(per_word: int, warps_n: int, D: int, mode: int, bt_max: int | None = None):
    """``(WB, BT)``: warps per chunk (a power of two dividing W_n) and tokens per chunk (8 R WB), at most
    ``bt_max`` tokens (None: 128, 64 for D > 128; fp32 q: one warp)."""
    per_warp = 8 * per_word                            # 32 tokens at 4 bits, 64 at 2 bits
    if mode == _MODE_FP32:
        bt_max = per_warp                              # IEEE fp32 dots: one warp per chunk
    else:
        bt_max = bt_max or (128 if D <= 128 else 64)
    wb = 1
    while warps_n % (2 * wb) == 0 and 2 * wb * per_warp <= bt_max:
        wb *= 2
    return wb, wb * per_warp


def _splits(n_chunks: int, bt: int, base: int, sms: int, cuda: bool, waves: float = 4, min_tokens: int = 256):
    """``(chunks per split, splits)``: about ``waves`` programs per SM, >= ``min_tokens`` tokens per split
    on the GPU (``cuda``)."""
    if n_chunks == 0:
        return 0, 0
    want = max(1, _cdiv(int(waves * sms), base))
    if cuda:
        want = min(want, max(1, (n_chunks * bt) // int(min_tokens)))
    cps = _cdiv(n_chunks, min(want, n_chunks))
    return cps, _cdiv(n_chunks, cps)


def decode(cfg, st, q, *, scale=None, knobs: Knobs | None = None):
    """Attention of q (B, H_q, T_q, D) over the BitDecoding cache ``st``: ``(out, lse)``, out in q's
    dtype, lse (B, H_q, T_q) float32, natural log; equals ``kvq.reference.bitdecoding.decode_attention``
    within contract rule 7.

    ``st`` is any object with the reference ``BitDecodingState``'s field names as torch tensors on q's
    device (res_k, res_v (B, H, N_r, D) fp16; k_words (P, H, 8 W_n, D) and v_words (P, H, N_r, D / R)
    uint16; k_params, v_params fp16 half2; table (B, N) int32; the pool and params contiguous), ``length``
    and ``shape`` = (B, H, D). Nothing is checked here: the caller (the cache wrapper) has validated q
    and the state, and :func:`supported` is true. One launch attends the packed pages and the residual
    rows ``[0, length mod N_r)`` in splits, one merge joins the splits; an empty cache gives out = 0,
    lse = -inf. ``knobs``: the launch knobs (None: the defaults), planned by ``plan``. The two launches
    are planned once per call shape (``DecodePlan``) and, once they hold their compiled kernels, take
    device addresses (``_launch``)."""
    knobs = DEFAULT_KNOBS if knobs is None else knobs
    if not isinstance(knobs, Knobs):
        raise TypeError(f"knobs must be a kvq.fast.triton.bitdecoding_decode.Knobs or None, got "
                        f"{type(knobs).__name__}")
    B, H, D = (int(x) for x in st.shape)
    dev = q.device
    sc = C.softmax_scale(scale, D)
    out = torch.empty(tuple(q.shape), dtype=q.dtype, device=dev)
    lse = torch.empty(tuple(q.shape[:3]), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse
    res_k = st.res_k if st.res_k.is_contiguous() else st.res_k.contiguous()
    res_v = st.res_v if st.res_v.is_contiguous() else st.res_v.contiguous()
    tensors = (q, st.k_words, st.k_params, st.v_words, st.v_params, st.table, res_k, res_v)
    ptrs = tuple(map(L.PTR, tensors))
    p = _decode_plan(cfg, (B, H, D), int(st.length), tuple(q.shape), q.stride(), tuple(map(L.DTYPE, tensors)),
                     st.table.shape[1], dev, L.device_index(dev), L.aligned(ptrs), knobs)
    if p.S == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    dev_index = p.dev_index
    stream = p.stream()
    buf = p.scratch(dev)
    o_part, m_part, l_part = p.regions(buf, stream)
    q32 = q.to(torch.float32, memory_format=torch.contiguous_format) if p.q_float else None   # alive until launched
    oview = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    if stream is not None:                     # addresses
        qa = ptrs[0] if q32 is None else q32.data_ptr()
        kw, kp, vw, vp, tab, rk, rv = ptrs[1:]
        oa, la = oview.data_ptr(), lse.data_ptr()
    else:                                      # tensors (Triton's dispatch)
        qa = q if q32 is None else q32
        kw, kp, vw, vp = (st.k_words.view(torch.int16), st.k_params.view(torch.int32),
                          st.v_words.view(torch.int16), st.v_params.view(torch.int32))
        tab, rk, rv, oa, la = st.table, res_k, res_v, oview, lse
    p.decode((qa, kw, kp, vw, vp, tab, rk, rv, o_part, m_part, l_part, *p.decode_ints, sc), stream, dev_index)
    p.merge((o_part, m_part, l_part, oa, la, p.S, D), stream, dev_index)
    p.settle(stream)
    return out, lse


#: decode plans kept (least recently used dropped), as kvq.fast.triton.paged's
PLAN_CACHE_SIZE = 256


class DecodePlan(L.Plan):
    """The two launches of one ``decode`` call (the fused kernel's, ``decode``, with its integer arguments;
    the merge's), planned once per call shape; ``S`` splits (0: nothing cached), ``q_float``: q goes in as a
    contiguous fp32 copy (the exact path of bf16 q under the interpreter). Its scratch (``_launch.Plan``): the
    partials o (rows, S, D), m and l (rows, S)."""

    __slots__ = ("rows", "S", "q_float", "decode", "decode_ints", "merge")


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _decode_plan(cfg, shape, T, q_shape, q_strides, dtypes, n_table, dev, dev_index, aligned,
                 knobs: Knobs) -> DecodePlan:
    """decode's launches for a cache of ``shape`` holding T tokens (a function of its arguments only:
    ``dtypes`` are q's and the state tensors' in ``decode``'s order)."""
    B, H, D = shape
    _, H_q, T_q, _ = q_shape
    q_dtype = dtypes[0]
    interp = interpreting()
    if q_dtype == torch.float32 or (q_dtype == torch.bfloat16 and interp):
        mode = _MODE_FP32
    elif q_dtype == torch.bfloat16:
        mode = _MODE_BF16
    else:
        mode = _MODE_FP16
    q_float = mode == _MODE_FP32 and q_dtype != torch.float32
    n_pages, res = divmod(T, cfg.n_r)
    BLOCK_M, m_blocks = A.row_blocks(H_q // H, T_q)
    lp = plan(cfg.per_word, cfg.warps_n, D, mode, n_pages, res, B * H * m_blocks, BLOCK_M, A.sm_count(dev),
              cuda=dev.type == "cuda", interp=interp, knobs=knobs)
    S = lp.S
    rows = B * H_q * T_q
    if S == 0:
        return DecodePlan(dev_index=dev_index, rows=rows, S=0, q_float=q_float)
    qs = C.contiguous_strides(q_shape) if q_float else q_strides
    fused = L.Launch(_decode_kernel, (B * H, S, m_blocks),
                     dict(G_Q=H_q // H, D=D, NR=cfg.n_r, WN=cfg.warps_n, WB=lp.WB, R=cfg.per_word, BITS=cfg.bits,
                          CHAN=cfg.k_mode == "channel", KG=cfg.k_group, VG=cfg.v_group, BLOCK_M=BLOCK_M, MODE=mode,
                          LEAF=lp.leaf, UNPACK=lp.unpack, TIGHT=not interp, NBLK=lp.cps if interp else 0),
                     dict(num_warps=lp.warps, num_stages=lp.stages), aligned)
    ints = (*qs, H_q, H, T_q, (H_q // H) * T_q, lp.n_chunks, lp.n_pc, res, lp.cps, S, n_table)
    n_o, n_s = rows * S * D, rows * S
    merge = A.planned_merge(rows, S, D, q_dtype, aligned)
    return DecodePlan(dev_index=dev_index, rows=rows, S=S, q_float=q_float, decode=fused, decode_ints=ints,
                      merge=merge, launches=(fused, merge), n_buf=n_o + 2 * n_s, offsets=(0, n_o, n_o + n_s),
                      shapes=((rows, S, D), (rows, S), (rows, S)))


