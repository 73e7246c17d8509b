"""The numerics contract (DESIGN.md section 2) as small, documented helpers.

Bit-exact agreement between NumPy, Triton and CUDA holds only when every tier does the same float32
operations in the same order. Each helper below is one rule of that contract; the reference modules
use nothing else for arithmetic that feeds a stored bit, and the fast kernels mirror each helper by
name in a comment.

    >>> from kvq.reference import numerics as nx
    >>> nx.rint(np.array([0.5, 1.5, 2.5], np.float32))      # round half to even
    array([0., 2., 2.], dtype=float32)

Rules, in code:

1. ``as_f32``: inputs (fp16, bf16 held in fp32, fp32) convert exactly to fp32; float64 is refused so
   that no float64 value leaks into a computation (NumPy promotes silently; ``f32`` guards scalars).
2. ``qmax``, ``div``, ``to_meta``, ``rint``, ``clamp``: asymmetric min-max quantization.
   ``scale = div(mx - mn, qmax)``; scale and mn are rounded to the metadata dtype; codes come from the
   stored values. ``canonical_zero`` turns a -0.0 into +0.0: the sign of a zero min or max depends
   on reduction order, so every tier adds +0.0 to mn and to the scale before storing them.
3. ``mul`` then ``add``: dequantization as two separately rounded fp32 operations, then ``to_out``
   (round to nearest even into fp16 / bf16 / fp32). **fp16 output saturates**: a finite fp32 value
   beyond the fp16 range becomes +-65504 (the largest finite fp16) instead of inf, so a group holding
   +-65504 dequantizes within one step of its input, as every other element (its rounded-up scale
   times the top code may exceed 65504). NaN stays NaN and +-inf stays +-inf (rule 8: never silently
   finite); bf16 and fp32 outputs hold every dequantized value and are unchanged. The kernels mirror
   it by name (``_sat_f16`` in Triton, ``sat_f16`` in CUDA) just before their fp16 rounding.
4. ``div``: IEEE round-to-nearest fp32 division (Triton: ``tl.div_rn``; CUDA: ``__fdiv_rn``).
5. No FMA anywhere in this module: NumPy never contracts.
6. Packing lives in ``packing.py``.
7. Order-dependent reductions (dot products, softmax) are outside bit-exactness: see ``attention.py``.
8. ``check_finite``: NaN / inf raise at the API boundary (``check_no_nan`` where inf has a meaning,
   e.g. a quantile, and only NaN would be silently misplaced).

``rint_magic`` is the form the Triton kernels use for round-half-to-even: for 0 <= y < 2**22,
``(y + 1.5 * 2**23) - 1.5 * 2**23`` is exactly ``rint(y)`` in fp32 (the addition rounds away the
fraction with the hardware's round-to-nearest-even). A test proves it equals ``rint`` on every fp32
value in [0, 256).
"""

from __future__ import annotations

import functools

import numpy as np

F32 = np.float32
#: bits -> supported by the quantizer
SUPPORTED_BITS = (2, 3, 4, 8)
#: metadata dtypes a cache may store its scale / min in
META_DTYPES = ("float16", "float32")
#: output dtypes of dequantization; "bfloat16" is returned as float32 values that are exactly bf16
OUT_DTYPES = ("float16", "bfloat16", "float32")
#: 1.5 * 2**23: adding and subtracting it rounds an fp32 in [0, 2**22) to the nearest even integer
MAGIC_RINT = F32(12582912.0)

_FP16_MAX = 65504.0


def dtype_name(dtype) -> str:
    """Normalize a dtype given as NumPy dtype, torch dtype or string to 'float16' / 'bfloat16' / 'float32'."""
    try:
        return _dtype_name_of(dtype)                # dtype objects and strings are hashable: once each
    except TypeError:                               # an unhashable argument: the same rule, uncached
        return _dtype_name_of.__wrapped__(dtype)


@functools.lru_cache(maxsize=256)
def _dtype_name_of(dtype) -> str:
    s = str(dtype).replace("torch.", "").replace("<class 'numpy.", "").replace("'>", "")
    aliases = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
               "fp32": "float32", "f2": "float16", "f4": "float32"}
    s = aliases.get(s, s)
    try:
        if s not in ("bfloat16",):
            s = np.dtype(s).name
    except TypeError:
        pass
    return s


def f32(v) -> np.float32:
    """A Python / NumPy scalar as an fp32 scalar (guards against float64 leaking into arithmetic)."""
    return F32(v)


