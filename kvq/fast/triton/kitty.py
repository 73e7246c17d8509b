"""Triton Kitty cache: mirrors ``kvq.reference.kitty`` on torch tensors (layout: ``kvq.fast.triton.paged``).

Kitty is KIVI-2bit with FP16 sink tokens and, per key page and head, the ``d_boost`` channels of
largest mean magnitude (eq. 2) at 4 bits, stored as a dense 2-bit ``low`` plane, a compact 2-bit
``high`` plane of the boosted channels and a channel -> row index ``idx`` (sentinel d_boost).

    from kvq.fast.triton import kitty
    cfg = kitty.CONFIGS["Kitty"]
    st = kitty.init(cfg, 8, 8, 128); kitty.append(cfg, st, k, v); out, lse = kitty.decode_attention(cfg, st, q)
    mse = kitty.channel_sensitivity(q, k)     # Fig. 2b: (H_q, D) score MSE per INT2 channel (float64)

Bit-exactness: every state tensor equals the reference's after the same appends, except where a
page's channel ranking has a near-tie: the scores are an order-dependent fp32 sum (contract rule 7),
so the fast tier may boost another channel only where two scores tie to within rounding. Random
selection draws the reference's NumPy random numbers on the host (the same generator and seed).
"""

from __future__ import annotations

import torch

from kvq.fast.caches import codecs as K
from kvq.fast.caches import paged as _paged
from kvq.fast import common as C
from kvq.fast.caches import sensitivity as S
from kvq.reference.kitty import CONFIGS, KittyConfig  # noqa: F401  (the reference's objects)

from . import paged
from .quant import interpreting

__all__ = ["KittyConfig", "CONFIGS", "init", "append", "dequantize", "decode_attention",
           "channel_scores", "select_boost", "encode_page", "dequantize_page", "channel_sensitivity"]


def channel_scores(kpage):
    """Mirrors `kvq.reference.kitty.channel_scores`: eq. 2, ``(1/G) sum_t |x_{t,i}|`` fp32, (..., G, D) -> (..., D).

    Differences: torch tensors; the sum is torch's (another order than NumPy's pairwise sum: contract
    rule 7, equal up to rounding; the division by G is IEEE and exact to the reference's given the sum).
    """
    K.check_kpage(kpage, allow_cpu=interpreting())
    return K.channel_scores(kpage)


def select_boost(scores, d_boost: int, selection: str = "magnitude", rng=None):
    """Mirrors `kvq.reference.kitty.select_boost`: bool mask (..., D) of the ``d_boost`` boosted channels.

    Largest scores first, ties to the lower channel (a stable sort on -score); ``selection="random"``
    draws ``rng.random(scores.shape)`` with the NumPy generator ``rng`` on the host (bit-identical to
    the reference's choice). Differences: torch tensors in and out; NaN / inf scores raise ValueError
    only while ``kvq.fast.validation`` is on (a read of the scores).
    """
    d_boost = K.check_select_boost(scores, d_boost, selection, rng, allow_cpu=interpreting())
    return K.select_boost(scores, d_boost, selection, rng)


def encode_page(kpage, boost, meta_dtype="float16") -> dict:
    """Mirrors `kvq.reference.kitty.encode_page`: INT4 where ``boost`` else INT2 per channel, split in planes.

    Returns ``low`` (..., D, G/4), ``high`` (..., D_boost, G/4), ``idx`` (..., D) uint8 and ``scale`` /
    ``mn`` (..., D). The page is quantized at both widths with the bit-exact Triton quantizer (codes
    along tokens), the planes are selected with torch and packed with the Triton packer.
    Differences: torch tensors in and out.
    """
    K.check_kpage(kpage, allow_cpu=interpreting())
    C.check_tensor(boost, "boost", allow_cpu=interpreting())
    boost = boost.to(torch.bool)
    d_boost = K.check_boost(kpage, boost)
    C.check_finite(kpage, "kpage")                               # rule 8, naming kpage (validation on)
    return K.encode(paged.OPS, kpage, boost, d_boost, meta_dtype)


def dequantize_page(page: dict, group_size: int):
    """Mirrors `kvq.reference.kitty.dequantize_page`: Algorithm 1, a key page back to fp32 keys (..., G, D).

    Differences: torch tensors; unpack, gather and dequantize run as Triton kernels plus torch gathers.
    """
    K.check_page(page)
    return K.dequantize_page(paged.OPS, page, group_size)


#: Kitty key pages (``kvq.fast.caches.codecs.KittyCodec``) quantized and packed by the Triton kernels
KeyCodec = K.KittyCodec(paged.OPS)


def init(cfg: KittyConfig, batch: int, kv_heads: int, head_dim: int, *, device=None) -> paged.PagedState:
    """Mirrors `kvq.reference.kitty.init`: an empty Kitty cache, preallocated.

    Differences: the state's tensors live on ``device`` (a CUDA device, e.g. "cuda:1"; the CPU only
    under the Triton interpreter); None: the current CUDA device (the CPU under the interpreter).
    """
    return paged.init(cfg, KeyCodec, batch, kv_heads, head_dim, device=device)


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
    _paged.check_state(cfg, KeyCodec, state)                 # before the decode reads any page
    return paged.decode_attention(cfg, KeyCodec, state, q, scale=scale)


def channel_sensitivity(q, k, *, bits: int = 2, group_size=None, causal: bool = True, scale=None):
    """Mirrors `kvq.reference.kitty.channel_sensitivity`: Fig. 2b, the (H_q, D) attention-score MSE per INT2 channel.

    Row h is query head h (GQA: head h reads kv head ``h // (H_q // H_kv)``). The keys with every channel
    quantized come from the bit-exact Triton quantize / dequantize kernels (bit-identical to the
    reference's); the shape rules and their messages are the reference's.
    Differences: q and k are torch tensors on a CUDA device (the CPU under ``TRITON_INTERPRET=1``);
    the result is a torch.float64 tensor on k's device. Scores and means are order-dependent (contract
    rule 7, the tolerance rule): each channel's perturbation is applied to one shared score matrix as
    a rank-1 change of the logits, in float64 (``kvq.fast.caches.sensitivity``). NaN / inf in q or k raise
    only while ``kvq.fast.validation`` is on (otherwise they propagate into the result).
    """
    return S.channel_sensitivity(paged.OPS, q, k, bits=bits, group_size=group_size, causal=causal, scale=scale)
