"""Kitty: 2-bit KV cache with a dynamic channel-wise INT4 boost of the keys (Kitty paper, sections 3-4).

Kitty is KIVI with FP16 sink tokens and, in every key page, the ``d_boost`` channels of largest mean
magnitude (eq. 2: ``s_i = mean_t |x_{t,i}|`` over the page's G tokens) quantized at 4 bits instead of 2.
Each key page is stored as two 2-bit tensors (section 4.1, Fig. 3a):

    low    (D, G)        every channel's low two bits (the whole code of a 2-bit channel)  -> packed (D, G/4)
    high   (D_boost, G)  the boosted channels' high two bits, compact, rows in channel order -> (D_boost, G/4)
    idx    (D,) uint8    channel -> its row in ``high``; unboosted channels hold the sentinel D_boost

The paper writes the index 1-based with sentinel D_boost + 1 and tests ``idx <= D_boost``; kvq uses
0-based rows, sentinel D_boost, and tests ``idx < D_boost``: the same map shifted by one. Metadata is
per channel per page (``scale``, ``mn``). Values are quantized per token over the whole head dim; the
token leaving the local window (R = 128) waits in a value Q-buffer, flushed one page at a time
(section 4.3). Algorithm 1 (page dequantization) is :func:`dequantize_page`.

    cfg = CONFIGS["Kitty"]                     # 12.5% boost; "Kitty-Pro": 25%
    st = init(cfg, 1, 8, 128); append(cfg, st, k, v); out, lse = decode_attention(cfg, st, q)
    mse = channel_sensitivity(q, k)            # Fig. 2b: (H_q, D) attention-score MSE per INT2 channel
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from . import checks
from . import metrics
from . import numerics as nx
from . import paged
from .attention import check_shapes
from .packing import pack, unpack
from .quant import dequantize as _dequantize
from .quant import quantize
from .state import check_int, check_real, check_str, register_layout

__all__ = ["KittyConfig", "CONFIGS", "init", "append", "dequantize", "decode_attention",
           "channel_scores", "select_boost", "encode_page", "dequantize_page", "channel_sensitivity"]

SELECTIONS = ("magnitude", "random")


@dataclass(frozen=True)
class KittyConfig(paged.PagedConfig):
    """A Kitty cache configuration.

    Attributes:
        boost_rate: fraction of key channels boosted to 4 bits per page and head (0.125 = Kitty,
            0.25 = Kitty-Pro); ``d_boost = round(boost_rate * D)``.
        selection: "magnitude" (eq. 2, the paper) or "random" (the ablation baseline, seeded by
            ``seed`` and the page's index in its sequence).
        group_size: G, the page size in tokens (default 128); residual: R, the value local window
            (default 128); sink: S FP16 initial tokens (default 32); v_bits: 2 (default) or 4.
    """

    boost_rate: float = 0.125
    selection: str = "magnitude"
    seed: int = 0
    group_size: int = 128
    residual: int = 128
    sink: int = 32
    v_bits: int = 2
    meta_dtype: str = "float16"
    max_tokens: int = 4096
    name: str = "Kitty"

    k_bits = 2                 # the dense plane; boosted channels add a 2-bit high plane
    v_group_size = None        # values: per token over the whole head dim
    v_qbuffer = True           # evicted values wait in a value Q-buffer (section 4.3)

    def __post_init__(self):
        check_real(self, "boost_rate", 0.0, 1.0)
        if not isinstance(self.selection, str) or self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r} is unknown; choose one of {SELECTIONS}")
        check_int(self, "seed", 0)                   # seeds np.random.default_rng([seed, page index])
        nx.check_bits(self.v_bits, (2, 4, 8), "v_bits")
        for n in ("group_size", "residual", "sink", "max_tokens"):
            v = getattr(self, n)
            positive = n in ("group_size", "max_tokens")
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < int(positive):
                raise ValueError(f"{n} must be a {'positive' if positive else 'non-negative'} int, got {v!r}")
        if self.group_size % 4:
            raise ValueError(f"group_size={self.group_size} must be a multiple of 4 (2-bit planes pack along tokens)")
        if nx.dtype_name(self.meta_dtype) not in nx.META_DTYPES:
            raise ValueError(f"meta_dtype={self.meta_dtype!r} is not supported; choose one of {nx.META_DTYPES}")
        check_str(self, "name")

    def d_boost(self, D: int) -> int:
        return int(round(float(self.boost_rate) * D))

    def v_group(self, D: int) -> int:
        return D

    def check_head_dim(self, D: int) -> None:
        if D % (8 // self.v_bits):
            raise ValueError(f"head_dim={D} is not a multiple of {8 // self.v_bits} ({self.v_bits}-bit value "
                             f"codes pack along channels)")
        if self.d_boost(D) > 255:
            raise ValueError(f"d_boost={self.d_boost(D)} does not fit the uint8 index (sentinel <= 255)")


CONFIGS = {
    "Kitty": KittyConfig(0.125, name="Kitty"),
    "Kitty-Pro": KittyConfig(0.25, name="Kitty-Pro"),
    "Kitty-random": KittyConfig(0.125, selection="random", name="Kitty-random"),
}


# ---------------------------------------------------------------------------------------------------
# one key page: ranking, selection, encoding (Fig. 3a), Algorithm 1


def channel_scores(kpage) -> np.ndarray:
    """Eq. 2: ``s_i = (1/G) sum_t |x_{t,i}|`` per channel, fp32, for keys (..., G, D) -> (..., D).

    The sum is an order-dependent reduction (NumPy sums pairwise); a fast tier may pick a different
    channel only where two scores tie to within rounding (contract rule 7).
    """
    x = nx.as_f32(kpage, "kpage")
    check_kpage_shape(x.shape)
    G = x.shape[-2]
    return nx.div(np.abs(x).sum(axis=-2, dtype=np.float32), np.float32(G))


def check_kpage_shape(shape, name: str = "kpage") -> None:
    """A key page (..., G, D): at least 2 dimensions and at least one token (shared with the fast tiers)."""
    shape = tuple(shape)
    if len(shape) < 2 or shape[-2] == 0:
        raise ValueError(f"{name} must be keys (..., G, D) with G >= 1 tokens; got shape {shape}")


def check_boost_args(d_boost, selection, rng, D: int) -> int:
    """The arguments of :func:`select_boost` other than the scores (shared with the fast tiers):
    ``d_boost`` an int in [0, D], ``selection`` one of ``SELECTIONS``, ``rng`` None or a NumPy
    ``Generator``. Returns ``d_boost`` as an int."""
    d_boost = checks.int_arg(d_boost, "d_boost", lo=0)
    if d_boost > D:
        raise ValueError(f"d_boost={d_boost} must lie in [0, D={D}]")
    if not isinstance(selection, str) or selection not in SELECTIONS:
        raise ValueError(f"selection={selection!r} is unknown; choose one of {SELECTIONS}")
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be None or a numpy.random.Generator (np.random.default_rng(seed)), "
                        f"got {type(rng).__name__}")
    return d_boost


def select_boost(scores, d_boost: int, selection: str = "magnitude", rng=None) -> np.ndarray:
    """Boolean mask (..., D) of the ``d_boost`` boosted channels: the largest scores (ties: lower
    channel first), or ``d_boost`` channels drawn at random with ``rng`` (``selection="random"``).

    ``scores`` (..., D) is a finite real floating array (NaN would sort as the largest score);
    ``rng`` None or a NumPy Generator. Raises TypeError / ValueError naming the argument.
    """
    scores = checks.real_array(scores, "scores", min_ndim=1, finite=True)
    D = scores.shape[-1]
    d_boost = check_boost_args(d_boost, selection, rng, D)
    if selection == "magnitude":
        order = np.argsort(-scores, axis=-1, kind="stable")
    elif selection == "random":
        rng = np.random.default_rng(0) if rng is None else rng
        order = np.argsort(rng.random(scores.shape), axis=-1, kind="stable")
    else:
        raise ValueError(f"selection={selection!r} is unknown; choose one of {SELECTIONS}")
    mask = np.zeros(scores.shape, bool)
    np.put_along_axis(mask, order[..., :d_boost], True, axis=-1)
    return mask


def encode_page(kpage, boost, meta_dtype="float16") -> dict:
    """Quantize one key page per channel (INT4 where ``boost``, else INT2) and split it (Fig. 3a).

    Args:
        kpage: (..., G, D) keys (fp16 / fp32). boost: (..., D) bool.
    Returns:
        dict of ``low`` (..., D, G/4) uint8, ``high`` (..., D_boost, G/4) uint8, ``idx`` (..., D) uint8,
        ``scale`` / ``mn`` (..., D) in ``meta_dtype``.
    """
    x = nx.as_f32(kpage, "kpage")
    check_kpage_shape(x.shape)
    G, D = x.shape[-2:]
    if boost is None:
        raise TypeError("boost must be a bool array (..., D), got None")
    boost = np.asarray(boost, bool)
    d_boost = int(boost.sum(axis=-1).max()) if boost.size else 0
    if boost.shape != x.shape[:-2] + (D,) or np.any(boost.sum(axis=-1) != d_boost):
        raise ValueError(f"boost must be (..., D={D}) with the same number of channels in every page")
    nx.check_finite(x, "kpage")
    c2, s2, m2 = quantize(x, 2, G, axis=-2, meta_dtype=meta_dtype)            # (..., G, D), (..., 1, D)
    c4, s4, m4 = quantize(x, 4, G, axis=-2, meta_dtype=meta_dtype)
    bt = boost[..., None, :]                                                   # (..., 1, D)
    low = np.where(bt, c4 & 3, c2).astype(np.uint8)                            # (..., G, D)
    rows = np.cumsum(boost, axis=-1) - 1                                       # row of each boosted channel
    idx = np.where(boost, rows, d_boost).astype(np.uint8)                      # (..., D)
    hi_all = np.swapaxes(c4 >> 2, -1, -2).astype(np.uint8)                     # (..., D, G)
    order = np.argsort(~boost, axis=-1, kind="stable")[..., :d_boost]          # boosted channels, ascending
    high = np.take_along_axis(hi_all, order[..., None], axis=-2)               # (..., D_boost, G)
    return {"low": pack(np.ascontiguousarray(np.swapaxes(low, -1, -2)), 2, axis=-1),
            "high": pack(np.ascontiguousarray(high), 2, axis=-1),
            "idx": idx,
            "scale": np.where(boost, s4[..., 0, :], s2[..., 0, :]),
            "mn": np.where(boost, m4[..., 0, :], m2[..., 0, :])}


PAGE_KEYS = ("low", "high", "idx", "scale", "mn")


def check_page(page) -> None:
    """A page of :func:`encode_page`: a dict holding ``PAGE_KEYS`` (shared with the fast tiers)."""
    if not isinstance(page, Mapping):
        raise TypeError(f"page must be a dict of {PAGE_KEYS} (as encode_page returns), got {type(page).__name__}")
    missing = [n for n in PAGE_KEYS if n not in page]
    if missing:
        raise ValueError(f"page lacks {missing}; a Kitty page holds {PAGE_KEYS} (as encode_page returns)")


def dequantize_page(page: dict, group_size: int) -> np.ndarray:
    """Algorithm 1: a key page back to fp32 keys (..., G, D).

    ``X_low = unpack(low)``; for channels with ``idx < D_boost`` (0-based; the paper's
    ``idx <= D_boost``) ``X_high = unpack(high)[idx]``; ``X = X_low | (X_high << 2)``;
    ``K = X * scale + mn`` (two rounded fp32 operations).
    """
    check_page(page)
    low = unpack(page["low"], 2, axis=-1)                                      # (..., D, G)
    high = unpack(page["high"], 2, axis=-1)                                    # (..., D_boost, G)
    idx = page["idx"].astype(np.int64)
    d_boost = high.shape[-2]
    boost = idx < d_boost                                                      # (..., D)
    if d_boost:
        x_high = np.take_along_axis(high, np.minimum(idx, d_boost - 1)[..., None], axis=-2)
        x_high = np.where(boost[..., None], x_high, 0).astype(np.uint8)
    else:
        x_high = np.zeros_like(low)
    codes = low | (x_high << 2)                                                # (..., D, G)
    x = _dequantize(codes, page["scale"][..., None], page["mn"][..., None], group_size, axis=-1,
                    out_dtype=np.float32)
    return np.swapaxes(x, -1, -2)


class KeyCodec:
    """Kitty key pages in the paged layout: ``low``, ``high``, ``idx``, ``scale``, ``mn`` per (page, head)."""

    config = KittyConfig         # the configuration class of the caches that store these pages

    @staticmethod
    def empty_pool(cfg: KittyConfig, P: int, H: int, D: int) -> dict:
        meta = np.dtype(nx.dtype_name(cfg.meta_dtype))
        G, Db = cfg.group_size, cfg.d_boost(D)
        return {"low": np.zeros((P, H, D, G // 4), np.uint8), "high": np.zeros((P, H, Db, G // 4), np.uint8),
                "idx": np.zeros((P, H, D), np.uint8), "scale": np.zeros((P, H, D), meta),
                "mn": np.zeros((P, H, D), meta)}

    @staticmethod
    def encode(cfg: KittyConfig, kpage: np.ndarray, page_index: int = 0) -> dict:
        D = kpage.shape[-1]
        rng = np.random.default_rng([cfg.seed, page_index]) if cfg.selection == "random" else None
        boost = select_boost(channel_scores(kpage), cfg.d_boost(D), cfg.selection, rng)
        return encode_page(kpage, boost, cfg.meta_dtype)

    @staticmethod
    def decode(cfg: KittyConfig, page: dict) -> np.ndarray:
        return dequantize_page(page, cfg.group_size)


def init(cfg: KittyConfig, batch: int, kv_heads: int, head_dim: int, *, device=None) -> paged.PagedState:
    """An empty Kitty cache (sink, key Q-buffer, value local window and Q-buffer, page pool); the state
    records ``cfg``, and every later call must pass the same configuration. ``device``: None or "cpu"."""
    return paged.init(cfg, KeyCodec, batch, kv_heads, head_dim, device=device)


register_layout(KittyConfig, init)                   # what state.check_layout holds a hand-built state against


def append(cfg: KittyConfig, state: paged.PagedState, k, v) -> paged.PagedState:
    """Step (1) and (3) of section 4.3: insert the tokens, quantize and pack every full Q-buffer."""
    return paged.append(cfg, KeyCodec, state, k, v)


def dequantize(cfg: KittyConfig, state: paged.PagedState):
    """The (K, V) the cache represents, fp32 (B, H_kv, T, D), in token order."""
    return paged.dequantize_cache(cfg, KeyCodec, state)


def decode_attention(cfg: KittyConfig, state: paged.PagedState, q, *, scale=None):
    """Step (2): attention of q (B, H_q, T_q, D) over the cache, ``(out, lse)`` merged over segments."""
    return paged.decode_attention(cfg, KeyCodec, state, q, scale=scale)


# ---------------------------------------------------------------------------------------------------
# Fig. 2b: channel sensitivity


def check_sensitivity_args(q_shape, k_shape, causal: bool) -> None:
    """The shape rules of :func:`channel_sensitivity`, shared by every tier: q (B, H_q, T_q, D) and
    k (B, H_kv, T, D) as attention takes them, at least one query row, and (causal) no query row
    without a key. An empty k is left to the quantizer, which names it. Raises ValueError."""
    q_shape, k_shape = tuple(q_shape), tuple(k_shape)
    check_shapes(q_shape, k_shape, k_shape)
    T_q, T = q_shape[2], k_shape[2]
    if T_q == 0:
        raise ValueError(f"q holds no query rows (shape {q_shape}); the score MSE would average over nothing")
    if causal and 0 < T < T_q:
        raise ValueError(f"query row 0 of batch 0 sees no key (causal: query 0 sits at position {T - T_q} "
                         f"with T_q={T_q}, T_k={T}); softmax over an empty set is undefined")


def channel_sensitivity(q, k, *, bits: int = 2, group_size=None, causal: bool = True, scale=None) -> np.ndarray:
    """Attention-score MSE when one key channel at a time is quantized (Kitty section 3.2, Fig. 2b).

    For each channel c, keys with only channel c quantized per channel (``bits``, groups of
    ``group_size`` tokens; None = all tokens) replace the keys in ``softmax(q k^T * scale)`` (eq. 1);
    the MSE against the unperturbed scores is taken per query head, over batch, queries and keys.

    Args:
        q: (B, H_q, T_q, D); k: (B, H_kv, T, D), H_q a multiple of H_kv (GQA).
    Returns:
        (H_q, D) float64: row h is query head h (Fig. 2b draws one series per query head of a group).
    Raises:
        TypeError on a dtype kvq does not take; ValueError on shapes attention refuses, no query rows,
        a causal query row without a key (T_q > T), NaN / inf, or what ``quant.quantize`` refuses.
    """
    k32 = nx.as_f32(k, "k")
    check_sensitivity_args(np.shape(q), k32.shape, bool(causal))
    nx.check_finite(k32, "k")
    B, H, T, D = k32.shape
    G = T if group_size is None else group_size
    codes, s, m = quantize(k32, bits, G, axis=2)
    k_q = _dequantize(codes, s, m, G, axis=2, out_dtype=np.float32)          # every channel quantized
    ref = metrics.attention_scores(q, k32, causal=causal, scale=scale)         # (B, H_q, T_q, T)
    out = np.zeros((ref.shape[1], D))
    for c in range(D):
        kc = k32.copy()
        kc[..., c] = k_q[..., c]
        pert = metrics.attention_scores(q, kc, causal=causal, scale=scale)
        out[:, c] = ((pert - ref) ** 2).mean(axis=(0, 2, 3))
    return out
