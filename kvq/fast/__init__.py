"""kvq.fast: the production API on torch CUDA tensors; the backend is chosen per call (Triton by default).

Every function mirrors the function of the same name in ``kvq.reference`` and agrees with it bit for
bit under the numerics contract (DESIGN.md section 2); the tests in ``tests/parity`` prove it.

    from kvq.fast import quantize_pack, decode_attention
    packed, scale, mn = quantize_pack(v, bits=2, group_size=128, axis=-1)          # Triton
    out, lse = decode_attention(q, [(k, v)], backend="cupy")                       # raw CUDA

Backends live in ``kvq.fast.triton`` and ``kvq.fast.cupy`` with the reference's module and function
names (``kvq.fast.triton.quant.quantize`` mirrors ``kvq.reference.quant.quantize``). Their cache
methods are thin bindings of one shared layer, ``kvq.fast.caches`` (states, append routing, codecs,
predictors on torch tensors), to the backend's kernels; ``kvq.fast.common`` holds the checks every fast
module shares. So kvq reads in four columns: reference, shared fast logic, Triton kernels, CUDA kernels.
Importing this package imports neither Triton nor CuPy: a backend is loaded on its first use.
"""

from __future__ import annotations

import importlib

import numpy as np

from .common import set_validation, validation, validation_enabled  # noqa: F401

BACKENDS = ("triton", "cupy")
DEFAULT_BACKEND = "triton"

#: reference module -> public functions every backend mirrors (or lists in NOT_YET_IMPLEMENTED)
MIRRORED = {
    "quant": ("quantize", "dequantize", "quantile", "percentile_clip"),
    "packing": ("pack", "unpack", "quantize_pack", "unpack_dequantize"),
    "attention": ("attention", "partial_attention", "merge", "decode_attention"),
    "kivi": ("KIVIConfig", "CONFIGS", "init", "append", "dequantize", "decode_attention"),
    "kitty": ("KittyConfig", "CONFIGS", "init", "append", "dequantize", "decode_attention",
              "channel_scores", "select_boost", "encode_page", "dequantize_page", "channel_sensitivity"),
    "oscar": ("DEFAULT_CLIP_K", "DEFAULT_CLIP_V", "CLIP_GRID", "OSCARCalibration", "identity_calibration",
              "calibrate", "calibrate_clip", "quantize_tokens",
              "OSCARConfig", "CONFIGS", "OSCARState", "counts", "init", "append", "dequantize",
              "decode_attention", "fold_value_rotation"),
    "hadamard": ("is_power_of_two", "hadamard_matrix", "fwht_scale", "fwht"),
    "higgs": ("SHIPPED_GRIDS", "HiggsConfig", "load_grid", "index_dtype", "group_sum_of_squares",
              "nearest", "quantize", "dequantize", "bits_per_value"),
    "aqua": ("Uniform", "Higgs", "KeepFP16", "AquaConfig", "Predictor", "AquaPredictors", "fit_ridge",
             "fit_reduced_rank", "to_tokens", "from_tokens", "calibration_tokens", "calibrate", "encode",
             "decode"),
    "aqua_cache": ("AquaState", "init", "append", "dequantize", "forward", "bits_per_value", "state_bytes"),
    "bitdecoding": ("BitDecodingConfig", "CONFIGS", "residual_block_size", "partition", "pack_keys", "pack_values",
                    "unpack_keys", "unpack_values", "dequantize_page", "query_transform", "query_untransform",
                    "BitDecodingState", "init", "append", "dequantize", "decode_attention"),
}

#: backend -> module -> reference functions that have no fast version yet, and the issue that adds it
NOT_YET_IMPLEMENTED = {
    backend: {
        "attention": {"attention": "prefill attention: torch SDPA serves it; no kvq kernel yet"},
    }
    for backend in BACKENDS
}
for _backend in BACKENDS:
    NOT_YET_IMPLEMENTED[_backend]["oscar"] = {
        "calibrate": "offline calibration (Algorithm 1, float64 eigendecompositions): the reference serves it",
        "calibrate_clip": "offline clip-ratio fit over CLIP_GRID: the reference serves it",
        "fold_value_rotation": "offline float64 weight folding, once per model: the reference serves it",
        "OSCARState": "the reference's class holds NumPy arrays; the fast state is "
                      f"kvq.fast.{_backend}.oscar.OSCARTensorState (the same fields as torch tensors)",
    }
