"""Shared Python-boundary checks of the fast tier (both backends): dtypes, devices, shapes, NaN / inf.

Kernels trust their inputs; everything a user can get wrong is checked here, with the same messages
as the reference tier (which owns the shape rules: ``kvq.reference.quant.check_groups``).

    from kvq.fast import common as C
    outer, n, inner = C.axis_view(x.shape, axis)      # x seen as (outer, n, inner), contiguous
    with C.validation(False): ...                     # turn the finiteness checks off (production)
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np
import torch

from kvq.reference import numerics as nx
from kvq.reference.attention import check_shapes
from kvq.reference.quant import check_groups

_FLOATS = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_BY_NAME = {v: k for k, v in _FLOATS.items()}
_STATE = {"validate": True}
#: dtypes the fast decode attention takes
ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of ints on the host: ``triton.cdiv``'s arithmetic. (Since Triton 3.7 ``triton.cdiv``
    and ``triton.next_power_of_2`` are constexpr functions whose host call costs microseconds; launches
    compute their grids and block sizes with these.)"""
    return (a + b - 1) // b


def contiguous_strides(shape) -> tuple:
    """The strides (in elements) of a contiguous tensor of ``shape``, as ``torch.empty(shape).stride()``."""
    out, acc = [], 1
    for n in reversed(tuple(shape)):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0): ``triton.next_power_of_2``'s bit arithmetic on the host."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    n += 1
    return n


def set_validation(enabled: bool) -> None:
    """Turn the fast tier's boundary checks for NaN / inf and metadata overflow on (default) or off.

    They cost a device synchronization and a small read of the metadata; production code that has
    already validated its activations may turn them off. Shape / dtype checks always run.
    """
    _STATE["validate"] = bool(enabled)


def validation_enabled() -> bool:
    return _STATE["validate"]


class validation:
    """Context manager form of :func:`set_validation`: the setting ``enabled`` inside the block, the one
    before it after (a class rather than a generator: a model's step enters one per layer and call)."""

    __slots__ = ("enabled", "old")

    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)
        self.old = None

    def __enter__(self):
        self.old = _STATE["validate"]
        _STATE["validate"] = self.enabled

    def __exit__(self, *exc):
        _STATE["validate"] = self.old
        return False


def torch_dtype(dtype) -> torch.dtype:
    """A dtype given as torch / NumPy dtype or string, as the torch float dtype."""
    name = nx.dtype_name(dtype)
    if name not in _BY_NAME:
        raise ValueError(f"dtype {dtype!r} is not supported; choose float16, bfloat16 or float32")
    return _BY_NAME[name]


