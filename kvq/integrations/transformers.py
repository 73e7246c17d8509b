"""kvq's compressed KV caches as Hugging Face ``transformers`` (5.x) Cache objects.

A ``KVQCache`` is what a user passes as ``cache=`` (``past_key_values=`` before transformers renamed it;
``cache_argument(model)`` says which) to ``model(...)`` or ``model.generate(...)``
of a decoder with RoPE and (grouped-query) full attention: Llama, Mistral, Qwen2, Qwen3 and alike.

    from kvq.integrations.transformers import make_cache
    cache = make_cache("Kitty", model)                                   # or KittyCache(model)
    out = model.generate(input_ids, cache=cache, max_new_tokens=64, do_sample=False)
    cache.bits_per_element(), cache.memory_bytes()

Building the cache switches the model's attention to ``"kvq"`` (``kvq.integrations.attention``; for every
cache that is not kvq's it is transformers' SDPA, unchanged). Then each attention layer's
``cache.update(key_states, value_states, layer_idx, ...)`` only appends the new post-RoPE tokens to the
layer's compressed state (``kvq.integrations.methods.KVStore``) and hands them back tagged; the attention
function attends the prompt over its own FP16 keys and values, and every decode step through the method's
fused decode over the compressed state: no dequantized copy of the cache is made. ``attention="dequantize"``
(or a model set to another attention implementation) keeps the older path: ``update`` returns the layer's
whole cache dequantized, which any attention implementation can read, at the cost of a copy per step. The
layout of ``transformers.cache_utils.QuantizedCache`` is followed: a ``Cache`` of one ``CacheLayerMixin``
per model layer (:class:`KVQLayer`), all sharing one store.

A model spread over several GPUs (``from_pretrained(..., device_map="auto")``) keeps each layer's compressed
state on that layer's device, read from the model's ``hf_device_map`` (or given as ``device=``, one per layer);
AQUA-KV, one cross-layer state, refuses such a model.

Every update checks its states before the cache changes (torch float tensors of the model's shape; the
store refuses NaN / inf and overflow), and a rejected update leaves the cache as it was.

Limits: the batch size is fixed at the first accepted update; prompts of different lengths in one batch
(left padding) are refused at the first prefill; beam search (``reorder_cache``), cache cropping (assisted
decoding) and batch re-indexing raise NotImplementedError (a compressed state cannot be re-indexed without
re-quantizing); sliding-window layers are refused unless their window covers the cache's capacity;
``torch.compile`` of the forward is not supported (``is_compileable = False``: kvq's launches are planned
on the host from the cache's lengths); ``kvq.integrations.graphs`` replays a decode step from CUDA graphs
instead, with each layer's kvq work run eagerly between the graphs (``graphs.generate``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import families as F
from . import methods as M
from .attention import ATTN_IMPLEMENTATION, tag_states, use_kvq_attention

__all__ = ["DEFAULT_MAX_TOKENS", "KVQLayer", "KVQCache", "KIVICache", "KittyCache", "OSCARCache", "AquaKVCache",
           "BitDecodingCache", "FP16Cache", "cache_argument", "hf_layer_devices", "make_cache", "model_dims"]

#: ``attention=``: "auto" attends through kvq's fused decode where the model can ("kvq" attention, which
#: :class:`KVQCache` switches a model to); "dequantize" hands the model every layer dequantized (the slow path
#: of any attention implementation, for comparisons)
ATTENTION_MODES = ("auto", "dequantize")

#: the initial capacity per sequence of a cache made without ``max_tokens``: its pools then grow with the tokens
#: (doubling, up to the model's max_position_embeddings), so a short prompt allocates little and a long
#: generation never fails for a length the model supports
DEFAULT_MAX_TOKENS = 256

_BEAM = ("kvq caches do not support beam search or batch re-indexing: the compressed pages of a sequence "
         "cannot be reordered without re-quantizing; use greedy or sampling decoding (num_beams=1)")


def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not hasattr(config, name):
            raise TypeError(f"expected a transformers model or config of a decoder (with {name}), got "
                            f"{type(model_or_config).__name__}")
    return config


def model_dims(model_or_config) -> dict:
    """``n_layers``, ``kv_heads``, ``head_dim``, ``max_position_embeddings``, ``rope_theta`` (or None) of a
    transformers model or config: ``head_dim`` is ``config.head_dim`` or ``hidden_size //
    num_attention_heads``; ``kv_heads`` is ``num_key_value_heads`` (default: the attention heads)."""
    c = _text_config(model_or_config)
    H_q = int(c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // H_q
    kv = getattr(c, "num_key_value_heads", None) or H_q
    rope = getattr(c, "rope_parameters", None)
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = getattr(c, "rope_theta", None) if theta is None else theta
    return dict(n_layers=int(c.num_hidden_layers), kv_heads=int(kv), head_dim=int(head_dim),
                max_position_embeddings=getattr(c, "max_position_embeddings", None),
                rope_theta=None if theta is None else float(theta))


def _sliding_window(config):
    """The sliding window of a model whose layers (some or all) attend over one, else None."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if types is not None:
        return int(window) if "sliding_attention" in types else None
    return int(window) if getattr(config, "use_sliding_window", True) else None


