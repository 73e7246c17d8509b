"""Attention with GQA and masks; decode over cache segments; the log-sum-exp merge of flash-decoding.

Every method in kvq is judged by what it does to attention, and every fast decode kernel splits the
cache into segments (sink, quantized pages, FP16 recent / residual buffers) and merges their partial
results. This module is the ground truth for both: plain softmax attention (Vaswani et al., 2017,
eq. 1) with grouped-query heads (Ainslie et al., 2023, GQA), bottom-right aligned causal masks and
key padding; and the split-K decode of flash-decoding (Dao et al., 2023), where each segment returns
``(o, lse)`` and :func:`merge` combines them exactly.

    out = attention(q, k, v, causal=True)                  # q (B, H_q, T_q, D), k, v (B, H_kv, T_k, D)
    o, lse = decode_attention(q, [(k_sink, v_sink), (k_hat, v_hat), (k_recent, v_recent)])
    o, lse = merge([partial_attention(q, k1, v1), partial_attention(q, k2, v2)])

Arithmetic (numerics contract, rule 7: order-dependent reductions are outside bit-exactness):
float16 / float32 inputs compute in float32 and return float32; float64 inputs compute in float64
and return float64 (tests use float64 as the ground truth). Mixing float64 with lower precisions is
refused, so a float64 truth is never computed from rounded inputs by accident. The softmax is the
stable one: subtract the row max, exponentiate, sum; outputs are normalized at the end, as flash
attention does: ``o = (e @ v) / l``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["attention", "partial_attention", "merge", "decode_attention"]

_LOW = (np.float16, np.float32)


# ----------------------------------------------------------------------------------------------------
# validation helpers


def _compute_dtype(**arrays) -> type:
    """float32 for float16 / float32 inputs, float64 for float64 inputs; TypeError otherwise or on a mix."""
    kinds = {}
    for name, a in arrays.items():
        dt = a.dtype
        if dt == np.float64:
            kinds[name] = np.float64
        elif dt in _LOW:
            kinds[name] = np.float32
        else:
            raise TypeError(f"{name} has dtype {dt}; attention takes float16 / float32 (computed in "
                            f"float32) or float64 (computed in float64)")
    if len(set(kinds.values())) > 1:
        wide = [n for n, k in kinds.items() if k == np.float64]
        narrow = [n for n, k in kinds.items() if k == np.float32]
        raise TypeError(f"{', '.join(wide)} float64 but {', '.join(narrow)} float16/float32: convert all "
                        f"to float64 for a ground truth, or all to float32")
    return next(iter(kinds.values()))


def check_finite(a: np.ndarray, name: str) -> None:
    """Numerics rule 8: NaN / inf raise at the API boundary."""
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains non-finite values ({int(np.isnan(a).sum())} NaN, "
                         f"{int(np.isinf(a).sum())} inf)")


def pairs_arg(seq, name: str, pair: str) -> list:
    """``seq`` (a list, tuple or other iterable of ``pair`` pairs) as a list; None, a string, an array or
    a mapping raise TypeError naming ``name`` (they are no sequence of pairs)."""
    if seq is None or isinstance(seq, (str, bytes, dict, np.ndarray)) or not hasattr(seq, "__iter__"):
        raise TypeError(f"{name} must be a list of {pair} pairs, got {type(seq).__name__}")
    return list(seq)


def check_shapes(q_shape, k_shape, v_shape) -> None:
    """The shape rules of attention inputs, shared by every tier: q (B, H_q, T_q, D), k and v
    (B, H_kv, T_k, D), H_q a multiple of H_kv. Raises ValueError naming the mismatch."""
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    for name, shp in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shp) != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, H, T, D); got shape {shp}")
    if k_shape != v_shape:
        raise ValueError(f"k and v must have the same shape (B, H_kv, T_k, D); got {k_shape} and {v_shape}")
    B, H_q, _, D = q_shape
    if k_shape[0] != B:
        raise ValueError(f"batch sizes differ: q has B={B}, k and v have B={k_shape[0]}")
    if k_shape[3] != D:
        raise ValueError(f"head dims differ: q has D={D}, k and v have D={k_shape[3]}")
    H_kv = k_shape[1]
    if H_kv == 0 or H_q % H_kv:
        raise ValueError(f"GQA needs H_q to be a multiple of H_kv; got H_q={H_q}, H_kv={H_kv}")


def check_qkv(q, k, v):
    """Shapes (B, H_q, T_q, D) and (B, H_kv, T_k, D), H_q a multiple of H_kv; returns the arrays and dtype."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    check_shapes(q.shape, k.shape, v.shape)
    dtype = _compute_dtype(q=q, k=k, v=v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        check_finite(a, name)
    return q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False), dtype


