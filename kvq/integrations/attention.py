"""Attention through kvq: a transformers attention function that runs each method's fused decode over the
compressed cache, so no dequantized copy of the cache exists while a model generates.

transformers 5 looks an attention layer's function up by ``config._attn_implementation`` in its
``AttentionInterface``. Importing this module registers ``"kvq"`` there (and SDPA's mask builder under the
same name). ``make_cache(name, model)`` switches the model to it, so a user writes nothing more:

    from kvq.integrations.transformers import make_cache
    cache = make_cache("KIVI-K2V2", model)            # model.config._attn_implementation becomes "kvq"
    out = model.generate(input_ids, cache=cache, max_new_tokens=64)

The road of one attention layer, with a kvq cache:

1. ``KVQCache.update(k, v, layer)`` appends the new post-RoPE tokens to the layer's compressed state and
   returns the new tokens themselves, the keys tagged with the cache (``_kvq`` attribute: cache, layer,
   tokens cached before them).
2. :func:`kvq_attention_forward` reads the tag and
   * prefill (nothing cached before): SDPA over the prompt's own FP16 keys and values, with the model's mask;
   * decode (one query token): the method's fused decode over the compressed state (:func:`decode`), which
     holds the new token already: ``kivi.decode_attention``, ``kitty``, ``oscar`` (queries rotated by R_K,
     the output rotated back by R_V^T), ``bitdecoding`` (tensor-core kernel on CuPy), AQUA-KV (the history
     reconstructed by its predictors, layer by layer, in the step), FP16 (SDPA over the stored tensors);
   * a prefill chunk after earlier tokens (several query tokens and a cached prefix): SDPA over the prefix
     dequantized once plus the chunk's own FP16 keys and values, with the model's causal mask. The fused
     decodes attend every query to every cached token (no causal mask inside the chunk), and chunked
     prefill happens once per chunk, not per generated token, so a transient copy of the prefix costs less
     than a masked variant of every kernel.
   Without the tag (any other cache: DynamicCache, StaticCache, ...) it is transformers' SDPA, unchanged.

Batches whose prompts have different lengths (left padding) are refused at the first prefill with a clear
error (the fused decodes attend to every cached token of a sequence; padded positions would count), and the
cache is left empty, as before the call.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

__all__ = ["ATTN_IMPLEMENTATION", "kvq_attention_forward", "decode", "use_kvq_attention"]

#: the name kvq's attention function is registered under in transformers' AttentionInterface
ATTN_IMPLEMENTATION = "kvq"

_PADDING = ("kvq caches do not support batches of prompts with different lengths (left padding): the fused "
            "decode attends to every cached token of a sequence, padded positions included. Generate each "
            "prompt on its own, or batch prompts of equal length")


def tag_states(t: torch.Tensor, cache, layer: int, prior: int) -> torch.Tensor:
    """A view of ``t`` carrying (cache, layer, tokens cached before it) for :func:`kvq_attention_forward`: the
    keys a kvq cache's fused ``update`` returns (``kvq.integrations.transformers``, and the CUDA-graph capture
    of ``kvq.integrations.graphs``; the values come back as they are: the attention function reads the tag
    of the keys only), so that the attention function finds the cache to decode from. The caller's tensor
    itself is not tagged."""
    out = t.view_as(t)
    out._kvq = (cache, layer, prior)
    return out


def kvq_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          **kwargs):
    """transformers attention function ``"kvq"``: kvq's fused decode for a kvq cache, SDPA otherwise.

    Args as transformers' ``sdpa_attention_forward``: query (B, H_q, T_q, D), key / value what the cache's
    ``update`` returned, ``attention_mask`` the model's (SDPA's boolean 4D mask, or None), ``scaling`` the
    softmax scale. Returns ``(attn_output (B, T_q, H_q, D), None)``.
    """
    tag = getattr(key, "_kvq", None)
    if tag is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    cache, layer, prior = tag
    capture = getattr(cache, "graph_capture", None)
    if capture is not None:                      # kvq.integrations.graphs records a step: this layer runs eagerly
        return capture.capture_attention(module, layer, query, key, value,
                                         dict(kwargs, dropout=dropout, scaling=scaling))
    T_q = query.shape[2]
    if prior == 0:
        if layer == 0 and attention_mask is not None and _has_padding(attention_mask, T_q):
            cache.reset()
            raise ValueError(_PADDING)
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
    elif T_q == 1 and cache.store.exact:                                     # FP16: DynamicCache's very call
        K, V = cache.store.keys_values(layer, query.dtype)
        out = sdpa_attention_forward(module, query, K, V, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
    elif T_q == 1:
        o = decode(cache.store, layer, query, scaling)                         # (B, H_q, 1, D)
        out = (o.transpose(1, 2).contiguous(), None)
    else:
        K, V = cache.store.keys_values(layer, query.dtype)                     # one-off: the prefix only
        K = torch.cat([K[:, :, :prior].to(key.device), key], dim=2)
        V = torch.cat([V[:, :, :prior].to(value.device), value], dim=2)
        out = sdpa_attention_forward(module, query, K, V, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
    cache.store.attended(layer)
    return out


def _has_padding(mask: torch.Tensor, T_q: int) -> bool:
    """True when a prefill's mask hides a position that causal attention would show (left padding)."""
    if mask.dtype != torch.bool:
        mask = mask == 0                                     # additive float masks: 0 where attended
    kv = mask.shape[-1]
    causal = torch.ones((T_q, kv), dtype=torch.bool, device=mask.device).tril(kv - T_q)
    return bool((causal & ~mask).any())


# ---------------------------------------------------------------------------------------------------
# one decode step of one layer over a KVStore


def decode(store, layer: int, q: torch.Tensor, scale=None) -> torch.Tensor:
    """Attention of ``q`` (B, H_q, T_q, D) over everything ``store`` holds for ``layer``, by the method's
    fused decode on the store's backend; returns (B, H_q, T_q, D) in q's dtype on q's device.

    ``KVStore.decode_attention``, i.e. the method family's ``decode_attention``
    (``kvq.integrations.families``): the reference backend runs the reference's ``decode_attention``
    (NumPy, fp32); OSCAR rotates the queries by R_K and the output back by R_V^T; AQUA-KV attends over its
    committed cache (history reconstructed through the predictors, ``decode_layer``) and the tokens still
    waiting for the other layers, merged by log-sum-exp; FP16 is SDPA over the stored tensors. The fast
    kernels run without their NaN / inf scan of q (a device synchronization per layer and step; a model's
    query is its own) and under the layer's device.
    """
    return store.decode_attention(layer, q, scale)


# ---------------------------------------------------------------------------------------------------
# registration


def use_kvq_attention(model) -> bool:
    """Switch ``model`` to the ``"kvq"`` attention function (SDPA for every cache that is not kvq's).
    Returns False (model unchanged) where the model cannot set its attention implementation."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        return config is not None
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        return False
    try:
        setter(ATTN_IMPLEMENTATION)
    except (ValueError, KeyError, TypeError, NotImplementedError):
        return False
    return getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


AttentionInterface.register(ATTN_IMPLEMENTATION, kvq_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
