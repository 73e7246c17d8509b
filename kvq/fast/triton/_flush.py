"""The paged cache's writes as single Triton kernels, straight into the preallocated pool.

``flush_key_pages``: full pages of fp16 keys -> the key pool, one launch for all of a flush's pages.
Per (page, head) one program quantizes every channel over the page's G tokens (rule 2, the bit-exact
quantizer's device helpers from ``kvq.fast.triton.quant``) and packs the codes along tokens (rule 6:
token PER j + k of byte j at bits [BITS k, BITS k + BITS)), at pool slot ``first + j * B + b`` (page j of
sequence b: page-major, then batch, the reference's allocation order).

- KIVI: ``codes`` (D, G * BITS / 8), ``scale`` / ``mn`` (D,).
- Kitty (``kvq.reference.kitty.encode_page``, in the reference's order of decisions):
  1. the channel scores of eq. 2, ``s_i = (1/G) sum_t |x_{t,i}|`` (an fp32 sum in the kernel's order,
     then an IEEE division by G: contract rule 7, as the torch path);
  2. the ``d_boost`` largest scores boosted, ties to the lower channel (each channel's rank counted
     against all others: the reference's stable sort on -s);
  3. every channel at 2 and at 4 bits;
  4. ``low`` (D, G/4): the 2-bit code of an unboosted channel, the low two bits of a boosted one's
     4-bit code; ``high`` (d_boost, G/4): the boosted channels' high two bits in channel order;
     ``idx`` (D,): a boosted channel's row in ``high``, ``d_boost`` otherwise; ``scale`` / ``mn``: the
     4-bit metadata of a boosted channel, the 2-bit metadata of the others.

``evict_values``: the tokens that leave the value window (or a full value Q-buffer), quantized per
token in groups of Gv channels and packed along channels, each written to its page slot: token q (q0 +
t) goes to page ``v_table[b, q // G]``, slot ``q % G``. One program per (token, head, sequence).

``append_token``: a decode token's whole append (key into the key Q-buffer, value into the window, the value it
evicts into the value Q-buffer or quantized into its page), one launch, one program per (head, sequence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.fast.caches.codecs import check_key_flush, check_value_evict, key_flush_operands

from kvq.fast.common import next_pow2 as _np2  # host grid arithmetic
from . import _launch as L
from .quant import group_codes, fast_ok, load_f32, group_meta, interpreting

__all__ = ["flush_key_pages", "evict_values"]


# Computes: the key-page arrays of one (page, head) into the pool (module docstring).
# Grid: (n * B, H): program (j * B + b, h) takes page j of sequence b, kv head h; the pages' last three
#   dimensions (n, G, D) contiguous, batch and head strides sx_b, sx_h (a slice of the keys, no copy).
# Tile: (BLOCK_J, PER, BLOCK_D) keys (token PER j + k, channel d) in registers; Kitty's ranking a
#   (BLOCK_D, BLOCK_D) comparison.
# Bytes: reads G * D fp16 keys; writes D * G * BITS / 8 code bytes and 2 D metadata (Kitty: also
#   d_boost * G / 4 high-plane bytes and D index bytes).
@triton.jit
def _key_flush_kernel(x_ptr, low_ptr, high_ptr, idx_ptr, s_ptr, m_ptr, sx_b, sx_h, B, n, G, D, DB, first, Gf,
                      BITS: tl.constexpr, QMAX: tl.constexpr, KITTY: tl.constexpr, FASTDIV: tl.constexpr,
                      BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    pid = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    jp = pid // B
    b = pid % B
    NJ = G // PER
    j3 = tl.arange(0, BLOCK_J)[:, None, None]
    k3 = tl.arange(0, PER)[None, :, None]
    dd = tl.arange(0, BLOCK_D)
    d3 = dd[None, None, :]
    dvalid = dd < D
    m = (j3 < NJ) & (d3 < D)
    base = b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h + jp.to(tl.int64) * G * D
    x = load_f32(x_ptr + base + (j3 * PER + k3) * D + d3, m, False)
    # per channel over the page's tokens (rule 2; nz: NaN where the channel holds a non-finite key;
    # padding channels: 0)
    lo = tl.where(dvalid, tl.min(tl.min(tl.where(m, x, float("inf")), axis=1), axis=0), 0.0)
    hi = tl.where(dvalid, tl.max(tl.max(tl.where(m, x, float("-inf")), axis=1), axis=0), 0.0)
    nz = tl.sum(tl.sum(x * 0.0, axis=1), axis=0)
    sa_st, ma_st, sa, ma = group_meta(lo, hi, nz, s_ptr, QMAX, 0.0, False)
    ca = group_codes(x, sa[None, None, :], ma[None, None, :], tl.div_rn(1.0, sa)[None, None, :], fast_ok(sa, dvalid),
                QMAX, 0.0, False, BITS, FASTDIV)
    ph = (first + pid).to(tl.int64) * H + h
    j2 = tl.arange(0, BLOCK_J)[:, None]
    d2 = dd[None, :]
    m2d = (j2 < NJ) & (d2 < D)
    if KITTY:
        # eq. 2 scores and the boosted channels: rank = channels with a larger score, or an equal one at
        # a lower index (padding channels score -inf and are never boosted)
        sc = tl.div_rn(tl.sum(tl.sum(tl.where(m, tl.abs(x), 0.0), axis=1), axis=0), Gf)
        sc = tl.where(dvalid, sc, float("-inf"))
        before = (sc[None, :] > sc[:, None]) | ((sc[None, :] == sc[:, None]) & (dd[None, :] < dd[:, None]))
        boost = (tl.sum(before.to(tl.int32), axis=1) < DB) & dvalid
        s4_st, m4_st, s4, m4 = group_meta(lo, hi, nz, s_ptr, 15.0, 0.0, False)
        c4 = group_codes(x, s4[None, None, :], m4[None, None, :], tl.div_rn(1.0, s4)[None, None, :],
                    fast_ok(s4, dvalid), 15.0, 0.0, False, 4, FASTDIV)
        codes = tl.where(boost[None, None, :], c4 & 3, ca)
        s_out = tl.where(boost, s4_st, sa_st)
        m_out = tl.where(boost, m4_st, ma_st)
        row = tl.cumsum(boost.to(tl.int32), axis=0) - 1
        tl.store(idx_ptr + ph * D + dd, tl.where(boost, row, DB).to(tl.uint8), mask=dvalid)
        high = tl.sum((c4 >> 2) << (k3 * 2), axis=1)
        tl.store(high_ptr + (ph * DB + row[None, :]) * NJ + j2, high.to(tl.uint8), mask=m2d & boost[None, :])
    else:
        codes = ca
        s_out = sa_st
        m_out = ma_st
    low = tl.sum(codes << (k3 * BITS), axis=1)                               # (BLOCK_J, BLOCK_D) bytes
    tl.store(low_ptr + (ph * D + d2) * NJ + j2, low.to(tl.uint8), mask=m2d)
    tl.store(s_ptr + ph * D + dd, s_out, mask=dvalid)
    tl.store(m_ptr + ph * D + dd, m_out, mask=dvalid)


def flush_key_pages(pages: torch.Tensor, pool: dict, first: int, bits: int, d_boost: int, kitty: bool) -> None:
    """Encode full key pages (B, H, n, G, D) fp16 into the key pool at slots ``first + j * B + b``:
    KIVI's ``codes`` / ``scale`` / ``mn`` with ``bits``-bit codes, or (``kitty``, magnitude selection,
    bits = 2) Kitty's ``low`` / ``high`` / ``idx`` / ``scale`` / ``mn``.

    Checks the shapes and dtypes it relies on; the caller (``kvq.fast.caches.paged.append``) has validated
    the keys (finite fp16) and allocated the slots.
    """
    check_key_flush(pages, pool, first, bits, d_boost, kitty)
    B, H, n, G, D = pages.shape
    if B * n == 0:
        return
    x, codes, high, idx, scale, mn = key_flush_operands(pages, pool, d_boost, kitty)
    _key_flush_kernel[(n * B, H)](x, codes, high, idx, scale, mn, x.stride(0), x.stride(1), B, n, G, D, d_boost,
                                  first, float(G), BITS=bits, QMAX=float(2 ** bits - 1), KITTY=bool(kitty),
                                  FASTDIV=not interpreting(), BLOCK_J=_np2(G * bits // 8),
                                  BLOCK_D=_np2(D), num_warps=8, enable_fp_fusion=False)


# The body of _value_evict_kernel and _append_token_kernel: the values x (BLOCK_J, PER) of channels c (mask m)
#   of one token, quantized per token in groups of GV channels (rule 2) and packed along channels (rule 6)
#   into pool row `row`. Groups by a (BLOCK_G, BLOCK_J, PER) membership mask (a group need not fill whole
#   bytes).
@triton.jit
def _quantize_token_row(x, c, m, row, c_ptr, s_ptr, m_ptr, D, GV, NGV,
                        BITS: tl.constexpr, QMAX: tl.constexpr, FASTDIV: tl.constexpr,
                        BLOCK_J: tl.constexpr, BLOCK_G: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    NJ = D // PER
    jj = tl.arange(0, BLOCK_J)
    gg = tl.arange(0, BLOCK_G)
    gvalid = gg < NGV
    gm = ((c // GV)[None, :, :] == gg[:, None, None]) & m[None, :, :]        # channel c in group g
    x3 = x[None, :, :]
    lo = tl.where(gvalid, tl.min(tl.min(tl.where(gm, x3, float("inf")), axis=2), axis=1), 0.0)
    hi = tl.where(gvalid, tl.max(tl.max(tl.where(gm, x3, float("-inf")), axis=2), axis=1), 0.0)
    nz = tl.sum(tl.sum(tl.where(gm, x3 * 0.0, 0.0), axis=2), axis=1)
    s_st, m_st, s32, m32 = group_meta(lo, hi, nz, s_ptr, QMAX, 0.0, False)
    # each channel's group metadata: a sum with one nonzero term per channel (exact)
    se = tl.sum(tl.where(gm, s32[:, None, None], 0.0), axis=0)
    me = tl.sum(tl.where(gm, m32[:, None, None], 0.0), axis=0)
    re = tl.sum(tl.where(gm, tl.div_rn(1.0, s32)[:, None, None], 0.0), axis=0)
    code = group_codes(x, se, me, re, fast_ok(s32, gvalid), QMAX, 0.0, False, BITS, FASTDIV)
    byte = tl.sum(code << (tl.arange(0, PER)[None, :] * BITS), axis=1)      # (BLOCK_J,)
    tl.store(c_ptr + row * NJ + jj, byte.to(tl.uint8), mask=jj < NJ)
    tl.store(s_ptr + row * NGV + gg, s_st, mask=gvalid)
    tl.store(m_ptr + row * NGV + gg, m_st, mask=gvalid)


# Computes: one token's values quantized per token in groups of GV channels (rule 2) and packed along
#   channels (rule 6), written to the token's page slot (module docstring).
# Grid: (e, H, B): program (t, h, b) takes token t of sequence b, kv head h; x strides sx_b, sx_h, sx_t,
#   channels contiguous.
# Tile: (BLOCK_J, PER) channels PER j + k (_quantize_token_row).
# Bytes: reads D fp16 values and one page-table entry; writes D * BITS / 8 code bytes and 2 D / GV metadata.
@triton.jit(do_not_specialize=["q0"])
def _value_evict_kernel(x_ptr, c_ptr, s_ptr, m_ptr, tab_ptr, sx_b, sx_h, sx_t, q0, G, D, GV, NGV, n_tab,
                        BITS: tl.constexpr, QMAX: tl.constexpr, FASTDIV: tl.constexpr,
                        BLOCK_J: tl.constexpr, BLOCK_G: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    H = tl.num_programs(1)
    jj = tl.arange(0, BLOCK_J)
    c = jj[:, None] * PER + tl.arange(0, PER)[None, :]                     # (BLOCK_J, PER) channels
    m = c < D
    x = load_f32(x_ptr + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h + t.to(tl.int64) * sx_t + c, m, False)
    q = q0 + t
    page = tl.load(tab_ptr + b.to(tl.int64) * n_tab + q // G).to(tl.int64)
    _quantize_token_row(x, c, m, (page * H + h) * G + q % G, c_ptr, s_ptr, m_ptr, D, GV, NGV,
                        BITS, QMAX, FASTDIV, BLOCK_J, BLOCK_G)


# Computes: the paged cache's append of one decode token past the sink whose key does not complete a page
#   (kvq.fast.caches.paged._append_token, the same state bit for bit), in one launch: the key into slot nb
#   of the key Q-buffer kb (B, H, GK, D); the value into slot `slot` of the window vw (B, H, R, D) (R = 0: no
#   window, the value itself is the evicted one); the evicted value (the slot's old value) in mode 1 into
#   slot nvb of the value Q-buffer vb (B, H, GB, D) (Kitty), in mode 2 quantized per token into its page
#   slot (_quantize_token_row): history token q0 of sequence b goes to page first_id + b where NEW_PAGE
#   (entered in the table v_table[b, q0 / G] by program h = 0), else to v_table[b, q0 / G]; mode 0 evicts
#   nothing.
# Grid: (H, B): program (h, b) takes kv head h of sequence b; k, v: (B, H, 1, D) with batch and head strides,
#   channels contiguous.
# Tile: (BLOCK_J, PER) channels; the evicted value is loaded before the new one is stored in its slot.
# Bytes: reads 2 D fp16 (and D of the window); writes 2 D fp16, and mode 2's D * BITS / 8 code bytes and
#   2 D / GV metadata.
@triton.jit(do_not_specialize=["nb", "slot", "nvb", "q0", "first_id"])     # they move every step: one binary
def _append_token_kernel(k_ptr, v_ptr, kb_ptr, vw_ptr, vb_ptr, c_ptr, s_ptr, m_ptr, tab_ptr, sk_b, sk_h, sv_b, sv_h,
                         GK, nb, R, slot, GB, nvb, q0, G, D, GV, NGV, n_tab, first_id,
                         MODE: tl.constexpr, NEW_PAGE: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr,
                         FASTDIV: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_G: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    h = tl.program_id(0)
    b = tl.program_id(1)
    H = tl.num_programs(0)
    bh = b.to(tl.int64) * H + h
    jj = tl.arange(0, BLOCK_J)
    c = jj[:, None] * PER + tl.arange(0, PER)[None, :]                     # (BLOCK_J, PER) channels
    m = c < D
    kx = tl.load(k_ptr + b.to(tl.int64) * sk_b + h.to(tl.int64) * sk_h + c, mask=m)
    tl.store(kb_ptr + (bh * GK + nb) * D + c, kx, mask=m)
    vx = tl.load(v_ptr + b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h + c, mask=m)
    old = vx
    if R > 0:
        w = vw_ptr + (bh * R + slot) * D + c
        old = tl.load(w, mask=m)
        tl.store(w, vx, mask=m)
    if MODE == 1:
        tl.store(vb_ptr + (bh * GB + nvb) * D + c, old, mask=m)
    if MODE == 2:
        entry = tab_ptr + b.to(tl.int64) * n_tab + q0 // G
        if NEW_PAGE:
            page = (first_id + b).to(tl.int64)
            if h == 0:
                tl.store(entry, page.to(tl.int32))
        else:
            page = tl.load(entry).to(tl.int64)
        _quantize_token_row(old.to(tl.float32), c, m, (page * H + h) * G + q0 % G, c_ptr, s_ptr, m_ptr, D, GV,
                            NGV, BITS, QMAX, FASTDIV, BLOCK_J, BLOCK_G)


#: under the interpreter (CPU) ``evict_values`` declines evictions of more (token, head) programs than
#: this: the interpreter runs one program at a time in Python, and the caller's value quantizer (a few
#: programs of many rows) writes the same bits (the writer tests check it) in minutes less of CI
INTERP_EVICT_PROGRAMS = 16


def evict_values(toks: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor, v_mn: torch.Tensor,
                 v_table: torch.Tensor, q0: int, bits: int, Gv: int) -> bool:
    """Quantize the values ``toks`` (B, H, e, D) fp16, tokens q0 .. q0 + e - 1 of the quantized history,
    per token in groups of ``Gv`` channels at ``bits`` bits, into their page slots: ``v_codes`` (slots, H,
    G, D * bits / 8), ``v_scale`` / ``v_mn`` (slots, H, G, D / Gv), pages from ``v_table`` (B, pages),
    whose entries for these tokens the caller has set. Returns True, or False (nothing written) for an
    eviction of more than ``INTERP_EVICT_PROGRAMS`` (token, head) programs under the interpreter.
    """
    check_value_evict(toks, v_codes, v_scale, v_mn, v_table, q0, bits, Gv)
    B, H, e, D = toks.shape
    G = v_codes.shape[2]
    if interpreting() and B * H * e > INTERP_EVICT_PROGRAMS:
        return False
    if B * H * e == 0:
        return True
    x = toks if toks.stride(-1) == 1 else toks.contiguous()
    _value_evict_kernel[(e, H, B)](x, v_codes, v_scale, v_mn, v_table, x.stride(0), x.stride(1), x.stride(2), q0, G,
                                   D, Gv, D // Gv, v_table.shape[1], BITS=bits, QMAX=float(2 ** bits - 1),
                                   FASTDIV=not interpreting(), BLOCK_J=_np2(D * bits // 8),
                                   BLOCK_G=_np2(D // Gv), num_warps=1, enable_fp_fusion=False)
    return True


def append_token(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_win: torch.Tensor, v_buf: torch.Tensor,
                 v_codes: torch.Tensor, v_scale: torch.Tensor, v_mn: torch.Tensor, v_table: torch.Tensor, nb: int,
                 slot: int, nvb: int, mode: int, q0: int, new_page: bool, first_id: int, bits: int, Gv: int) -> bool:
    """One decode token's append to the paged cache in one kernel (``_append_token_kernel``; the
    ``token_append`` writer of ``kvq.fast.caches.codecs.Ops``, whose comment gives the arguments): the same
    state, bit for bit, as ``kvq.fast.caches.paged._append_token``'s copies and ``evict_values``.

    The caller (``_append_token``) has checked k and v (one finite fp16 token of the cache's shape on its
    device) and routed the token; the state's buffers are ``init``'s contiguous tensors. Returns False
    (nothing launched) where the kernel does not take these operands: a token without unit channel stride,
    or a value group that does not divide D. The launch is kept per call shape (``_launch.site``): after
    its first call, the compiled kernel takes the addresses (no Triton dispatch per token)."""
    B, H, _, D = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or Gv < 1 or D % Gv or bits not in (2, 4, 8) or D % (8 // bits):
        return False
    tensors = (k, v, k_buf, v_win, v_buf, v_codes, v_scale, v_mn, v_table)
    ptrs = tuple(map(L.PTR, tensors))
    fixed = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_buf.shape[2], v_win.shape[2], v_buf.shape[2],
             v_codes.shape[2], D, Gv, D // Gv, v_table.shape[1])
    sk_b, sk_h, sv_b, sv_h, GK, R, GB, G, _, _, NGV, n_tab = fixed
    ints = (sk_b, sk_h, sv_b, sv_h, GK, nb, R, slot, GB, nvb, q0, G, D, Gv, NGV, n_tab, first_id)
    dev_index = L.device_index(k.device)
    # the step's slots (nb, slot, nvb, q0, first_id) are not specialized: only their type (i32) is in the key
    la = L.site(_append_token_kernel, (H, B),
                (("MODE", mode), ("NEW_PAGE", bool(new_page)), ("BITS", bits), ("QMAX", float(2 ** bits - 1)),
                 ("FASTDIV", not interpreting()), ("BLOCK_J", _np2(D * bits // 8)),
                 ("BLOCK_G", _np2(D // Gv))),
                (("num_warps", 1), ("enable_fp_fusion", False)), L.aligned(ptrs),
                (fixed, tuple(map(L.DTYPE, tensors)), dev_index, max(nb, slot, nvb, q0, first_id) < 2 ** 31))
    stream = L.current_stream(dev_index) if la.compiled is not None else None
    la((ptrs if stream is not None else tensors) + ints, stream, dev_index)
    return True
