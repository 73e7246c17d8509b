"""Triton fused OSCAR append (OSCAR section 4, Algorithm 1 Prefill / DecodeStep): ONE kernel per append
for K and one for V that rotates the new tokens, rounds them to fp16 and writes each where it belongs:
the sink, the window ring, or (clipped, quantized, packed) its page slot, together with the OLD window
tokens that the new ones push out of the window.

A fast-only helper of ``kvq.fast.caches.oscar.append`` (``OscarOps.fused_append``), not a mirrored module. It
fuses what the unfused path does in ~10 launches (the fixed-order rotation ``kvq.fast.triton.rotate``,
the fp16 rounding, the concatenation of the window ring with the new tokens, the fused clip + INT-b +
pack of ``oscar_quant`` and the torch scatters into sink / ring / pages) because a decode step appends
one token per sequence: launches, not bytes, set its cost. The bits are those of the unfused path,
which are the reference's (``kvq.reference.oscar.append``): the same rotation order (contract rule 7's
fixed order), the same quantile / clip / quantizer helpers (``kvq.fast.triton.quant``).

    from kvq.fast.triton import oscar_append as OA
    if OA.supported(cfg, D): OA.append(cfg, st, 0, k, R_K, calib.clip_k, plan)      # plan: kvq.fast.caches.oscar.AppendPlan

Which token goes where (``plan``: counters before the append, host arithmetic). ``n_s`` new tokens fill
the sink; the other new tokens follow the ``n_old`` tokens already in the window: sequence index
``i = n_old + (idx - n_s)`` over [old window tokens, new post-sink tokens], ``m = n_old + n - n_s`` in all,
the oldest ``e = m - min(m, W)`` leave the window (into page position ``first + i``, ``first`` = the
post-sink index of the window's oldest token before the append), the rest end in slot
``(first + i) % W``. An OLD token ``i' < min(e, n_old)`` that leaves shares its slot with exactly one new
token that stays, ``i'' = i' + k W`` (k >= 1), and ``i' = i'' % W``: the program that writes new token
``i''`` into slot s first reads the old token from s and quantizes it into page position ``first + i'``,
then (after a barrier) writes the new token. No other program touches s, so programs never race.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvq.fast.caches import oscar as _O

from kvq.fast.common import cdiv as _cdiv, next_pow2 as _np2  # host grid arithmetic
from . import _launch as L
from . import quant as Q

__all__ = ["supported", "append"]

MAX_D = 256                 # longest head dim of the fused kernel (the (BLOCK_T, D) tile in registers)
#: under the interpreter, which pays per operation and not per element: rows of several heads per program
#: (``_tiling``), the rotation's sequential sums as one NumPy cumsum and the order statistics by rank
#: selection (see the kernel and ``_select_quantile``). False runs the GPU's code paths (a test does).
INTERP_SHORTCUTS = True


@triton.jit
def _rows3(v):
    """Per-row sum over the last three axes of a (BLOCK_T, NG, NJ, PER) tile: (BLOCK_T,)."""
    return tl.sum(tl.sum(tl.sum(v, axis=3), axis=2), axis=1)


@triton.jit
def _select_quantile(key, nnan, N, LO, HI, FRAC, BLOCK_T: tl.constexpr, D: tl.constexpr, RANK: tl.constexpr):
    """``quant.quantile`` of each row of ``key`` (BLOCK_T, NG, NJ, PER), a row's D channels: tau (BLOCK_T,) fp32.

    ``key`` holds the row's |x| as int32 bit patterns (non-negative floats order like their bits), NaN
    as +inf (``nnan`` counts them; NumPy sorts them last). The order statistic ``s[LO]`` is the least
    key v with ``#{key <= v} >= LO + 1``, found by bisection over the bit patterns [0, +inf] (31
    steps, one compare and one row count each: exact, no sort, no shared memory); ``s[HI]`` (HI = LO + 1,
    or LO) is ``s[LO]`` when at least HI + 1 keys are <= it, else the least key above it. Then
    ``tau = s[LO] + FRAC * (s[HI] - s[LO])``, three rounded fp32 ops (launch without FMA contraction),
    NaN where an order statistic falls on a NaN slot (as ``quant.sorted_quantile``).

    The row counts reduce the 4-D tile over its last three axes. Reshaped to (BLOCK_T, D) first, the same
    bisection miscompiles on the GPU (H100 and H200, Triton 3.6, BLOCK_T = 2 and 4): wrong order
    statistics, NaN clip thresholds, whole rows of wrong codes, while the interpreter was exact.

    RANK (the interpreter's default, ``INTERP_SHORTCUTS``): ``quant.sorted_quantile``'s rank selection
    instead (two (BLOCK_T, D, D) compares: a few NumPy calls, where the interpreter pays per call for
    each of the bisection's 31 row counts). Both select the same order statistics.
    """
    if RANK:
        k2 = tl.reshape(key, (BLOCK_T, D))
        tau = Q.sorted_quantile(k2.to(tl.float32, bitcast=True), nnan, N, LO, HI, FRAC, D, True)
    else:
        lo = tl.zeros_like(nnan)
        hi = tl.zeros_like(nnan) + 0x7F800000
        for _ in range(31):                                       # hi - lo < 2**31 halves every step
            mid = lo + ((hi - lo) >> 1)
            ge = _rows3((key <= mid[:, None, None, None]).to(tl.int32)) >= LO + 1
            hi = tl.where(ge, mid, hi)
            lo = tl.where(ge, lo, mid + 1)
        l4 = lo[:, None, None, None]
        n_le = _rows3((key <= l4).to(tl.int32))
        above = tl.min(tl.min(tl.min(tl.where(key > l4, key, 0x7F800000), axis=3), axis=2), axis=1)
        s_lo = lo.to(tl.float32, bitcast=True)
        s_hi = tl.where(n_le >= HI + 1, lo, above).to(tl.float32, bitcast=True)
        n_fin = N - nnan
        s_lo = tl.where(LO >= n_fin, float("nan"), s_lo)
        s_hi = tl.where(HI >= n_fin, float("nan"), s_hi)
        tau = s_lo + FRAC * (s_hi - s_lo)
    return tau


# Fused OSCAR append: one program takes BLOCK_R rows (new tokens): row r is token t = r % N_PAD of
#   (batch, head) bh = r // N_PAD. GPU: N_PAD a multiple of BLOCK_R, so the rows of a program are BLOCK_R
#   tokens of ONE (batch, head) and each row of R_h is read once for all of them. Interpreter shortcuts
#   (PER_ROW_R = CUMSUM = RANK = True, INTERP_SHORTCUTS): N_PAD = n, a program takes tokens of several
#   heads, each row with its own R_h; the rotation's sums as one cumsum; rank selection.
# Computes, per new token idx = t (row) of x (B, H, n, D):
#   y = fp16(x R_h) with R_h = R + h * R_SH, as rotate.py: acc = x_0 R_0, then acc = acc + x_i R_i for
#     i = 1 .. D-1 (rounded mul, rounded add: launch with enable_fp_fusion=False), then acc + 0.0;
#   idx < n_s: y -> sink[b, h, T0 + idx];
#   else i = n_old + idx - n_s: i < e: y -> page position first + i; i >= e: y -> window slot
#     (first + i) % W, and if i >= W and i % W < n_old the old token i % W in that slot (read before the
#     write, a barrier between) -> page position first + i % W;
#   a row bound for a page (y, or the old token) as oscar_quant's kernel: tau = quantile(|x|, clip)
#     (_select_quantile), xc = clip(x, tau), per group of G channels mn / mx of xc, scale / mn in the
#     metadata dtype (quant.group_meta; NaN scale where the RAW group holds NaN / inf), codes =
#     clamp(rint((xc - mn_s) / scale_s), 0, QMAX), PER = 8 // BITS channel codes per byte; page position p
#     -> page table[b, p // PG], slot p % PG.
# Tile (BLOCK_R, NG, NJ, PER): channel c = g*G + j*PER + k (D and G powers of two, PER | G).
# Grid: (cdiv(B * H * N_PAD, BLOCK_R),); GPU: (B * H * cdiv(n, BLOCK_R),).
# Bytes: reads n*D inputs and D*D fp32 of R per program (L2-resident), the old window tokens that leave
#   (fp16) and their page ids; writes the fp16 sink / window rows, D/PER code bytes + 2 D/G metadata
#   values per token that enters a page.
@triton.jit(do_not_specialize=["T0", "first"])             # they move every step: one binary
def _append_kernel(x_ptr, r_ptr, sink_ptr, win_ptr, q_ptr, s_ptr, m_ptr, tab_ptr,
                   n, N_PAD, BH, H, R_SH, sx_b, sx_h, sx_t, sx_d,
                   T0, n_s, n_old, first, e, W, W1, S0, PG, N_TAB, LO, HI, FRAC,
                   D: tl.constexpr, G: tl.constexpr, QMAX: tl.constexpr, BITS: tl.constexpr,
                   PER: tl.constexpr, FASTDIV: tl.constexpr, BLOCK_R: tl.constexpr, PER_ROW_R: tl.constexpr,
                   RANK: tl.constexpr, CUMSUM: tl.constexpr):
    NG: tl.constexpr = D // G
    NJ: tl.constexpr = G // PER
    NB: tl.constexpr = D // PER
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    bh = r // N_PAD                                                        # (BLOCK_R,) b * H + h
    t = (r - bh * N_PAD).to(tl.int32)                                     # new-token index idx
    b = bh // H
    h = bh - b * H
    g4 = tl.arange(0, NG)[None, :, None, None]
    j4 = tl.arange(0, NJ)[None, None, :, None]
    k4 = tl.arange(0, PER)[None, None, None, :]
    c4 = g4 * G + j4 * PER + k4                                            # (1, NG, NJ, PER) channel
    tv = (t < n) & (bh < BH)
    # 1. rotate: the reference's fixed order, one R row per step for all BLOCK_R tokens
    xrow = x_ptr + b * sx_b + h * sx_h + t.to(tl.int64) * sx_t             # (BLOCK_R,)
    if PER_ROW_R:
        rb = (r_ptr + h * R_SH)[:, None, None, None] + c4                  # (BLOCK_R, NG, NJ, PER)
        rm = tv[:, None, None, None] & (c4 >= 0)
    else:
        h0 = ((tl.program_id(0).to(tl.int64) * BLOCK_R) // N_PAD) % H     # one (batch, head) per program
        rb = r_ptr + h0 * R_SH + c4                                        # (1, NG, NJ, PER)
        rm = c4 >= 0
    if CUMSUM:
        # interpreter: the same sums as one NumPy cumsum (np.add.accumulate: sequential, fp32) over the
        # products x_i R_i, its last entry picked by a select + sum of zeros (exact; -0.0 -> +0.0)
        ii = tl.arange(0, D)
        xt = tl.load(xrow[:, None] + ii[None, :] * sx_d, mask=tv[:, None] & (ii[None, :] >= 0), other=0.0)
        rt = tl.load((r_ptr + h * R_SH)[:, None, None] + ii[None, :, None] * D + ii[None, None, :])  # (R, D, D)
        cs = tl.cumsum(xt.to(tl.float32)[:, :, None] * rt, axis=1)
        acc = tl.reshape(tl.sum(tl.where(ii[None, :, None] == D - 1, cs, 0.0), axis=1), (BLOCK_R, NG, NJ, PER))
    else:
        x0 = tl.load(xrow, mask=tv, other=0.0).to(tl.float32)
        acc = x0[:, None, None, None] * tl.load(rb, mask=rm, other=0.0)
        for i in range(1, D):
            xi = tl.load(xrow + i * sx_d, mask=tv, other=0.0).to(tl.float32)
            acc = acc + xi[:, None, None, None] * tl.load(rb + i * D, mask=rm, other=0.0)
    y16 = tl.where(acc == 0.0, 0.0, acc).to(tl.float16)                  # acc + 0.0, then fp16 (RNE)
    # 2. where each row goes
    post = tv & (t >= n_s)
    i_seq = tl.where(post, n_old + t - n_s, 0)                             # sequence index
    to_page = post & (i_seq < e)
    to_win = post & (i_seq >= e)
    slot = (first + i_seq) % W1
    evict = to_win & (i_seq >= W) & ((i_seq % W1) < n_old)                # an old token leaves slot `slot`
    qrow = to_page | evict
    pos = tl.where(to_page, first + i_seq, first + i_seq % W1)              # page position (post-sink)
    page = tl.load(tab_ptr + b * N_TAB + pos // PG, mask=qrow, other=0).to(tl.int64)
    prow = (page * H + h) * PG + pos % PG                                  # (BLOCK_R,) row of the page arrays
    wrow = (bh * W + slot) * D                                             # (BLOCK_R,) window row offset
    ev4 = evict[:, None, None, None]
    old = tl.load(win_ptr + wrow[:, None, None, None] + c4, mask=ev4, other=0.0).to(tl.float32)
    x = tl.where(ev4, old, y16.to(tl.float32))                             # the row that enters a page
    # 3. clip + quantize + pack (oscar_quant._quantize_tokens_kernel's arithmetic)
    nz = tl.sum(tl.sum(x * 0.0, axis=3), axis=2)                          # (BLOCK_R, NG): NaN if non-finite
    a = tl.abs(x)
    nnan = _rows3((a != a).to(tl.int32))
    key = tl.where(a == a, a, float("inf")).to(tl.int32, bitcast=True)        # (BLOCK_R, NG, NJ, PER)
    tau = _select_quantile(key, nnan, D, LO, HI, FRAC, BLOCK_R, D, RANK)    # (BLOCK_R,)
    xc = Q.clip_np(x, tau[:, None, None, None])
    lo = tl.min(tl.min(xc, axis=3), axis=2)
    hi = tl.max(tl.max(xc, axis=3), axis=2)
    scale_st, mn_st, s32, m32 = Q.group_meta(lo, hi, nz, s_ptr, QMAX, 0.0, False)
    g2 = tl.arange(0, NG)[None, :]
    m2 = qrow[:, None] & (g2 >= 0)
    tl.store(s_ptr + prow[:, None] * NG + g2, scale_st, mask=m2)
    tl.store(m_ptr + prow[:, None] * NG + g2, mn_st, mask=m2)
    bad = m2 & (s32 != 0.0) & ((s32 < 1.2621774483536189e-29) | (s32 > 1.329227995784916e36))
    ok = tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) == 0            # see quant.fast_ok
    c = Q.group_codes(xc, s32[:, :, None, None], m32[:, :, None, None], tl.div_rn(1.0, s32)[:, :, None, None], ok,
                 QMAX, 0.0, False, BITS, FASTDIV)
    byte = tl.sum(c << (k4 * BITS), axis=3)                               # (BLOCK_R, NG, NJ)
    g3 = tl.arange(0, NG)[None, :, None]
    j3 = tl.arange(0, NJ)[None, None, :]
    tl.store(q_ptr + prow[:, None, None] * NB + (g3 * NJ + j3), byte.to(tl.uint8),
             mask=qrow[:, None, None] & (g3 >= 0) & (j3 >= 0))
    # 4. the fp16 rows: sink, and window slots (after every old token of this program has been read)
    srow = (bh * S0 + T0 + t) * D
    sk4 = (tv & (t < n_s))[:, None, None, None] & (c4 >= 0)
    tl.store(sink_ptr + srow[:, None, None, None] + c4, y16, mask=sk4)
    tl.debug_barrier()
    tl.store(win_ptr + wrow[:, None, None, None] + c4, y16, mask=to_win[:, None, None, None] & (c4 >= 0))


def supported(cfg, D: int) -> bool:
    """Whether the fused kernel takes this configuration: D a power of two <= MAX_D, G a power of two
    (dividing D) holding whole bytes of codes (8 // bits divides G). Otherwise the unfused path runs."""
    G, per = cfg.group_size, 8 // cfg.bits
    p2 = lambda v: v > 0 and v & (v - 1) == 0                                        # noqa: E731
    return p2(D) and D <= MAX_D and p2(G) and D % G == 0 and G % per == 0


def _tiling(n: int, BH: int, D: int, shortcuts: bool):
    """``(N_PAD, BLOCK_R)``. GPU: a program takes BLOCK_R (a power of two covering n, up to a cap: the
    (BLOCK_R, D) fp32 tile stays at <= 32 registers a thread with 4 warps) tokens of one (batch, head):
    N_PAD = n rounded up to BLOCK_R. Interpreter shortcuts: rows of several heads at once (N_PAD = n,
    each row with its own R), up to 2**20 / D**2 rows (the cumsum and the rank selection hold
    BLOCK_R * D * D values; Triton caps a tensor at 2**20 elements)."""
    if shortcuts:
        return n, min(_np2(BH * n), max(1, 2 ** 20 // (D * D)))
    BR = min(_np2(n), max(1, 4096 // D))
    return _cdiv(n, BR) * BR, BR


#: the fused append's launch options (no FMA contraction: the rotation's rounded products and sums)
OPTIONS = (("num_warps", 4), ("enable_fp_fusion", False))


@functools.lru_cache(maxsize=L.SITE_CACHE_SIZE)
def _shape(cfg, BH: int, D: int, n: int, interp: bool) -> tuple:
    """``(grid, N_PAD, constexprs)`` of an append of n tokens to BH (batch, head) rows of head dim D under
    ``cfg`` (``_tiling``; ``interp``: the interpreter, which takes ``INTERP_SHORTCUTS``)."""
    short = bool(INTERP_SHORTCUTS) and interp
    N_PAD, BR = _tiling(n, BH, D, short)
    consts = (("D", D), ("G", cfg.group_size), ("QMAX", float(2 ** cfg.bits - 1)), ("BITS", cfg.bits),
              ("PER", 8 // cfg.bits), ("FASTDIV", not interp), ("BLOCK_R", BR), ("PER_ROW_R", short),
              ("RANK", short), ("CUMSUM", short))
    return (_cdiv(BH * N_PAD, BR),), N_PAD, consts


def append(cfg, st, kv: int, x: torch.Tensor, R: torch.Tensor, clip: float, plan) -> None:
    """Append the new tokens ``x`` of K (``kv = 0``) or V (``kv = 1``) to the OSCAR state ``st`` in one
    launch of ``_append_kernel``: ``kvq.fast.caches.oscar.OscarOps.fused_append``'s contract. The launch is
    kept per call shape (``_launch.site``, keyed by every argument Triton specializes on; the counters that
    move every step, T0 and first, are not specialized): after its first call, the compiled kernel takes
    the addresses (no Triton dispatch per step)."""
    B, H, D = st.shape
    n = x.shape[2]
    if n == 0:
        return
    fo = _O.fused_operands(st, kv, R, clip)
    lo, hi, frac = fo.quantile
    W = cfg.window
    tensors = (x, R, *fo.fields, st.table)
    ptrs = tuple(map(L.PTR, tensors))
    grid, N_PAD, consts = _shape(cfg, B * H, D, n, Q.interpreting())
    T0, first = plan.T0, plan.first
    fixed = (n, N_PAD, B * H, H, fo.r_stride, *x.stride())
    routing = (plan.n_s, plan.n_old)
    tail = (plan.e, W, max(W, 1), cfg.sink, cfg.page_size, st.table.shape[1], lo, hi)
    dev_index = L.device_index(x.device)
    la = L.site(_append_kernel, grid, consts, OPTIONS, L.aligned(ptrs),
                (fixed, routing, tail, tuple(map(L.DTYPE, tensors)), dev_index, max(T0, first) < 2 ** 31))
    stream = L.current_stream(dev_index) if la.compiled is not None else None
    la((ptrs if stream is not None else tensors) + fixed + (T0,) + routing + (first,) + tail + (frac,),
       stream, dev_index)
