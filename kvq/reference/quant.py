"""Affine (min-max) quantization in groups along an axis; symmetric variant; percentile clipping.

Implements the quantizer shared by every method in kvq: KIVI (per-channel keys = groups of G tokens
along the token axis; per-token values = groups of G channels along the channel axis), Kitty, OSCAR
(App. A.5: per-token percentile clip, then per-token-group asymmetric INT2) and the uniform backbone
of AQUA-KV. The arithmetic is the numerics contract (``numerics.py``, DESIGN.md section 2).

    codes, scale, mn = quantize(k, bits=2, group_size=128, axis=2)      # k: (B, H_kv, T, D), per-channel
    k_hat = dequantize(codes, scale, mn, group_size=128, axis=2, out_dtype=np.float16)
    v_clip, tau = percentile_clip(v, ratio=0.92, axis=-1)                 # OSCAR's per-token clip

Shapes: ``x`` has any shape; ``codes`` has the shape of ``x`` (uint8, one code per element);
``scale`` and ``mn`` have the shape of ``x`` with ``shape[axis]`` replaced by ``shape[axis] // group_size``.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import numerics as nx

F32 = nx.F32

__all__ = ["quantize", "dequantize", "quantile", "percentile_clip"]


def _grouped_shape(shape, axis: int, group_size: int):
    """(..., n, ...) -> (..., n // G, G, ...): the group index at ``axis``, the member at ``axis + 1``."""
    n = shape[axis]
    return shape[:axis] + (n // group_size, group_size) + shape[axis + 1:]


def check_groups(shape, axis: int, group_size, name: str = "x") -> int:
    """Validate the group size against the quantized axis; returns it as an int (None = whole axis)."""
    n = shape[axis]
    if n == 0 or 0 in shape:
        raise ValueError(f"{name} is empty (shape {tuple(shape)}); nothing to quantize")
    if group_size is None:
        return int(n)
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    if n % group_size:
        raise ValueError(f"group_size={group_size} does not divide {name}.shape[{axis}]={n}")
    return int(group_size)


def quantize(x, bits: int, group_size, axis: int = -1, meta_dtype=np.float16, *, symmetric: bool = False):
    """Quantize ``x`` in groups of ``group_size`` consecutive elements along ``axis``.

    Asymmetric (default), per the contract: ``mn, mx`` = exact group min / max (``mn`` canonicalized
    to +0.0), ``scale = (mx - mn) / (2**bits - 1)`` in fp32 (also canonicalized: a group of +0.0 and
    -0.0 would otherwise store a scale whose sign depends on reduction order), both rounded to
    ``meta_dtype``; then
    ``code = clamp(rint((x - mn_s) / scale_s), 0, qmax)``. A group whose stored scale is 0 gets
    all-zero codes and dequantizes exactly to ``mn_s``.

    Symmetric (``symmetric=True``): ``q = 2**(bits-1) - 1``, ``scale = max|x| / q``, signed code
    ``clamp(rint(x / scale_s), -q, q)`` stored unsigned with offset ``2**(bits-1)``, and
    ``mn_s = -2**(bits-1) * scale_s`` (exact) so that ``dequantize`` is the same affine map.

    Args:
        x: float16 / float32 array (bf16 data as float32 values).
        bits: 2, 3, 4 or 8.
        group_size: elements per group along ``axis``; must divide ``x.shape[axis]``; None = whole axis.
        axis: the axis the groups run along (per-channel keys: the token axis; per-token: channels).
        meta_dtype: np.float16 (default) or np.float32, the dtype of the stored scale and min.
    Returns:
        ``(codes, scale, mn)``: uint8 codes shaped like ``x``; scale and mn in ``meta_dtype``.
    Raises:
        TypeError on a non-float dtype, ValueError on unsupported bits, a group size that does not
        divide the axis, an empty array, NaN / inf input, or metadata that overflows ``meta_dtype``.
    """
    xf = nx.as_f32(x)
    axis = nx.normalize_axis(axis, xf.ndim)
    bits = nx.check_bits(bits)
    G = check_groups(xf.shape, axis, group_size)
    nx.check_finite(xf)
    xg = xf.reshape(_grouped_shape(xf.shape, axis, G))           # (..., n/G, G, ...)
    red = axis + 1
    if not symmetric:
        qmax = nx.qmax(bits)
        mn = nx.canonical_zero(xg.min(axis=red, keepdims=True))
        mx = xg.max(axis=red, keepdims=True)
        scale_s = nx.to_meta(nx.canonical_zero(nx.div(nx.sub(mx, mn), qmax)), meta_dtype, "scale")
        mn_s = nx.to_meta(mn, meta_dtype, "min")
        s32, m32 = scale_s.astype(F32), mn_s.astype(F32)
        y = nx.clamp(nx.div(nx.sub(xg, m32), s32), 0, qmax)     # NaN only where scale_s == 0
        codes = np.where(s32 == 0, F32(0), nx.rint(np.nan_to_num(y)))
    else:
        q = F32(2 ** (bits - 1) - 1)
        off = F32(2 ** (bits - 1))
        amax = np.abs(xg).max(axis=red, keepdims=True)
        scale_s = nx.to_meta(nx.div(amax, q), meta_dtype, "scale")
        s32 = scale_s.astype(F32)
        mn_s = nx.to_meta(nx.canonical_zero(nx.mul(-off, s32)), meta_dtype, "min")
        y = nx.clamp(nx.div(xg, s32), -q, q)
        codes = np.where(s32 == 0, off, nx.add(nx.rint(np.nan_to_num(y)), off))
    codes = codes.astype(np.uint8).reshape(xf.shape)
    return codes, np.squeeze(scale_s, axis=red), np.squeeze(mn_s, axis=red)


def _check_meta(codes, scale, mn, G: int, axis: int):
    want = codes.shape[:axis] + (codes.shape[axis] // G,) + codes.shape[axis + 1:]
    for name, m in (("scale", scale), ("mn", mn)):
        if m.shape != want:
            raise ValueError(f"{name} has shape {m.shape}; codes of shape {codes.shape} with "
                             f"group_size={G} along axis {axis} need {want}")
        if nx.dtype_name(m.dtype) not in nx.META_DTYPES:
            raise TypeError(f"{name} has dtype {m.dtype}; expected one of {nx.META_DTYPES}")


def dequantize(codes, scale, mn, group_size, axis: int = -1, out_dtype=np.float16):
    """Inverse of :func:`quantize`: ``x_hat = float32(code) * scale_s + mn_s``, rounded to ``out_dtype``.

    The multiply and the add are two separately rounded fp32 operations (no FMA), then the result is
    rounded to nearest even into ``out_dtype`` (np.float16, np.float32, or "bfloat16", which comes
    back as float32 values exactly representable in bf16). float16 output saturates
    (``numerics.to_out``): a group holding +-65504, whose rounded-up scale times the top code can exceed
    65504, dequantizes to +-65504, not inf.
    """
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"codes have dtype {codes.dtype}; expected uint8 (one code per element)")
    axis = nx.normalize_axis(axis, codes.ndim)
    G = check_groups(codes.shape, axis, group_size, "codes")
    scale, mn = np.asarray(scale), np.asarray(mn)
    _check_meta(codes, scale, mn, G, axis)
    cg = codes.reshape(_grouped_shape(codes.shape, axis, G)).astype(F32)
    s32 = np.expand_dims(scale.astype(F32), axis + 1)
    m32 = np.expand_dims(mn.astype(F32), axis + 1)
    x = nx.add(nx.mul(cg, s32), m32)
    return nx.to_out(x.reshape(codes.shape), out_dtype)


def check_ratio(rho, name: str = "rho") -> float:
    """A quantile ratio: a real number in (0, 1] (a bool, a string or None is refused with TypeError, a
    value outside (0, 1] or NaN with ValueError, both naming ``name``); returned as a float. Shared with
    the fast tiers, which raise the same errors."""
    if isinstance(rho, (bool, np.bool_)) or not isinstance(rho, numbers.Real):
        raise TypeError(f"{name} must be a real number in (0, 1] (a quantile ratio), got {rho!r}")
    if not (0.0 < float(rho) <= 1.0):
        raise ValueError(f"quantile ratio {name}={rho!r} must lie in (0, 1]")
    return float(rho)


def quantile(a, rho: float, axis: int = -1) -> np.ndarray:
    """The ``rho``-quantile along ``axis`` by linear interpolation between order statistics.

    The exact rule (NumPy's and torch's default "linear" method, with its arithmetic pinned down):
    sort the values in fp32 ascending as ``s[0..n-1]``; ``h = (n - 1) * rho`` in float64 (an index, not
    data); ``lo = floor(h)``, ``hi = min(lo + 1, n - 1)``, ``frac = float32(h - lo)``; then
    ``tau = s[lo] + frac * (s[hi] - s[lo])`` as three separately rounded fp32 operations.

    NaN input raises ValueError (contract rule 8: a sort would place NaN as the largest value and
    return a silently wrong threshold); +-inf is ordered and accepted (the interpolation follows IEEE,
    so ``inf - inf`` gives NaN, never a finite value).
    ``rho`` must be a real number in (0, 1] (:func:`check_ratio`; ``True`` is not 1).
    """
    rho = check_ratio(rho, "rho")
    a = nx.as_f32(a, "a")
    axis = nx.normalize_axis(axis, a.ndim)
    n = a.shape[axis]
    if n == 0:
        raise ValueError("cannot take a quantile over an empty axis")
    nx.check_no_nan(a, "a")
    s = np.sort(a, axis=axis)
    h = (n - 1) * rho
    lo = int(np.floor(h))
    hi = min(lo + 1, n - 1)
    frac = F32(h - lo)
    s_lo = np.take(s, [lo], axis=axis)
    s_hi = np.take(s, [hi], axis=axis)
    return np.squeeze(nx.add(s_lo, nx.mul(frac, nx.sub(s_hi, s_lo))), axis=axis)


def percentile_clip(x, ratio: float, axis: int = -1):
    """OSCAR App. A.5 per-row percentile clip: ``tau = quantile_ratio(|x|)`` along ``axis``, then clip.

    Each row (all elements along ``axis``, e.g. one token's d channels) gets its own threshold
    ``tau`` (:func:`quantile` of the absolute values, linear rule), and ``x`` is clipped to
    ``[-tau, tau]``. ``ratio = 1`` keeps the row's max, so nothing changes. OSCAR's defaults are
    0.96 for keys and 0.92 for values.

    Returns:
        ``(x_clipped, tau)``: fp32, x's shape; tau with ``axis`` removed.
    Raises:
        TypeError / ValueError naming ``ratio`` unless it is a real number in (0, 1]; TypeError on a
        non-float ``x``; ValueError on NaN / inf in ``x``.
    """
    ratio = check_ratio(ratio, "ratio")
    xf = nx.as_f32(x)
    axis = nx.normalize_axis(axis, xf.ndim)
    nx.check_finite(xf)
    tau = quantile(np.abs(xf), ratio, axis=axis)
    t = np.expand_dims(tau, axis)
    return np.minimum(np.maximum(xf, -t), t).astype(F32), tau

