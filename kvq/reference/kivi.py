"""KIVI: per-channel keys, per-token values, an FP16 residual, in kvq's paged layout.

KIVI (Liu et al., 2024; described in the Kitty paper section 2.1 and its Table 2) quantizes keys per
channel, in groups of G tokens along the token axis, and values per token, in groups of channels; the
most recent tokens stay in FP16: a key buffer of up to G tokens (flushed one page at a time) and a
value window of R tokens (the token leaving it is quantized at once). The asterisk variants of the
Kitty paper also keep the first S = 32 tokens in FP16 (sink). The layout is ``paged.py``'s.

    cfg = CONFIGS["KIVI-K2V2"]
    st = init(cfg, batch=1, kv_heads=8, head_dim=128); append(cfg, st, k, v)
    out, lse = decode_attention(cfg, st, q)

A key page is three arrays per (page, KV head): ``codes`` (D, G * k_bits / 8) uint8, packed along
tokens (contract rule 6: keys pack along tokens), and ``scale`` / ``mn`` (D,) in the metadata dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import numerics as nx
from . import paged
from .packing import pack, unpack
from .quant import dequantize as _dequantize
from .quant import quantize
from .state import check_int, check_str, register_layout

__all__ = ["KIVIConfig", "CONFIGS", "init", "append", "dequantize", "decode_attention"]


@dataclass(frozen=True)
class KIVIConfig(paged.PagedConfig):
    """A KIVI cache configuration (sizes in tokens; bits per quantized element).

    Attributes:
        k_bits, v_bits: 2, 4 or 8.
        group_size: G, tokens per key group = page size (default 128).
        residual: R, the FP16 value window (default 128).
        sink: S, FP16 initial tokens (0 = plain KIVI; 32 for the asterisk variants).
        v_group_size: channels per value group (None = the whole head dim).
        meta_dtype: "float16" (default) or "float32" for scale / min.
        max_tokens: capacity per sequence (the page pool is preallocated for it).
    """

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 128
    residual: int = 128
    sink: int = 0
    v_group_size: int | None = None
    meta_dtype: str = "float16"
    max_tokens: int = 4096
    name: str = "KIVI"

    v_qbuffer = False          # values are quantized as they leave the window (no value Q-buffer)

    def __post_init__(self):
        nx.check_bits(self.k_bits, (2, 4, 8), "k_bits")
        nx.check_bits(self.v_bits, (2, 4, 8), "v_bits")
        for n in ("group_size", "residual", "sink", "max_tokens"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (1 if n in ("group_size", "max_tokens") else 0):
                raise ValueError(f"{n} must be a {'positive' if n in ('group_size', 'max_tokens') else 'non-negative'} int, got {v!r}")
        if self.group_size % (8 // self.k_bits):
            raise ValueError(f"group_size={self.group_size} must be a multiple of {8 // self.k_bits} "
                             f"({self.k_bits}-bit key codes pack along tokens)")
        check_int(self, "v_group_size", 1, optional=True)
        if nx.dtype_name(self.meta_dtype) not in nx.META_DTYPES:
            raise ValueError(f"meta_dtype={self.meta_dtype!r} is not supported; choose one of {nx.META_DTYPES}")
        check_str(self, "name")

    def v_group(self, D: int) -> int:
        return D if self.v_group_size is None else self.v_group_size

    def check_head_dim(self, D: int) -> None:
        Gv = self.v_group(D)
        if D % Gv:
            raise ValueError(f"v_group_size={Gv} does not divide head_dim={D}")
        if D % (8 // self.v_bits):
            raise ValueError(f"head_dim={D} is not a multiple of {8 // self.v_bits} ({self.v_bits}-bit value "
                             f"codes pack along channels)")


#: the configurations named as in the Kitty paper (Table 2); * = 32 FP16 sink tokens
CONFIGS = {
    "KIVI-K2V2": KIVIConfig(2, 2, name="KIVI-K2V2"),
    "KIVI-K4V4": KIVIConfig(4, 4, name="KIVI-K4V4"),
    "KIVI-K2V2*": KIVIConfig(2, 2, sink=32, name="KIVI-K2V2*"),
    "KIVI-K2V4*": KIVIConfig(2, 4, sink=32, name="KIVI-K2V4*"),
    "KIVI-K4V2*": KIVIConfig(4, 2, sink=32, name="KIVI-K4V2*"),
}


class KeyCodec:
    """KIVI key pages: per-channel b-bit codes over the page's G tokens, packed along tokens."""

    config = KIVIConfig          # the configuration class of the caches that store these pages

    @staticmethod
    def empty_pool(cfg: KIVIConfig, P: int, H: int, D: int) -> dict:
        meta = np.dtype(nx.dtype_name(cfg.meta_dtype))
        return {"codes": np.zeros((P, H, D, cfg.group_size * cfg.k_bits // 8), np.uint8),
                "scale": np.zeros((P, H, D), meta), "mn": np.zeros((P, H, D), meta)}

    @staticmethod
    def encode(cfg: KIVIConfig, kpage: np.ndarray, page_index: int = 0) -> dict:
        """(B, H, G, D) fp16 keys -> page arrays (B, H, ...): quantize along tokens, pack along tokens."""
        codes, scale, mn = quantize(kpage, cfg.k_bits, cfg.group_size, axis=2, meta_dtype=cfg.meta_dtype)
        codes = np.ascontiguousarray(np.swapaxes(codes, 2, 3))                 # (B, H, D, G)
        return {"codes": pack(codes, cfg.k_bits, axis=-1), "scale": scale[:, :, 0], "mn": mn[:, :, 0]}

    @staticmethod
    def decode(cfg: KIVIConfig, page: dict) -> np.ndarray:
        """One page (arrays (H, ...)) -> fp32 keys (H, G, D)."""
        codes = unpack(page["codes"], cfg.k_bits, axis=-1)                     # (H, D, G)
        x = _dequantize(codes, page["scale"][..., None], page["mn"][..., None], cfg.group_size,
                        axis=-1, out_dtype=np.float32)
        return np.swapaxes(x, 1, 2)


def init(cfg: KIVIConfig, batch: int, kv_heads: int, head_dim: int, *, device=None) -> paged.PagedState:
    """An empty KIVI cache for ``batch`` sequences (see ``paged.PagedState`` for the arrays); the state
    records ``cfg``, and every later call must pass the same configuration. ``device``: None or "cpu"
    (the fast tiers' argument; NumPy arrays live on the host)."""
    return paged.init(cfg, KeyCodec, batch, kv_heads, head_dim, device=device)


register_layout(KIVIConfig, init)                   # what state.check_layout holds a hand-built state against


def append(cfg: KIVIConfig, state: paged.PagedState, k, v) -> paged.PagedState:
    """Append tokens (B, H_kv, T_new, D) to the cache (prefill or decode); see ``paged.append``."""
    return paged.append(cfg, KeyCodec, state, k, v)


def dequantize(cfg: KIVIConfig, state: paged.PagedState):
    """The (K, V) the cache represents, fp32 (B, H_kv, T, D), in token order."""
    return paged.dequantize_cache(cfg, KeyCodec, state)


def decode_attention(cfg: KIVIConfig, state: paged.PagedState, q, *, scale=None):
    """Attention of q (B, H_q, T_q, D) over the cache: ``(out, lse)``; see ``paged.decode_attention``."""
    return paged.decode_attention(cfg, KeyCodec, state, q, scale=scale)