del _backend
for _backend in BACKENDS:
    NOT_YET_IMPLEMENTED[_backend]["aqua"] = {
        name: "offline calibration (Algorithm 1, float64 ridge solves): the reference serves it"
        for name in ("fit_ridge", "fit_reduced_rank", "calibration_tokens", "calibrate")}
    NOT_YET_IMPLEMENTED[_backend]["aqua_cache"] = {
        "AquaState": "the reference's class holds NumPy arrays; the fast state is "
                     f"kvq.fast.{_backend}.aqua_cache.AquaTensorState (the same fields as torch tensors)",
        "forward": "Algorithm 4 runs a model layer by layer: kvq has no torch model behind the KVModel interface "
                   "yet; its cache steps are aqua_cache.append, decode_layer and decode_attention",
    }
for _backend in BACKENDS:
    NOT_YET_IMPLEMENTED[_backend]["bitdecoding"] = {
        "BitDecodingState": "the reference's class holds NumPy arrays; the fast state is "
                            f"kvq.fast.{_backend}.bitdecoding.BitDecodingTensorState (the same fields as torch "
                            "tensors)",
    }
del _backend


def triton_interpreting() -> bool:
    """Whether kvq's Triton kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1`` when they
    were decorated): the process-wide fact of ``kvq.fast.triton.quant.interpreting``, never the environment
    read now. False where Triton cannot be imported."""
    try:
        from kvq.fast.triton import quant
    except ImportError:
        return False
    return quant.interpreting()


def backend_module(module: str, backend: str | None = None):
    """The module ``kvq.fast.<backend>.<module>``; ``backend=None`` means the default (Triton)."""
    backend = DEFAULT_BACKEND if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; choose one of {BACKENDS}")
    if module not in MIRRORED:
        raise ValueError(f"module {module!r} has no fast version; fast modules: {tuple(MIRRORED)}")
    return importlib.import_module(f"kvq.fast.{backend}.{module}")


def quantize(x, bits, group_size, axis=-1, meta_dtype=np.float16, *, symmetric=False, backend=None):
    """Mirrors :func:`kvq.reference.quant.quantize` on a torch tensor; returns (codes, scale, mn)."""
    return backend_module("quant", backend).quantize(x, bits, group_size, axis, meta_dtype, symmetric=symmetric)


def dequantize(codes, scale, mn, group_size, axis=-1, out_dtype=np.float16, *, backend=None):
    """Mirrors :func:`kvq.reference.quant.dequantize`; bf16 output is a torch.bfloat16 tensor."""
    return backend_module("quant", backend).dequantize(codes, scale, mn, group_size, axis, out_dtype)


def quantile(a, rho, axis=-1, *, backend=None):
    """Mirrors :func:`kvq.reference.quant.quantile`; returns a torch.float32 tensor."""
    return backend_module("quant", backend).quantile(a, rho, axis)


def percentile_clip(x, ratio, axis=-1, *, backend=None):
    """Mirrors :func:`kvq.reference.quant.percentile_clip`; returns (x_clipped, tau), torch.float32."""
    return backend_module("quant", backend).percentile_clip(x, ratio, axis)


def pack(codes, bits, axis=-1, *, backend=None):
    """Mirrors :func:`kvq.reference.packing.pack`."""
    return backend_module("packing", backend).pack(codes, bits, axis)


def unpack(packed, bits, axis=-1, *, backend=None):
    """Mirrors :func:`kvq.reference.packing.unpack`."""
    return backend_module("packing", backend).unpack(packed, bits, axis)


def quantize_pack(x, bits, group_size, axis=-1, meta_dtype=np.float16, *, symmetric=False, backend=None):
    """Mirrors :func:`kvq.reference.packing.quantize_pack`: one fused kernel, returns (packed, scale, mn)."""
    return backend_module("packing", backend).quantize_pack(x, bits, group_size, axis, meta_dtype,
                                                            symmetric=symmetric)


def unpack_dequantize(packed, scale, mn, bits, group_size, axis=-1, out_dtype=np.float16, *, backend=None):
    """Mirrors :func:`kvq.reference.packing.unpack_dequantize`: one fused kernel."""
    return backend_module("packing", backend).unpack_dequantize(packed, scale, mn, bits, group_size, axis,
                                                                out_dtype)


def partial_attention(q, k, v, *, scale=None, backend=None):
    """Mirrors :func:`kvq.reference.attention.partial_attention`; returns (o in q's dtype, lse fp32)."""
    return backend_module("attention", backend).partial_attention(q, k, v, scale=scale)


def merge(partials, *, backend=None):
    """Mirrors :func:`kvq.reference.attention.merge`."""
    return backend_module("attention", backend).merge(partials)


def decode_attention(q, segments, *, scale=None, backend=None):
    """Mirrors :func:`kvq.reference.attention.decode_attention`: FP16 flash-decoding over KV segments."""
    return backend_module("attention", backend).decode_attention(q, segments, scale=scale)
