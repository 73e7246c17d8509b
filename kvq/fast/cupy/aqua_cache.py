"""CuPy AQUA-KV cache over all layers (AQUA-KV §3.3, Algorithm 4): mirrors ``kvq.reference.aqua_cache``.

The CuPy twin of ``kvq.fast.triton.aqua_cache``: the same state (``AquaTensorState``), routing (sink,
buffer, one chunk per full buffer, layer 0 first, keys pre-RoPE by default) and reading, written once
in ``kvq.fast.caches.aqua_cache``, run with this backend's kernels (``aqua.OPS``: the fused decode of
``aqua.cu``, the HIGGS quantizer of ``higgs.cu``, ``packing.quantize_pack``, the flash-decoding kernel
of ``attention.cu``).

    from kvq.fast.cupy import aqua_cache
    st = aqua_cache.init(cfg, n_layers=28, batch=1, kv_heads=8, head_dim=128)
    aqua_cache.append(cfg, P, st, K, V)                          # (L, B, H_kv, T_new, D), keys post-RoPE
    hat = aqua_cache.decode_layer(cfg, P, st, l, hat)            # layer l's history from layer l-1's
    out, lse = aqua_cache.decode_attention(cfg, P, st, l, q, hat)
"""

from __future__ import annotations

from kvq.fast.caches import aqua_cache as _A
from kvq.fast.caches.aqua_cache import AquaTensorState, bits_per_value, state_bytes  # noqa: F401
from kvq.reference.aqua import AquaConfig, AquaPredictors

from .aqua import OPS

__all__ = ["AquaTensorState", "init", "append", "dequantize", "decode_layer", "decode_attention",
           "bits_per_value", "state_bytes"]


def init(cfg: AquaConfig, n_layers: int, batch: int, kv_heads: int, head_dim: int, *,
         device=None) -> AquaTensorState:
    """Mirrors `kvq.reference.aqua_cache.init`: an empty cache, every tensor preallocated for max_tokens.

    Differences: an :class:`AquaTensorState` (the reference's fields as torch tensors) on ``device`` (a
    CUDA device, e.g. "cuda:1"; None: the current CUDA device); backbones Uniform, Higgs, KeepFP16 only
    (TypeError for others).
    """
    return _A.init(OPS, cfg, n_layers, batch, kv_heads, head_dim, device=device)


def append(cfg: AquaConfig, P: AquaPredictors, st: AquaTensorState, K, V) -> AquaTensorState:
    """Mirrors `kvq.reference.aqua_cache.append`: as ``kvq.fast.triton.aqua_cache.append`` (the same routing
    and checks; bad input leaves the state unchanged), with this backend's kernels.

    Differences: K, V are float16 / float32 torch CUDA tensors on the cache's device; NaN / inf and
    float16-overflow checks while ``kvq.fast.validation`` is on; residual codes of layers >= 1 follow
    contract rule 7 (fp32 predictor products); sinks, buffers, layer-0 codes and counters are bit-identical.
    """
    return _A.append(OPS, cfg, P, st, K, V)


def dequantize(cfg: AquaConfig, P: AquaPredictors, st: AquaTensorState) -> list:
    """Mirrors `kvq.reference.aqua_cache.dequantize`: ``[(K_l, V_l)]`` fp32 (B, H, T, D), keys post-RoPE.

    Differences: torch CUDA tensors; each layer's chunks decoded at once (:func:`decode_layer`); layer 0,
    sink and buffer bit-identical, layers >= 1 within the tolerance rule.
    """
    return _A.dequantize(OPS, cfg, P, st)


def decode_layer(cfg: AquaConfig, P: AquaPredictors, st: AquaTensorState, l: int, prev=None) -> tuple:
    """Algorithm 3 for layer l over the whole history, as ``kvq.fast.triton.aqua_cache.decode_layer``:
    ``(K_hat, V_hat)`` (B, n_chunks * buffer, F) fp32 from ``prev`` (layer l-1's; from layer 0 up when None),
    one product per predictor and one fused kernel of ``aqua.cu`` per K / V."""
    return _A.decode_layer(OPS, cfg, P, st, l, prev)


def decode_attention(cfg: AquaConfig, P: AquaPredictors, st: AquaTensorState, l: int, q, hat=None, *,
                     scale=None):
    """``(out, lse)`` of q over layer l's cache, as ``kvq.fast.triton.aqua_cache.decode_attention``: sink,
    reconstructed history (``hat`` or :func:`decode_layer`, RoPE'd) and buffer attended in fp32 by
    ``kvq.fast.cupy.attention.decode_attention``; out in q's dtype, lse float32. D in {16, 32, 64, 128}
    (the CuPy attention kernel's fp32 head dims).
    """
    return _A.decode_attention(OPS, cfg, P, st, l, q, hat, scale=scale)
