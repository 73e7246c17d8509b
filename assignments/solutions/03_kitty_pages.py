"""Reference solution of assignment 3 (Kitty key pages), written with NumPy only.

    boost = select_boost(channel_scores(kpage), 4); page = encode_page(kpage, boost)
    k_hat = dequantize_page(page, kpage.shape[-2])
"""

import numpy as np

F32 = np.float32


def _as_f32(x):
    x = np.asarray(x)
    if x.dtype not in (np.float16, np.float32):
        raise TypeError(f"kpage has dtype {x.dtype}; expected float16 or float32")
    return x.astype(F32)


def channel_scores(kpage):
    """Eq. 2: mean absolute value of each channel over the page's tokens, fp32 (..., D)."""
    x = _as_f32(kpage)
    return np.abs(x).sum(axis=-2, dtype=F32) / F32(x.shape[-2])


def select_boost(scores, d_boost):
    """The ``d_boost`` largest scores per row (stable sort: the lower channel wins a tie)."""
    scores = np.asarray(scores)
    D = scores.shape[-1]
    if not 0 <= d_boost <= D:
        raise ValueError(f"d_boost={d_boost} must lie in [0, {D}]")
    mask = np.zeros(scores.shape, bool)
    flat_s, flat_m = scores.reshape(-1, D), mask.reshape(-1, D)
    for r in range(flat_s.shape[0]):
        order = sorted(range(D), key=lambda c: (-float(flat_s[r, c]), c))
        flat_m[r, order[:d_boost]] = True
    return mask


def _quant_channels(x, bits):
    """Per-channel quantization over tokens: x (..., G, D) fp32 -> codes (..., D, G), scale, mn (..., D) fp16."""
    qmax = F32(2 ** bits - 1)
    mn = x.min(axis=-2) + F32(0)
    scale = (x.max(axis=-2) - mn) / qmax + F32(0)
    scale_h, mn_h = scale.astype(np.float16), mn.astype(np.float16)
    s, m = scale_h.astype(F32)[..., None, :], mn_h.astype(F32)[..., None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = (x - m) / s
    codes = np.where(s == 0, F32(0), np.rint(np.clip(y, F32(0), qmax))).astype(np.uint8)
    return np.swapaxes(codes, -1, -2), scale_h, mn_h


def _pack2(c):
    """2-bit codes (..., G) -> bytes (..., G/4), first code in the low bits."""
    out = np.zeros(c.shape[:-1] + (c.shape[-1] // 4,), np.uint8)
    for i in range(4):
        out |= (c[..., i::4] << (2 * i)).astype(np.uint8)
    return out


def _unpack2(p):
    out = np.empty(p.shape[:-1] + (4 * p.shape[-1],), np.uint8)
    for i in range(4):
        out[..., i::4] = (p >> (2 * i)) & 3
    return out


def encode_page(kpage, boost):
    """Fig. 3a: the dense low plane, the compact high plane of boosted channels, the index, metadata."""
    x = _as_f32(kpage)                                           # (..., G, D)
    G, D = x.shape[-2:]
    lead = x.shape[:-2]
    boost = np.asarray(boost, bool)
    if boost.shape != lead + (D,):
        raise ValueError(f"boost has shape {boost.shape}; expected {lead + (D,)}")
    counts = boost.sum(axis=-1)
    d_boost = int(counts.max()) if counts.size else 0
    if np.any(counts != d_boost):
        raise ValueError("every page must boost the same number of channels")
    c2, s2, m2 = _quant_channels(x, 2)                           # (..., D, G), (..., D)
    c4, s4, m4 = _quant_channels(x, 4)
    low = np.where(boost[..., None], c4 & 3, c2)                 # (..., D, G)
    high = np.zeros(lead + (d_boost, G), np.uint8)               # (..., D_boost, G)
    idx = np.full(lead + (D,), d_boost, np.uint8)                # (..., D)
    for pos in np.ndindex(*lead):
        channels = np.flatnonzero(boost[pos])                    # ascending
        high[pos] = c4[pos][channels] >> 2
        idx[pos][channels] = np.arange(d_boost)
    return {"low": _pack2(low), "high": _pack2(high), "idx": idx,
            "scale": np.where(boost, s4, s2), "mn": np.where(boost, m4, m2)}


def dequantize_page(page, group_size):
    """Algorithm 1: X = X_low | X_high << 2 for boosted channels; K = X * scale + mn (fp32)."""
    low = _unpack2(np.asarray(page["low"]))                      # (..., D, G)
    high = _unpack2(np.asarray(page["high"]))                    # (..., D_boost, G)
    if low.shape[-1] != group_size:
        raise ValueError(f"the page holds {low.shape[-1]} tokens, not group_size={group_size}")
    idx = np.asarray(page["idx"])
    d_boost = high.shape[-2]
    codes = low.copy()
    for pos in np.ndindex(*idx.shape[:-1]):
        for c in np.flatnonzero(idx[pos] < d_boost):
            codes[pos + (c,)] |= high[pos + (int(idx[pos + (c,)]),)] << 2
    s = np.asarray(page["scale"]).astype(F32)[..., None]         # (..., D, 1)
    m = np.asarray(page["mn"]).astype(F32)[..., None]
    k = codes.astype(F32) * s                                    # one rounded multiply ...
    k = k + m                                                    # ... then one rounded add
    return np.swapaxes(k, -1, -2)                                # (..., G, D)