def resolve_scale(scale, D: int, dtype) -> np.floating:
    """Default 1/sqrt(D), computed in float64 and rounded once to the compute dtype (what kernels get
    when handed a Python float ``sm_scale``)."""
    if scale is None:
        if D == 0:
            raise ValueError("head dim D is 0; give scale explicitly")
        return dtype(1.0 / math.sqrt(D))
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return dtype(scale)


# ----------------------------------------------------------------------------------------------------
# the pieces: scores, visibility, softmax


def scaled_scores(q, k, scale) -> np.ndarray:
    """Scaled scores ``s = (q @ k^T) * scale``, (B, H_q, T_q, T_k), one GQA group at a time.

    GQA: the H_q query heads form H_kv groups of ``g = H_q // H_kv`` consecutive heads; query head h
    reads kv head ``h // g`` (the same as repeating every kv head g times, without the copy).
    """
    B, H_q, T_q, _ = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    g = H_q // H_kv
    s = np.empty((B, H_q, T_q, T_k), dtype=q.dtype)
    for j in range(H_kv):                                   # kv head j serves query heads j*g .. j*g+g-1
        q_grp = q[:, j * g:(j + 1) * g]                     # (B, g, T_q, D)
        k_j = k[:, j:j + 1]                                 # (B, 1, T_k, D), broadcast over the group
        s[:, j * g:(j + 1) * g] = np.matmul(q_grp, np.swapaxes(k_j, -1, -2)) * scale
    return s


def _weighted_values(e, v) -> np.ndarray:
    """``e @ v`` per GQA group: (B, H_q, T_q, T_k) weights times (B, H_kv, T_k, D) -> (B, H_q, T_q, D)."""
    B, H_q, T_q, _ = e.shape
    H_kv, D = v.shape[1], v.shape[3]
    g = H_q // H_kv
    out = np.empty((B, H_q, T_q, D), dtype=e.dtype)
    for j in range(H_kv):
        out[:, j * g:(j + 1) * g] = np.matmul(e[:, j * g:(j + 1) * g], v[:, j:j + 1])
    return out


def visible_keys(B: int, T_q: int, T_k: int, causal: bool, key_padding_mask) -> np.ndarray | None:
    """Which keys each query row sees, (B, 1, T_q, T_k) bool, or None when every key is visible.

    Causal is bottom-right aligned: query i sits at absolute position ``T_k - T_q + i`` and sees the
    keys at positions ``<=`` that. Raises if some query row sees no key at all.
    """
    if not causal and key_padding_mask is None:
        return None
    vis = np.ones((B, 1, T_q, T_k), dtype=bool)
    if causal:
        pos_q = T_k - T_q + np.arange(T_q)                  # (T_q,) absolute positions of the queries
        vis &= (np.arange(T_k)[None, :] <= pos_q[:, None])  # (T_q, T_k)
    if key_padding_mask is not None:
        m = np.asarray(key_padding_mask)
        if m.dtype != np.bool_:
            raise TypeError(f"key_padding_mask must be a bool array (True = key visible); "
                            f"got dtype {m.dtype}")
        if m.shape != (B, T_k):
            raise ValueError(f"key_padding_mask has shape {m.shape}; expected (B, T_k) = {(B, T_k)}")
        vis &= m[:, None, None, :]
    empty = ~vis.any(axis=-1)                               # (B, 1, T_q)
    if empty.any():
        b, _, i = (int(x) for x in np.argwhere(empty)[0])
        why = []
        if causal:
            why.append(f"causal: query {i} sits at position {T_k - T_q + i} with T_q={T_q}, T_k={T_k}")
        if key_padding_mask is not None:
            why.append(f"key_padding_mask[{b}] shows {int(np.asarray(key_padding_mask)[b].sum())} of "
                       f"{T_k} keys")
        if not why:
            why.append(f"T_k={T_k}")
        raise ValueError(f"query row {i} of batch {b} sees no key ({'; '.join(why)}); "
                         f"softmax over an empty set is undefined")
    return vis


