"""Bits per element and cache bytes of a KV-cache format; the batch that fits a memory budget.

The KV cache of a transformer holds, per layer, a key and a value vector of ``head_dim`` numbers for
every KV head and every token: ``2 * layers * kv_heads * head_dim * tokens * batch`` numbers. A
format decides how many bits each number costs. This module implements the accounting the papers use
(OSCAR, Table 1 at 32K context and Table 2 at 128K; KIVI section 3; Kitty section 4) and a stricter
one that also counts the buffers they leave out.

    bits_per_element(FORMATS["OSCAR"], 32768)                       # 2.3843..., OSCAR Table 1: 2.38
    cache_bytes(FORMATS["FP16"], layers=80, kv_heads=8, head_dim=128, tokens=131072)  # 40 GiB
    max_batch(FORMATS["Kitty"], 80 * 2**30, 80, 8, 128, 131072)     # sequences that fit in 80 GiB

Two accountings, per K or V stream of ``T`` tokens (per head and channel):

* ``"paper"``: ``n_fp = min(sink + recent, T)`` tokens cost ``fp_bits``; the other ``T - n_fp`` cost
  the quantized bits ``q`` (payload plus ``n_meta * meta_bits / group_size`` of metadata; for keys a
  fraction ``k_boost_rate`` of channels pays ``boost_bits`` instead of ``k_bits``). With
  ``f = n_fp / T`` this is ``bpe = (1 - f) * q + f * fp_bits``.
* ``"full"``: also the FP16 buffers the papers do not count (``residual_k`` / ``residual_v`` tokens:
  KIVI's key Q-buffer of up to G tokens and value window R, Kitty's key Q-buffer and value local
  window plus Q-buffer), index bits (Kitty's uint8 dense->sparse index, per key channel per page),
  and the quantized tokens rounded up to whole pages of ``group_size`` tokens (a paged allocator
  hands out whole pages). Buffers are counted at capacity (capped by the tokens there are), so this
  is an upper bound on what the cache holds, and never less than the paper's number.

All arithmetic is exact (``fractions.Fraction``); byte counts round up to whole bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

ACCOUNTINGS = ("paper", "full")


def _check_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_accounting(accounting: str) -> str:
    if not isinstance(accounting, str) or accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting={accounting!r} is unknown; choose one of {ACCOUNTINGS}")
    return accounting


def _check_fmt(fmt) -> None:
    """``fmt`` must be a :class:`CacheFormat` (e.g. ``FORMATS["OSCAR"]``): TypeError otherwise."""
    if not isinstance(fmt, CacheFormat):
        raise TypeError(f"fmt must be a CacheFormat (e.g. FORMATS['OSCAR']), got {type(fmt).__name__}"
                        + (f" {fmt!r}; a format by name is FORMATS[{fmt!r}]" if isinstance(fmt, str) else ""))


@dataclass(frozen=True)
class CacheFormat:
    """How a KV cache stores its numbers (all sizes in bits or tokens).

    Attributes:
        name: label, e.g. "KIVI-KV2".
        k_bits, v_bits: payload bits of a quantized key / value element (16 = not quantized).
        group_size: G, elements per quantization group = tokens per page.
        meta_bits, n_meta: bits of one metadata number and numbers per group (scale + zero = 2).
        sink: initial tokens kept in FP16 (attention sinks), counted by the paper.
        recent: most recent tokens kept in FP16, counted by the paper (OSCAR's window).
        k_boost_rate, boost_bits: fraction of key channels stored at ``boost_bits`` (Kitty).
        residual_k, residual_v: FP16 buffers the paper does not count ("full" accounting only).
        index_bits: bits per key channel per page for an index ("full" only; Kitty: 8).
        fp_bits: bits of an unquantized element (16).
    """

    name: str
    k_bits: int = 16
    v_bits: int = 16
    group_size: int = 128
    meta_bits: int = 16
    n_meta: int = 2
    sink: int = 0
    recent: int = 0
    k_boost_rate: float = 0.0
    boost_bits: int = 4
    residual_k: int = 0
    residual_v: int = 0
    index_bits: int = 0
    fp_bits: int = 16

    def __post_init__(self):
        for f in ("k_bits", "v_bits", "group_size", "boost_bits", "fp_bits"):
            _check_int(f, getattr(self, f), 1)
        for f in ("meta_bits", "n_meta", "sink", "recent", "residual_k", "residual_v", "index_bits"):
            _check_int(f, getattr(self, f), 0)
        r = self.k_boost_rate
        if isinstance(r, bool) or not isinstance(r, (int, float, np.integer, np.floating)) or not 0 <= r <= 1:
            raise ValueError(f"k_boost_rate must be a fraction in [0, 1], got {r!r}")


def quantized_bits(fmt: CacheFormat, accounting: str = "paper") -> tuple[Fraction, Fraction]:
    """Bits of one quantized key element and one quantized value element, metadata included.

    Keys: ``(1 - r) * k_bits + r * boost_bits + n_meta * meta_bits / G`` (+ ``index_bits / G`` in the
    "full" accounting). Values: ``v_bits + n_meta * meta_bits / G``. Kitty: keys 2 + 0.125 * 2 + 0.25.
    """
    _check_fmt(fmt)
    _check_accounting(accounting)
    G = fmt.group_size
    r = Fraction(str(fmt.k_boost_rate))                     # 0.125 -> 1/8 exactly
    meta = Fraction(fmt.n_meta * fmt.meta_bits, G)
    q_k = (1 - r) * fmt.k_bits + r * fmt.boost_bits + meta
    if accounting == "full":
        q_k += Fraction(fmt.index_bits, G)
    q_v = fmt.v_bits + meta
    return q_k, q_v


def _stream_bits(q: Fraction, fp_tokens: int, tokens: int, fmt: CacheFormat, accounting: str) -> Fraction:
    """Bits of one K or V stream (one head, one channel) over ``tokens`` tokens."""
    n_fp = min(fp_tokens, tokens)                           # tokens held in FP16
    n_q = tokens - n_fp                                     # quantized tokens
    if accounting == "full":
        n_q = math.ceil(n_q / fmt.group_size) * fmt.group_size   # whole pages
    return n_fp * fmt.fp_bits + n_q * q


def _bits_per_token_channel(fmt: CacheFormat, tokens: int, accounting: str) -> Fraction:
    """K plus V bits of one head-channel over ``tokens`` tokens."""
    q_k, q_v = quantized_bits(fmt, accounting)
    fp = fmt.sink + fmt.recent
    fp_k = fp + (fmt.residual_k if accounting == "full" else 0)
    fp_v = fp + (fmt.residual_v if accounting == "full" else 0)
    return (_stream_bits(q_k, fp_k, tokens, fmt, accounting)
            + _stream_bits(q_v, fp_v, tokens, fmt, accounting))


def bits_per_element(fmt: CacheFormat, context: int, accounting: str = "paper") -> float:
    """Average bits per cached number, over K and V, at a context of ``context`` tokens.

    ``accounting="paper"`` reproduces the papers' tables (e.g. OSCAR Table 1 at 32K: KIVI-KV2 2.25,
    KIVI-KV2* 2.26, Kitty 2.39, OSCAR 2.38); ``"full"`` adds residual buffers, index bits and the
    partially filled last page.
    """
    _check_fmt(fmt)
    _check_accounting(accounting)
    context = _check_int("context", context, 1)
    return float(_bits_per_token_channel(fmt, context, accounting) / (2 * context))


def cache_bytes(fmt: CacheFormat, layers: int, kv_heads: int, head_dim: int, tokens: int, batch: int = 1,
                accounting: str = "full") -> int:
    """Bytes of the KV cache: ``bits(K + V per head-channel) * head_dim * kv_heads * layers * batch / 8``,
    rounded up. FP16: ``2 * layers * kv_heads * head_dim * tokens * batch * 2`` bytes."""
    _check_fmt(fmt)
    _check_accounting(accounting)
    layers = _check_int("layers", layers, 1)
    kv_heads = _check_int("kv_heads", kv_heads, 1)
    head_dim = _check_int("head_dim", head_dim, 1)
    tokens = _check_int("tokens", tokens, 0)
    batch = _check_int("batch", batch, 0)
    bits = _bits_per_token_channel(fmt, tokens, accounting) * head_dim * kv_heads * layers * batch
    return math.ceil(bits / 8)


def max_batch(fmt: CacheFormat, budget_bytes, layers: int, kv_heads: int, head_dim: int, tokens: int,
              accounting: str = "full") -> int:
    """The largest batch whose cache of ``tokens`` tokens per sequence fits in ``budget_bytes``.

    Consistent with :func:`cache_bytes`: ``cache_bytes(..., batch=b) <= budget_bytes`` exactly for
    ``b <= max_batch(...)``.
    """
    _check_fmt(fmt)
    _check_accounting(accounting)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float, np.integer, np.floating)):
        raise TypeError(f"budget_bytes must be a number, got {budget_bytes!r}")
    if not math.isfinite(budget_bytes) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be finite and >= 0, got {budget_bytes!r}")
    tokens = _check_int("tokens", tokens, 1)
    layers = _check_int("layers", layers, 1)
    kv_heads = _check_int("kv_heads", kv_heads, 1)
    head_dim = _check_int("head_dim", head_dim, 1)
    per_seq_bits = _bits_per_token_channel(fmt, tokens, accounting) * head_dim * kv_heads * layers
    budget = math.floor(Fraction(budget_bytes))             # whole bytes
    return math.floor(budget * 8 / per_seq_bits)


#: The formats compared in OSCAR Tables 1-2 and the Kitty paper (sizes per their defaults).
FORMATS: dict[str, CacheFormat] = {f.name: f for f in (
    # No quantization: no metadata, and one "page" per token so that nothing is rounded up.
    CacheFormat("FP16", k_bits=16, v_bits=16, group_size=1, n_meta=0),
    # KIVI (Liu et al., 2024): per-channel keys, per-token values, G = 128; FP16 key Q-buffer of up
    # to G tokens and value window R = 128, not counted by the paper.
    CacheFormat("KIVI-KV2", k_bits=2, v_bits=2, residual_k=128, residual_v=128),
    CacheFormat("KIVI-KV2*", k_bits=2, v_bits=2, sink=32, residual_k=128, residual_v=128),
    CacheFormat("KIVI-KV4", k_bits=4, v_bits=4, residual_k=128, residual_v=128),
    # Kitty (Xia et al., 2025): 2-bit with a fraction of key channels boosted to 4 bits, 32 FP16 sink
    # tokens; key Q-buffer (one page), value local window (one page) + Q-buffer (one page); a uint8
    # dense->sparse index per key channel per page.
    CacheFormat("Kitty", k_bits=2, v_bits=2, k_boost_rate=0.125, boost_bits=4, sink=32,
                residual_k=128, residual_v=256, index_bits=8),
    CacheFormat("Kitty-Pro", k_bits=2, v_bits=2, k_boost_rate=0.25, boost_bits=4, sink=32,
                residual_k=128, residual_v=256, index_bits=8),
    # OSCAR: 2-bit keys and values, 64 FP16 sink tokens and 256 FP16 recent tokens.
    CacheFormat("OSCAR", k_bits=2, v_bits=2, sink=64, recent=256),
)}