def as_f32(x, name: str = "x") -> np.ndarray:
    """Rule 1: convert an fp16 / fp32 array exactly to fp32.

    bf16 data arrives in NumPy as fp32 values that are exactly representable in bf16 (NumPy has no
    bf16 dtype), so it passes through unchanged. float64 and integer arrays are refused with an error
    naming the dtype: converting them would round silently.
    """
    a = np.asarray(x)
    if a.dtype == np.float16 or a.dtype == np.float32:
        return a.astype(F32, copy=False)
    raise TypeError(
        f"{name} has dtype {a.dtype}; kvq quantizes float16 / bfloat16 / float32 data "
        f"(bfloat16 as float32 values in NumPy). Convert explicitly, e.g. {name}.astype(np.float32)."
    )


def check_finite(x: np.ndarray, name: str = "x") -> None:
    """Rule 8: NaN or inf in the input raises a clear error instead of producing wrong finite output."""
    if not np.all(np.isfinite(x)):
        n_nan = int(np.isnan(x).sum())
        n_inf = int(np.isinf(x).sum())
        raise ValueError(f"{name} contains non-finite values ({n_nan} NaN, {n_inf} inf); "
                         f"kvq refuses to quantize them")


def nan_message(name: str, n_nan: int, what: str) -> str:
    """The rule-8 error for NaN in an input that only NaN makes meaningless (shared with the fast tiers)."""
    return (f"{name} contains {n_nan} NaN value(s); kvq cannot {what} with NaN (a sort would place it "
            f"as the largest value). Remove or replace them first (e.g. nan_to_num)")


def check_no_nan(x: np.ndarray, name: str = "x", what: str = "take a quantile") -> None:
    """Rule 8 for inputs where inf is ordered and meaningful but NaN is not (quantiles): NaN raises."""
    n_nan = int(np.isnan(x).sum())
    if n_nan:
        raise ValueError(nan_message(name, n_nan, what))


def check_bits(bits: int, allowed=SUPPORTED_BITS, name: str = "bits") -> int:
    """Bits must be one of ``allowed``; returns it as an int. ``name``: the argument's name in the error
    (e.g. "k_bits" for a configuration field)."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in allowed:
        raise ValueError(f"{name}={bits!r} is not supported; choose one of {tuple(allowed)}")
    return int(bits)


def qmax(bits: int) -> np.float32:
    """Largest unsigned code for b bits, 2**b - 1, as fp32."""
    return F32(2 ** check_bits(bits) - 1)


def _f32_operands(op: str, *xs) -> None:
    """The arithmetic helpers take fp32 arrays only (rule 1: no float64 may leak in): TypeError otherwise."""
    for x in xs:
        if x.dtype != F32:
            raise TypeError(f"numerics.{op} takes float32 operands; got {', '.join(str(y.dtype) for y in xs)} "
                            f"(convert with as_f32 / f32 first: rule 1)")


def div(a, b) -> np.ndarray:
    """Rule 4: IEEE round-to-nearest fp32 division (x / 0 gives inf or NaN, handled by the caller)."""
    a = np.asarray(a)
    b = np.asarray(b)
    _f32_operands("div", a, b)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.divide(a, b, dtype=F32)


def mul(a, b) -> np.ndarray:
    """Rule 3: one rounded fp32 multiply (never fused with a following add)."""
    a = np.asarray(a)
    b = np.asarray(b)
    _f32_operands("mul", a, b)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.multiply(a, b, dtype=F32)


def add(a, b) -> np.ndarray:
    """Rule 3: one rounded fp32 add."""
    a = np.asarray(a)
    b = np.asarray(b)
    _f32_operands("add", a, b)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.add(a, b, dtype=F32)


def sub(a, b) -> np.ndarray:
    """One rounded fp32 subtract."""
    a = np.asarray(a)
    b = np.asarray(b)
    _f32_operands("sub", a, b)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.subtract(a, b, dtype=F32)


def rint(x) -> np.ndarray:
    """Rule 2: round half to even (IEEE roundTiesToEven), fp32 in, fp32 out."""
    x = np.asarray(x)
    _f32_operands("rint", x)
    return np.rint(x)


def rint_magic(y) -> np.ndarray:
    """The kernels' round-half-to-even for 0 <= y < 2**22: ``(y + 1.5*2**23) - 1.5*2**23`` in fp32."""
    y = np.asarray(y)
    _f32_operands("rint_magic", y)
    return sub(add(y, MAGIC_RINT), MAGIC_RINT)


