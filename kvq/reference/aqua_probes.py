"""What AQUA-KV's predictors explain: the Fig. 2 probes and the residual variance per layer (AQUA-KV §3.1).

A linear probe predicts a cache component (keys or values of layer l, token t) from another source:
the previous 1-3 layers, the previous 1-3 tokens, or the other role (K <-> V). Its explained variance
(App. A: per-channel variances, so a bias does not count) says how much of the component a predictor
could remove before quantization: 1- and 2-bit quantizers explain about 0.75 and 0.89 (§3.1).

    ev = probe_explained_variance(cfg, kv_train, kv_test)        # {"K": {"L-1": 0.57, ...}, "V": {...}}
    before, after = residual_variance(cfg, P, kv_test)            # (2, L): K and V, per layer
"""

from __future__ import annotations

import numpy as np

from . import checks
from .aqua import (AquaConfig, AquaPredictors, kv_pairs, real_matrix, calibration_tokens, check_config,
                   check_predictors, encode, fit_ridge, to_tokens)
from .model import apply_rope

__all__ = ["explained_variance", "probe_explained_variance", "residual_variance"]


def explained_variance(y, y_hat) -> float:
    """``1 - sum_c Var(y_c - y_hat_c) / sum_c Var(y_c)`` over channels c (per-channel variances, so a
    constant bias is not counted; App. A). y, y_hat (N, F) float or integer matrices of one shape (or
    (N,) vectors: one channel); computed in float64. NaN / inf in them give a NaN result (propagated,
    never a finite one).

    Raises ValueError where y is constant in every channel (every row equal, e.g. N = 1: ``sum_c Var(y_c)
    = 0``): the ratio is then 0 / 0 or x / 0 and no fraction of the variance is "explained"; TypeError /
    ValueError name y or y_hat when they are not such matrices.
    """
    shapes = np.shape(y), np.shape(y_hat)
    y, y_hat = _observations(y, "y"), _observations(y_hat, "y_hat")
    if y.shape != y_hat.shape:
        raise ValueError(f"y and y_hat must have one shape (N, F), got {shapes[0]} and {shapes[1]}")
    if not np.any(y != y[:1]):                      # every channel constant (its variance 0, or rounding noise)
        raise ValueError(f"y is constant in every channel (zero variance over its N={y.shape[0]} rows): the "
                         f"explained variance 1 - Var(y - y_hat) / Var(y) is undefined")
    with np.errstate(invalid="ignore", over="ignore"):     # NaN / inf propagate to a NaN result (documented)
        return float(1.0 - (y - y_hat).var(axis=0).sum() / y.var(axis=0).sum())


def _observations(x, name: str) -> np.ndarray:
    """``x`` (N, F), or (N,) as one channel, as a float64 matrix (``aqua.real_matrix``'s rules, NaN kept)."""
    if x is not None and np.ndim(x) == 1:
        x = np.asarray(x)[:, None]
    return real_matrix(x, name, finite=False)


