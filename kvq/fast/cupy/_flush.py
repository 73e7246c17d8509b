"""The paged cache's writes as single CUDA kernels (``flush.cu``), straight into the preallocated pool:
the CuPy twins of ``kvq.fast.triton._flush``, the same arguments, checks and bits.

``flush_key_pages``: full pages of fp16 keys -> the key pool (KIVI's 2 / 4 / 8-bit codes and metadata,
or Kitty's planes, index and metadata), one launch for all of a flush's pages, one block per (page,
head): one thread per channel (rounded up to a warp) times up to 8 slices of the page's tokens.
``evict_values``: the values that leave the window, quantized per token
into their page slots, one launch per append, one block per (token, head, sequence).
``append_token``: a decode token's whole append (key into the key Q-buffer, value into the window, the value
it evicts into the value Q-buffer or its page), one launch planned once per shape (``_loader.Prepared``), one
block per (head, sequence). The quantizer's arithmetic is ``quant.cu``'s (the bit-exact min-max quantizer of
the numerics contract).
"""

from __future__ import annotations


import numpy as np
import torch

from kvq.fast.caches.codecs import check_key_flush, check_value_evict, key_flush_operands

from . import _loader as L

__all__ = ["flush_key_pages", "evict_values", "append_token"]

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


#: append_token's argument types, every one a per-call value (``_loader.planned``): flush.cu's order
_APPEND_TYPES = (torch.Tensor, np.int64, np.int64, torch.Tensor, np.int64, np.int64, torch.Tensor, np.int32, np.int32,
                 torch.Tensor, np.int32, np.int32, torch.Tensor, np.int32, np.int32, np.int32, torch.Tensor,
                 torch.Tensor, torch.Tensor, torch.Tensor, np.int32, np.int32, np.int32, np.int32, np.int32, np.int32,
                 np.int32)


def append_token(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_win: torch.Tensor, v_buf: torch.Tensor,
                 v_codes: torch.Tensor, v_scale: torch.Tensor, v_mn: torch.Tensor, v_table: torch.Tensor, nb: int,
                 slot: int, nvb: int, mode: int, q0: int, new_page: bool, first_id: int, bits: int, Gv: int) -> bool:
    """``kvq.fast.triton._flush.append_token`` as one CUDA kernel (``flush.cu`` append_token, its launch planned
    once per shape): the same arguments, routing and pool bits. Returns False (nothing launched) for what the
    Triton writer declines, and for a head dim over the block's threads."""
    B, H, _, D = k.shape
    if (k.stride(-1) != 1 or v.stride(-1) != 1 or D > L.FLUSH_MAX_D or Gv < 1 or D % Gv
            or bits not in L.PAGED_VBITS or D % (8 // bits)):
        return False
    dev = L.device_index(k.device)
    launch = L.planned(L.kernel(_SRC, L.append_token_name(bits, _meta_half(v_scale), Gv & (Gv - 1) == 0)), (H, B),
                       (_threads(D),), 0, _APPEND_TYPES)
    values = (k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), k_buf.data_ptr(),
              k_buf.shape[2], nb, v_win.data_ptr(), v_win.shape[2], slot, v_buf.data_ptr(), v_buf.shape[2], nvb,
              mode, v_codes.data_ptr(), v_scale.data_ptr(), v_mn.data_ptr(), v_table.data_ptr(), q0,
              v_codes.shape[2], D, Gv, v_table.shape[1], int(new_page), first_id)
    with L.on_device(dev):
        launch.launch(values, dev, L.raw_stream(dev))
    return True
