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

import torch

from kvq.reference import numerics as nx
from kvq.reference.kivi import CONFIGS, KIVIConfig  # noqa: F401  (the reference's objects)

from . import packing as P
from . import paged

__all__ = ["KIVIConfig", "CONFIGS", "init", "append", "dequantize", "decode_attention"]


class KeyCodec:
    """KIVI key pages on the device: per-channel b-bit codes over the page's G tokens, packed along tokens."""

    @staticmethod
    def empty_pool(cfg, Pn: int, H: int, D: int, device) -> dict:
        meta = paged.meta_dtype(cfg)
        return {"codes": torch.zeros((Pn, H, D, cfg.group_size * cfg.k_bits // 8), dtype=torch.uint8, device=device),
                "scale": torch.zeros((Pn, H, D), dtype=meta, device=device),
                "mn": torch.zeros((Pn, H, D), dtype=meta, device=device)}

    @staticmethod
    def encode_pages(cfg, pages: torch.Tensor, first_index: int) -> dict:
        """(B, H, n, G, D) fp16 keys -> page arrays (B, n, H, ...), one quantize+pack kernel for all."""
        B, H, n, G, D = pages.shape
        packed, scale, mn = P.quantize_pack(pages.reshape(B, H, n * G, D), cfg.k_bits, G, axis=2,
                                            meta_dtype=nx.dtype_name(cfg.meta_dtype))
        codes = packed.view(B, H, n, G * cfg.k_bits // 8, D).permute(0, 2, 1, 4, 3)   # (B, n, H, D, GB)
        return {"codes": codes, "scale": scale.transpose(1, 2), "mn": mn.transpose(1, 2)}

    @staticmethod
    def decode(cfg, page: dict) -> torch.Tensor:
        """Pages (..., H, ...) -> fp32 keys (..., H, G, D)."""
        x = P.unpack_dequantize(page["codes"], page["scale"][..., None], page["mn"][..., None], cfg.k_bits,
                                cfg.group_size, axis=-1, out_dtype="float32")          # (..., D, G)
        return x.transpose(-1, -2)

    @staticmethod
    def kernel_arrays(cfg, st) -> dict:
        """The key-pool tensors and constants the fused decode kernel takes."""
        p = st.k_pool
        return {"codes": p["codes"], "high": p["codes"], "idx": p["codes"], "scale": p["scale"], "mn": p["mn"],
                "bits": cfg.k_bits, "kitty": False, "d_boost": 0}


def init(cfg: KIVIConfig, batch: int, kv_heads: int, head_dim: int) -> paged.PagedState:
    """Mirrors `kvq.reference.kivi.init`: an empty KIVI cache, preallocated.

    Differences: the state's tensors live on the current CUDA device (the CPU under TRITON_INTERPRET=1).
    """
    return paged.init(cfg, KeyCodec, batch, kv_heads, head_dim)


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
    return paged.decode_attention(cfg, KeyCodec, state, q, scale=scale)