def softmax_parts(s, visible):
    """Stable softmax pieces of scores s (..., T_k): ``e = exp(s - m)`` (0 where hidden), row max m,
    row sum l. The probabilities are ``e / l``; the log-sum-exp is ``m + log(l)``. Every row must see
    at least one key (checked by :func:`visible_keys`)."""
    if visible is not None:
        s = np.where(visible, s, s.dtype.type(-np.inf))
    m = s.max(axis=-1, keepdims=True)                       # (..., 1), finite
    e = np.exp(s - m)                                       # hidden keys: exp(-inf) = 0
    l = e.sum(axis=-1, keepdims=True)                       # (..., 1), >= 1
    return e, m, l


# ----------------------------------------------------------------------------------------------------
# public API


def attention(q, k, v, *, causal: bool = False, key_padding_mask=None, scale=None) -> np.ndarray:
    """Softmax attention ``softmax(q k^T * scale + mask) v`` with GQA.

    Args:
        q: (B, H_q, T_q, D) queries.
        k, v: (B, H_kv, T_k, D) keys and values; H_q must be a multiple of H_kv and query head h
            uses kv head ``h // (H_q // H_kv)``.
        causal: bottom-right aligned causal mask (query i at position ``T_k - T_q + i`` sees keys at
            positions <= that): T_q == T_k is causal prefill, T_q == 1 sees every key.
        key_padding_mask: optional bool (B, T_k), True = the key is visible.
        scale: score scale, default ``1 / sqrt(D)``.
    Returns:
        (B, H_q, T_q, D): float32 for float16 / float32 inputs, float64 for float64 inputs.
    Raises:
        TypeError on other dtypes or a float64 / float32 mix; ValueError on bad shapes, non-finite
        input, or a query row that sees no key (naming the row).
    """
    q, k, v, dtype = check_qkv(q, k, v)
    B, _, T_q, D = q.shape
    T_k = k.shape[2]
    sc = resolve_scale(scale, D, dtype)
    visible = visible_keys(B, T_q, T_k, bool(causal), key_padding_mask) # (B, 1, T_q, T_k) or None
    if T_q == 0:
        return np.zeros(q.shape, dtype)
    if T_k == 0:
        raise ValueError(f"k and v hold no keys (T_k=0): every one of the {T_q} query rows sees no key")
    s = scaled_scores(q, k, sc)                             # (B, H_q, T_q, T_k)
    e, _, l = softmax_parts(s, visible)
    return _weighted_values(e, v) / l                       # (B, H_q, T_q, D)


def partial_attention(q, k, v, *, scale=None):
    """Attention of q over one cache segment in which every key is visible (decode), with its lse.

    Returns:
        ``(o, lse)``: o (B, H_q, T_q, D) the softmax-normalized output over this segment; lse
        (B, H_q, T_q) = ``log(sum_j exp(s_j))`` of the scaled scores (natural log). An empty segment
        (T_k == 0) gives o = 0 and lse = -inf, which :func:`merge` ignores.
    """
    q, k, v, dtype = check_qkv(q, k, v)
    B, H_q, T_q, D = q.shape
    sc = resolve_scale(scale, D, dtype)
    if k.shape[2] == 0:
        return np.zeros((B, H_q, T_q, D), dtype), np.full((B, H_q, T_q), -np.inf, dtype)
    s = scaled_scores(q, k, sc)                             # (B, H_q, T_q, T_k)
    e, m, l = softmax_parts(s, None)
    o = _weighted_values(e, v) / l                          # (B, H_q, T_q, D)
    lse = (m + np.log(l))[..., 0]                           # (B, H_q, T_q)
    return o, lse


