"""Capture a Hugging Face model's attention inputs: post-RoPE queries, keys and values, per layer.

What a KV cache stores is the key *after* RoPE and the value, per KV head; what OSCAR calibrates on is
those plus the (post-RoPE) queries. Every attention layer of a transformers 5 model (Llama, Qwen2,
Mistral, BERT, ...) calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``
with exactly these tensors: ``query`` (B, H_q, T, D), ``key`` / ``value`` (B, H_kv, T, D). So this module
registers two attention functions, ``kvq_capture_sdpa`` and ``kvq_capture_eager`` (each with the mask
builder of the implementation it wraps), that record ``(layer_idx, query, key, value, scaling)`` and
then delegate to ``sdpa`` or to the model's own ``eager_attention_forward``; :func:`capture_qkv`
switches the model's configs to them for one forward pass and restores them afterwards, also when the
forward raises. Models that use flash / flex attention are captured through the sdpa path (same Q, K,
V; the attention output is computed by sdpa for that one pass).

    layers = capture_qkv(model, input_ids)                  # [{"q": (B, H_q, T, D), "k", "v": (B, H_kv, T, D)}]
    calib = collect_calibration(model, batches)             # per layer, concatenated over batches
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys

import numpy as np

__all__ = ["CAPTURE_IMPLEMENTATIONS", "capture_qkv", "collect_calibration", "capture_implementation"]

#: the attention implementations this module registers, by the implementation they wrap
CAPTURE_IMPLEMENTATIONS = {"sdpa": "kvq_capture_sdpa", "eager": "kvq_capture_eager"}

_RECORDER: contextvars.ContextVar = contextvars.ContextVar("kvq_capture_recorder", default=None)
_REGISTERED = False


class _StopForward(Exception):
    """Raised inside the forward pass once every requested layer is captured (skips the rest)."""


def _to_numpy(x) -> np.ndarray:
    import torch

    return x.detach().to(torch.float32).cpu().numpy()


class _Recorder:
    """Collects one forward pass's attention inputs; ``layers``: the indices to keep (None = all)."""

    def __init__(self, layers, keep):
        self.layers = None if layers is None else set(layers)
        self.keep = tuple(keep)
        self.records: dict = {}
        self.calls = 0

    def record(self, module, query, key, value, scaling) -> None:
        if getattr(module, "is_cross_attention", False) or "Cross" in type(module).__name__:
            return                                              # encoder-decoder cross attention: not a KV cache of this sequence
        l = getattr(module, "layer_idx", None)
        l = self.calls if l is None else int(l)
        self.calls += 1
        if l in self.records:
            raise RuntimeError(f"attention layer {l} ran twice in one forward pass; capture_qkv handles models "
                               f"whose every layer attends once (no shared or repeated layers)")
        if self.layers is None or l in self.layers:
            tensors = {"q": query, "k": key, "v": value}
            rec = {name: _to_numpy(tensors[name]) for name in self.keep}
            rec["layer"] = l
            rec["scaling"] = None if scaling is None else float(scaling)
            self.records[l] = rec
        if self.layers is not None and self.layers <= set(self.records):
            raise _StopForward


