"""Assignment 2: per-channel vs per-token key quantization (see README.md beside this file).

    k_c = quantize_per_channel(k, bits=2, group=32)   # k: (B, H, T, D) -> dequantized, float32
    k_t = quantize_per_token(k, bits=2, group=32)
    errors(k, 2, 32)                                  # {"per_channel": ..., "per_token": ...}

Use NumPy only. All quantization math in float32; metadata (scale, min) rounded to float16.
"""

# import numpy as np    (uncomment: you will need it)


def quantize_per_channel(k, bits, group):
    """Quantize keys per channel and return the dequantized keys.

    Each group is ``group`` consecutive tokens (axis 2) of one channel of one head: asymmetric min-max
    quantization under the numerics contract (fp32 math, fp16 scale and min, round half to even,
    dequantization as a multiply then an add, both rounded in fp32).

    Args:
        k: (B, H, T, D) float16 or float32 keys.
        bits: 2, 3, 4 or 8.
        group: tokens per group; divides T.
    Returns:
        (B, H, T, D) float32: ``float32(code) * scale_s + mn_s``.
    """
    raise NotImplementedError


def quantize_per_token(k, bits, group):
    """Quantize keys per token and return the dequantized keys.

    Each group is ``group`` consecutive channels (axis 3) of one token of one head; otherwise exactly
    as :func:`quantize_per_channel`.

    Args:
        k: (B, H, T, D) float16 or float32 keys.
        bits: 2, 3, 4 or 8.
        group: channels per group; divides D.
    Returns:
        (B, H, T, D) float32.
    """
    raise NotImplementedError


def errors(k, bits, group):
    """Relative MSE ``||k - k_hat||^2 / ||k||^2`` (in float64) of both schemes.

    Returns:
        ``{"per_channel": float, "per_token": float}``.
    """
    raise NotImplementedError
