"""Kitty's key-page flush as ONE Triton kernel: full pages of fp16 keys straight into the page pool.

Per (page, head), one program does what ``kvq.reference.kitty.encode_page`` does, in the reference's
order of decisions, and writes the pool's arrays in place (no intermediate arrays, no copies):

1. the channel scores of eq. 2, ``s_i = (1/G) sum_t |x_{t,i}|`` (an fp32 sum in the kernel's order,
   then an IEEE division by G: contract rule 7, as the torch path);
2. the ``d_boost`` largest scores boosted, ties to the lower channel (the rank of each channel counted
   against all others: the reference's stable sort on -s);
3. every channel quantized over its G tokens at 2 and at 4 bits with the bit-exact quantizer's device
   helpers (``kvq.fast.triton.quant``: rule 2's metadata, rounding and clamping);
4. ``low`` (D, G/4): the 2-bit code of an unboosted channel, the low two bits of a boosted one's 4-bit
   code; ``high`` (d_boost, G/4): the high two bits of the boosted channels in channel order; ``idx``
   (D,): a boosted channel's row in ``high``, ``d_boost`` otherwise; ``scale`` / ``mn``: the 4-bit
   metadata of a boosted channel, the 2-bit metadata of the others. Codes pack along tokens, token
   4j + k of a byte at bits [2k, 2k + 2) (rule 6).

The pages are the ``(B, H, n, G, D)`` fp16 keys of a flush; page ``j`` of sequence ``b`` goes to pool
slot ``first + j * B + b`` (page-major, then batch: the reference's allocation order). Magnitude
selection only: random selection draws the reference's NumPy numbers on the host (the torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.fast import _common as C

from .quant import _codes, _fast_ok, _load_f32, _meta

__all__ = ["flush_pages"]


# Computes: the Kitty page arrays of one (page, head) into the pool (module docstring).
# Grid: (n * B, H): program (j * B + b, h) takes page j of sequence b, kv head h; the pages' last three
#   dimensions (n, G, D) contiguous, batch and head strides sx_b, sx_h (a slice of the keys, no copy).
# Tile: (BLOCK_J, 4, BLOCK_D) keys (token 4 j + k, channel d) in registers; the ranking a (BLOCK_D,
#   BLOCK_D) comparison.
# Bytes: reads G * D fp16 keys; writes D * G / 4 + d_boost * G / 4 + D code bytes and 2 D metadata.
@triton.jit
def _kitty_flush_kernel(x_ptr, low_ptr, high_ptr, idx_ptr, s_ptr, m_ptr, sx_b, sx_h, B, n, G, D, DB, first, Gf,
                        FASTDIV: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    jp = pid // B
    b = pid % B
    NJ = G // 4
    j3 = tl.arange(0, BLOCK_J)[:, None, None]
    k3 = tl.arange(0, 4)[None, :, None]
    dd = tl.arange(0, BLOCK_D)
    d3 = dd[None, None, :]
    dvalid = dd < D
    m = (j3 < NJ) & (d3 < D)
    base = b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h + jp.to(tl.int64) * G * D
    x = _load_f32(x_ptr + base + (j3 * 4 + k3) * D + d3, m, False)
    # 1-2. eq. 2 scores and the boosted channels: rank = channels with a larger score, or an equal one
    # at a lower index (padding channels score -inf and are never boosted)
    sc = tl.div_rn(tl.sum(tl.sum(tl.where(m, tl.abs(x), 0.0), axis=1), axis=0), Gf)
    sc = tl.where(dvalid, sc, float("-inf"))
    si = sc[:, None]
    sj = sc[None, :]
    before = (sj > si) | ((sj == si) & (dd[None, :] < dd[:, None]))
    rank = tl.sum(before.to(tl.int32), axis=1)
    boost = (rank < DB) & dvalid
    # 3. both widths over the page's tokens (rule 2; nz: NaN where the channel holds a non-finite key)
    lo = tl.where(dvalid, tl.min(tl.min(tl.where(m, x, float("inf")), axis=1), axis=0), 0.0)   # padding: 0
    hi = tl.where(dvalid, tl.max(tl.max(tl.where(m, x, float("-inf")), axis=1), axis=0), 0.0)
    nz = tl.sum(tl.sum(x * 0.0, axis=1), axis=0)
    s2_st, m2_st, s2, m2 = _meta(lo, hi, nz, s_ptr, 3.0, 0.0, False)
    s4_st, m4_st, s4, m4 = _meta(lo, hi, nz, s_ptr, 15.0, 0.0, False)
    c2 = _codes(x, s2[None, None, :], m2[None, None, :], tl.div_rn(1.0, s2)[None, None, :], _fast_ok(s2, dvalid),
                3.0, 0.0, False, 2, FASTDIV)
    c4 = _codes(x, s4[None, None, :], m4[None, None, :], tl.div_rn(1.0, s4)[None, None, :], _fast_ok(s4, dvalid),
                15.0, 0.0, False, 4, FASTDIV)
    # 4. planes, packed along tokens, and the index; written at pool slot first + pid, head h
    b3 = boost[None, None, :]
    low = tl.sum(tl.where(b3, c4 & 3, c2) << (k3 * 2), axis=1)              # (BLOCK_J, BLOCK_D) bytes
    high = tl.sum((c4 >> 2) << (k3 * 2), axis=1)
    ph = (first + pid).to(tl.int64) * H + h
    j2 = tl.arange(0, BLOCK_J)[:, None]
    d2 = dd[None, :]
    m2d = (j2 < NJ) & (d2 < D)
    tl.store(low_ptr + (ph * D + d2) * NJ + j2, low.to(tl.uint8), mask=m2d)
    row = tl.cumsum(boost.to(tl.int32), axis=0) - 1
    tl.store(idx_ptr + ph * D + dd, tl.where(boost, row, DB).to(tl.uint8), mask=dvalid)
    tl.store(s_ptr + ph * D + dd, tl.where(boost, s4_st, s2_st), mask=dvalid)
    tl.store(m_ptr + ph * D + dd, tl.where(boost, m4_st, m2_st), mask=dvalid)
    tl.store(high_ptr + (ph * DB + row[None, :]) * NJ + j2, high.to(tl.uint8), mask=m2d & boost[None, :])


def flush_pages(pages: torch.Tensor, pool: dict, first: int, d_boost: int) -> None:
    """Encode full key pages (B, H, n, G, D) fp16 into the Kitty pool arrays ``low``, ``high``, ``idx``,
    ``scale``, ``mn`` (each (slots, H, ...)) at slots ``first + j * B + b`` (magnitude selection).

    Checks the shapes and dtypes it relies on; the caller (``kvq.fast._paged.append``) has validated
    the keys (finite fp16) and allocated the slots.
    """
    if pages.ndim != 5 or pages.dtype != torch.float16:
        raise ValueError(f"pages must be (B, H, n, G, D) float16, got {tuple(pages.shape)} {pages.dtype}")
    B, H, n, G, D = pages.shape
    if G % 4 or not 0 <= d_boost <= min(D, 255):
        raise ValueError(f"group size {G} must be a multiple of 4 and d_boost={d_boost} in [0, min(D, 255)]")
    low, high, idx, scale, mn = (pool[k] for k in ("low", "high", "idx", "scale", "mn"))
    if (low.shape[1:] != (H, D, G // 4) or high.shape[1:] != (H, d_boost, G // 4) or idx.shape[1:] != (H, D)
            or scale.shape != idx.shape or mn.shape != idx.shape or first + n * B > low.shape[0]):
        raise ValueError("the pool arrays do not match the pages (or too few slots are left)")
    if not all(t.is_contiguous() for t in (low, high, idx, scale, mn)):
        raise ValueError("the pool arrays must be contiguous")
    if B * n == 0:
        return
    x = pages if pages.stride()[2:] == (G * D, D, 1) else pages.contiguous()
    _kitty_flush_kernel[(n * B, H)](x, low, high if d_boost else low, idx, scale, mn, x.stride(0), x.stride(1),
                                    B, n, G, D, d_boost, first,
                                    float(G), FASTDIV=not C.interpreting(), BLOCK_J=triton.next_power_of_2(G // 4),
                                    BLOCK_D=triton.next_power_of_2(D), num_warps=8, enable_fp_fusion=False)
