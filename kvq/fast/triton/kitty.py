"""Triton Kitty cache: mirrors ``kvq.reference.kitty`` on torch tensors (layout: ``kvq.fast.triton.paged``).

Kitty is KIVI-2bit with FP16 sink tokens and, per key page and head, the ``d_boost`` channels of
largest mean magnitude (eq. 2) at 4 bits, stored as a dense 2-bit ``low`` plane, a compact 2-bit
``high`` plane of the boosted channels and a channel -> row index ``idx`` (sentinel d_boost).

    from kvq.fast.triton import kitty
    cfg = kitty.CONFIGS["Kitty"]
    st = kitty.init(cfg, 8, 8, 128); kitty.append(cfg, st, k, v); out, lse = kitty.decode_attention(cfg, st, q)

Bit-exactness: every state tensor equals the reference's after the same appends, except where a
page's channel ranking has a near-tie: the scores are an order-dependent fp32 sum (contract rule 7),
so the fast tier may boost another channel only where two scores tie to within rounding. Random
selection draws the reference's NumPy random numbers on the host (the same generator and seed).
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast import _common as C
from kvq.reference import numerics as nx
from kvq.reference.kitty import CONFIGS, SELECTIONS, KittyConfig  # noqa: F401  (the reference's objects)

from . import packing as P
from . import paged
from . import quant as Q

__all__ = ["KittyConfig", "CONFIGS", "init", "append", "dequantize", "decode_attention",
           "channel_scores", "select_boost", "encode_page", "dequantize_page"]


def _check_kpage(kpage, name="kpage"):
    C.check_tensor(kpage, name, allow_cpu=C.interpreting())
    if kpage.dtype not in (torch.float16, torch.float32):
        raise TypeError(f"{name} has dtype {kpage.dtype}; kvq quantizes float16 / bfloat16 / float32 data "
                        f"(bfloat16 as float32 values in NumPy). Convert explicitly, e.g. {name}.float().")


def channel_scores(kpage):
    """Mirrors `kvq.reference.kitty.channel_scores`: eq. 2, ``(1/G) sum_t |x_{t,i}|`` fp32, (..., G, D) -> (..., D).

    Differences: torch tensors; the sum is torch's (another order than NumPy's pairwise sum: contract
    rule 7, equal up to rounding; the division by G is IEEE and exact to the reference's given the sum).
    """
    _check_kpage(kpage)
    G = kpage.shape[-2]
    # a 0-d device tensor, not a Python scalar: torch divides by a CPU scalar as a multiply by its reciprocal on CUDA
    return kpage.float().abs().sum(dim=-2) / torch.full((), float(G), dtype=torch.float32, device=kpage.device)


def select_boost(scores, d_boost: int, selection: str = "magnitude", rng=None):
    """Mirrors `kvq.reference.kitty.select_boost`: bool mask (..., D) of the ``d_boost`` boosted channels.

    Largest scores first, ties to the lower channel (a stable sort on -score); ``selection="random"``
    draws ``rng.random(scores.shape)`` with the NumPy generator ``rng`` on the host (bit-identical to
    the reference's choice). Differences: torch tensors in and out.
    """
    D = scores.shape[-1]
    if not 0 <= d_boost <= D:
        raise ValueError(f"d_boost={d_boost} must lie in [0, D={D}]")
    if selection == "magnitude":
        order = torch.sort(-scores.float(), dim=-1, stable=True).indices
    elif selection == "random":
        rng = np.random.default_rng(0) if rng is None else rng
        r = torch.from_numpy(rng.random(tuple(scores.shape))).to(scores.device)
        order = torch.sort(r, dim=-1, stable=True).indices
    else:
        raise ValueError(f"selection={selection!r} is unknown; choose one of {SELECTIONS}")
    mask = torch.zeros(tuple(scores.shape), dtype=torch.bool, device=scores.device)
    mask.scatter_(-1, order[..., :d_boost], True)
    return mask


def encode_page(kpage, boost, meta_dtype="float16") -> dict:
    """Mirrors `kvq.reference.kitty.encode_page`: INT4 where ``boost`` else INT2 per channel, split in planes.

    Returns ``low`` (..., D, G/4), ``high`` (..., D_boost, G/4), ``idx`` (..., D) uint8 and ``scale`` /
    ``mn`` (..., D). The page is quantized at both widths with the bit-exact Triton quantizer (codes
    along tokens), the planes are selected with torch and packed with the Triton packer.
    Differences: torch tensors in and out.
    """
    _check_kpage(kpage)
    G, D = kpage.shape[-2:]
    boost = boost.to(torch.bool)
    cnt = boost.sum(dim=-1)
    d_boost = int(cnt.max()) if boost.numel() else 0
    if tuple(boost.shape) != tuple(kpage.shape[:-2]) + (D,) or bool((cnt != d_boost).any()):
        raise ValueError(f"boost must be (..., D={D}) with the same number of channels in every page")
    return _encode(kpage, boost, d_boost, meta_dtype)


def _encode(kpage, boost, d_boost: int, meta_dtype):
    """encode_page without the checks (which synchronize): ``boost`` holds ``d_boost`` channels per page."""
    G = kpage.shape[-2]
    meta = nx.dtype_name(meta_dtype)
    c2, s2, m2 = Q.quantize(kpage, 2, G, axis=-2, meta_dtype=meta)          # (..., G, D), (..., 1, D)
    c4, s4, m4 = Q.quantize(kpage, 4, G, axis=-2, meta_dtype=meta)
    bt = boost.unsqueeze(-2)
    low = torch.where(bt, c4 & 3, c2)                                       # (..., G, D)
    rows = torch.cumsum(boost.to(torch.int32), dim=-1) - 1
    idx = torch.where(boost, rows, torch.full_like(rows, d_boost)).to(torch.uint8)
    hi_all = (c4 >> 2).transpose(-1, -2)                                    # (..., D, G)
    order = torch.sort((~boost).to(torch.int32), dim=-1, stable=True).indices[..., :d_boost]
    high = torch.gather(hi_all, -2, order.unsqueeze(-1).expand(*order.shape, G))
    return {"low": P.pack(low.transpose(-1, -2).contiguous(), 2, axis=-1),
            "high": P.pack(high.contiguous(), 2, axis=-1),
            "idx": idx,
            "scale": torch.where(boost, s4[..., 0, :], s2[..., 0, :]),
            "mn": torch.where(boost, m4[..., 0, :], m2[..., 0, :])}


def dequantize_page(page: dict, group_size: int):
    """Mirrors `kvq.reference.kitty.dequantize_page`: Algorithm 1, a key page back to fp32 keys (..., G, D).

    Differences: torch tensors; unpack, gather and dequantize run as Triton kernels plus torch gathers.
    """
    low = P.unpack(page["low"], 2, axis=-1)                                 # (..., D, G)
    high = P.unpack(page["high"], 2, axis=-1)                               # (..., D_boost, G)
    idx = page["idx"].long()
    d_boost = high.shape[-2]
    boost = idx < d_boost
    if d_boost:
        rows = torch.clamp(idx, max=d_boost - 1).unsqueeze(-1).expand(*idx.shape, low.shape[-1])
        x_high = torch.where(boost.unsqueeze(-1), torch.gather(high, -2, rows), 0).to(torch.uint8)
    else:
        x_high = torch.zeros_like(low)
    codes = low | (x_high << 2)
    x = Q.dequantize(codes, page["scale"][..., None], page["mn"][..., None], group_size, axis=-1,
                     out_dtype="float32")
    return x.transpose(-1, -2)


class KeyCodec:
    """Kitty key pages on the device: ``low``, ``high``, ``idx``, ``scale``, ``mn`` per (page, head)."""

    @staticmethod
    def empty_pool(cfg, Pn: int, H: int, D: int, device) -> dict:
        meta = paged.meta_dtype(cfg)
        G, Db = cfg.group_size, cfg.d_boost(D)
        u8 = dict(dtype=torch.uint8, device=device)
        return {"low": torch.zeros((Pn, H, D, G // 4), **u8), "high": torch.zeros((Pn, H, Db, G // 4), **u8),
                "idx": torch.zeros((Pn, H, D), **u8), "scale": torch.zeros((Pn, H, D), dtype=meta, device=device),
                "mn": torch.zeros((Pn, H, D), dtype=meta, device=device)}

    @staticmethod
    def encode_pages(cfg, pages: torch.Tensor, first_index: int) -> dict:
        """(B, H, n, G, D) fp16 keys -> page arrays (B, n, H, ...)."""
        B, H, n, G, D = pages.shape
        scores = channel_scores(pages)                                      # (B, H, n, D)
        if cfg.selection == "random":
            boost = torch.stack([select_boost(scores[:, :, j], cfg.d_boost(D), "random",
                                              np.random.default_rng([cfg.seed, first_index + j]))
                                 for j in range(n)], dim=2)
        else:
            boost = select_boost(scores, cfg.d_boost(D), cfg.selection)
        arrays = _encode(pages, boost, cfg.d_boost(D), cfg.meta_dtype)      # select_boost: d_boost per page
        return {name: a.transpose(1, 2) for name, a in arrays.items()}

    @staticmethod
    def decode(cfg, page: dict) -> torch.Tensor:
        return dequantize_page(page, cfg.group_size)

    @staticmethod
    def kernel_arrays(cfg, st) -> dict:
        p = st.k_pool
        Db = p["high"].shape[2]
        return {"codes": p["low"], "high": p["high"] if Db else p["low"], "idx": p["idx"], "scale": p["scale"],
                "mn": p["mn"], "bits": 2, "kitty": True, "d_boost": Db}


def init(cfg: KittyConfig, batch: int, kv_heads: int, head_dim: int) -> paged.PagedState:
    """Mirrors `kvq.reference.kitty.init`: an empty Kitty cache, preallocated.

    Differences: the state's tensors live on the current CUDA device (the CPU under TRITON_INTERPRET=1).
    """
    return paged.init(cfg, KeyCodec, batch, kv_heads, head_dim)


def append(cfg: KittyConfig, state: paged.PagedState, k, v) -> paged.PagedState:
    """Mirrors `kvq.reference.kitty.append`: insert the tokens, quantize and pack every full Q-buffer.

    Differences: torch tensors on the cache's device; a boosted channel may differ from the reference's
    only where two channel scores tie to within rounding (see the module docstring).
    """
    return paged.append(cfg, KeyCodec, state, k, v)


def dequantize(cfg: KittyConfig, state: paged.PagedState):
    """Mirrors `kvq.reference.kitty.dequantize`: (K, V) fp32 (B, H_kv, T, D), bit-identical."""
    return paged.dequantize_cache(cfg, KeyCodec, state)


def decode_attention(cfg: KittyConfig, state: paged.PagedState, q, *, scale=None):
    """Mirrors `kvq.reference.kitty.decode_attention`: ``(out, lse)`` of q over the cache.

    Differences: one fused Triton kernel (Algorithm 1 in registers) for the quantized pages; out in
    q's dtype (the reference returns float32), lse float32; float64 q is refused.
    """
    return paged.decode_attention(cfg, KeyCodec, state, q, scale=scale)