def merge(partials):
    """Combine partial results ``(o_i, lse_i)`` over disjoint key segments, as flash-decoding does.

    ``m = max_i lse_i``; ``w_i = exp(lse_i - m)``; ``o = sum_i w_i o_i / sum_i w_i``;
    ``lse = m + log(sum_i w_i)``. Segments with lse = -inf contribute nothing; where every segment
    is -inf the result is o = 0, lse = -inf. The segments are summed in the order given.

    Args:
        partials: a non-empty sequence of ``(o, lse)``, o (..., D) and lse = o.shape[:-1], all alike.
    Returns:
        ``(o, lse)`` in the compute dtype (float32, or float64 for float64 inputs).
    """
    partials = pairs_arg(partials, "partials", "(o, lse)")
    if not partials:
        raise ValueError("merge needs at least one (o, lse) partial; got an empty sequence")
    os_, lses = [], []
    for i, p in enumerate(partials):
        if not isinstance(p, (tuple, list)) or len(p) != 2:
            raise ValueError(f"partial {i} must be a pair (o, lse); got {type(p).__name__}")
        o, lse = np.asarray(p[0]), np.asarray(p[1])
        if o.ndim < 1 or lse.shape != o.shape[:-1]:
            raise ValueError(f"partial {i}: lse has shape {lse.shape} but o has shape {o.shape}; "
                             f"lse must be o.shape[:-1]")
        if os_ and o.shape != os_[0].shape:
            raise ValueError(f"partial {i}: o has shape {o.shape}, partial 0 has {os_[0].shape}")
        if np.any(np.isnan(lse)) or np.any(lse == np.inf):
            raise ValueError(f"partial {i}: lse contains NaN or +inf")
        check_finite(o, f"partial {i} o")
        os_.append(o)
        lses.append(lse)
    dtype = _compute_dtype(**{f"partial {i}": a for i, a in enumerate(os_ + lses)})
    os_ = [o.astype(dtype, copy=False) for o in os_]
    lses = [lse.astype(dtype, copy=False) for lse in lses]

    m = lses[0]
    for lse in lses[1:]:
        m = np.maximum(m, lse)                              # (...,) running max of the lse
    m_safe = np.where(np.isfinite(m), m, dtype(0))          # rows where all are -inf: weights all 0
    num = np.zeros(os_[0].shape, dtype)                     # (..., D)
    den = np.zeros(m.shape, dtype)                          # (...,)
    for o, lse in zip(os_, lses):
        w = np.exp(lse - m_safe)                            # 0 for an empty segment
        num = num + w[..., None] * o
        den = den + w
    empty = den == 0
    den_safe = np.where(empty, dtype(1), den)
    o = np.where(empty[..., None], dtype(0), num / den_safe[..., None])
    lse = np.where(empty, dtype(-np.inf), m_safe + np.log(den_safe))
    return o, lse


def decode_attention(q, segments, *, scale=None):
    """Attention of q over a cache split into segments: :func:`partial_attention` on each, then :func:`merge`.

    Args:
        q: (B, H_q, T_q, D).
        segments: non-empty list of ``(k, v)`` pairs, each (B, H_kv, T_i, D) (T_i may be 0).
    Returns:
        ``(o, lse)`` over the concatenation of all segments; every key is visible.
    """
    segments = pairs_arg(segments, "segments", "(k, v)")
    if not segments:
        raise ValueError("decode_attention needs at least one (k, v) segment; got an empty list")
    partials = []
    for i, seg in enumerate(segments):
        if not isinstance(seg, (tuple, list)) or len(seg) != 2:
            raise ValueError(f"segment {i} must be a pair (k, v); got {type(seg).__name__}")
        try:
            partials.append(partial_attention(q, seg[0], seg[1], scale=scale))
        except (ValueError, TypeError) as err:
            raise type(err)(f"segment {i}: {err}") from err
    return merge(partials)