def check_tensor(x, name: str, *, allow_cpu: bool = False) -> None:
    """x must be a torch tensor on a CUDA device (or the CPU when ``allow_cpu``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__} "
                        f"(the reference tier kvq.reference takes NumPy arrays)")
    if x.device.type != "cuda" and not (allow_cpu and x.device.type == "cpu"):
        where = "a CUDA device" + (" or the CPU" if allow_cpu else "")
        hint = _INTERP_HINT if x.device.type == "cpu" else ""     # Triton takes CPU tensors interpreted
        raise ValueError(f"{name} is on {x.device}; expected {where}{hint}")


def check_float(x, name: str = "x", *, allow_cpu: bool = False) -> None:
    """x: a float16 / bfloat16 / float32 tensor on an allowed device."""
    check_tensor(x, name, allow_cpu=allow_cpu)
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} has dtype {x.dtype}; kvq quantizes float16 / bfloat16 / float32 data. "
                        f"Convert explicitly, e.g. {name}.float()")


def _capturing(x) -> bool:
    """Whether ``x`` is a CUDA tensor and the current stream is capturing a CUDA graph (where a device read,
    a synchronization, is not permitted: a captured call is checked when it is called eagerly)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def check_finite(x, name: str = "x", what: str = "quantize them") -> None:
    """Rule 8 at the Python boundary (only while validation is on, and not while a CUDA graph is being
    captured): NaN / inf raise (one device read)."""
    if validation_enabled() and x.numel() and not _capturing(x) and not bool(torch.isfinite(x).all()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(f"{name} contains non-finite values ({n_nan} NaN, {n_inf} inf); "
                         f"kvq refuses to {what}")


def check_meta(x, scale, mn) -> None:
    """After a quantize kernel: non-finite metadata means NaN / inf input or a metadata overflow.

    The kernels propagate NaN into the group's scale, so this check reads only the metadata
    (1 / group_size of the data) instead of the whole input; the input is read again only to word
    the error.
    """
    if not validation_enabled():
        return
    if bool(torch.isfinite(scale).all()) and bool(torch.isfinite(mn).all()):
        return
    check_finite(x)
    kind = _FLOATS.get(scale.dtype, str(scale.dtype))
    name = "scale" if not bool(torch.isfinite(scale).all()) else "min"
    raise ValueError(f"{name} overflows {kind} metadata; use meta_dtype=float32 or rescale the input")


def check_codes(codes, name: str = "codes", *, allow_cpu: bool = False) -> None:
    check_tensor(codes, name, allow_cpu=allow_cpu)
    if codes.dtype != torch.uint8:
        raise TypeError(f"{name} have dtype {codes.dtype}; expected uint8")


def check_meta_shapes(codes_shape, scale, mn, G: int, axis: int, *, allow_cpu: bool = False) -> None:
    """scale and mn: the code shape with ``shape[axis]`` replaced by the number of groups."""
    want = tuple(codes_shape[:axis]) + (codes_shape[axis] // G,) + tuple(codes_shape[axis + 1:])
    for name, m in (("scale", scale), ("mn", mn)):
        check_tensor(m, name, allow_cpu=allow_cpu)
        if tuple(m.shape) != want:
            raise ValueError(f"{name} has shape {tuple(m.shape)}; codes of shape {tuple(codes_shape)} "
                             f"with group_size={G} along axis {axis} need {want}")
        if nx.dtype_name(m.dtype) not in nx.META_DTYPES:
            raise TypeError(f"{name} has dtype {m.dtype}; expected one of {nx.META_DTYPES}")


def axis_view(shape, axis: int):
    """(outer, n, inner) of a contiguous tensor seen around ``axis``."""
    outer = math.prod(shape[:axis])
    inner = math.prod(shape[axis + 1:])
    return outer, shape[axis], inner


def quant_args(x, bits, group_size, axis, meta_dtype, *, allow_cpu: bool, pack_bits=None):
    """Validate quantize arguments like the reference does; returns (axis, bits, G, meta torch dtype)."""
    check_float(x, allow_cpu=allow_cpu)
    axis = nx.normalize_axis(axis, x.dim())
    bits = nx.check_bits(bits, pack_bits or nx.SUPPORTED_BITS)
    G = check_groups(tuple(x.shape), axis, group_size)
    if nx.dtype_name(meta_dtype) not in nx.META_DTYPES:
        raise ValueError(f"meta_dtype={meta_dtype!r} is not supported; choose one of {nx.META_DTYPES}")
    return axis, bits, G, torch_dtype(meta_dtype)


def meta_shape(shape, axis: int, G: int):
    return tuple(shape[:axis]) + (shape[axis] // G,) + tuple(shape[axis + 1:])


def check_qkv(q, k, v, *, allow_cpu: bool = False) -> None:
    """One (q, k, v) of a decode: 4-D (B, H, T, D) tensors of one float dtype and device, GQA shapes, finite
    while validation is on."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        check_tensor(a, name, allow_cpu=allow_cpu)
        if a.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, H, T, D); got shape {tuple(a.shape)}")
        if a.dtype not in ATTN_DTYPES:
            raise TypeError(f"{name} has dtype {a.dtype}; the fast decode takes float16 / bfloat16 / "
                            f"float32 (the reference tier computes float64 truths)")
    check_shapes(q.shape, k.shape, v.shape)
    if not (k.dtype == v.dtype == q.dtype):
        raise TypeError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    for name, a in (("q", q), ("k", k), ("v", v)):            # rule 8, as the reference (while validating)
        check_finite(a, name, "attend with them")


def softmax_scale(scale, D: int) -> float:
    """The softmax scale as a Python float: 1/sqrt(D) by default, else a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    if type(scale) is float and math.isfinite(scale):        # a model's scaling: no ABC check
        return scale
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)


def check_partials(partials, *, allow_cpu: bool = False):
    """The (o, lse) pairs of a merge: shapes, dtypes, and (while validation is on) no NaN / +inf lse.

    Returns the lists ``(os_, lses)``.
    """
    partials = list(partials)
    if not partials:
        raise ValueError("merge needs at least one (o, lse) partial; got an empty sequence")
    os_, lses = [], []
    for i, p in enumerate(partials):
        if not isinstance(p, (tuple, list)) or len(p) != 2:
            raise ValueError(f"partial {i} must be a pair (o, lse); got {type(p).__name__}")
        o, ls = p
        check_tensor(o, f"partial {i} o", allow_cpu=allow_cpu)
        check_tensor(ls, f"partial {i} lse", allow_cpu=allow_cpu)
        if o.dim() < 1 or tuple(ls.shape) != tuple(o.shape[:-1]):
            raise ValueError(f"partial {i}: lse has shape {tuple(ls.shape)} but o has shape "
                             f"{tuple(o.shape)}; lse must be o.shape[:-1]")
        if os_ and o.shape != os_[0].shape:
            raise ValueError(f"partial {i}: o has shape {tuple(o.shape)}, partial 0 has "
                             f"{tuple(os_[0].shape)}")
        for name, a in (("o", o), ("lse", ls)):
            if a.dtype not in ATTN_DTYPES:
                raise TypeError(f"partial {i} {name} has dtype {a.dtype}; expected float16 / bfloat16 / "
                                f"float32")
        if os_ and o.dtype != os_[0].dtype:
            raise TypeError(f"partial {i}: o has dtype {o.dtype}, partial 0 has {os_[0].dtype}")
        os_.append(o)
        lses.append(ls)
    if validation_enabled():
        for i, ls in enumerate(lses):
            if ls.numel() and bool((torch.isnan(ls) | (ls == float("inf"))).any()):
                raise ValueError(f"partial {i}: lse contains NaN or +inf")
    return os_, lses


def check_decode_q(q, shape, device, length: int, *, allow_cpu: bool = False) -> None:
    """A cache's decode query against the cache: q (B, H_q, T_q, D) with H_q a multiple of H_kv, a
    float16 / bfloat16 / float32 tensor on the cache's device, finite while validation is on (rule 8, as
    the reference), and a non-empty cache (``shape`` = (B, H_kv, D), ``length`` = tokens cached)."""
    B, H, D = shape
    check_tensor(q, "q", allow_cpu=allow_cpu)
    if q.dim() != 4 or q.shape[0] != B or q.shape[3] != D or q.shape[1] % H:
        raise ValueError(f"q has shape {tuple(q.shape)}; this cache takes (B={B}, H_q (a multiple of {H}), "
                         f"T_q, D={D})")
    if q.dtype not in ATTN_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; the fast decode takes float16 / bfloat16 / float32 (the "
                        f"reference tier computes float64 truths)")
    if q.device != device:
        raise ValueError(f"q is on {q.device}; the cache is on {device}")
    if length == 0:
        raise ValueError("the cache is empty: append tokens before attending")
    check_finite(q, "q", "attend with them")


def quantile_index(n: int, rho) -> tuple[int, int, float]:
    """``(lo, hi, frac)`` of ``quant.quantile`` for n values: ``h = (n - 1) * rho`` in float64 (an
    index, not data), ``lo = floor(h)``, ``hi = min(lo + 1, n - 1)``, ``frac = float32(h - lo)``
    (returned as the Python float of that fp32 value, so a kernel argument holds it exactly)."""
    h = (n - 1) * float(rho)
    lo = int(np.floor(h))
    return lo, min(lo + 1, n - 1), float(np.float32(h - lo))


def check_ratio(rho) -> None:
    """The reference's check of a quantile ratio, with its message."""
    if not (0.0 < float(rho) <= 1.0):
        raise ValueError(f"quantile ratio rho={rho!r} must lie in (0, 1]")


def check_kv_append(k, v, shape, device, length: int, max_tokens: int, *, allow_cpu: bool = False,
                    dtype_rule: str = "float16 or float32") -> None:
    """The checks of a cache's ``append`` (paged KIVI / Kitty, OSCAR): k and v float16 / float32 tensors
    (B, H_kv, T_new, D) of the cache's ``shape`` (B, H_kv, D) on its device, finite, of one shape, and
    ``length + T_new <= max_tokens``. ``dtype_rule`` ends the dtype error ("append takes ...")."""
    B, H, D = shape
    for name, x in (("k", k), ("v", v)):
        check_tensor(x, name, allow_cpu=allow_cpu)
        if x.dtype not in (torch.float16, torch.float32):
            raise TypeError(f"{name} has dtype {str(x.dtype).replace('torch.', '')}; append takes {dtype_rule}")
        if x.dim() != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; this cache takes (B={B}, H_kv={H}, T_new, D={D})")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}; the cache is on {device}")
        check_finite(x, name)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if length + k.shape[2] > max_tokens:
        raise ValueError(f"appending {k.shape[2]} tokens to {length} exceeds the capacity max_tokens={max_tokens}")


def quantile_rows(a, rho, axis: int, launch, *, clip: bool, allow_cpu: bool = False):
    """The front end of either backend's ``quant.quantile`` (``clip=False``: returns tau) and
    ``quant.percentile_clip`` (``clip=True``: returns ``(x_clipped, tau)``): the reference's checks in
    its order, the axis moved last, then ``launch(rows, n, rho, clip=...) -> (tau, out)``, the
    backend's row kernel (sort, interpolate, and clip)."""
    name = "x" if clip else "a"
    check_float(a, name, allow_cpu=allow_cpu)
    axis = nx.normalize_axis(axis, a.dim())
    if clip:
        check_finite(a)
    check_ratio(rho)
    n = a.shape[axis]
    if n == 0:
        raise ValueError("cannot take a quantile over an empty axis")
    x = a.movedim(axis, -1).contiguous()
    tau, out = launch(x, n, rho, clip=clip)
    tau = tau.reshape(tuple(x.shape[:-1]))
    return (out.movedim(-1, axis).contiguous(), tau) if clip else tau


def token_quant_args(x_rot, clip, group_size, bits, meta_dtype, packed: bool, *, allow_cpu: bool = False):
    """The checks of either backend's ``oscar_quant.quantize_tokens``, in the reference's order, and its
    operands: ``(x, D, G, bits, meta, per)`` with x the contiguous rows, D the row length, G the
    group size, meta the torch metadata dtype and per the codes per byte (1 unpacked)."""
    from kvq.reference.packing import check_pack_bits

    check_float(x_rot, "x", allow_cpu=allow_cpu)
    if x_rot.dim() == 0:
        nx.normalize_axis(-1, 0)                                       # the reference's error
    check_ratio(clip)
    D = x_rot.shape[-1]
    if D == 0:
        raise ValueError("cannot take a quantile over an empty axis")
    bits = check_pack_bits(bits) if packed else nx.check_bits(bits)
    G = check_groups(tuple(x_rot.shape), x_rot.dim() - 1, group_size)
    if nx.dtype_name(meta_dtype) not in nx.META_DTYPES:
        raise ValueError(f"meta_dtype={meta_dtype!r} is not supported; choose one of {nx.META_DTYPES}")
    per = 8 // bits if packed else 1
    if D % per:
        raise ValueError(f"codes.shape[{x_rot.dim() - 1}]={D} is not a multiple of {per} "
                         f"({bits}-bit codes per byte)")
    return x_rot.contiguous(), D, G, bits, torch_dtype(meta_dtype), per


def rotation_operands(x, R, *, allow_cpu: bool = False):
    """Checks and operands of the fixed-order rotation kernels (``rotate`` of either backend): x
    (..., D) float, R float32 (D, D) or (H_R, D, D) on x's device. Returns ``(x4, R, out, ratio,
    r_stride, shape)``: x as (B, H, T, D), R contiguous, the fp32 output (B, H, T, D), the GQA ratio
    H / H_R (1 for a shared R), R's head stride (0 for a shared R) and the shape to return."""
    check_float(x, "x", allow_cpu=allow_cpu)
    check_tensor(R, "R", allow_cpu=allow_cpu)
    if R.dtype != torch.float32:
        raise TypeError(f"R has dtype {str(R.dtype).replace('torch.', '')}; the cache keeps its rotations in float32")
    if x.dim() == 0:
        raise ValueError("x must have at least one axis (the channels)")
    D = x.shape[-1]
    if R.dim() not in (2, 3) or tuple(R.shape[-2:]) != (D, D):
        raise ValueError(f"R has shape {tuple(R.shape)}; rotating vectors of length {D} needs ({D}, {D}) "
                         f"or (H, {D}, {D})")
    if R.device != x.device:
        raise ValueError(f"R is on {R.device}; x is on {x.device}")
    shape = tuple(x.shape)
    if R.dim() == 3:
        if x.dim() != 4 or x.shape[1] % R.shape[0]:
            raise ValueError(f"x has shape {shape}; per-head rotations {tuple(R.shape)} need (B, H, T, {D}) "
                             f"with H a multiple of {R.shape[0]}")
        x4, ratio, r_sh = x, x.shape[1] // R.shape[0], D * D
    else:
        x4, ratio, r_sh = (x.reshape(1, 1, -1, D) if x.dim() != 4 else x), 1, 0
    B, H, T, _ = x4.shape
    out = torch.empty((B, H, T, D), dtype=torch.float32, device=x.device)
    return x4, R.contiguous(), out, ratio, r_sh, shape


def cache_device(ops, device=None) -> torch.device:
    """Where a backend's new cache lives (``ops.name``: the backend's name; ``ops.allow_cpu()``: whether
    its kernels run on the CPU, i.e. Triton under the interpreter, see ``kvq.fast.triton.quant.interpreting``).

    ``device`` (a torch.device, a string such as ``"cuda:1"`` / ``"cpu"``, or a CUDA index) wins when
    given: a CUDA device must exist (``"cuda"`` alone means the current one); the CPU is accepted only
    where ``ops.allow_cpu()``; anything else is a ValueError (TypeError for a value that is no device).
    ``None``: the CPU where ``ops.allow_cpu()``, else the current CUDA device (RuntimeError without one).
    No environment variable is read here: the answer depends on the arguments and on facts fixed for
    the process."""
    if device is None:
        if ops.allow_cpu():
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise RuntimeError(f"kvq.fast.{ops.name} caches live on a CUDA device and none is available"
                               + (_INTERP_HINT if ops.name == "triton" else ""))
        return torch.device("cuda", torch.cuda.current_device())
    dev = _as_device(device)
    if dev.type == "cpu":
        if ops.allow_cpu():
            return dev
        raise ValueError(f"device={device!r}: kvq.fast.{ops.name} caches live on a CUDA device"
                         + (_INTERP_HINT if ops.name == "triton" else ""))
    if dev.type != "cuda":
        raise ValueError(f"device={device!r}: kvq.fast.{ops.name} caches live on a CUDA device"
                         + (" or the CPU" if ops.allow_cpu() else "") + f", not {dev.type}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ValueError(f"device={device!r}: no CUDA device is available")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < n:
        raise ValueError(f"device={device!r}: there is no CUDA device {index} ({n} available: 0..{n - 1})")
    return torch.device("cuda", index)


#: the end of an error that refuses the CPU to the Triton backend
_INTERP_HINT = (" (the CPU only under Triton's interpreter: set TRITON_INTERPRET=1 before kvq's Triton kernels "
                "are imported)")


def _as_device(device) -> torch.device:
    """``device`` (torch.device, str or int) as a torch.device; TypeError / ValueError naming it."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, numbers.Integral)):
        raise TypeError(f"device must be a torch.device, a string such as 'cuda:0' or a CUDA index; "
                        f"got {type(device).__name__}")
    if isinstance(device, numbers.Integral):
        if device < 0:
            raise ValueError(f"device={device!r}: a CUDA index must be >= 0")
        return torch.device("cuda", int(device))
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device={device!r} is not a device name (e.g. 'cuda', 'cuda:1', 'cpu')") from e


class TensorFields:
    """``arrays()`` and ``copy()`` of a dataclass cache state whose arrays are torch tensors (the fast
    twins of kvq.reference.state.FlatArrays)."""

    def arrays(self) -> dict:
        """Every tensor of the state by name (the reference state's ``arrays()`` keys)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def copy(self):
        return dataclasses.replace(self, **{n: a.clone() for n, a in self.arrays().items()})


def check_no_nan(x: torch.Tensor, name: str = "a") -> None:
    """Rule 8 for quantiles (``numerics.check_no_nan``, the same message): NaN raises ValueError while
    ``kvq.fast.validation`` is on (one read of ``x``); +-inf is ordered and accepted."""
    if validation_enabled() and x.numel():
        n_nan = int(torch.isnan(x).sum())
        if n_nan:
            raise ValueError(nx.nan_message(name, n_nan, "take a quantile"))


_F16_MAX = 65504.0


def to_out(x: torch.Tensor, dtype) -> torch.Tensor:
    """Rule 3's last step on a torch tensor (``numerics.to_out``): ``x`` cast to ``dtype``; for float16 a
    finite value beyond +-65504 becomes +-65504 (the largest finite fp16) instead of inf, NaN and +-inf
    pass. Values in (65504, 65520) round to 65504 anyway, so the clamp changes only would-be infs."""
    if x.dtype is dtype:                                      # nothing to cast (a decode's out in q's dtype)
        return x
    dtype = torch_dtype(dtype) if not isinstance(dtype, torch.dtype) else dtype
    if dtype == torch.float16 and x.dtype != torch.float16:
        x = torch.where(torch.isfinite(x), x.clamp(-_F16_MAX, _F16_MAX), x)
    return x.to(dtype)


def is_int(v) -> bool:
    """True for an int that is not a bool (a knob's count)."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_knob(owner: str, ok: bool, name: str, value, expected: str) -> None:
    """ValueError ``<owner>.Knobs.<name> = <value>: <expected>`` unless ``ok`` (the launch knobs' checks)."""
    if not ok:
        raise ValueError(f"{owner}.Knobs.{name} = {value!r}: {expected}")


def check_launch_knobs(owner: str, knobs) -> None:
    """The checks every Triton decode's ``Knobs`` shares (:func:`check_knob` naming ``owner``): ``num_warps``
    None or a power of two, ``waves`` a positive number, ``num_stages`` None or a positive int, and, where the
    knobs have it, ``block_t`` None or a power of two >= 16."""
    w, waves, st = knobs.num_warps, knobs.waves, knobs.num_stages
    check_knob(owner, w is None or (is_int(w) and w > 0 and w & (w - 1) == 0), "num_warps", w, "None or a power of two")
    check_knob(owner, isinstance(waves, (int, float)) and not isinstance(waves, bool) and waves > 0, "waves", waves,
               "a positive number")
    if hasattr(knobs, "block_t"):
        b = knobs.block_t
        check_knob(owner, b is None or (is_int(b) and b >= 16 and b & (b - 1) == 0), "block_t", b,
                   "None or a power of two >= 16")
    check_knob(owner, st is None or (is_int(st) and st > 0), "num_stages", st, "None or a positive int")
