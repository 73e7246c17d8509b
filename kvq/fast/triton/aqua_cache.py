"""Triton AQUA-KV cache over all layers (AQUA-KV §3.3, Algorithm 4): mirrors ``kvq.reference.aqua_cache``.

Per sequence and layer: the first ``sink`` tokens and a recent buffer of up to ``buffer`` tokens in FP16;
every earlier token as codes only, layer 0 quantized directly, layers 1..L-1 the residuals after the
predictors. When the buffer fills, its tokens are compressed as one chunk, layer 0 first, each layer
predicted from the previous layer's reconstruction, keys pre-RoPE by default. Routing, state and
reading are written once for both backends (``kvq.fast.caches.aqua_cache``), run here with this backend's
kernels (``aqua.OPS``: the fused decode of ``aqua.py``, the HIGGS quantizer, ``packing.quantize_pack``,
the flash-decoding kernel of ``attention.py``).

    from kvq.fast.triton import aqua_cache
    st = aqua_cache.init(cfg, n_layers=28, batch=1, kv_heads=8, head_dim=128)
    aqua_cache.append(cfg, P, st, K, V)                          # (L, B, H_kv, T_new, D), keys post-RoPE
    hat = None
    for l in range(28):                                          # a decode step, layer by layer (Alg. 4)
        hat = aqua_cache.decode_layer(cfg, P, st, l, hat)        # layer l's history from layer l-1's
        out, lse = aqua_cache.decode_attention(cfg, P, st, l, q[l], hat)

State parity: sinks, buffers, layer-0 codes, counters are the reference's bit for bit after the same
appends; residual codes of layers >= 1 follow contract rule 7 (the predictors are fp32 matrix products).
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

    Differences: returns an :class:`AquaTensorState` (the reference's fields as torch tensors, the same
    shapes and dtypes) on ``device`` (a CUDA device, e.g. "cuda:1"; the CPU only under the Triton
    interpreter; None: the current CUDA device, the CPU under the interpreter); backbones Uniform,
    Higgs, KeepFP16 only (TypeError for others).
    """
    return _A.init(OPS, cfg, n_layers, batch, kv_heads, head_dim, device=device)


def append(cfg: AquaConfig, P: AquaPredictors, st: AquaTensorState, K, V) -> AquaTensorState:
    """Mirrors `kvq.reference.aqua_cache.append`: append (L, B, H_kv, T_new, D) tokens (keys post-RoPE).

    Sink first, then the buffer; every full buffer is encoded as one chunk (Algorithm 2 per layer, layer 0
    first, keys pre-RoPE when ``cfg.pre_rope``), each chunk on its own, so appending token by token gives
    the same state bit for bit as appending at once. Validation and encoding come before any write:
    bad input leaves the state unchanged, with the reference's error (type and message).
    Differences: K, V are float16 / float32 torch tensors on the cache's device; the NaN / inf and
    float16-overflow checks run while ``kvq.fast.validation`` is on; the predictions are fp32 matrix
    products, so residual codes of layers >= 1 follow contract rule 7 (sinks, buffers, layer-0 codes
    and counters are bit-identical).
    """
    return _A.append(OPS, cfg, P, st, K, V)


def dequantize(cfg: AquaConfig, P: AquaPredictors, st: AquaTensorState) -> list:
    """Mirrors `kvq.reference.aqua_cache.dequantize`: ``[(K_l, V_l)]`` fp32 (B, H, T, D), keys post-RoPE.

    Sink and buffer are the FP16 tokens widened (bit-identical); the chunks of each layer are decoded all
    at once (:func:`decode_layer`: the fused kernel after one product per predictor), layer 0 first.
    Differences: torch tensors; layer 0 is bit-identical, layers >= 1 follow the tolerance rule (fp32
    products over all chunks at once, where the reference decodes chunk by chunk).
    """
    return _A.dequantize(OPS, cfg, P, st)


def decode_layer(cfg: AquaConfig, P: AquaPredictors, st: AquaTensorState, l: int, prev=None) -> tuple:
    """Algorithm 3 for layer l over the whole history: ``(K_hat, V_hat)`` (B, n_chunks * buffer, F) fp32
    token vectors (keys pre-RoPE when ``cfg.pre_rope``), from ``prev`` = layer l-1's result (decoded from
    layer 0 up when None). One product per predictor and one fused kernel (:func:`aqua.reconstruct`) per
    K / V. The per-layer step of Algorithm 4 (no reference function: the reference's ``dequantize``
    decodes every layer at once)."""
    return _A.decode_layer(OPS, cfg, P, st, l, prev)


def decode_attention(cfg: AquaConfig, P: AquaPredictors, st: AquaTensorState, l: int, q, hat=None, *,
                     scale=None):
    """``(out, lse)`` of q (B, H_q, T_q, D) over layer l's cache (Algorithm 4's attention at decode).

    The history is ``hat`` (or :func:`decode_layer`), RoPE'd at its positions; sink, history and buffer
    are attended in fp32 by ``kvq.fast.triton.attention.decode_attention`` (flash-decoding, one
    log-sum-exp merge). Equals ``kvq.reference.attention.decode_attention(q, [sink, history, buffer])``
    over the reference's ``dequantize`` within the tolerance rule; out in q's dtype, lse float32.
    q float16 / bfloat16 / float32; D a power of two in [16, 256].
    """
    return _A.decode_attention(OPS, cfg, P, st, l, q, hat, scale=scale)