def _check_attention_layers(config, max_tokens: int) -> None:
    """Refuse layers that are not plain full attention over the whole cache (sliding windows shorter
    than the capacity, chunked / linear attention)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    use_sw = getattr(config, "use_sliding_window", True)
    if types is not None:
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"kvq caches serve full-attention layers only; this model has {bad}")
        if "sliding_attention" in types and window is not None and window < max_tokens:
            raise ValueError(f"this model has sliding-window layers (window {window} < max_tokens={max_tokens}); "
                             f"kvq caches attend over the whole cache: pass max_tokens <= {window}")
    elif window is not None and use_sw and window < max_tokens:
        raise ValueError(f"this model uses a sliding window of {window} tokens < max_tokens={max_tokens}; kvq "
                         f"caches attend over the whole cache: pass max_tokens <= {window}")


def load_calibration_file(method: str, path, dims: dict):
    """``(calibration, overrides)`` from a ``kvq calibrate`` file for ``method`` on a model of ``dims``
    (``model_dims``): OSCAR files give the per-layer calibrations, AQUA-KV files the predictors and their
    configuration's fields as overrides (the backbone must be the method's). A file of the wrong kind,
    shape or backbone fails with ``kvq.calibration``'s clear error."""
    from kvq import calibration as CF

    kind = M.get_method(method).calibration
    if kind is None:
        raise ValueError(f"{method} takes no calibration file (got {str(path)!r})")
    expect = {k: dims[k] for k in ("n_layers", "kv_heads", "head_dim")}
    if kind == "oscar":
        cal, _ = CF.load_oscar(path, expect=expect)
        return cal, {}
    P, cfg, _ = CF.load_aqua(path, expect={**expect, "rope_theta": dims.get("rope_theta")})
    want = type(M.configure(method, head_dim=dims["head_dim"], kv_heads=dims["kv_heads"], max_tokens=8).backbone)
    if type(cfg.backbone) is not want:
        raise ValueError(f"{path} was calibrated with the {type(cfg.backbone).__name__} backbone; {method} uses "
                         f"{want.__name__} (kvq calibrate aqua --backbone {want.__name__.lower()})")
    return P, {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "max_tokens"}


_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def hf_layer_devices(model, n_layers: int):
    """One device per decoder layer from a model's ``hf_device_map`` (``from_pretrained(device_map=...)``),
    or None when the model has none (a config, a model on one device). Entries ``...layers.<i>`` (or a
    submodule of it, its attention preferred) place layer ``i``; a map whose entries all name one device
    places every layer there. ValueError when a layer's device cannot be told (pass ``device=``)."""
    dmap = getattr(model, "hf_device_map", None)
    if not isinstance(dmap, dict) or not dmap:
        return None
    per_layer: dict[int, list] = {}
    for key, dev in dmap.items():
        m = _LAYER_KEY.search(str(key))
        if m:
            per_layer.setdefault(int(m.group(1)), []).append((str(key), dev))
    distinct = {str(d) for d in dmap.values()}
    devices = []
    for l in range(n_layers):
        entries = per_layer.get(l)
        if not entries:
            if len(distinct) == 1:
                devices.append(next(iter(dmap.values())))
                continue
            raise ValueError(f"the model's hf_device_map names no device for decoder layer {l} "
                             f"(entries: {sorted(dmap)[:6]}...); pass make_cache(..., device=[one per layer])")
        attn = [d for k, d in entries if "attn" in k.rsplit("layers.", 1)[-1]]
        devices.append(attn[0] if attn else min(entries, key=lambda e: len(e[0]))[1])
    return [torch.device("cuda", d) if isinstance(d, int) and not isinstance(d, bool) else d for d in devices]