def clamp(x, lo, hi) -> np.ndarray:
    """``min(max(x, lo), hi)`` in fp32 (inf saturates; the caller excludes NaN)."""
    return np.minimum(np.maximum(x, F32(lo)), F32(hi)).astype(F32, copy=False)


def canonical_zero(x) -> np.ndarray:
    """``x + 0.0``: maps -0.0 to +0.0 and leaves every other value unchanged (IEEE, round to nearest)."""
    return add(np.asarray(x, dtype=F32), np.zeros((), F32))


def round_to_bf16(x) -> np.ndarray:
    """Round fp32 to the nearest bf16 (ties to even), returned as fp32 values. NaN stays NaN."""
    x = np.ascontiguousarray(np.asarray(x, dtype=F32))
    bits = x.view(np.uint32).astype(np.uint64)
    lsb = (bits >> np.uint64(16)) & np.uint64(1)
    rounded = ((bits + np.uint64(0x7FFF) + lsb) >> np.uint64(16)) << np.uint64(16)
    out = (rounded & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(F32)
    return np.where(np.isnan(x), x, out).astype(F32)


def _real_values(x, name: str) -> np.ndarray:
    """``x`` as an array of real numbers (float, int or bool dtype) for a rounding into a float dtype:
    None, complex numbers, strings and objects raise TypeError naming ``name`` (NumPy would drop an
    imaginary part with a warning, or fail inside its conversion)."""
    if x is None:
        raise TypeError(f"{name} must be an array of real numbers, got None")
    a = np.asarray(x)
    if a.dtype.kind not in "fiub":
        raise TypeError(f"{name} must be an array of real numbers, got dtype {a.dtype}")
    return a


def to_meta(x, meta_dtype, name: str = "scale") -> np.ndarray:
    """Rule 2: round fp32 metadata (scale, min) to the metadata dtype, round to nearest even.

    Raises if a finite value overflows the metadata dtype (for fp16: |value| > 65504 after rounding),
    naming the remedy, since an inf scale would dequantize to NaN.
    """
    kind = dtype_name(meta_dtype)
    if kind not in META_DTYPES:
        raise ValueError(f"meta_dtype={meta_dtype!r} is not supported; choose one of {META_DTYPES}")
    x = np.asarray(_real_values(x, name), dtype=F32)
    if kind == "float32":
        out = x.copy()
    else:
        with np.errstate(over="ignore"):
            out = x.astype(np.float16)
    if not np.all(np.isfinite(out)):
        big = float(np.max(np.abs(x)))
        raise ValueError(
            f"{name} overflows {kind} metadata (|{name}| up to {big:.4g}; {kind} holds at most "
            f"{_FP16_MAX if kind == 'float16' else np.finfo(F32).max:.6g}); "
            f"use meta_dtype=np.float32 or rescale the input")
    return out


def saturate_f16(x) -> np.ndarray:
    """Rule 3's fp16 saturation: finite fp32 values beyond +-65504 become +-65504; all others (NaN, +-inf,
    values in range) are returned unchanged. fp32 in, fp32 out."""
    x = np.asarray(x, dtype=F32)
    over = np.isfinite(x) & (np.abs(x) > F32(_FP16_MAX))
    if not over.any():
        return x
    return np.where(over, np.copysign(F32(_FP16_MAX), x), x).astype(F32)


def to_out(x, out_dtype) -> np.ndarray:
    """Rule 3: round fp32 values into the output dtype (ties to even). bf16 comes back as fp32 values.

    float16 saturates: a finite value beyond the fp16 range becomes +-65504 (the largest finite fp16)
    instead of inf (:func:`saturate_f16`); NaN and +-inf pass through. bf16 and fp32 are plain roundings.
    """
    kind = dtype_name(out_dtype)
    x = np.asarray(_real_values(x, "x"), dtype=F32)
    if kind == "float32":
        return x
    if kind == "float16":
        return saturate_f16(x).astype(np.float16)
    if kind == "bfloat16":
        return round_to_bf16(x)
    raise ValueError(f"out_dtype={out_dtype!r} is not supported; choose one of {OUT_DTYPES}")


def normalize_axis(axis: int, ndim: int) -> int:
    """A possibly negative axis as a non-negative one, with a clear error when out of range."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an int, got {axis!r}")
    if isinstance(ndim, (bool, np.bool_)) or not isinstance(ndim, (int, np.integer)):
        raise TypeError(f"ndim must be an int, got {ndim!r}")
    if ndim < 0:
        raise ValueError(f"ndim must be an int >= 0, got {ndim}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for an array with {ndim} dimension(s)")
    return int(axis) % ndim
