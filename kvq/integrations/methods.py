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

What differs between the methods' families (config adaptations, memory accounting, calibration, how a
store writes, reads and decodes) is one class per family in ``kvq.integrations.families``; this module and
the store dispatch through it and never branch on the family.

The device helpers the integration modules share live here too, public but outside ``__all__``:
:func:`layer_devices` and :func:`same_device`; the tensor helpers of the store and the families are
``kvq.integrations.tensors``.

This module imports NumPy and kvq.reference only; torch is imported when a store is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import numpy as np

from kvq.reference import aqua, bitdecoding, kitty, kivi, oscar

from . import families as F
from .tensors import check_pos_int, checked_half, fast_common, import_torch, to_numpy

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
    head_dim = check_pos_int("head_dim", head_dim)
    max_tokens = check_pos_int("max_tokens", max_tokens)
    base = spec.base()
    fields = {f.name for f in dataclasses.fields(base)} - {"name", "max_tokens"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"{name} has no option {', '.join(map(repr, unknown))}; its options are: "
                         f"{', '.join(sorted(fields)) or '(none)'}")
    family = F.family_of(spec)
    adapt = family.adapt(name, base, overrides, head_dim, kv_heads)
    try:
        cfg = dataclasses.replace(base, **{**adapt, **overrides, "max_tokens": max_tokens})
        if hasattr(cfg, "check_head_dim"):
            cfg.check_head_dim(head_dim)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{name} cannot be configured for head_dim={head_dim}: {e}") from None
    family.check_config(name, cfg, head_dim)
    return cfg


# ---------------------------------------------------------------------------------------------------
# bits per element


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
    T = check_pos_int("context", context)
    for n, v in (("head_dim", head_dim), ("kv_heads", kv_heads), ("n_layers", n_layers)):
        check_pos_int(n, v)
    return F.family_of(spec).bits_per_element(cfg, T, head_dim, kv_heads, n_layers, accounting)


# ---------------------------------------------------------------------------------------------------
# KVStore


def resolve_calibration(name: str, calibration, *, n_layers: int, kv_heads: int, head_dim: int):
    """Validate ``calibration`` for method ``name`` on a model's cache shape and return what the method
    takes: None (methods without calibration), a list of ``n_layers`` ``OSCARCalibration`` (OSCAR) or an
    ``AquaPredictors`` (AQUA-KV). "identity" gives ``oscar.identity_calibration`` for every layer, or
    predictor-less AQUA-KV (empty predictors; the store then disables prediction). Errors name the
    method, the layer and the mismatch; a missing calibration names ``kvq calibrate``."""
    return F.family_of(get_method(name)).resolve_calibration(name, calibration, n_layers, kv_heads, head_dim)


#: the dtypes ``KVStore.keys_values`` / ``update`` return, by name
OUT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _out_dtype(dtype):
    """The torch dtype of ``keys_values(layer, dtype)``: None (float32), a torch float dtype of
    :data:`OUT_DTYPES` or its name; TypeError otherwise (checked before the store changes)."""
    torch = import_torch()
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype in OUT_DTYPES:
        return getattr(torch, dtype)
    if isinstance(dtype, torch.dtype) and str(dtype).replace("torch.", "") in OUT_DTYPES:
        return dtype
    raise TypeError(f"dtype={dtype!r} is not an output dtype of a kvq store; pass None (float32), a torch dtype "
                    f"or a name among {', '.join(OUT_DTYPES)}")


def layer_devices(device, n_layers: int):
    """``KVStore(device=)`` as one torch device per layer: None stays None (the backend's default), one device
    (a ``torch.device``, its string or a CUDA index) serves every layer, a list or tuple gives one per layer.
    ValueError for a wrong length or an unknown device string, TypeError for anything else."""
    torch = import_torch()

    def one(d, what):
        if isinstance(d, bool) or not isinstance(d, (str, int, np.integer, torch.device)):
            raise TypeError(f"{what} must be a torch.device, a device string or a CUDA index, got "
                            f"{type(d).__name__}")
        try:
            return torch.device(int(d) if isinstance(d, np.integer) else d)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"{what}={d!r} is not a torch device ({e})") from None

    if device is None:
        return None
    if isinstance(device, (list, tuple)):
        if len(device) != n_layers:
            raise ValueError(f"device has {len(device)} entries; pass one device, or one per layer "
                             f"({n_layers} layers)")
        return [one(d, f"device[{l}]") for l, d in enumerate(device)]
    if isinstance(device, (str, int, np.integer, torch.device)) and not isinstance(device, bool):
        return [one(device, "device")] * n_layers
    raise TypeError(f"device must be None, a torch.device (or its string / CUDA index) or a list of one per "
                    f"layer ({n_layers}), got {type(device).__name__}")