def _make_capture(base: str):
    """The capture function that wraps implementation ``base`` ("sdpa" or "eager")."""

    def capture_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        rec = _RECORDER.get()
        if rec is not None:
            rec.record(module, query, key, value, scaling)
        if base == "eager":
            fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
            if fn is None:
                raise RuntimeError(f"{type(module).__name__}'s module has no eager_attention_forward to delegate to")
        else:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn
        return fn(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    capture_attention.__name__ = f"kvq_capture_{base}"
    capture_attention.__doc__ = f"Record (layer, q, k, v), then run the {base} attention (kvq.integrations.capture)."
    return capture_attention


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for base, name in CAPTURE_IMPLEMENTATIONS.items():
        AttentionInterface.register(name, _make_capture(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    _REGISTERED = True


def _configs(model) -> list:
    """Every distinct transformers config reachable from the model (its own, sub-configs, submodules')."""
    from transformers import PretrainedConfig

    seen, out = set(), []

    def add(cfg):
        if isinstance(cfg, PretrainedConfig) and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
            for key in getattr(cfg, "sub_configs", {}) or {}:
                add(getattr(cfg, key, None))

    add(getattr(model, "config", None))
    for m in model.modules():
        add(getattr(m, "config", None))
    return out


@contextlib.contextmanager
def capture_implementation(model):
    """Within the block, every config of ``model`` uses the capture attention wrapping its own
    implementation (sdpa, eager; others through sdpa); the implementations are restored on exit,
    also on an exception."""
    _register()
    saved = [(c, c._attn_implementation_internal) for c in _configs(model)]
    try:
        for c, impl in saved:
            base = impl if impl in CAPTURE_IMPLEMENTATIONS else "sdpa"
            c._attn_implementation_internal = CAPTURE_IMPLEMENTATIONS[base]
        yield
    finally:
        for c, impl in saved:
            c._attn_implementation_internal = impl


def _device(model):
    try:
        return next(model.parameters()).device
    except StopIteration:
        return None


def _as_ids(x, device, name: str):
    import torch

    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex:
        raise TypeError(f"{name} must hold integer token ids, got {t.dtype}")
    if t.ndim == 1:
        t = t[None]
    if t.ndim != 2 or t.shape[1] == 0:
        raise ValueError(f"{name} must have shape (B, T) with T >= 1, got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.long)


def capture_qkv(model, input_ids, *, layers=None, attention_mask=None, keep=("q", "k", "v")) -> list:
    """Run ``model`` on ``input_ids`` (B, T) and return its attention inputs, one dict per layer.

    Each dict holds ``"q"`` (B, H_q, T, D), ``"k"``, ``"v"`` (B, H_kv, T, D) as float32 NumPy arrays:
    keys and queries after RoPE (what the KV cache stores), values as projected; plus ``"layer"`` (the
    layer index) and ``"scaling"`` (the softmax scale the layer uses). ``layers``: indices to capture
    (the forward stops after the last of them); None captures all. ``keep``: which of q, k, v to keep.
    Runs under ``torch.no_grad()`` with ``use_cache=False``; the model's attention implementation is
    restored afterwards, also on an exception.
    """
    import torch

    keep = tuple(keep)
    if not keep or any(k not in ("q", "k", "v") for k in keep):
        raise ValueError(f"keep={keep!r} must name some of 'q', 'k', 'v'")
    if layers is not None:
        layers = sorted({int(l) for l in layers})
        if not layers:
            raise ValueError("layers is empty; pass None to capture every layer")
    device = _device(model)
    ids = _as_ids(input_ids, device, "input_ids")
    kwargs = {"input_ids": ids}
    if attention_mask is not None:
        m = attention_mask if isinstance(attention_mask, torch.Tensor) else torch.as_tensor(np.asarray(attention_mask))
        if tuple(m.shape) != tuple(ids.shape):
            raise ValueError(f"attention_mask has shape {tuple(m.shape)}; input_ids has {tuple(ids.shape)}")
        kwargs["attention_mask"] = m.to(device)
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        kwargs["use_cache"] = False
    rec = _Recorder(layers, keep)
    token = _RECORDER.set(rec)
    try:
        with capture_implementation(model), torch.no_grad():
            try:
                model(**kwargs)
            except _StopForward:
                pass
    finally:
        _RECORDER.reset(token)
    want = sorted(rec.records) if layers is None else layers
    missing = [l for l in want if l not in rec.records]
    if missing or not want:
        raise RuntimeError(f"no attention inputs captured for layers {missing or want}: does this model call "
                           f"transformers' AttentionInterface (config._attn_implementation)?")
    return [rec.records[l] for l in want]


def collect_calibration(model, token_batches, *, progress: bool = True, layers=None, keep=("q", "k", "v")) -> list:
    """Capture every batch of ``token_batches`` ((B, T) or (T,) integer ids, all of one length T) and
    return one dict per layer with ``"q"``, ``"k"``, ``"v"`` concatenated along the batch axis
    ((N_seq, H, T, D) float32), ``"layer"`` and ``"scaling"``. ``progress``: a tqdm bar over batches."""
    parts, T = None, None
    batches = token_batches
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(token_batches, desc="capture", unit="batch")
    for i, ids in enumerate(batches):
        recs = capture_qkv(model, ids, layers=layers, keep=keep)
        t = recs[0][keep[0]].shape[2]
        if T is not None and t != T:
            raise ValueError(f"batch {i} has {t} tokens per sequence, earlier batches {T}: calibration "
                             f"batches must share one sequence length")
        T = t
        if parts is None:
            parts = [{"layer": r["layer"], "scaling": r["scaling"], **{k: [] for k in keep}} for r in recs]
        for p, r in zip(parts, recs):
            for k in keep:
                p[k].append(r[k])
    if parts is None:
        raise ValueError("token_batches is empty")
    return [{**p, **{k: np.concatenate(p[k], axis=0) for k in keep}} for p in parts]
