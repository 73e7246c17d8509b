"""Reference solution of assignment 2 (quantization granularity), written with NumPy only.

    k_c = quantize_per_channel(k, 2, 32); k_t = quantize_per_token(k, 2, 32); errors(k, 2, 32)
"""

import numpy as np

F32 = np.float32


def _fake_quant(k, bits, group, axis):
    """Quantize ``k`` in groups of ``group`` along ``axis`` and dequantize (the numerics contract)."""
    k = np.asarray(k)
    if k.dtype not in (np.float16, np.float32):
        raise TypeError(f"k has dtype {k.dtype}; expected float16 or float32")
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits={bits!r} is not supported")
    x = np.moveaxis(k.astype(F32), axis, -1)                    # (..., n), quantized axis last
    n = x.shape[-1]
    if group <= 0 or n % group:
        raise ValueError(f"group={group} does not divide {n}")
    if not np.all(np.isfinite(x)):
        raise ValueError("k contains NaN or inf")
    g = x.reshape(x.shape[:-1] + (n // group, group))            # (..., groups, group)
    qmax = F32(2 ** bits - 1)
    mn = g.min(axis=-1, keepdims=True) + F32(0)                  # -0.0 -> +0.0
    mx = g.max(axis=-1, keepdims=True)
    scale = (mx - mn) / qmax + F32(0)
    with np.errstate(over="ignore"):
        scale_s = scale.astype(np.float16).astype(F32)           # stored metadata, back in fp32
        mn_s = mn.astype(np.float16).astype(F32)
    if not (np.all(np.isfinite(scale_s)) and np.all(np.isfinite(mn_s))):
        raise ValueError("scale or min overflows float16")
    with np.errstate(divide="ignore", invalid="ignore"):
        y = (g - mn_s) / scale_s
    codes = np.where(scale_s == 0, F32(0), np.rint(np.clip(y, F32(0), qmax)))
    k_hat = codes.astype(F32) * scale_s                          # one rounded multiply ...
    k_hat = k_hat + mn_s                                         # ... then one rounded add
    return np.ascontiguousarray(np.moveaxis(k_hat.reshape(x.shape), -1, axis))


def quantize_per_channel(k, bits, group):
    """Groups of ``group`` tokens of one channel (axis 2); returns float32 dequantized keys."""
    return _fake_quant(k, bits, group, axis=2)


def quantize_per_token(k, bits, group):
    """Groups of ``group`` channels of one token (axis 3); returns float32 dequantized keys."""
    return _fake_quant(k, bits, group, axis=3)


def _rel_mse(k, k_hat):
    k = np.asarray(k, np.float64)
    return float(np.sum((k - np.asarray(k_hat, np.float64)) ** 2) / np.sum(k * k))


def errors(k, bits, group):
    """Relative MSE of both schemes: ``{"per_channel": ..., "per_token": ...}``."""
    return {"per_channel": _rel_mse(k, quantize_per_channel(k, bits, group)),
            "per_token": _rel_mse(k, quantize_per_token(k, bits, group))}
