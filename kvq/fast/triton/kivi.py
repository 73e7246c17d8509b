"""Triton KIVI cache: mirrors ``kvq.reference.kivi`` on torch tensors (layout: ``kvq.fast.triton.paged``).

    from kvq.fast.triton import kivi
    cfg = kivi.CONFIGS["KIVI-K2V2"]                        # the reference's objects
    st = kivi.init(cfg, batch=8, kv_heads=8, head_dim=128)  # on the current CUDA device
    kivi.append(cfg, st, k, v)                             # k, v: (B, H_kv, T_new, D) fp16 CUDA tensors
    out, lse = kivi.decode_attention(cfg, st, q)           # one fused kernel over the packed pages

The state's tensors are bit-identical to the reference state's arrays after the same appends; a key
page is ``codes`` (D, G * k_bits / 8) uint8 packed along tokens, ``scale`` / ``mn`` (D,).
"""

from __future__ import annotations

from kvq.fast.caches import paged as _paged
from kvq.fast.caches.codecs import KIVICodec
from kvq.reference.kivi import CONFIGS, KIVIConfig  # noqa: F401  (the reference's objects)

from . import paged

__all__ = ["KIVIConfig", "CONFIGS", "init", "append", "dequantize", "decode_attention"]


#: KIVI key pages (``kvq.fast.caches.codecs.KIVICodec``) quantized and packed by the Triton kernels
KeyCodec = KIVICodec(paged.OPS)


def init(cfg: KIVIConfig, batch: int, kv_heads: int, head_dim: int, *, device=None) -> paged.PagedState:
    """Mirrors `kvq.reference.kivi.init`: an empty KIVI cache, preallocated.

    Differences: the state's tensors live on ``device`` (a CUDA device, e.g. "cuda:1"; the CPU only
    under the Triton interpreter); None: the current CUDA device (the CPU under the interpreter).
    """
    return paged.init(cfg, KeyCodec, batch, kv_heads, head_dim, device=device)


def append(cfg: KIVIConfig, state: paged.PagedState, k, v) -> paged.PagedState:
    """Mirrors `kvq.reference.kivi.append`: append (B, H_kv, T_new, D) tokens; the state is bit-identical.

    Differences: k, v are float16 / float32 torch tensors on the cache's device; the NaN / inf and
    float16-overflow checks run while ``kvq.fast.validation`` is on.
    """
    return paged.append(cfg, KeyCodec, state, k, v)


def dequantize(cfg: KIVIConfig, state: paged.PagedState):
    """Mirrors `kvq.reference.kivi.dequantize`: (K, V) fp32 (B, H_kv, T, D), bit-identical."""
    return paged.dequantize_cache(cfg, KeyCodec, state)


def decode_attention(cfg: KIVIConfig, state: paged.PagedState, q, *, scale=None):
    """Mirrors `kvq.reference.kivi.decode_attention`: ``(out, lse)`` of q (B, H_q, T_q, D) over the cache.

    Differences: one fused Triton kernel reads the packed pages (tolerance rule, contract rule 7);
    out comes back in q's dtype (float16 / bfloat16 / float32; the reference returns float32), lse
    float32; float64 q is refused.
    """
    _paged.check_state(cfg, KeyCodec, state)                 # before the decode reads any page
    return paged.decode_attention(cfg, KeyCodec, state, q, scale=scale)
