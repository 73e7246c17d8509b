"""The paged cache's writes as single CUDA kernels (``flush.cu``), straight into the preallocated pool:
the CuPy twins of ``kvq.fast.triton._flush``, the same arguments, checks and bits.

``flush_key_pages``: full pages of fp16 keys -> the key pool (KIVI's 2 / 4 / 8-bit codes and metadata,
or Kitty's planes, index and metadata), one launch for all of a flush's pages, one block per (page,
head): one thread per channel (rounded up to a warp) times up to 8 slices of the page's tokens.
``evict_values``: the values that leave the window, quantized per token
into their page slots, one launch per append, one block per (token, head, sequence). The quantizer's
arithmetic is ``quant.cu``'s (the bit-exact min-max quantizer of the numerics contract).
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast.caches.codecs import check_key_flush, check_value_evict, key_flush_operands

from . import _loader as L

__all__ = ["flush_key_pages", "evict_values"]

_SRC = "flush.cu"


def _meta_half(scale: torch.Tensor) -> bool:
    """fp16 metadata (else fp32: the shared checks have refused any other dtype)."""
    return scale.dtype == torch.float16


def _threads(D: int) -> int:
    """Threads along the channels: one per channel, rounded up to a warp."""
    if D > L.FLUSH_MAX_D:
        raise ValueError(f"head dim {D} exceeds the writers' {L.FLUSH_MAX_D} threads per block")
    return -(-D // 32) * 32


def _slices(DX: int, NJ: int) -> int:
    """key_flush's token slices per block (blockDim.y): up to 8, within FLUSH_MAX_D threads and NJ code bytes."""
    return max(1, min(8, L.FLUSH_MAX_D // DX, NJ))


def _on_cuda(*ts) -> None:
    if not all(t.is_cuda and t.device == ts[0].device for t in ts):
        raise ValueError("the CuPy writers take CUDA tensors, all on one device")


def flush_key_pages(pages: torch.Tensor, pool: dict, first: int, bits: int, d_boost: int, kitty: bool) -> None:
    """Encode full key pages (B, H, n, G, D) fp16 into the key pool at slots ``first + j * B + b``:
    KIVI's ``codes`` / ``scale`` / ``mn`` with ``bits``-bit codes, or (``kitty``, magnitude selection,
    bits = 2) Kitty's ``low`` / ``high`` / ``idx`` / ``scale`` / ``mn``.

    Checks the shapes and dtypes it relies on (``kvq.fast.caches.codecs.check_key_flush``); the caller
    (``kvq.fast.caches.paged.append``) has validated the keys (finite fp16) and allocated the slots.
    """
    check_key_flush(pages, pool, first, bits, d_boost, kitty)
    B, H, n, G, D = pages.shape
    mh = _meta_half(pool["scale"])
    threads = _threads(D)
    _on_cuda(pages, *pool.values())
    if B * n == 0:
        return
    x, codes, high, idx, scale, mn = key_flush_operands(pages, pool, d_boost, kitty)
    fn = L.kernel(_SRC, L.key_flush_name(bits, kitty, mh))
    args = (x, np.int64(x.stride(0)), np.int64(x.stride(1)), codes, high, idx, scale, mn, np.int32(B), np.int32(G),
            np.int32(D), np.int32(d_boost), np.int64(first))
    L.run(fn, (n * B, H), (threads, _slices(threads, G * bits // 8)), args, x.device)


def evict_values(toks: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor, v_mn: torch.Tensor,
                 v_table: torch.Tensor, q0: int, bits: int, Gv: int) -> bool:
    """``kvq.fast.triton._flush.evict_values`` as one CUDA kernel (``flush.cu`` value_evict): the same
    arguments, checks and pool bits; CUDA tensors, fp16 or fp32 metadata. Returns True (it takes every
    eviction)."""
    check_value_evict(toks, v_codes, v_scale, v_mn, v_table, q0, bits, Gv)
    B, H, e, D = toks.shape
    mh = _meta_half(v_scale)
    threads = _threads(D)
    _on_cuda(toks, v_codes, v_scale, v_mn, v_table)
    if B * H * e == 0:
        return True
    x = toks if toks.stride(-1) == 1 else toks.contiguous()
    fn = L.kernel(_SRC, L.value_evict_name(bits, mh, Gv & (Gv - 1) == 0))
    args = (x, np.int64(x.stride(0)), np.int64(x.stride(1)), np.int64(x.stride(2)), v_codes, v_scale, v_mn, v_table,
            np.int32(q0), np.int32(v_codes.shape[2]), np.int32(D), np.int32(Gv), np.int32(v_table.shape[1]))
    L.run(fn, (e, H, B), (threads,), args, x.device)
    return True
