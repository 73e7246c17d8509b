"""Attention-level errors of a quantized cache: relative MSE, logit MSE, attention KL, output MSE.

A quantizer is judged by what it does to attention, not by the reconstruction error of K and V
alone: keys are hurt through the logits ``q k^T`` (KIVI section 3.1, per-channel key outliers),
values through the weighted sum. These are the metrics the papers report (OSCAR section 5, AQUA-KV
section 4) on one footing. All are computed in float64 from float16 / float32 / float64 inputs,
reusing :mod:`kvq.reference.attention` (GQA, causal alignment and the stable softmax live there).

    relative_mse(k, k_hat)                                 # ||k - k_hat||^2 / ||k||^2
    attention_kl(q, k, k_hat, causal=True)                 # mean KL(p || p_hat) over query rows
    output_mse(q, k, v, k_hat, v_hat)                      # mean (attn(q,k,v) - attn(q,k_hat,v_hat))^2

Shapes: q (B, H_q, T_q, D); k, v, k_hat, v_hat (B, H_kv, T_k, D), H_q a multiple of H_kv.
"""

from __future__ import annotations

import numpy as np

from . import attention as attn

F64 = np.float64


def as_f64(x, name: str) -> np.ndarray:
    """float16 / float32 / float64 -> float64 (exact); anything else is refused."""
    a = np.asarray(x)
    if a.dtype not in (np.float16, np.float32, np.float64):
        raise TypeError(f"{name} has dtype {a.dtype}; metrics take float16 / float32 / float64 arrays")
    return a.astype(F64)


def _finite(**arrays) -> None:
    """Numerics rule 8 for the attention metrics: NaN / inf in any input raise, naming that input (the
    attention behind them would name only its own q / k / v)."""
    for name, a in arrays.items():
        attn.check_finite(a, name)


def _same_shape(a, b, na: str, nb: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{na} has shape {a.shape} but {nb} has shape {b.shape}; they must match")


def relative_mse(x, x_hat) -> float:
    """``||x - x_hat||^2 / ||x||^2`` over all elements (0 for a perfect reconstruction)."""
    x, x_hat = as_f64(x, "x"), as_f64(x_hat, "x_hat")
    _same_shape(x, x_hat, "x", "x_hat")
    den = float(np.sum(x * x))
    if den == 0.0:
        raise ValueError("x is all zeros; the relative error is undefined")
    return float(np.sum((x - x_hat) ** 2)) / den


def _scores_f64(q, k, scale):
    """Scaled scores in float64, (B, H_q, T_q, T_k), validated as attention validates them."""
    q, k, _, dtype = attn.check_qkv(q, k, k)
    return attn.scaled_scores(q, k, attn.resolve_scale(scale, q.shape[-1], dtype))


def logit_mse(q, k, k_hat, scale=None) -> float:
    """Mean squared error of the scaled logits ``q k^T * scale`` against ``q k_hat^T * scale`` (GQA-aware).

    The mean runs over every (batch, query head, query, key) logit; no mask is applied.
    """
    q, k, k_hat = as_f64(q, "q"), as_f64(k, "k"), as_f64(k_hat, "k_hat")
    _same_shape(k, k_hat, "k", "k_hat")
    _finite(q=q, k=k, k_hat=k_hat)
    s, s_hat = _scores_f64(q, k, scale), _scores_f64(q, k_hat, scale)
    if s.size == 0:
        raise ValueError(f"no logits to compare (scores shape {s.shape})")
    return float(np.mean((s - s_hat) ** 2))


def _log_probs(q, k, causal: bool, scale):
    """Attention log-probabilities ``s - m - log(l)`` (float64, -inf where a key is hidden)."""
    s = _scores_f64(q, k, scale)                            # (B, H_q, T_q, T_k)
    B, _, T_q, T_k = s.shape
    visible = attn.visible_keys(B, T_q, T_k, causal, None)  # (B, 1, T_q, T_k) or None
    if T_k == 0:
        raise ValueError("k holds no keys (T_k=0); attention is undefined")
    _, m, l = attn.softmax_parts(s, visible)
    logp = s - m - np.log(l)
    if visible is not None:
        logp = np.where(visible, logp, -np.inf)
    return logp


def attention_scores(q, k, causal: bool = False, scale=None) -> np.ndarray:
    """The attention score matrix ``softmax(q k^T * scale)`` in float64, (B, H_q, T_q, T_k), GQA-aware.

    Hidden keys (causal mask) get probability 0. This is eq. (1) of the Kitty paper, the matrix whose
    perturbation measures a channel's sensitivity.
    """
    return np.exp(_log_probs(as_f64(q, "q"), as_f64(k, "k"), bool(causal), scale))


def attention_kl(q, k, k_hat, causal: bool = False, scale=None) -> float:
    """Mean over query rows of ``KL(softmax(q k^T) || softmax(q k_hat^T))`` (natural log, nats).

    Each row's KL is ``sum_j p_j (log p_j - log p_hat_j)`` over the keys it sees; the log-probabilities
    come from the log-sum-exp, so no probability is rounded to 0 before its log is taken.
    """
    q, k, k_hat = as_f64(q, "q"), as_f64(k, "k"), as_f64(k_hat, "k_hat")
    _same_shape(k, k_hat, "k", "k_hat")
    _finite(q=q, k=k, k_hat=k_hat)
    logp = _log_probs(q, k, bool(causal), scale)            # (B, H_q, T_q, T_k)
    logp_hat = _log_probs(q, k_hat, bool(causal), scale)
    if logp.shape[2] == 0:
        raise ValueError("q holds no query rows (T_q=0); nothing to average")
    p = np.exp(logp)                                        # 0 exactly where a key is hidden
    with np.errstate(invalid="ignore"):                     # hidden keys: -inf - -inf, discarded
        terms = np.where(np.isfinite(logp), p * (logp - logp_hat), 0.0)
    kl_rows = terms.sum(axis=-1)                            # (B, H_q, T_q)
    return float(np.mean(kl_rows))


def output_mse(q, k, v, k_hat, v_hat, causal: bool = False, scale=None) -> float:
    """Mean squared error of the attention output with the exact cache against the quantized one."""
    q, k, v = as_f64(q, "q"), as_f64(k, "k"), as_f64(v, "v")
    k_hat, v_hat = as_f64(k_hat, "k_hat"), as_f64(v_hat, "v_hat")
    _same_shape(k, k_hat, "k", "k_hat")
    _same_shape(v, v_hat, "v", "v_hat")
    _finite(q=q, k=k, v=v, k_hat=k_hat, v_hat=v_hat)
    out = attn.attention(q, k, v, causal=causal, scale=scale)          # (B, H_q, T_q, D)
    out_hat = attn.attention(q, k_hat, v_hat, causal=causal, scale=scale)
    if out.size == 0:
        raise ValueError(f"no outputs to compare (output shape {out.shape})")
    return float(np.mean((out - out_hat) ** 2))
