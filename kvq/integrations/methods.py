"""One registry of kvq's cache methods: configs adapted to a model, memory accounting, a multi-layer store.

The methods of the papers under one name each (``METHODS``): FP16, KIVI (``kivi.py``), Kitty
(``kitty.py``), OSCAR (``oscar.py``), AQUA-KV (``aqua_cache.py``, cross-layer) and BitDecoding
(``bitdecoding.py``). :func:`configure` adapts a method's paper config to a model's head dim and
capacity; :func:`bits_per_element` is the memory accounting; :class:`KVStore` holds every layer of
one batch's compressed cache on the reference (NumPy), Triton or CuPy backend, behind one
``append`` / ``keys_values`` interface (what ``kvq.integrations.transformers`` builds on).

    store = KVStore("KIVI-K2V2", n_layers=2, batch=1, kv_heads=2, head_dim=64, max_tokens=512)
    store.append(0, k, v)                       # k, v: (B, H_kv, T_new, D) post-RoPE, numpy or torch
    K_hat, V_hat = store.keys_values(0)         # torch fp32 (B, H_kv, T, D): everything appended so far

This module imports NumPy and kvq.reference only; torch is imported when a store is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import numpy as np

from kvq.reference import aqua, aqua_cache, bitdecoding, kitty, kivi, oscar, paged
from kvq.reference.model import apply_rope

__all__ = ["MethodSpec", "METHODS", "FP16Config", "BACKENDS", "ACCOUNTINGS", "get_method", "configure", "resolve_calibration",
           "bits_per_element", "KVStore"]

BACKENDS = ("auto", "reference", "triton", "cupy")
ACCOUNTINGS = ("paper", "state")


@dataclass(frozen=True)
class FP16Config:
    """The uncompressed baseline: tokens kept in FP16 (or in the model's bf16), ``max_tokens`` per sequence."""

    max_tokens: int = 4096
    name: str = "FP16"


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: ``family`` (fp16, kivi, kitty, oscar, aqua, bitdecoding), the reference
    ``module`` that implements it (its fast twins share the name), ``base()`` the paper's config,
    ``calibration`` (None, "oscar": one ``OSCARCalibration`` per layer, "aqua": ``AquaPredictors``)."""

    name: str
    family: str
    module: str | None
    base: Callable[[], object]
    calibration: str | None
    summary: str


def _spec(name, family, module, base, summary, calibration=None) -> MethodSpec:
    return MethodSpec(name, family, module, base, calibration, summary)


#: method name -> spec (names as in the papers' tables)
METHODS: dict[str, MethodSpec] = {s.name: s for s in (
    _spec("FP16", "fp16", None, FP16Config, "no compression (the baseline)"),
    _spec("KIVI-K2V2", "kivi", "kivi", lambda: kivi.CONFIGS["KIVI-K2V2"],
          "KIVI 2-bit keys per channel / values per token, G = R = 128"),
    _spec("KIVI-K2V2*", "kivi", "kivi", lambda: kivi.CONFIGS["KIVI-K2V2*"], "KIVI-K2V2 with 32 FP16 sink tokens"),
    _spec("KIVI-K4V4", "kivi", "kivi", lambda: kivi.CONFIGS["KIVI-K4V4"], "KIVI 4-bit"),
    _spec("Kitty", "kitty", "kitty", lambda: kitty.CONFIGS["Kitty"], "2-bit, 12.5% of key channels boosted to 4 bits"),
    _spec("Kitty-Pro", "kitty", "kitty", lambda: kitty.CONFIGS["Kitty-Pro"], "2-bit, 25% of key channels boosted"),
    _spec("OSCAR", "oscar", "oscar", lambda: oscar.CONFIGS["OSCAR"],
          "rotated INT2 keys and values, 64 sink + 256 recent FP16 tokens", calibration="oscar"),
    _spec("AQUA-KV", "aqua", "aqua_cache", aqua.AquaConfig,
          "cross-layer predictors + HIGGS 2-bit residuals (4-bit first layer)", calibration="aqua"),
    _spec("AQUA-KV-uniform", "aqua", "aqua_cache", lambda: aqua.AquaConfig(backbone=aqua.Uniform(bits=2)),
          "cross-layer predictors + uniform 2-bit residuals in groups of 64", calibration="aqua"),
    _spec("BitDecoding-2", "bitdecoding", "bitdecoding", lambda: bitdecoding.CONFIGS["BitDecoding-KC2"],
          "tensor-core layout, 2-bit, channel-wise keys (BitDecoding-KC2)"),
    _spec("BitDecoding-4", "bitdecoding", "bitdecoding", lambda: bitdecoding.CONFIGS["BitDecoding-KC4"],
          "tensor-core layout, 4-bit, channel-wise keys (BitDecoding-KC4)"),
)}


def get_method(name: str) -> MethodSpec:
    """The spec of method ``name``; ValueError listing the known names otherwise."""
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"unknown kvq method {name!r}; known methods: {', '.join(METHODS)}")
    return METHODS[name]


def _check_pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _largest_divisor(n: int, cap: int, step: int = 1) -> int | None:
    """The largest g <= cap, a multiple of ``step``, that divides n (None if there is none)."""
    for g in range(min(cap, n) - min(cap, n) % step, 0, -step):
        if n % g == 0:
            return g
    return None


# ---------------------------------------------------------------------------------------------------
# configure: a method's paper config adapted to a model


def configure(name: str, *, head_dim: int, max_tokens: int, kv_heads: int | None = None, **overrides):
    """The config of method ``name`` for a model with head dim ``head_dim``, ``max_tokens`` per sequence.

    Starts from the paper's config (``kivi.CONFIGS[...]``, ``kitty.CONFIGS[...]``,
    ``oscar.CONFIGS["OSCAR"]``, ``AquaConfig()``, ``bitdecoding.CONFIGS["BitDecoding-KC2" / "-KC4"]``),
    replaces the fields named in ``overrides`` (e.g. ``sink=4, residual=16, group_size=32``; an unknown
    field is a ValueError listing the valid ones) and sets ``max_tokens``. Then, only for fields the
    caller did not override, adaptations to head dims the paper's 128 does not fit:

    * OSCAR: ``group_size`` (channels per INT2 group, 128) must divide head_dim: it becomes the largest
      divisor of head_dim below 128 (64 for head_dim 64, 80 for 80). An explicit ``group_size`` that
      does not divide head_dim is a ValueError.
    * BitDecoding: ``v_group`` (channels per value group, 128; and ``k_group`` for the tensor-wise
      KT modes) must divide head_dim and be a multiple of 8 (a fragment tile): it becomes the largest
      such divisor. head_dim itself must be a multiple of ``8 * 16 / bits`` (64 at 2 bits, 32 at
      4 bits: the tensor-core fragment layout packs 16/bits codes per word over 8-channel tiles);
      otherwise ValueError.
    * AQUA-KV-uniform: the uniform quantizer's group (64 values of a token's H_kv * head_dim vector)
      becomes the largest divisor of head_dim below 64, so that it divides the vector. HIGGS (AQUA-KV)
      zero-pads its groups and serves any head_dim; given ``kv_heads``, the HIGGS group (1024 values,
      of the backbone and of the first layer) becomes the largest power of two dividing
      ``kv_heads * head_dim`` when that is smaller, so that no padding is stored (a model with 2 KV
      heads of 32 has 64-value vectors: groups of 64). Pass the model's ``rope_theta`` (keys are
      quantized pre-RoPE, the paper's default): ``kvq.integrations.transformers`` does.
    * KIVI, Kitty: no adaptation (key groups run along tokens; value groups are the whole head dim);
      head_dim must be a multiple of 8 / v_bits (codes pack along channels).

    Raises ValueError with the method's name where it cannot serve ``head_dim``.
    """
    spec = get_method(name)
    head_dim = _check_pos_int("head_dim", head_dim)
    max_tokens = _check_pos_int("max_tokens", max_tokens)
    base = spec.base()
    fields = {f.name for f in dataclasses.fields(base)} - {"name", "max_tokens"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"{name} has no option {', '.join(map(repr, unknown))}; its options are: "
                         f"{', '.join(sorted(fields)) or '(none)'}")
    fam = spec.family
    adapt = {}
    if fam == "oscar" and "group_size" not in overrides and head_dim % base.group_size:
        g = _largest_divisor(head_dim, base.group_size)
        adapt["group_size"] = g
    if fam == "bitdecoding":
        bits = overrides.get("bits", base.bits)
        step = 8 * (16 // bits) if bits in (2, 4) else 8
        if head_dim % step:
            raise ValueError(f"{name} cannot serve head_dim={head_dim}: BitDecoding's tensor-core fragment "
                             f"layout needs head_dim to be a multiple of {step} at {bits} bits (8-channel "
                             f"tiles x {16 // bits} codes per 16-bit word)")
        k_mode = overrides.get("k_mode", base.k_mode)
        groups = ["v_group"] + (["k_group"] if k_mode == "tensor" else [])
        for gname in groups:
            g0 = getattr(base, gname)
            if gname not in overrides and head_dim % g0:
                adapt[gname] = _largest_divisor(head_dim, g0, 8)
    if fam == "aqua":
        for bname in ("backbone", "first_layer"):
            bb = overrides.get(bname, getattr(base, bname))
            if bname not in overrides and isinstance(bb, aqua.Uniform) and head_dim % bb.group_size:
                adapt[bname] = dataclasses.replace(bb, group_size=_largest_divisor(head_dim, bb.group_size))
            if bname not in overrides and isinstance(bb, aqua.Higgs) and kv_heads is not None:
                F = _check_pos_int("kv_heads", kv_heads) * head_dim
                g = F & -F                                          # largest power of two dividing F
                if g < bb.cfg.group_size and g % bb.cfg.d == 0:
                    adapt[bname] = aqua.Higgs(dataclasses.replace(bb.cfg, group_size=g))
    try:
        cfg = dataclasses.replace(base, **{**adapt, **overrides, "max_tokens": max_tokens})
        if hasattr(cfg, "check_head_dim"):
            cfg.check_head_dim(head_dim)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{name} cannot be configured for head_dim={head_dim}: {e}") from None
    if fam == "aqua":
        if cfg.pre_rope and head_dim % 2:
            raise ValueError(f"{name} cannot serve head_dim={head_dim}: pre-RoPE keys need an even head_dim")
        for bname in ("backbone", "first_layer"):
            bb = getattr(cfg, bname)
            if isinstance(bb, aqua.Uniform) and head_dim % bb.group_size:
                raise ValueError(f"{name} cannot serve head_dim={head_dim}: the uniform {bname}'s "
                                 f"group_size={bb.group_size} must divide head_dim")
    return cfg


# ---------------------------------------------------------------------------------------------------
# bits per element


def _meta_bits(meta_dtype) -> int:
    return 8 * np.dtype(np.float16 if str(meta_dtype) in ("float16", "fp16") else meta_dtype).itemsize


def _quantized_bits(fam: str, cfg, head_dim: int, kv_heads: int, n_layers: int, accounting: str):
    """(q_k, q_v): bits of one quantized key / value element, metadata (and index) included."""
    D = head_dim
    if fam == "kivi":
        mb = _meta_bits(cfg.meta_dtype)
        return (cfg.k_bits + Fraction(2 * mb, cfg.group_size), cfg.v_bits + Fraction(2 * mb, cfg.v_group(D)))
    if fam == "kitty":
        mb = _meta_bits(cfg.meta_dtype)
        q_k = 2 + Fraction(2 * cfg.d_boost(D), D) + Fraction(2 * mb, cfg.group_size)
        if accounting == "state":
            q_k += Fraction(8, cfg.group_size)                   # the uint8 boost index per channel per page
        return q_k, cfg.v_bits + Fraction(2 * mb, cfg.v_group(D))
    if fam == "oscar":
        q = cfg.bits + Fraction(2 * _meta_bits(cfg.meta_dtype), cfg.group_size)
        return q, q
    if fam == "bitdecoding":
        return cfg.bits + Fraction(32, cfg.k_group), cfg.bits + Fraction(32, cfg.v_group)
    if fam == "aqua":
        q = aqua_cache.bits_per_value(cfg, n_layers, kv_heads * head_dim)
        return q, q
    raise AssertionError(fam)


def _fp_and_quantized_tokens(fam: str, cfg, T: int, accounting: str):
    """((fp_k, q_k_tokens), (fp_v, q_v_tokens)): tokens of one K / V stream in FP16 and quantized."""
    if accounting == "paper":
        if fam == "oscar":
            fp = cfg.sink + cfg.window
        elif fam == "bitdecoding":
            fp = 0
        else:
            fp = cfg.sink                                         # KIVI / Kitty / AQUA-KV sink tokens
        n_fp = min(fp, T)
        return (n_fp, T - n_fp), (n_fp, T - n_fp)
    if fam in ("kivi", "kitty"):
        c = paged.counts(cfg, T)
        fk = c["n_sink"] + c["n_kbuf"]
        fv = c["n_sink"] + c["n_win"] + c["n_vbuf"]
        return (fk, T - fk), (fv, T - fv)
    if fam == "oscar":
        c = oscar.counts(cfg, T)
        f = c["n_sink"] + c["n_win"]
        return (f, T - f), (f, T - f)
    if fam == "bitdecoding":
        n_p, res = bitdecoding.partition(T, cfg.n_r)
        return (res, n_p), (res, n_p)
    if fam == "aqua":
        n_sink, n_chunks, n_buf = _aqua_counts(cfg, T)
        return ((n_sink + n_buf, n_chunks * cfg.buffer),) * 2
    raise AssertionError(fam)


def _aqua_counts(cfg, T: int):
    """(n_sink, n_chunks, n_buf) of T tokens in an AQUA-KV cache (``aqua_cache``'s bookkeeping)."""
    n_sink = min(T, cfg.sink)
    post = T - n_sink
    return n_sink, post // cfg.buffer, post % cfg.buffer


def bits_per_element(name: str, cfg, *, context: int, head_dim: int, kv_heads: int, n_layers: int,
                     accounting: str = "paper") -> float:
    """Average bits per cached number (over K and V, all heads and layers) at ``context`` tokens.

    Quantized elements cost their payload plus metadata: ``bits + 2 * meta_bits / group`` (scale and
    minimum per group; keys grouped over G tokens per channel for KIVI / Kitty / BitDecoding-KC,
    values over the group's channels per token); Kitty's keys add ``2 * d_boost / D`` for the boosted
    channels' high plane; OSCAR's groups are channels per token; AQUA-KV's are
    ``aqua_cache.bits_per_value`` (first layer and residual backbone averaged over layers, HIGGS
    per-group scales included). Unquantized tokens cost 16 bits. FP16 is 16.

    ``accounting="paper"`` is ``kvq.reference.memory``'s paper accounting with this config's sizes:
    tokens the papers keep in FP16 and count (sink, OSCAR's recent window, AQUA-KV's sink) cost 16
    bits, every other token the quantized bits (residual buffers not counted: KIVI's and Kitty's
    Q-buffers and windows, AQUA-KV's buffer, BitDecoding's residual block). With the papers' sizes it
    equals ``memory.bits_per_element(memory.FORMATS[...], context)`` (KIVI-K2V2: 2.25 at any context).
    ``accounting="state"`` counts where the ``context`` tokens actually are in the state: every token
    in an FP16 sink / buffer / window / residual at 16 bits, every quantized token at the quantized
    bits plus index bits (Kitty's uint8 channel index: 8 / G per key element); preallocated empty
    capacity is not counted.
    """
    spec = get_method(name)
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting={accounting!r} is unknown; choose one of {ACCOUNTINGS}")
    T = _check_pos_int("context", context)
    for n, v in (("head_dim", head_dim), ("kv_heads", kv_heads), ("n_layers", n_layers)):
        _check_pos_int(n, v)
    if spec.family == "fp16":
        return 16.0
    q_k, q_v = _quantized_bits(spec.family, cfg, head_dim, kv_heads, n_layers, accounting)
    (fk, nk), (fv, nv) = _fp_and_quantized_tokens(spec.family, cfg, T, accounting)
    total = 16 * fk + nk * q_k + 16 * fv + nv * q_v
    return float(Fraction(total) / (2 * T))


# ---------------------------------------------------------------------------------------------------
# KVStore


def _torch():
    import torch
    return torch


def _fast_interpreting() -> bool:
    """Whether kvq's Triton kernels run under Triton's CPU interpreter: the process-wide fact of
    ``kvq.fast._common.interpreting`` (fixed when the kernels were decorated), never the environment."""
    from kvq.fast import _common
    return _common.interpreting()


def _to_numpy(a):
    """A reference array or a fast-tier tensor as a NumPy array (uint16 tensors included)."""
    torch = _torch()
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        if a.dtype == torch.uint16:
            return a.view(torch.int16).numpy().view(np.uint16)
        return a.numpy()
    return np.asarray(a)


def resolve_calibration(name: str, calibration, *, n_layers: int, kv_heads: int, head_dim: int):
    """Validate ``calibration`` for method ``name`` on a model's cache shape and return what the method
    takes: None (methods without calibration), a list of ``n_layers`` ``OSCARCalibration`` (OSCAR) or an
    ``AquaPredictors`` (AQUA-KV). "identity" gives ``oscar.identity_calibration`` for every layer, or
    predictor-less AQUA-KV (empty predictors; the store then disables prediction). Errors name the
    method, the layer and the mismatch; a missing calibration names ``kvq calibrate``."""
    spec = get_method(name)
    kind, L, H, D = spec.calibration, n_layers, kv_heads, head_dim
    if kind is None:
        if calibration is not None:
            raise ValueError(f"{name} takes no calibration (got {type(calibration).__name__})")
        return None
    if calibration is None:
        what = ("a list of one kvq.reference.oscar.OSCARCalibration per layer" if kind == "oscar"
                else "kvq.reference.aqua.AquaPredictors for every layer")
        raise ValueError(f"{name} needs a calibration: {what}. Run `kvq calibrate` on the model (or "
                         f"calibrate with kvq.reference.{kind}.calibrate), or pass calibration='identity' "
                         f"for the uncalibrated baseline")
    if isinstance(calibration, str):
        if calibration != "identity":
            raise ValueError(f"calibration={calibration!r} is unknown; pass calibration objects or 'identity'")
        if kind == "oscar":
            return [oscar.identity_calibration(D)] * L
        return aqua.AquaPredictors((None,) * L, (None,) * L)
    if kind == "oscar":
        if isinstance(calibration, oscar.OSCARCalibration) or not hasattr(calibration, "__len__"):
            raise TypeError(f"{name} calibration must be a list of {L} OSCARCalibration (one per "
                            f"layer), got {type(calibration).__name__}")
        cal = list(calibration)
        if len(cal) != L:
            raise ValueError(f"{name} calibration has {len(cal)} layers; the model has {L}")
        for l, c in enumerate(cal):
            if not isinstance(c, oscar.OSCARCalibration):
                raise TypeError(f"calibration[{l}] must be an OSCARCalibration, got {type(c).__name__}")
            try:
                c.check(H, D)
            except ValueError as e:
                raise ValueError(f"{name} calibration of layer {l} does not fit this model "
                                 f"(head_dim={D}, kv_heads={H}): {e}") from None
        return cal
    if not isinstance(calibration, aqua.AquaPredictors):
        raise TypeError(f"{name} calibration must be kvq.reference.aqua.AquaPredictors, got "
                        f"{type(calibration).__name__}")
    if calibration.n_layers != L:
        raise ValueError(f"{name} calibration has predictors for {calibration.n_layers} layers; the "
                         f"model has {L}")
    F = H * D
    for l in range(1, L):
        for which, p, f_in in (("f_key", calibration.f_key[l], F), ("f_value", calibration.f_value[l], 2 * F)):
            if p is None:
                continue
            shp = (np.shape(p.mats[0])[0], np.shape(p.mats[-1])[-1])
            if shp != (f_in, F):
                raise ValueError(f"{name} calibration {which}[{l}] maps {shp[0]} -> {shp[1]} values; this "
                                 f"model needs {f_in} -> {F} (kv_heads={H} x head_dim={D})")
            if not all(np.isfinite(np.asarray(a)).all() for a in (*p.mats, p.bias)):
                raise ValueError(f"{name} calibration {which}[{l}] has NaN or inf weights; every prediction "
                                 f"would be NaN (recalibrate: `kvq calibrate aqua`)")
    return calibration


def _checked_half(t, dtype, name: str):
    """Torch tensor ``t`` rounded to the 16-bit ``dtype``, refusing NaN / inf input and overflow (the
    methods' rule for what enters an FP16 buffer)."""
    torch = _torch()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or inf")
    y = t.to(dtype)
    if not bool(torch.isfinite(y).all()):
        raise ValueError(f"{name} overflows {str(dtype).replace('torch.', '')} (|x| > "
                         f"{torch.finfo(dtype).max:g}); the FP16 buffers cannot hold it")
    return y


#: the dtypes ``KVStore.keys_values`` / ``update`` return, by name
OUT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _to_out(x, dtype):
    """Dequantized fp32 ``x`` in ``dtype``: float16 saturates finite values beyond +-65504 (the numerics
    contract's ``to_out``, on torch tensors ``kvq.fast._common.to_out``: a group holding 65504 has a top code
    whose fp32 value rounds to inf in fp16)."""
    return importlib.import_module("kvq.fast._common").to_out(x, dtype)


def _out_dtype(dtype):
    """The torch dtype of ``keys_values(layer, dtype)``: None (float32), a torch float dtype of
    :data:`OUT_DTYPES` or its name; TypeError otherwise (checked before the store changes)."""
    torch = _torch()
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype in OUT_DTYPES:
        return getattr(torch, dtype)
    if isinstance(dtype, torch.dtype) and str(dtype).replace("torch.", "") in OUT_DTYPES:
        return dtype
    raise TypeError(f"dtype={dtype!r} is not an output dtype of a kvq store; pass None (float32), a torch dtype "
                    f"or a name among {', '.join(OUT_DTYPES)}")


def _copy_state(old, new, cfg):
    """``new`` (an empty state from ``init(cfg, ...)``, larger in capacity only) holding ``old``'s contents:
    every array of ``old`` copied into the leading block of the same array of ``new`` (page pools and tables
    grow along one axis; the used part of each is a prefix, the rest keeps ``init``'s fill), every other field
    (length, page counters, shape) taken from ``old``, and ``cfg`` recorded."""
    fields = {}
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if f.name == "cfg":
            fields[f.name] = cfg
        else:
            fields[f.name] = _copy_into(a, b, f.name)
    return dataclasses.replace(new, **fields)


def _copy_into(a, b, name: str):
    """``a`` copied into the leading block of ``b`` (arrays, or dicts of them); other values: ``a``."""
    torch = _torch()
    if isinstance(a, dict):
        return {k: _copy_into(a[k], b[k], f"{name}.{k}") for k in a}
    if isinstance(a, (np.ndarray, torch.Tensor)):
        if tuple(a.shape) == tuple(b.shape):
            return a
        if a.ndim != b.ndim or any(x > y for x, y in zip(a.shape, b.shape)):
            raise AssertionError(f"state array {name} cannot grow from {tuple(a.shape)} to {tuple(b.shape)}")
        b[tuple(slice(0, x) for x in a.shape)] = a
        return b
    return a


class KVStore:
    """All layers of one batch's compressed KV cache for method ``name``.

    Args:
        name: a key of ``METHODS``.
        n_layers, batch, kv_heads, head_dim: the model's cache shape (batch fixed for the store's life).
        max_tokens: capacity per sequence (pages are preallocated for it); with ``grow=True`` only the
            initial capacity.
        grow: when an append needs more than the capacity, reallocate every layer's state for
            ``max(needed, 2 * capacity)`` tokens (at most ``max_capacity``) and copy the pages over, instead
            of refusing the append. Off by default: a fixed capacity keeps every buffer where it is (what a
            captured CUDA graph needs); the HF caches turn it on unless given ``max_tokens``.
        max_capacity: with ``grow``, the largest capacity (None: no limit); an append beyond it is refused.
        validate: the fast backends' NaN / inf scan of appended tokens (``kvq.fast.validation``), a device
            read per append. False: no scan (a model's step then never waits on the GPU; NaN keys give NaN
            outputs, as in an FP16 cache); shapes, dtypes, devices and capacity are still checked. The
            reference, FP16 and AQUA-KV's waiting tokens are checked either way.
        backend: "reference" (NumPy, ``kvq.reference``), "triton" / "cupy" (``kvq.fast.<backend>``, state
            on a CUDA device), or "auto": reference unless ``device`` is a CUDA device, then triton.
        calibration: OSCAR: a list of one ``oscar.OSCARCalibration`` per layer, or "identity"
            (``oscar.identity_calibration``: no rotation, no clipping); AQUA-KV: an
            ``aqua.AquaPredictors`` for ``n_layers`` layers, or "identity" (no predictors: the
            "w/o K and V predictor" ablation, ``predict_keys = predict_values = False``). Other
            methods take none. A method that needs one and gets none raises ValueError.
        device: where ``keys_values`` returns its tensors (and the fast tiers keep the state); default
            the CPU for the reference, the current CUDA device for triton / cupy.
        overrides: config fields for :func:`configure`.

    ``append(layer, k, v)`` takes post-RoPE keys and values (B, H_kv, T_new, D), NumPy or torch, any
    float dtype: float16 and float32 go to the method as they are (it rounds to its FP16 buffers);
    bfloat16 is widened exactly to float32 first, float64 rounded to float32. ``keys_values(layer)``
    returns everything appended to the layer so far, dequantized, as torch tensors (fp32 by default).
    Every call checks everything before its first write: a rejected call (ValueError / TypeError naming
    the argument) leaves the store bit-identical, so retrying it never appends twice.

    AQUA-KV compresses all layers of a chunk together: the tokens given to each layer wait (rounded to
    fp16) until every layer has received them, then one ``aqua_cache.append`` takes them all; a layer
    whose tokens still wait reads the committed cache dequantized followed by its waiting tokens exactly
    (Algorithm 4's order). :meth:`update` is append-then-read with that order for every layer (the
    read happens before the commit the append completes), the step of a transformer layer. Tokens
    past the sink that a layer's quantizer could not take (keys that leave fp16 once undone from RoPE)
    are refused by the append that brings them where that layer alone decides it; otherwise the commit
    fails and the append that completed it is undone (the store as before that call).

    Dequantized results are memoised per layer (and output dtype) and recomputed only after the layer's
    state changed (``dequantize_calls`` counts the recomputations). ``memoize=False`` keeps no dequantized
    copy: a transformer's cache changes at every step, so a memo would only hold every layer's whole cache
    decompressed between steps (the HF cache classes build their store so). The reference AQUA-KV decodes each
    chunk once (chunks are encoded and decoded independently), so a decode step costs only the
    chunks it completed.
    """

    def __init__(self, name: str, *, n_layers: int, batch: int, kv_heads: int, head_dim: int, max_tokens: int,
                 backend: str = "auto", calibration=None, device=None, memoize: bool = True, grow: bool = False,
                 max_capacity: int | None = None, validate: bool = True, **overrides):
        torch = _torch()
        self.spec = get_method(name)
        self.memoize = bool(memoize)
        self.name = name
        self.n_layers = _check_pos_int("n_layers", n_layers)
        self.batch = _check_pos_int("batch", batch)
        self.kv_heads = _check_pos_int("kv_heads", kv_heads)
        self.head_dim = _check_pos_int("head_dim", head_dim)
        self.max_tokens = _check_pos_int("max_tokens", max_tokens)
        if not isinstance(grow, (bool, np.bool_)):
            raise TypeError(f"grow must be True or False, got {grow!r}")
        self.grow = bool(grow)
        if not isinstance(validate, (bool, np.bool_)):
            raise TypeError(f"validate must be True or False, got {validate!r}")
        self.validate = bool(validate)
        self.max_capacity = None if max_capacity is None else _check_pos_int("max_capacity", max_capacity)
        if self.max_capacity is not None and self.max_capacity < self.max_tokens:
            raise ValueError(f"max_capacity={self.max_capacity} is below max_tokens={self.max_tokens}")
        self.growths = 0                                         # reallocations so far (grow=True)
        self.backend, self.device = self._resolve_backend(backend, device)
        fam = self.spec.family
        if fam == "aqua" and isinstance(calibration, str) and calibration == "identity":
            overrides = {"predict_keys": False, "predict_values": False, **overrides}
        self.cfg = configure(name, head_dim=head_dim, max_tokens=max_tokens, kv_heads=kv_heads, **overrides)
        self.calibration = self._resolve_calibration(calibration)
        self.dequantize_calls = 0
        L = self.n_layers
        self._memo = [dict() for _ in range(L)]                 # layer -> {dtype: (K, V)}
        self._mod = None
        if fam == "fp16":
            self._k = [None] * L
            self._v = [None] * L
            self._fp_dtype = None
            self._len = [0] * L
            return
        if self.backend == "reference":
            self._mod = importlib.import_module(f"kvq.reference.{self.spec.module}")
        else:
            self._mod = importlib.import_module(f"kvq.fast.{self.backend}.{self.spec.module}")
        with self._device_ctx():
            if fam == "aqua":
                self._state = self._mod.init(self.cfg, L, self.batch, self.kv_heads, self.head_dim)
                self._pending_k = [None] * L
                self._pending_v = [None] * L
                self._chunks = []                                    # reference: decoded chunks, all layers
                self._aqua_all = None                                # fast: (length, [(K_l, V_l)])
                self._history = None                                 # fast: (layer, chunks, hat) in a step
            else:
                self._states = [self._mod.init(self.cfg, self.batch, self.kv_heads, self.head_dim)
                                for _ in range(L)]
        del torch

    # ------------------------------------------------------------------ setup helpers

    def _resolve_backend(self, backend, device):
        torch = _torch()
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is unknown; choose one of {BACKENDS}")
        dev = None if device is None else torch.device(device)
        if backend == "auto":
            backend = "triton" if (dev is not None and dev.type == "cuda") else "reference"
        if backend == "reference":
            return backend, dev if dev is not None else torch.device("cpu")
        if not torch.cuda.is_available():
            if backend == "triton" and _fast_interpreting():
                return backend, torch.device("cpu")
            raise RuntimeError(f"backend={backend!r} keeps the cache on a CUDA device and none is available"
                               + (" (Triton can run on the CPU under TRITON_INTERPRET=1)" if backend == "triton"
                                  else "") + "; use backend='reference'")
        if dev is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type != "cuda":
            raise ValueError(f"backend={backend!r} needs a CUDA device, got device={dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return backend, dev

    def _device_ctx(self):
        torch = _torch()
        if self.device.type == "cuda" and self.backend != "reference":
            return torch.cuda.device(self.device)
        import contextlib
        return contextlib.nullcontext()

    def _resolve_calibration(self, calibration):
        return resolve_calibration(self.name, calibration, n_layers=self.n_layers, kv_heads=self.kv_heads,
                                   head_dim=self.head_dim)

    # ------------------------------------------------------------------ inputs

    def _check_layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.n_layers:
            raise IndexError(f"layer={layer!r} is out of range for {self.n_layers} layers")
        return int(layer)

    def _convert(self, x, name: str):
        """x as the method's input: NumPy float16 / float32 (reference) or a torch tensor on the device."""
        torch = _torch()
        if not isinstance(x, (torch.Tensor, np.ndarray)):
            try:
                x = np.asarray(x)
            except (ValueError, TypeError) as e:
                raise TypeError(f"{name} must be a float array or tensor (B, H_kv, T_new, D), got "
                                f"{type(x).__name__} ({e})") from None
        shape = tuple(x.shape)
        B, H, D = self.batch, self.kv_heads, self.head_dim
        if len(shape) != 4 or shape[0] != B or shape[1] != H or shape[3] != D:
            raise ValueError(f"{name} has shape {shape}; this cache takes (B={B}, H_kv={H}, T_new, D={D})")
        if isinstance(x, torch.Tensor):
            if x.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{name} is on {x.device}; a kvq store takes CPU or CUDA tensors (or NumPy arrays)")
            x = x.detach()
            if not x.is_floating_point():
                raise TypeError(f"{name} has dtype {x.dtype}; append takes a float tensor")
            if x.dtype not in (torch.float16, torch.float32):
                x = x.to(torch.float32)                       # bf16: exact; fp64: rounded once
            if self.backend == "reference":
                return x.cpu().numpy()
            return x.to(self.device)
        a = np.asarray(x)
        if a.dtype.kind != "f":
            raise TypeError(f"{name} has dtype {a.dtype}; append takes a float array")
        if a.dtype not in (np.float16, np.float32):
            a = a.astype(np.float32)
        if self.backend == "reference":
            return a
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _round16(self, x, name: str):
        """x (converted) rounded to fp16, refusing NaN / inf and fp16 overflow (the methods' rule); a new
        array, never the caller's memory."""
        torch = _torch()
        if isinstance(x, torch.Tensor):
            y = _checked_half(x, torch.float16, name)
            return y.clone() if y.data_ptr() == x.data_ptr() else y
        if not np.isfinite(x).all():
            raise ValueError(f"{name} contains NaN or inf")
        with np.errstate(over="ignore"):
            y = x.astype(np.float16)
        if not np.isfinite(y).all():
            raise ValueError(f"{name} overflows float16 (|x| > 65504); the FP16 buffers cannot hold it")
        return y

    def _check_capacity(self, layer: int, n: int):
        need = self.length(layer) + n
        if need <= self.max_tokens:
            return
        if not self.grow:
            raise ValueError(f"appending {n} tokens to {self.length(layer)} exceeds the capacity "
                             f"max_tokens={self.max_tokens} of layer {layer} (grow=False)")
        if self.max_capacity is not None and need > self.max_capacity:
            raise ValueError(f"appending {n} tokens to {self.length(layer)} exceeds max_capacity="
                             f"{self.max_capacity} of layer {layer}")

    def _grown_capacity(self, need: int) -> int:
        """The capacity a growth to ``need`` tokens allocates: doubling (amortized O(1) copies per token),
        at least ``need``, at most ``max_capacity``."""
        cap = max(need, 2 * self.max_tokens)
        return cap if self.max_capacity is None else min(cap, self.max_capacity)

    def _grow_to(self, need: int) -> None:
        """Reallocate every layer's state for :meth:`_grown_capacity` tokens and copy the old states in (each
        array's pages, tables and counters keep their place: a state's capacity only sizes its pools and page
        tables, whose used part is a prefix). The config changes only in ``max_tokens``. Called by
        :meth:`_write` inside :meth:`_atomic`, which puts the old states back if the append then fails."""
        fam = self.spec.family
        if fam == "fp16" or need <= self.max_tokens:
            return
        cap = self._grown_capacity(need)
        cfg = dataclasses.replace(self.cfg, max_tokens=cap)
        with self._device_ctx():
            if fam == "aqua":
                new = self._mod.init(cfg, self.n_layers, self.batch, self.kv_heads, self.head_dim)
                self._state = _copy_state(self._state, new, cfg)
            else:
                self._states = [_copy_state(old, self._mod.init(cfg, self.batch, self.kv_heads, self.head_dim), cfg)
                                for old in self._states]
        self.cfg, self.max_tokens = cfg, cap
        self.growths += 1

    # ------------------------------------------------------------------ public API

    def length(self, layer: int) -> int:
        """Tokens appended to ``layer`` so far (AQUA-KV: committed plus waiting)."""
        layer = self._check_layer(layer)
        fam = self.spec.family
        if fam == "fp16":
            return self._len[layer]
        if fam == "aqua":
            p = self._pending_k[layer]
            return int(self._state.length) + (0 if p is None else int(p.shape[2]))
        return int(self._states[layer].length)

    def state(self, layer: int):
        """The kvq state object holding ``layer`` (AQUA-KV: the one cross-layer state of every layer;
        FP16: ``(K, V)`` as stored, or None before the first append)."""
        layer = self._check_layer(layer)
        fam = self.spec.family
        if fam == "fp16":
            return None if self._k[layer] is None else (self._k[layer], self._v[layer])
        if fam == "aqua":
            return self._state
        return self._states[layer]

    def pending(self, layer: int) -> int:
        """AQUA-KV: tokens of ``layer`` waiting for the other layers (0 for the other methods)."""
        layer = self._check_layer(layer)
        if self.spec.family != "aqua" or self._pending_k[layer] is None:
            return 0
        return int(self._pending_k[layer].shape[2])

    def append(self, layer: int, k, v, *, commit: bool = True) -> None:
        """Append post-RoPE tokens k, v (B, H_kv, T_new, D) to ``layer``. Everything is checked before any
        change, and a rejected call (AQUA-KV's cross-layer commit included) leaves the store as it was.

        ``commit=False`` (AQUA-KV): the tokens wait even when every layer has them; :meth:`attended` commits
        after the layer's attention, so that each layer of a model's step reads the cache before the commit
        its tokens complete (Algorithm 4's order, as :meth:`update`)."""
        layer = self._check_layer(layer)
        kx, vx = self._validate_append(layer, k, v)
        with self._atomic(layer):
            self._write(layer, kx, vx)
            if commit:
                self._commit()

    def attended(self, layer: int) -> None:
        """A model's attention of ``layer`` is done for this step: AQUA-KV commits the tokens every layer has
        received (a no-op for the other methods and while a layer still waits for its tokens), and forgets
        the history it reconstructed for the step once the last layer has attended."""
        if self.spec.family != "aqua":
            return
        layer = self._check_layer(layer)
        self._commit()
        if layer == self.n_layers - 1:
            self._history = None

    def aqua_history(self, layer: int):
        """AQUA-KV, fast backends: layer ``layer``'s history reconstructed by the predictors (``decode_layer``:
        ``(K_hat, V_hat)`` token vectors of every encoded chunk), from layer ``layer - 1``'s, which the store
        keeps only during one model step (one layer at a time, never every layer), else decoded from layer 0."""
        st = self._state
        chunks = _aqua_counts(self.cfg, st.length)[1]
        prev = None
        if layer and self._history is not None and self._history[:2] == (layer - 1, chunks):
            prev = self._history[2]
        with self._device_ctx():
            hat = self._mod.decode_layer(self.cfg, self.calibration, st, layer, prev)
        self._history = (layer, chunks, hat)
        return hat

    def update(self, layer: int, k, v, dtype=None):
        """Append k, v to ``layer`` and return its ``keys_values`` in ``dtype`` (for AQUA-KV read before the
        commit this append completes: the new tokens attend to themselves exactly, Algorithm 4).
        ``dtype`` and the tokens are checked before the append; a rejected call changes nothing."""
        layer = self._check_layer(layer)
        dtype = _out_dtype(dtype)
        kx, vx = self._validate_append(layer, k, v)
        with self._atomic(layer):
            self._write(layer, kx, vx)
            out = self.keys_values(layer, dtype)
            self._commit()
        return out

    def keys_values(self, layer: int, dtype=None):
        """(K_hat, V_hat): everything appended to ``layer``, dequantized, torch (B, H_kv, T, D) in ``dtype``
        (None: float32; a torch dtype or a name of ``OUT_DTYPES``) on the store's device. Memoised until
        the layer's state changes."""
        torch = _torch()
        layer = self._check_layer(layer)
        dtype = _out_dtype(dtype)
        memo = self._memo[layer] if self.memoize else {}
        if dtype in memo:
            return memo[dtype]
        fam = self.spec.family
        if fam == "fp16":
            if self._k[layer] is None:
                out = self._empty(dtype)
            else:
                out = (self._k[layer].to(dtype), self._v[layer].to(dtype))
            memo[dtype] = out
            return out
        if torch.float32 in memo:
            K, V = memo[torch.float32]
        else:
            K, V = self._dequantize(layer)
            memo[torch.float32] = (K, V)
        out = (_to_out(K, dtype), _to_out(V, dtype))
        memo[dtype] = out
        return out

    def bits_per_element(self, accounting: str = "state", context: int | None = None) -> float:
        """:func:`bits_per_element` of this store's method and config at ``context`` tokens (default: the
        tokens appended to layer 0; at least 1)."""
        T = max(self.length(0), 1) if context is None else context
        return bits_per_element(self.name, self.cfg, context=T, head_dim=self.head_dim, kv_heads=self.kv_heads,
                                n_layers=self.n_layers, accounting=accounting)

    def memory_bytes(self, accounting: str = "state") -> int:
        """Bytes the cached tokens occupy (every layer, K and V, the whole batch): ``bits_per_element``
        times ``2 * n_layers * batch * kv_heads * head_dim * length`` / 8, rounded up; 0 when empty."""
        T = self.length(0)
        if T == 0:
            return 0
        n = 2 * self.n_layers * self.batch * self.kv_heads * self.head_dim * T
        return int(-(-Fraction(self.bits_per_element(accounting, T)) * n // 8))

    def allocated_bytes(self) -> int:
        """Bytes of every array the state holds, preallocated capacity included (FP16: the stored tensors)."""
        fam = self.spec.family
        if fam == "fp16":
            return int(sum(t.numel() * t.element_size() for t in self._k + self._v if t is not None))
        states = [self._state] if fam == "aqua" else self._states
        total = 0
        for st in states:
            for a in st.arrays().values():
                total += int(a.nbytes) if isinstance(a, np.ndarray) else int(a.numel() * a.element_size())
        return total

    def state_arrays(self, layer: int) -> dict:
        """Every array of ``layer``'s state as NumPy (fast-tier tensors copied to the host), for comparisons."""
        st = self.state(layer)
        if st is None or isinstance(st, tuple):
            raise ValueError(f"{self.name} has no kvq state arrays")
        return {n: _to_numpy(a) for n, a in st.arrays().items()}

    # ------------------------------------------------------------------ internals

    def _empty(self, dtype):
        torch = _torch()
        z = torch.zeros((self.batch, self.kv_heads, 0, self.head_dim), dtype=dtype, device=self.device)
        return z, z.clone()

    # ------------------------------------------------------------------ append: validate, then write

    def _validate_append(self, layer: int, k, v):
        """k, v converted and checked for ``layer`` without changing anything: shapes, dtypes, capacity and
        what the write needs (FP16: finite and within the store's dtype; AQUA-KV: finite, within fp16 and,
        where this layer alone decides it, quantizable by its chunk's commit). Returns the tokens as
        :meth:`_write` takes them (the other methods' appends check their inputs before writing)."""
        kx, vx = self._convert(k, "k"), self._convert(v, "v")
        if tuple(kx.shape) != tuple(vx.shape):
            raise ValueError(f"k and v must have the same shape, got {tuple(kx.shape)} and {tuple(vx.shape)}")
        self._check_capacity(layer, int(kx.shape[2]))
        if kx.shape[2] == 0:
            return kx, vx
        fam = self.spec.family
        if fam == "fp16":
            dtype = self._fp16_dtype(k)
            return self._fp16_tensor(kx, dtype, "k"), self._fp16_tensor(vx, dtype, "v")
        if fam == "aqua":
            k16, v16 = self._round16(kx, "k"), self._round16(vx, "v")
            self._check_aqua_quantizable(layer, k16)
            return k16, v16
        return kx, vx

    def _write(self, layer: int, kx, vx) -> None:
        """Append tokens checked by :meth:`_validate_append` to ``layer``: FP16 tensors and AQUA-KV's waiting
        tokens are concatenations that cannot fail on them; the other methods' appends validate first."""
        torch = _torch()
        n = int(kx.shape[2])
        if n == 0:
            return
        fam = self.spec.family
        if fam != "aqua":                       # AQUA-KV: the tokens wait; the commit grows the state
            self._grow_to(self.length(layer) + n)
        if fam == "fp16":
            if self._fp_dtype is None:
                self._fp_dtype = kx.dtype                     # fixed by the first accepted append
            if self._k[layer] is None:
                self._k[layer], self._v[layer] = kx, vx
            else:
                self._k[layer] = torch.cat([self._k[layer], kx], dim=2)
                self._v[layer] = torch.cat([self._v[layer], vx], dim=2)
            self._len[layer] += n
        elif fam == "aqua":
            cat = (lambda a, b: torch.cat([a, b], dim=2)) if isinstance(kx, torch.Tensor) else \
                (lambda a, b: np.concatenate([a, b], axis=2))
            pk, pv = self._pending_k[layer], self._pending_v[layer]
            self._pending_k[layer] = kx if pk is None else cat(pk, kx)
            self._pending_v[layer] = vx if pv is None else cat(pv, vx)
        elif fam == "oscar":
            with self._value_checks():
                self._mod.append(self.cfg, self.calibration[layer], self._states[layer], kx, vx)
        else:
            with self._value_checks():
                self._mod.append(self.cfg, self._states[layer], kx, vx)
        self._memo[layer].clear()

    def _value_checks(self):
        """The fast tier's value scans off for this call where the store was made with ``validate=False``."""
        if self.validate or self.backend == "reference":
            return contextlib.nullcontext()
        return importlib.import_module("kvq.fast._common").validation(False)

    @contextlib.contextmanager
    def _atomic(self, layer: int):
        """Run an append of ``layer``; if it raises, put back what the store itself keeps of the layer (FP16
        tensors, length and dtype; AQUA-KV's waiting tokens; the memo and counter) and re-raise. With the
        methods' appends validating before they write, a rejected call, AQUA-KV's failed commit included,
        leaves the store exactly as it was: the call that completed the commit gets the error and its
        tokens are taken back, so later appends work."""
        fam = self.spec.family
        memo, calls = dict(self._memo[layer]), self.dequantize_calls
        fp = (self._k[layer], self._v[layer], self._len[layer], self._fp_dtype) if fam == "fp16" else None
        waiting = (self._pending_k[layer], self._pending_v[layer]) if fam == "aqua" else None
        sized = (self.cfg, self.max_tokens, self.growths,
                 None if fam == "fp16" else (self._state if fam == "aqua" else list(self._states)))
        try:
            yield
        except BaseException:
            self._memo[layer].clear()
            self._memo[layer].update(memo)
            self.dequantize_calls = calls
            if sized[2] != self.growths:               # a growth happened: the old states are intact
                self.cfg, self.max_tokens, self.growths = sized[:3]
                if fam == "aqua":
                    self._state = sized[3]
                else:
                    self._states = sized[3]
            if fp is not None:
                self._k[layer], self._v[layer], self._len[layer], self._fp_dtype = fp
            if waiting is not None:
                self._pending_k[layer], self._pending_v[layer] = waiting
            raise

    def _fp16_dtype(self, k_in):
        """FP16: the store's dtype, fixed by its first accepted append (that input's fp16 / bf16, else fp16)."""
        torch = _torch()
        if self._fp_dtype is not None:
            return self._fp_dtype
        src = getattr(k_in, "dtype", None)
        return src if src in (torch.float16, torch.bfloat16) else torch.float16

    def _fp16_tensor(self, x, dtype, name: str):
        """FP16: x as a new tensor of ``dtype`` on the store's device, NaN / inf and overflow refused whatever
        the input dtype (the quantized methods' rule); never the caller's memory."""
        torch = _torch()
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
        t = t.to(self.device)
        y = _checked_half(t, dtype, name)
        return y.clone() if y is t else y

    #: |k| up to which a key's pre-RoPE form fits fp16 (undoing RoPE rotates channel pairs: at most sqrt(2) |k|)
    _ROPE_SAFE = 46000.0

    def _check_aqua_quantizable(self, layer: int, k16) -> None:
        """AQUA-KV: refuse keys of ``layer`` that its chunk's commit could not quantize, where the layer alone
        decides it: tokens past the sink (sink tokens stay fp16) of a layer whose key residual is the
        pre-RoPE key itself (layer 0, or no key predictor).

        Every shipped quantizer (Uniform, HIGGS, KeepFP16) takes any vector within fp16's range: its scale
        and minimum fit fp16 metadata. Values are fp16 already, and so are pre-RoPE keys while |k| <= 46000;
        larger keys are undone from RoPE and run through the layer's quantizer on the host, the commit's
        own computation for them. A residual after a prediction depends on the layers before: the commit
        finds it, and :meth:`_atomic` takes the completing append back."""
        cfg, P = self.cfg, self.calibration
        if not cfg.pre_rope or (layer and cfg.predict_keys and P.f_key[layer] is not None):
            return
        t0 = self.length(layer)                               # the position of the first new token
        skip = max(0, cfg.sink - t0)
        k = k16[:, :, skip:]
        if k.shape[2] == 0 or float(abs(k).max()) <= self._ROPE_SAFE:
            return
        pos = np.arange(t0 + skip, t0 + int(k16.shape[2]))
        k_pre = apply_rope(_to_numpy(k).astype(np.float32), pos, cfg.rope_theta, inverse=True)   # (B, H, T, D)
        quantizer = cfg.first_layer if layer == 0 else cfg.backbone
        try:
            quantizer.encode(aqua.to_tokens(k_pre))
        except ValueError as e:
            raise ValueError(f"k cannot be compressed by {self.name} at layer {layer}: undone from RoPE (keys are "
                             f"quantized pre-RoPE) it leaves the range of the "
                             f"{getattr(quantizer, 'label', type(quantizer).__name__)} quantizer ({e})") from None

    def _commit(self) -> None:
        """AQUA-KV: append the tokens every layer has received (the common prefix) with one call. The method's
        append validates and encodes before it writes, so a failure (a residual beyond fp16 metadata, NaN
        predictions) leaves its state and every layer's waiting tokens as they were; the error names the
        commit, and :meth:`_atomic` takes back the tokens of the append that completed it."""
        torch = _torch()
        L = self.n_layers
        if self.spec.family != "aqua" or any(p is None for p in self._pending_k):
            return
        n = min(int(p.shape[2]) for p in self._pending_k)
        if n == 0:
            return
        if isinstance(self._pending_k[0], torch.Tensor):
            K = torch.stack([p[:, :, :n] for p in self._pending_k])
            V = torch.stack([p[:, :, :n] for p in self._pending_v])
        else:
            K = np.stack([p[:, :, :n] for p in self._pending_k])
            V = np.stack([p[:, :, :n] for p in self._pending_v])
        before = (self.cfg, self.max_tokens, self.growths, self._state)
        try:
            self._grow_to(int(self._state.length) + n)
            with self._device_ctx():
                self._mod.append(self.cfg, self.calibration, self._state, K, V)
        except (ValueError, TypeError) as e:
            self.cfg, self.max_tokens, self.growths, self._state = before
            raise type(e)(f"{self.name} could not compress the {n} token(s) of every layer that this append "
                          f"completed, so the append was undone: {e}") from e
        for l in range(L):
            rest_k, rest_v = self._pending_k[l][:, :, n:], self._pending_v[l][:, :, n:]
            keep = rest_k.shape[2] > 0
            self._pending_k[l] = rest_k if keep else None
            self._pending_v[l] = rest_v if keep else None
            self._memo[l].clear()

    def _tensor(self, a):
        torch = _torch()
        if isinstance(a, torch.Tensor):
            return a.to(self.device, torch.float32)
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(self.device)

    def _dequantize(self, layer: int):
        """The layer's cache dequantized, fp32 torch (B, H, T, D) (AQUA-KV: committed, then waiting)."""
        torch = _torch()
        fam = self.spec.family
        self.dequantize_calls += 1
        if fam == "aqua":
            K, V = self._aqua_committed(layer)
            pk, pv = self._pending_k[layer], self._pending_v[layer]
            if pk is not None:
                K = torch.cat([K, self._tensor(pk)], dim=2)
                V = torch.cat([V, self._tensor(pv)], dim=2)
            return K, V
        st = self._states[layer]
        if st.length == 0:
            return self._empty(torch.float32)
        with self._device_ctx():
            if fam == "oscar":
                K, V = self._mod.dequantize(self.cfg, self.calibration[layer], st)
            else:
                K, V = self._mod.dequantize(self.cfg, st)
        return self._tensor(K), self._tensor(V)

    def _aqua_committed(self, layer: int):
        """Layer ``layer``'s committed AQUA-KV cache, fp32 torch: sink, decoded chunks, buffer."""
        torch = _torch()
        st, cfg, P = self._state, self.cfg, self.calibration
        if st.length == 0:
            return self._empty(torch.float32)
        if self.backend != "reference":
            if self._aqua_all is None or self._aqua_all[0] != st.length:
                with self._device_ctx():
                    self._aqua_all = (st.length, self._mod.dequantize(cfg, P, st))
            K, V = self._aqua_all[1][layer]
            return self._tensor(K), self._tensor(V)
        L, B, H, D = st.shape
        n_sink, n_chunks, n_buf = _aqua_counts(cfg, st.length)
        F, R = H * D, cfg.buffer
        while len(self._chunks) < n_chunks:                  # decode each chunk once, all layers, layer 0 first
            c = len(self._chunks)
            pos = cfg.sink + c * R + np.arange(R)
            K_hat = V_hat = None
            per_layer = []
            for l in range(L):
                codes = (st.first_k, st.first_v) if l == 0 else (st.res_k, st.res_v)
                Kq, Vq = ({n: (a[:, c] if l == 0 else a[l - 1, :, c]) for n, a in g.items()} for g in codes)
                K_hat, V_hat = aqua.decode(cfg, P, l, Kq, Vq, F, K_hat, V_hat)      # (B, R, F)
                k = aqua.from_tokens(K_hat, H)
                if cfg.pre_rope:
                    k = apply_rope(k, pos, cfg.rope_theta)
                per_layer.append((k, aqua.from_tokens(V_hat, H)))
            self._chunks.append(per_layer)
        ks = [st.sink_k[layer][:, :, :n_sink].astype(np.float32)] + [ch[layer][0] for ch in self._chunks[:n_chunks]]
        vs = [st.sink_v[layer][:, :, :n_sink].astype(np.float32)] + [ch[layer][1] for ch in self._chunks[:n_chunks]]
        ks.append(st.buf_k[layer][:, :, :n_buf].astype(np.float32))
        vs.append(st.buf_v[layer][:, :, :n_buf].astype(np.float32))
        return self._tensor(np.concatenate(ks, axis=2)), self._tensor(np.concatenate(vs, axis=2))

    def __repr__(self):
        return (f"KVStore({self.name!r}, backend={self.backend!r}, n_layers={self.n_layers}, batch={self.batch}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, length={self.length(0)})")