def attn_implementation(config) -> str | None:
    """``config._attn_implementation`` (None where the config has none): transformers 5 keeps it in the
    config's ``__dict__`` as ``_attn_implementation_internal``, read there directly (past the config's
    ``__getattribute__`` overrides: a few us per call, and a model's step asks once per layer), else by
    the attribute."""
    try:
        return object.__getattribute__(config, "__dict__")["_attn_implementation_internal"]
    except (AttributeError, KeyError, TypeError):
        return getattr(config, "_attn_implementation", None)


class KVQLayer(CacheLayerMixin):
    """One model layer's view of a :class:`KVQCache` (the cache's shared ``KVStore`` holds the data)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache: "KVQCache", layer_idx: int):
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Record the model's dtype and device and create the cache's store (batch size fixed here); the
        states are checked first (``KVQCache._check_states``)."""
        self._cache._check_states(key_states, value_states)
        self._cache._ensure_store(key_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new post-RoPE (B, H_kv, T_new, D) states; return what :meth:`KVQCache.update` returns
        (the tagged new states when the model attends through kvq, else every cached token dequantized).
        The layer records the model's dtype and device
        only once an update succeeded: a rejected first update leaves it uninitialized."""
        out = self._cache._update(self.layer_idx, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) = (cached tokens + query_length, 0): the layer attends over everything."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens cached in this layer."""
        store = self._cache._store
        return 0 if store is None else store.length(self.layer_idx)

    def get_max_length(self) -> int:
        """The fixed capacity per sequence (``max_tokens``), or -1 when the capacity grows."""
        return self._cache.get_max_cache_shape()

    def get_max_cache_shape(self) -> int:
        """Same as :meth:`get_max_length`."""
        return self._cache.get_max_cache_shape()

    def offload(self):
        """Offloading is not supported (the compressed state stays where the backend keeps it): no-op."""

    def prefetch(self):
        """See :meth:`offload`: no-op."""

    def reset(self) -> None:
        """Forget the layer's dtype / device; the cache's :meth:`KVQCache.reset` drops the store."""
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search is not supported: NotImplementedError."""
        raise NotImplementedError(_BEAM)

    def crop(self, tokens_to_remove: int) -> None:
        """Cropping (assisted / speculative decoding) is not supported: NotImplementedError."""
        raise NotImplementedError("kvq caches cannot be cropped: tokens already quantized into pages cannot be "
                                  "removed (assisted / speculative decoding and cache rollback are not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Not supported: NotImplementedError."""
        raise NotImplementedError(_BEAM)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Not supported: NotImplementedError."""
        raise NotImplementedError(_BEAM)


class KVQCache(Cache):
    """A transformers Cache backed by a kvq method (``kvq.integrations.methods.METHODS``).

    Args:
        model_or_config: a transformers causal-LM model (its config, dtype-independent; its device picks
            the backend under ``backend="auto"``) or its config.
        method: a method name, e.g. "KIVI-K2V2", "Kitty", "OSCAR", "AQUA-KV", "BitDecoding-4", "FP16".
        backend: "auto" (the reference on CPU tensors, Triton on CUDA), "reference", "triton", "cupy".
        calibration: OSCAR: one ``OSCARCalibration`` per layer or "identity"; AQUA-KV:
            ``AquaPredictors`` or "identity" (see ``methods.resolve_calibration``); or the path of a file
            from ``kvq calibrate`` (checked against this model's shape; an AQUA-KV file also gives the
            configuration its predictors were fit for, which explicit overrides still replace).
        max_tokens: a fixed capacity per sequence, every page preallocated (what a captured CUDA graph
            needs). Default None: the capacity starts at ``DEFAULT_MAX_TOKENS`` and grows with the tokens
            (``KVStore(grow=True)``: doubling, pages copied) up to max_position_embeddings, or up to the
            sliding window of a model that has one (beyond it the window's attention is not the whole cache's).
        validate: whether each appended token is scanned for NaN / inf on the fast backends and by the FP16
            and AQUA-KV caches (and AQUA-KV's keys checked against its quantizer's range pre-RoPE), so that a
            NaN key is refused with the cache unchanged (``KVStore(validate=)``). None (default): where the scan
            costs no GPU synchronization, on a store in CPU memory (the reference tier, Triton's
            interpreter), and not on a CUDA device, where it is a device read per layer and step that stalls
            the host (lab/2026-11-28-step-syncs, H200: a Llama-3.1-8B-shaped step at 1 x 32K 54.7 ms with
            the scans, 45.1 ms without); a model's keys and values are its own, and NaN there comes from NaN
            hidden states, which reach the logits anyway. True / False: always / never.
        attention: "auto" (default): switch a model to kvq's attention function (``use_kvq_attention``) and
            decode through the method's fused decode; "dequantize": ``update`` returns the whole cache
            dequantized for the model's own attention (the slow path; for comparisons).
        device: where each layer's state lives (``KVStore(device=)``): None (default) takes the model's
            ``hf_device_map`` (a model loaded with ``device_map=...`` over several GPUs: each layer's state on
            that layer's device, see :func:`hf_layer_devices`), else every layer on the device of the first
            update's states; one device, or a list of one per layer. A layer's states arriving on another
            device are refused (ValueError, the cache unchanged). AQUA-KV (one cross-layer state) refuses
            layers on more than one device.
        overrides: method config fields (``methods.configure``), e.g. ``sink=4, residual=16``.
            AQUA-KV gets the model's ``rope_theta`` unless given.

    The method, config and calibration are validated here; the store is created at the first
    ``update`` (its batch size and device are the states'). ``bits_per_element`` / ``memory_bytes``
    report the compressed state. ``graph_capture`` is the ``kvq.integrations.graphs.DecodeGraphs``
    recording a step of this cache (None otherwise): while it is set, ``update`` writes nothing and hands
    the states to it, and the attention function hands the layer's work to it.
    """

    family: str | None = None
    default_method: str | None = None

    def __init__(self, model_or_config, method: str | None = None, *, backend: str = "auto", calibration=None,
                 max_tokens: int | None = None, attention: str = "auto", validate: bool | None = None, device=None,
                 **overrides):
        method = method if method is not None else self.default_method
        if method is None:
            raise ValueError(f"name a kvq method; known methods: {', '.join(M.METHODS)}")
        spec = M.get_method(method)
        if self.family is not None and spec.family != self.family:
            fam = [n for n, s in M.METHODS.items() if s.family == self.family]
            raise ValueError(f"{type(self).__name__} serves {', '.join(fam)}; got {method!r} (use make_cache)")
        if validate is not None and not isinstance(validate, bool):
            raise TypeError(f"validate must be True or False, or None (scan where it costs no GPU "
                            f"synchronization), got {validate!r}")
        self.validate = validate
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention={attention!r} is unknown; choose one of {ATTENTION_MODES}")
        config = _text_config(model_or_config)
        dims = model_dims(config)
        mpe = dims["max_position_embeddings"]
        self.grow = max_tokens is None
        # a growing cache stops at the model's length, and at its sliding window where it has one (kvq caches
        # attend over the whole cache, which equals the window's attention only up to the window)
        limits = [int(x) for x in (mpe, _sliding_window(config)) if x]
        self.max_capacity = min(limits) if (self.grow and limits) else None
        if max_tokens is None:
            max_tokens = min(self.max_capacity, DEFAULT_MAX_TOKENS) if self.max_capacity else DEFAULT_MAX_TOKENS
        max_tokens = M.check_pos_int("max_tokens", max_tokens)
        _check_attention_layers(config, self.max_capacity or max_tokens)
        if isinstance(calibration, (str, os.PathLike)) and str(calibration) != "identity":
            calibration, file_overrides = load_calibration_file(method, calibration, dims)
            overrides = {**file_overrides, **overrides}
        family = F.family_of(spec)
        overrides = family.model_overrides(dims, calibration, overrides)
        self.method = method
        self.backend = backend
        self.max_tokens = max_tokens
        self.n_layers, self.kv_heads, self.head_dim = dims["n_layers"], dims["kv_heads"], dims["head_dim"]
        self.config = M.configure(method, head_dim=self.head_dim, max_tokens=max_tokens, kv_heads=self.kv_heads,
                                  **overrides)
        M.resolve_calibration(method, calibration, n_layers=self.n_layers, kv_heads=self.kv_heads,
                              head_dim=self.head_dim)
        if backend not in M.BACKENDS:
            raise ValueError(f"backend={backend!r} is unknown; choose one of {M.BACKENDS}")
        self._calibration = calibration
        self._overrides = overrides
        self._device = getattr(model_or_config, "device", None) if not hasattr(model_or_config, "to_dict") else None
        if device is None:
            device = hf_layer_devices(model_or_config, self.n_layers)
        self._layer_devices = M.layer_devices(device, self.n_layers)      # None: the first key states' device
        family.check_devices(method, self._layer_devices)
        self._store: M.KVStore | None = None
        self.graph_capture = None                    # the DecodeGraphs recording a step (kvq.integrations.graphs)
        self.attention = attention
        self._model_config = config
        self._warned = False
        if attention == "auto" and hasattr(model_or_config, "set_attn_implementation"):
            use_kvq_attention(model_or_config)
        super().__init__(layers=[KVQLayer(self, i) for i in range(self.n_layers)])

    # ------------------------------------------------------------------ the store

    def _check_states(self, key_states, value_states) -> None:
        """What a model hands to :meth:`update`, checked before the cache changes: torch float tensors
        (TypeError otherwise: a transformers cache takes torch tensors), of one dtype and device, of one
        shape (B, H_kv, T_new, D) with this model's H_kv and D, and B the batch size fixed by the first
        update. Values (NaN / inf, overflow) are the store's to check: it refuses them unchanged."""
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor (a transformers cache takes torch tensors), got "
                                f"{type(x).__name__}")
            if not x.is_floating_point():
                raise TypeError(f"{name} has dtype {x.dtype}; a kvq cache takes float tensors")
            if x.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{name} is on {x.device}; a kvq cache takes CPU or CUDA tensors")
            if x.ndim != 4 or x.shape[1] != self.kv_heads or x.shape[3] != self.head_dim:
                raise ValueError(f"{name} have shape {tuple(x.shape)}; this cache was built for "
                                 f"(B, H_kv={self.kv_heads}, T, D={self.head_dim})")
        if key_states.shape != value_states.shape:
            raise ValueError(f"key_states and value_states must have the same shape, got "
                             f"{tuple(key_states.shape)} and {tuple(value_states.shape)}")
        if key_states.dtype != value_states.dtype or key_states.device != value_states.device:
            raise ValueError(f"key_states and value_states must have one dtype and device, got "
                             f"{key_states.dtype} on {key_states.device} and {value_states.dtype} on "
                             f"{value_states.device}")
        if self._store is not None and key_states.shape[0] != self._store.batch:
            raise ValueError(f"the batch size of a kvq cache is fixed at its first update (B={self._store.batch}); "
                             f"got {key_states.shape[0]}. " + _BEAM)

    def _check_device(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """Layer ``layer_idx``'s states must arrive on the device of its state: the ``device=`` / ``hf_device_map``
        entry of the layer, else (no such entry) the device of the first update's states. ValueError before the
        cache changes otherwise."""
        devs = self._store.devices if self._store is not None else self._layer_devices
        if devs is None:
            return
        dev = devs[layer_idx]
        if not M.same_device(key_states.device, dev):
            where = ("the model's hf_device_map or device=" if self._layer_devices is not None
                     else "the device of the cache's first update")
            raise ValueError(f"key_states of layer {layer_idx} are on {key_states.device}; this cache keeps layer "
                             f"{layer_idx} on {dev} ({where}); pass make_cache(..., device=[one device per layer]) "
                             f"for a model spread over devices")

    def _ensure_store(self, key_states: torch.Tensor) -> M.KVStore:
        """The cache's store, created for ``key_states`` (checked by :meth:`_check_states`) if there is none:
        each layer on its device (``device=`` or the model's ``hf_device_map``), else every layer on the
        first key states' device."""
        if self._store is None:
            devices = self._layer_devices if self._layer_devices is not None else key_states.device
            on_cuda = key_states.device.type == "cuda" or (
                self._layer_devices is not None and any(d.type == "cuda" for d in self._layer_devices))
            validate = self.validate if self.validate is not None else not on_cuda
            self._store = M.KVStore(self.method, n_layers=self.n_layers, batch=int(key_states.shape[0]),
                                    kv_heads=self.kv_heads, head_dim=self.head_dim, max_tokens=self.max_tokens,
                                    backend=self.backend, calibration=self._calibration,
                                    device=devices, memoize=False, grow=self.grow, validate=validate,
                                    max_capacity=self.max_capacity, **self._overrides)
        return self._store

    def _update(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Check the states, create the store at the first update, append and read (``KVStore.update``).
        A rejected call changes nothing: the store validates before it writes, and a store this call
        created is dropped again (the batch size is not fixed by a rejected first update)."""
        self._check_states(key_states, value_states)
        self._check_device(layer_idx, key_states)
        if self.graph_capture is not None:          # kvq.integrations.graphs records a step: nothing is written
            return self.graph_capture.capture_update(layer_idx, key_states, value_states)
        fused = self.fused
        created = self._store is None
        store = self._ensure_store(key_states)
        try:
            if fused:
                prior = store.length(layer_idx)
                store.append(layer_idx, key_states, value_states, commit=False)
            else:
                K, V = store.update(layer_idx, key_states, value_states, dtype=key_states.dtype)
        except BaseException:
            if created:
                self._store = None
            raise
        if fused:                                   # the new tokens only, the keys tagged for kvq's attention
            return tag_states(key_states, self, layer_idx, prior), value_states
        if K.device != key_states.device:
            K, V = K.to(key_states.device), V.to(key_states.device)
        return K, V

    @property
    def fused(self) -> bool:
        """True when the model attends through kvq (``attention="auto"`` and the model's attention
        implementation is ``"kvq"``): ``update`` only appends and the method's decode reads the compressed
        state. False: ``update`` returns the layer's whole cache dequantized (``attention="dequantize"``, or a
        model that attends with another implementation).

        Warns once when the model's config names another attention implementation (``"sdpa"``, ``"eager"``,
        ...): that model pays a dequantized copy of the cache per layer and step. A config that no model has
        bound yet (implementation None: a cache used on its own, ``update`` called directly) gets no warning.
        """
        if self.attention != "auto":
            return False
        impl = attn_implementation(self._model_config)
        if impl == ATTN_IMPLEMENTATION:
            return True
        if impl is not None and not self._warned:
            self._warned = True
            warnings.warn(f"this model attends with {impl!r}, "
                          f"so the kvq cache hands it every layer dequantized at every step; set "
                          f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) (make_cache does) for the fused "
                          f"decode over the compressed cache", stacklevel=4)
        return False

    @property
    def store(self) -> M.KVStore | None:
        """The ``KVStore`` behind the cache (None before the first update)."""
        return self._store

    def state(self, layer_idx: int):
        """The kvq state of layer ``layer_idx`` (``KVStore.state``); ValueError before the first update."""
        if self._store is None:
            raise ValueError("the cache is empty: no update has created its state yet")
        return self._store.state(layer_idx)

    # ------------------------------------------------------------------ transformers API

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append layer ``layer_idx``'s new states. Return, where the model attends through kvq
        (:attr:`fused`), the new states themselves tagged for the ``"kvq"`` attention function; otherwise
        (K, V): the layer's whole cache, dequantized, new tokens included, in the states' dtype and device."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.n_layers:
            raise IndexError(f"layer_idx={layer_idx!r} is out of range for {self.n_layers} layers")
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        """Drop every cached token (the next update starts a fresh store, possibly of another batch size)."""
        self._store = None
        for layer in self.layers:
            layer.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Beam search is not supported: NotImplementedError."""
        raise NotImplementedError(_BEAM)

    def crop(self, tokens_to_remove: int) -> None:
        """Not supported: NotImplementedError (see :meth:`KVQLayer.crop`)."""
        self.layers[0].crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int):
        """Not supported: NotImplementedError."""
        raise NotImplementedError(_BEAM)

    def batch_select_indices(self, indices: torch.Tensor):
        """Not supported: NotImplementedError."""
        raise NotImplementedError(_BEAM)

    @property
    def is_compileable(self) -> bool:
        """False: the cache runs host-side routing (and NumPy on the reference backend)."""
        return False

    @property
    def max_batch_size(self) -> int:
        """The batch size fixed at the first update (-1 before it)."""
        return -1 if self._store is None else self._store.batch

    @property
    def batch_size(self) -> int:
        """Same as :attr:`max_batch_size`."""
        return self.max_batch_size

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """The fixed capacity per sequence (``max_tokens``), or -1 when the capacity grows (as a dynamic cache)."""
        return -1 if self.grow else self.max_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """Same as :meth:`get_max_cache_shape`."""
        return self.get_max_cache_shape()

    def allocated_bytes(self) -> int:
        """Bytes every layer's state holds, unused capacity included (``memory_bytes`` counts the cached
        tokens only); 0 before the first update."""
        return 0 if self._store is None else self._store.allocated_bytes()

    # ------------------------------------------------------------------ memory

    def bits_per_element(self, accounting: str = "state", context: int | None = None) -> float:
        """Bits per cached element (``methods.bits_per_element``) at ``context`` tokens (default: the tokens
        cached now). ``accounting="state"``: where the tokens actually are; "paper": the papers' accounting."""
        if context is None:
            if self._store is None or self._store.length(0) == 0:
                raise ValueError("the cache is empty: pass context= to get the bits at a given context length")
            context = self._store.length(0)
        return M.bits_per_element(self.method, self.config, context=context, head_dim=self.head_dim,
                                  kv_heads=self.kv_heads, n_layers=self.n_layers, accounting=accounting)

    def memory_bytes(self, accounting: str = "state") -> int:
        """Bytes the cached tokens occupy in the compressed state, all layers, K and V (0 when empty);
        ``store.allocated_bytes()`` gives the preallocated capacity."""
        return 0 if self._store is None else self._store.memory_bytes(accounting)

    def __repr__(self):
        n = 0 if self._store is None else self._store.length(0)
        return f"{type(self).__name__}(method={self.method!r}, backend={self.backend!r}, tokens={n})"


class FP16Cache(KVQCache):
    """The uncompressed baseline through the same machinery (method "FP16"): a DynamicCache's results."""

    family, default_method = "fp16", "FP16"


class KIVICache(KVQCache):
    """KIVI ("KIVI-K2V2" by default; "KIVI-K2V2*", "KIVI-K4V4")."""

    family, default_method = "kivi", "KIVI-K2V2"


class KittyCache(KVQCache):
    """Kitty ("Kitty" by default; "Kitty-Pro")."""

    family, default_method = "kitty", "Kitty"


class OSCARCache(KVQCache):
    """OSCAR: needs ``calibration=`` (one OSCARCalibration per layer, or "identity")."""

    family, default_method = "oscar", "OSCAR"


class AquaKVCache(KVQCache):
    """AQUA-KV ("AQUA-KV" HIGGS by default; "AQUA-KV-uniform"): needs ``calibration=`` (AquaPredictors)."""

    family, default_method = "aqua", "AQUA-KV"


class BitDecodingCache(KVQCache):
    """BitDecoding ("BitDecoding-4" by default; "BitDecoding-2")."""

    family, default_method = "bitdecoding", "BitDecoding-4"


_BY_FAMILY = {c.family: c for c in (FP16Cache, KIVICache, KittyCache, OSCARCache, AquaKVCache, BitDecodingCache)}


def cache_argument(model) -> str:
    """The keyword ``model(...)`` and ``model.generate(...)`` take a cache by: ``"cache"`` where the model's
    ``forward`` has that argument (newer transformers 5, which deprecate the old name), else
    ``"past_key_values"``. ``model(ids, **{cache_argument(model): cache})`` works on either."""
    import inspect
    forward = getattr(type(model), "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        params = {}
    return "cache" if "cache" in params else "past_key_values"


def make_cache(method_name: str, model_or_config, **kwargs) -> KVQCache:
    """The cache of ``method_name`` for ``model_or_config`` (the family's class; kwargs as :class:`KVQCache`).

    A model spread over several GPUs (``from_pretrained(..., device_map="auto")``) needs nothing more: the
    cache reads the model's ``hf_device_map`` and keeps each layer's compressed state, buffers and outputs on
    that layer's device, running the fused kernels of a layer under its device (``device=`` overrides it
    with one device or one per layer). AQUA-KV, whose layers share one cross-layer state, refuses a model
    spread over devices with a ValueError here."""
    spec = M.get_method(method_name)
    return _BY_FAMILY[spec.family](model_or_config, method_name, **kwargs)