def probe_explained_variance(cfg: AquaConfig, kv_train, kv_test, *, depth: int = 3, ridge: float = 1e-3):
    """Explained variance of linear probes (§3.1, Fig. 2), trained on ``kv_train``, scored on ``kv_test``.

    Both are clean ``[(K_l, V_l)]`` (B, H, T, D) lists (keys pre-RoPE when ``cfg.pre_rope``). For each
    role (K, V) the target is layer l's vector of token t, for every layer l >= depth and token
    t >= depth; sources: the same role at layers l-1 .. l-j ("L-1" .. "L-1..j"), at tokens t-1 .. t-j
    of layer l ("T-1" .. "T-1..j"), and the other role at (l, t) ("V" for keys, "K" for values).
    Returns ``{"K": {source: ev}, "V": {source: ev}}``, each the mean over target layers.
    """
    check_config(cfg)
    depth = checks.int_arg(depth, "depth", lo=1)
    ridge = checks.real_arg(ridge, "ridge", 0.0)

    def prep(kv):
        out = []
        for K, V in kv_pairs(kv):
            if cfg.pre_rope:
                K = apply_rope(K, np.arange(K.shape[2]), cfg.rope_theta, inverse=True)
            out.append({"K": to_tokens(K), "V": to_tokens(V)})                       # (B, T, F)
        return out

    tr, te = prep(kv_train), prep(kv_test)
    L = len(tr)
    if len(te) != L:
        raise ValueError(f"kv_test has {len(te)} layers, kv_train {L}: give both for every layer")
    if not 1 <= depth < L:
        raise ValueError(f"depth={depth} needs 1 <= depth < n_layers={L}")
    other = {"K": "V", "V": "K"}

    def sources(data, l, role):
        tgt = data[l][role][:, depth:]                                           # (B, T - depth, F)
        src = {}
        for j in range(1, depth + 1):
            name = "L-1" if j == 1 else f"L-1..{j}"
            src[name] = np.concatenate([data[l - i][role][:, depth:] for i in range(1, j + 1)], -1)
        T = data[l][role].shape[1]
        for j in range(1, depth + 1):
            name = "T-1" if j == 1 else f"T-1..{j}"
            src[name] = np.concatenate([data[l][role][:, depth - i:T - i] for i in range(1, j + 1)], -1)
        src[other[role]] = data[l][other[role]][:, depth:]
        flat = lambda a: a.reshape(-1, a.shape[-1])                              # noqa: E731
        return flat(tgt), {k: flat(a) for k, a in src.items()}

    result = {}
    for role in ("K", "V"):
        evs = {}
        for l in range(depth, L):
            y_tr, x_tr = sources(tr, l, role)
            y_te, x_te = sources(te, l, role)
            for name in x_tr:
                p = fit_ridge(x_tr[name], y_tr, ridge)
                evs.setdefault(name, []).append(explained_variance(y_te, p(x_te[name])))
        result[role] = {k: float(np.mean(v)) for k, v in evs.items()}
    return result


def residual_variance(cfg: AquaConfig, P: AquaPredictors, kv):
    """Total per-channel variance of what each layer quantizes, before and after prediction.

    ``kv``: clean ``[(K_l, V_l)]`` (B, H, T, D). Runs Algorithm 2 layer by layer on the tokens after the
    sink; "before" is the variance of K_l (V_l) itself, "after" that of the residual ``K_l - K_pred``
    (``V_l - V_pred``) the backbone is given (layer 0 is quantized directly: after = before).
    Returns ``(before, after)``, each (2, L) float64: row 0 keys, row 1 values.
    """
    toks = calibration_tokens(cfg, kv)
    L = len(toks)
    if not L:
        raise ValueError("kv is empty: give the keys and values of every layer")
    check_predictors(cfg, P, toks[0][0].shape[-1], L)
    before, after = np.zeros((2, L)), np.zeros((2, L))
    K_hat = V_hat = None
    var = lambda a: float(np.asarray(a, np.float64).var(axis=0).sum())          # noqa: E731
    for l, (K, V) in enumerate(toks):
        before[:, l] = var(K), var(V)
        if l == 0 or P.f_key[l] is None:
            after[:, l] = before[:, l]
        else:
            K_pred = P.f_key[l](K_hat) if cfg.predict_keys else 0
            after[0, l] = var(np.asarray(K, np.float64) - K_pred)
        Kq, Vq, K_hat_new, V_hat_new = encode(cfg, P, l, K, V, K_hat, V_hat)
        if l and P.f_value[l] is not None:
            V_pred = P.f_value[l](np.concatenate([V_hat, K_hat_new], axis=-1)) if cfg.predict_values else 0
            after[1, l] = var(np.asarray(V, np.float64) - V_pred)
        K_hat, V_hat = K_hat_new, V_hat_new
    return before, after