#: what a device without an index ("cuda") stands for in :func:`same_device`
UNINDEXED = ("any", "zero")


def same_device(a, b, *, unindexed: str = "any") -> bool:
    """Whether devices ``a`` and ``b`` (``torch.device``, a device string or a CUDA index) are one device.

    Devices of different types never are; two indexed devices are one when their indices are equal. A device
    without an index ("cuda") is read by ``unindexed``:

    * "any" (default): it matches every index of its type ("cuda" names whichever CUDA device is current:
      what a store's or a cache's device check accepts, ``cuda`` against ``cuda:1`` included);
    * "zero": it is index 0 ("cuda" is "cuda:0", not "cuda:1": what CUDA-graph decode compares, a model's
      device against the layers' devices of its cache).

    ValueError for another ``unindexed``; TypeError / RuntimeError from ``torch.device`` for what is no
    device.
    """
    if unindexed not in UNINDEXED:
        raise ValueError(f"unindexed must be one of {UNINDEXED}, got {unindexed!r}")
    torch = import_torch()
    if isinstance(a, torch.device) and a == b:          # the common case, one device: no further work
        return True
    a, b = (d if isinstance(d, torch.device) else torch.device(d) for d in (a, b))
    if a.type != b.type:
        return False
    if unindexed == "zero":
        return (a.index or 0) == (b.index or 0)
    return a.index is None or b.index is None or a.index == b.index


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
            outputs, as in an FP16 cache; so do FP16's and AQUA-KV's tokens beyond fp16's range, and AQUA-KV
            keys whose pre-RoPE form its quantizer cannot hold); shapes, dtypes, devices and capacity are
            still checked. The reference backend (NumPy arrays) is checked either way.
        backend: "reference" (NumPy, ``kvq.reference``), "triton" / "cupy" (``kvq.fast.<backend>``, state
            on a CUDA device), or "auto": reference unless ``device`` is a CUDA device, then triton.
        calibration: OSCAR: a list of one ``oscar.OSCARCalibration`` per layer, or "identity"
            (``oscar.identity_calibration``: no rotation, no clipping); AQUA-KV: an
            ``aqua.AquaPredictors`` for ``n_layers`` layers, or "identity" (no predictors: the
            "w/o K and V predictor" ablation, ``predict_keys = predict_values = False``). Other
            methods take none. A method that needs one and gets none raises ValueError.
        device: where ``keys_values`` returns its tensors (and the fast tiers keep the state); default
            the CPU for the reference, the current CUDA device for triton / cupy. One device (a
            ``torch.device``, its string or a CUDA index) serves every layer; a list or tuple of
            ``n_layers`` devices places each layer on its own (a model spread over GPUs with
            ``device_map``): every state, buffer and output of layer ``l`` then lives on ``devices[l]``, the
            fast kernels of layer ``l`` run under that device, and a CUDA tensor appended to layer ``l`` from
            another device is refused (ValueError, the store unchanged; host input, NumPy or CPU tensors, is
            copied over). "auto" picks triton only when every layer is on a CUDA device. AQUA-KV keeps all
            layers in one cross-layer state and refuses more than one distinct device (ValueError at
            construction). ``devices`` is the tuple of one device per layer; ``device`` is layer 0's.
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

    What differs between the methods is one object of their family's class (``kvq.integrations.families``):
    the store checks, converts and keeps atomicity the same way for every method and hands the rest to it
    (``prepare`` / ``write`` / ``commit`` an append, ``dequantize`` / ``read`` a layer, ``decode_attention``
    a query). The store's state is ``layer_states`` (one entry per layer: the method's state, FP16's
    tensors, AQUA-KV's waiting tokens) and ``shared_state`` (what the layers share: AQUA-KV's cross-layer
    state, FP16's dtype); the family reads and replaces them, and a rejected call puts both back. What the
    family uses of the store besides them: :meth:`check_layer`, :meth:`device_ctx`, :meth:`tensor`,
    :meth:`empty`, :meth:`round16`, :meth:`value_checks`, :meth:`grow_to`, :meth:`dequantize` and
    :meth:`clear_memo`.

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
        self.spec = get_method(name)
        self.memoize = bool(memoize)
        self.name = name
        self.n_layers = check_pos_int("n_layers", n_layers)
        self.batch = check_pos_int("batch", batch)
        self.kv_heads = check_pos_int("kv_heads", kv_heads)
        self.head_dim = check_pos_int("head_dim", head_dim)
        self.max_tokens = check_pos_int("max_tokens", max_tokens)
        if not isinstance(grow, (bool, np.bool_)):
            raise TypeError(f"grow must be True or False, got {grow!r}")
        self.grow = bool(grow)
        if not isinstance(validate, (bool, np.bool_)):
            raise TypeError(f"validate must be True or False, got {validate!r}")
        self.validate = bool(validate)
        self.max_capacity = None if max_capacity is None else check_pos_int("max_capacity", max_capacity)
        if self.max_capacity is not None and self.max_capacity < self.max_tokens:
            raise ValueError(f"max_capacity={self.max_capacity} is below max_tokens={self.max_tokens}")
        self.growths = 0                                         # reallocations so far (grow=True)
        self.backend, self.devices = self._resolve_backend(backend, device)
        self.device = self.devices[0]
        family = F.family_of(self.spec)
        family.check_devices(name, self.devices)
        overrides = family.store_overrides(calibration, overrides)
        self.cfg = configure(name, head_dim=head_dim, max_tokens=max_tokens, kv_heads=kv_heads, **overrides)
        self.calibration = self._resolve_calibration(calibration)
        self.dequantize_calls = 0
        self._memo = [dict() for _ in range(self.n_layers)]     # layer -> {dtype: (K, V)}
        self._family = family(self)                            # the method's module and derived caches
        # the whole state: one entry per layer (each on its layer's device) and what the layers share
        self.layer_states, self.shared_state = self._family.init(self.cfg)

    # ------------------------------------------------------------------ setup helpers

    def _resolve_backend(self, backend, device):
        """(backend, devices): the backend "auto" resolves to and one torch device per layer (see the class)."""
        torch = import_torch()
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is unknown; choose one of {BACKENDS}")
        devs = layer_devices(device, self.n_layers)
        if backend == "auto":
            backend = "triton" if (devs is not None and all(d.type == "cuda" for d in devs)) else "reference"
        if backend == "reference":
            return backend, tuple(devs) if devs is not None else (torch.device("cpu"),) * self.n_layers
        if not torch.cuda.is_available():
            from kvq.fast import triton_interpreting          # (kvq.fast needs torch: imported where torch is)
            if backend == "triton" and triton_interpreting():
                return backend, (torch.device("cpu"),) * self.n_layers
            raise RuntimeError(f"backend={backend!r} keeps the cache on a CUDA device and none is available"
                               + (" (Triton can run on the CPU under TRITON_INTERPRET=1)" if backend == "triton"
                                  else "") + "; use backend='reference'")
        if devs is None:
            devs = [torch.device("cuda", torch.cuda.current_device())] * self.n_layers
        for l, dev in enumerate(devs):
            if dev.type != "cuda":
                what = "device" if len(set(devs)) == 1 else f"device[{l}]"
                raise ValueError(f"backend={backend!r} needs a CUDA device, got {what}={dev}")
        return backend, tuple(torch.device("cuda", torch.cuda.current_device()) if d.index is None else d
                              for d in devs)

    def _resolve_calibration(self, calibration):
        return resolve_calibration(self.name, calibration, n_layers=self.n_layers, kv_heads=self.kv_heads,
                                   head_dim=self.head_dim)

    # ------------------------------------------------------------------ inputs

    def _convert(self, x, name: str, layer: int):
        """x as the method's input: NumPy float16 / float32 (reference) or a torch tensor on ``layer``'s device.
        Host input (NumPy, CPU tensors) is copied over; a CUDA tensor must be on the layer's device where that
        is a CUDA device (ValueError otherwise: a model spread over devices appends each layer on its own)."""
        torch = import_torch()
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
            dev = self.devices[layer]
            if x.device.type == "cuda" and dev.type == "cuda" and not same_device(x.device, dev):
                raise ValueError(f"{name} is on {x.device}; layer {layer} of this store lives on {dev} (a model "
                                 f"spread over devices appends each layer's tokens on that layer's device)")
            if x.requires_grad:
                x = x.detach()
            if not x.is_floating_point():
                raise TypeError(f"{name} has dtype {x.dtype}; append takes a float tensor")
            if x.dtype not in (torch.float16, torch.float32):
                x = x.to(torch.float32)                       # bf16: exact; fp64: rounded once
            if self.backend == "reference":
                return x.cpu().numpy()
            return x if x.device == dev else x.to(dev)
        a = np.asarray(x)
        if a.dtype.kind != "f":
            raise TypeError(f"{name} has dtype {a.dtype}; append takes a float array")
        if a.dtype not in (np.float16, np.float32):
            a = a.astype(np.float32)
        if self.backend == "reference":
            return a
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.devices[layer])

    def _check_capacity(self, layer: int, n: int):
        need = self._family.length(layer) + n
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

    # ------------------------------------------------------------------ public API

    def length(self, layer: int) -> int:
        """Tokens appended to ``layer`` so far (AQUA-KV: committed plus waiting)."""
        return self._family.length(self.check_layer(layer))

    def state(self, layer: int):
        """The kvq state object holding ``layer`` (AQUA-KV: the one cross-layer state of every layer;
        FP16: ``(K, V)`` as stored, or None before the first append)."""
        return self._family.state(self.check_layer(layer))

    def pending(self, layer: int) -> int:
        """AQUA-KV: tokens of ``layer`` waiting for the other layers (0 for the other methods)."""
        return self._family.pending(self.check_layer(layer))

    def append(self, layer: int, k, v, *, commit: bool = True) -> None:
        """Append post-RoPE tokens k, v (B, H_kv, T_new, D) to ``layer``. Everything is checked before any
        change, and a rejected call (AQUA-KV's cross-layer commit included) leaves the store as it was.

        ``commit=False`` (AQUA-KV): the tokens wait even when every layer has them; :meth:`attended` commits
        after the layer's attention, so that each layer of a model's step reads the cache before the commit
        its tokens complete (Algorithm 4's order, as :meth:`update`)."""
        layer = self.check_layer(layer)
        kx, vx = self._validate_append(layer, k, v)
        with self._atomic(layer):
            self._write(layer, kx, vx)
            if commit:
                self._commit()

    def attended(self, layer: int) -> None:
        """A model's attention of ``layer`` is done for this step: AQUA-KV commits the tokens every layer has
        received (a no-op for the other methods and while a layer still waits for its tokens), and forgets
        the history it reconstructed for the step once the last layer has attended."""
        self._family.attended(layer)

    def aqua_history(self, layer: int):
        """AQUA-KV, fast backends: layer ``layer``'s history reconstructed by the predictors (``decode_layer``:
        ``(K_hat, V_hat)`` token vectors of every encoded chunk), from layer ``layer - 1``'s, which the store
        keeps only during one model step (one layer at a time, never every layer), else decoded from layer 0."""
        return self._family.aqua_history(layer)

    @property
    def exact(self) -> bool:
        """True where reads are the stored tokens themselves (FP16): a model may attend over ``keys_values``
        with its own attention, as over a DynamicCache."""
        return self._family.exact

    def decode_attention(self, layer: int, q, scale=None):
        """Attention of ``q`` (B, H_q, T_q, D) over everything held for ``layer``, by the method's fused decode
        on the store's backend (the family's ``decode_attention``); (B, H_q, T_q, D) in q's dtype on q's
        device."""
        return self._family.decode_attention(self.check_layer(layer), q, scale)

    def update(self, layer: int, k, v, dtype=None):
        """Append k, v to ``layer`` and return its ``keys_values`` in ``dtype`` (for AQUA-KV read before the
        commit this append completes: the new tokens attend to themselves exactly, Algorithm 4).
        ``dtype`` and the tokens are checked before the append; a rejected call changes nothing."""
        layer = self.check_layer(layer)
        dtype = _out_dtype(dtype)
        kx, vx = self._validate_append(layer, k, v)
        with self._atomic(layer):
            self._write(layer, kx, vx)
            out = self.keys_values(layer, dtype)
            self._commit()
        return out

    def keys_values(self, layer: int, dtype=None):
        """(K_hat, V_hat): everything appended to ``layer``, dequantized, torch (B, H_kv, T, D) in ``dtype``
        (None: float32; a torch dtype or a name of ``OUT_DTYPES``) on the layer's device. Memoised until
        the layer's state changes."""
        layer = self.check_layer(layer)
        dtype = _out_dtype(dtype)
        memo = self._memo[layer] if self.memoize else {}
        if dtype in memo:
            return memo[dtype]
        out = self._family.read(layer, dtype, memo)
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
        return self._family.allocated_bytes()

    def state_arrays(self, layer: int) -> dict:
        """Every array of ``layer``'s state as NumPy (fast-tier tensors copied to the host), for comparisons."""
        st = self.state(layer)
        if st is None or isinstance(st, tuple):
            raise ValueError(f"{self.name} has no kvq state arrays")
        return {n: to_numpy(a) for n, a in st.arrays().items()}

    # ------------------------------------------------------------------ what the families use of the store
    # (kvq.integrations.families: the family object of the store's method reads and writes through these)

    def check_layer(self, layer) -> int:
        """``layer`` as an int when it is a layer index of this store; IndexError otherwise."""
        if type(layer) is int and 0 <= layer < self.n_layers:          # a model's layer_idx
            return layer
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.n_layers:
            raise IndexError(f"layer={layer!r} is out of range for {self.n_layers} layers")
        return int(layer)

    def device_ctx(self, layer: int = 0):
        """The fast tier's current-device context of ``layer``'s device (a no-op on the CPU and the reference):
        ``layer``'s CUDA device current inside the block, the one before after it."""
        dev = self.devices[layer]
        if dev.type == "cuda" and self.backend != "reference":
            return _OnDevice(dev.index)
        return contextlib.nullcontext()

    def tensor(self, a, layer: int):
        """``a`` (NumPy or torch) as a float32 tensor on ``layer``'s device."""
        torch = import_torch()
        if isinstance(a, torch.Tensor):
            return a.to(self.devices[layer], torch.float32)
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(self.devices[layer])

    def empty(self, dtype, layer: int):
        """``(K, V)``: two empty (B, H_kv, 0, D) tensors of ``dtype`` on ``layer``'s device (a read of a layer
        that holds no tokens yet)."""
        torch = import_torch()
        z = torch.zeros((self.batch, self.kv_heads, 0, self.head_dim), dtype=dtype, device=self.devices[layer])
        return z, z.clone()

    def round16(self, x, name: str):
        """x (converted) rounded to fp16, refusing NaN / inf and fp16 overflow (the methods' rule); a new
        array, never the caller's memory. A torch tensor of a store made with ``validate=False`` is rounded
        without the scan (NumPy arrays, the reference's, are scanned either way: no GPU to wait for)."""
        torch = import_torch()
        if isinstance(x, torch.Tensor):
            y = checked_half(x, torch.float16, name, scan=self.validate)
            return y.clone() if y.data_ptr() == x.data_ptr() else y
        if not np.isfinite(x).all():
            raise ValueError(f"{name} contains NaN or inf")
        with np.errstate(over="ignore"):
            y = x.astype(np.float16)
        if not np.isfinite(y).all():
            raise ValueError(f"{name} overflows float16 (|x| > 65504); the FP16 buffers cannot hold it")
        return y

    def value_checks(self):
        """The fast tier's value scans off for this call where the store was made with ``validate=False``."""
        if self.validate or self.backend == "reference":
            return contextlib.nullcontext()
        return fast_common().validation(False)

    def grow_to(self, need: int) -> None:
        """Reallocate every layer's state for :meth:`_grown_capacity` tokens and copy the old states in (each
        array's pages, tables and counters keep their place: a state's capacity only sizes its pools and page
        tables, whose used part is a prefix). The config changes only in ``max_tokens``; a no-op where the
        family does not grow or ``need`` fits. Called by the family's ``write`` (from :meth:`_write`, inside
        :meth:`_atomic`, which puts the old states back if the append then fails)."""
        if not self._family.grows or need <= self.max_tokens:
            return
        cap = self._grown_capacity(need)
        cfg = dataclasses.replace(self.cfg, max_tokens=cap)
        self.layer_states, self.shared_state = self._family.grown(cfg)
        self.cfg, self.max_tokens = cfg, cap
        self.growths += 1

    def dequantize(self, layer: int):
        """The layer's cache dequantized, fp32 torch (B, H, T, D) (the family's ``dequantize``; AQUA-KV:
        committed, then waiting), computed afresh and counted in ``dequantize_calls``: what a family's ``read``
        calls; :meth:`keys_values` is the memoised read in any output dtype."""
        self.dequantize_calls += 1
        return self._family.dequantize(layer)

    def clear_memo(self, layer: int) -> None:
        """Forget ``layer``'s memoised ``keys_values`` (its state changed: a write, AQUA-KV's commit)."""
        self._memo[layer].clear()

    # ------------------------------------------------------------------ append: validate, then write

    def _validate_append(self, layer: int, k, v):
        """k, v converted and checked for ``layer`` without changing anything: shapes, dtypes, capacity and
        what the write needs (FP16: finite and within the store's dtype; AQUA-KV: finite, within fp16 and,
        where this layer alone decides it, quantizable by its chunk's commit). Returns the tokens as
        :meth:`_write` takes them (the other methods' appends check their inputs before writing)."""
        kx, vx = self._convert(k, "k", layer), self._convert(v, "v", layer)
        if tuple(kx.shape) != tuple(vx.shape):
            raise ValueError(f"k and v must have the same shape, got {tuple(kx.shape)} and {tuple(vx.shape)}")
        self._check_capacity(layer, int(kx.shape[2]))
        if kx.shape[2] == 0:
            return kx, vx
        return self._family.prepare(layer, kx, vx, k)

    def _write(self, layer: int, kx, vx) -> None:
        """Append tokens checked by :meth:`_validate_append` to ``layer`` (the family's ``write``: FP16 tensors
        and AQUA-KV's waiting tokens are concatenations that cannot fail on them; the other methods' appends
        validate first)."""
        if int(kx.shape[2]) == 0:
            return
        self._family.write(layer, kx, vx)
        self.clear_memo(layer)

    def _atomic(self, layer: int) -> "_Atomic":
        """Run an append of ``layer``; if it raises, put back what the store itself keeps (every layer's entry of
        ``layer_states``: FP16 tensors and length, AQUA-KV's waiting tokens, the per-layer states a growth
        replaced; ``shared_state``: FP16's dtype, AQUA-KV's state; the config and capacity; the memo and counter) and
        re-raise. With the
        methods' appends validating before they write, a rejected call, AQUA-KV's failed commit included,
        leaves the store exactly as it was: the call that completed the commit gets the error and its
        tokens are taken back, so later appends work."""
        return _Atomic(self, layer)

    def _commit(self) -> None:
        """Write what every layer has received where the family holds tokens back for a cross-layer step
        (AQUA-KV's commit; a no-op for the other methods)."""
        self._family.commit()

    # ------------------------------------------------------------------ read-only views of the family's parts
    # (the names the store's attributes had before the families; tests and benchmarks read them)

    @property
    def _mod(self):
        """The method's module on the store's backend (None for FP16)."""
        return self._family.mod

    @property
    def _state(self):
        """AQUA-KV: the one cross-layer state."""
        return self.shared_state

    @property
    def _pending_k(self) -> list:
        """AQUA-KV: every layer's waiting keys (None where none wait)."""
        return self._family.pending_k

    @property
    def _pending_v(self) -> list:
        """AQUA-KV: every layer's waiting values."""
        return self._family.pending_v

    @property
    def _fp_dtype(self):
        """FP16: the store's dtype, fixed by the first accepted append (None before)."""
        return self._family.dtype

    @property
    def _chunks(self) -> list:
        """AQUA-KV, reference: the chunks decoded so far (each once, every layer)."""
        return self._family.chunks

    def __repr__(self):
        return (f"KVStore({self.name!r}, backend={self.backend!r}, n_layers={self.n_layers}, batch={self.batch}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, length={self.length(0)})")


class _Atomic:
    """``KVStore._atomic``'s context manager (a class rather than a generator: a model's step enters one per
    layer): what the store keeps, taken on entry and put back if the block raises."""

    __slots__ = ("store", "layer", "memo", "calls", "held")

    def __init__(self, store: KVStore, layer: int):
        self.store, self.layer = store, layer

    def __enter__(self):
        s = self.store
        self.memo, self.calls = dict(s._memo[self.layer]), s.dequantize_calls
        self.held = (list(s.layer_states), s.shared_state, s.cfg, s.max_tokens, s.growths)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            s = self.store
            s._memo[self.layer].clear()
            s._memo[self.layer].update(self.memo)
            s.dequantize_calls = self.calls
            s.layer_states, s.shared_state, s.cfg, s.max_tokens, s.growths = self.held
        return False


class _OnDevice:
    """``KVStore.device_ctx``'s context on a CUDA device (``torch.cuda.device``'s effect, without its argument
    parsing: a model's step enters one per layer): CUDA device ``index`` current inside the block, the device
    current before it after; no device switch where it is current already."""

    __slots__ = ("index", "prev")

    def __init__(self, index: int):
        self.index, self.prev = index, None

    def __enter__(self):
        cuda = import_torch().cuda
        self.prev = cuda.current_device()
        if self.prev != self.index:
            cuda.set_device(self.index)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.prev != self.index:
            import_torch().cuda.set_device(self.prev)
        return False
