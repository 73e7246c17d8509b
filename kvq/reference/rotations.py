"""Orthogonal rotations for OSCAR: eigenbases, the Hadamard factor, the permuted bit-reversal, ablations.

OSCAR (App. A.1-A.4) rotates keys by ``R_K = U_Q H P_br`` and values by ``R_V = U_S H P_br``: ``U`` the
eigenbasis of an attention-aware target covariance (columns sorted by descending eigenvalue),
``H`` the normalized Walsh-Hadamard matrix (App. A.1, from ``hadamard.py``), and ``P_br`` the
permutation that puts the k-th column at position ``bit_reverse(k)`` (App. A.4). This module holds
those pieces, the ablation rotations of Table 4 / Table 10, and ``rotate``, the fixed-order fp32
product the cache applies to every token.

    lam, U = eig_desc(C_Q)                       # C_Q (D, D) -> lam (D,) descending, U (D, D)
    R_K = compose("oscar", U)                    # U @ H @ P_br, float64 (D, D)
    k_rot = rotate(k, R_K.astype(np.float32))    # k (..., D) @ R_K in fp32, fixed order

Row-vector convention throughout (the paper's): a token is a row ``k`` (1, D), rotated as ``k R``.
Float64 is used for calibration and analysis (eigendecompositions, compositions); the cache stores
the rotations in fp32 and applies them with :func:`rotate`.
"""

from __future__ import annotations

import numpy as np

from . import attention as attn
from . import checks
from . import metrics
from . import numerics as nx
from .quant import dequantize, percentile_clip, quantize
from .hadamard import hadamard_matrix, is_power_of_two

__all__ = ["ROTATIONS", "bit_reverse", "bit_reversal", "pbr_matrix", "hadamard64", "eig_desc",
           "random_orthogonal", "compose", "rotate", "frozen_surrogate", "target_covariances",
           "quantize_tokens", "fake_quantize", "rotation_table", "error_table"]

#: rotation choices: OSCAR and the factors / targets of Table 4 and Table 10
#: (the target covariance behind ``U`` is the caller's: C_Q / C_S for OSCAR, K^T K / V^T V for "kk_vv")
ROTATIONS = {
    "oscar": ("U", "H", "P"),           # full OSCAR: U H P_br (eq. 3)
    "eigen_hadamard": ("U", "H"),       # w/o P_br
    "eigen_pbr": ("U", "P"),            # w/o H
    "hadamard_pbr": ("H", "P"),         # w/o U
    "eigen": ("U",),                    # U alone
    "hadamard": ("H",),                 # H alone (QuaRot-style)
    "identity": (),                     # no rotation
    "random": ("random",),              # a random orthogonal matrix
}


def as_real64(x, name: str, *, ndim=None, min_ndim: int | None = None, square: bool = False) -> np.ndarray:
    """``x`` as a float64 ndarray for the float64 analysis functions (eigenbases, compositions, folds).

    Real numbers only: float16 / 32 / 64 and integer arrays convert exactly (as ``np.asarray(x, float64)``
    always did here); bool, complex, string and object arrays (and None) are refused with a TypeError
    naming ``name``. ``ndim``: an int or a tuple of allowed numbers of dimensions; ``square``: the last two
    axes must be equal (a (..., D, D) matrix). NaN / inf are left to the caller.
    """
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    a = np.asarray(x)
    if not (a.dtype.kind in "iu" or a.dtype.name in ("float16", "float32", "float64")):
        raise TypeError(f"{name} must be a real array (float16 / float32 / float64 or integer), got dtype {a.dtype}")
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if allowed is not None and a.ndim not in allowed:
        raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dimension(s), got shape {a.shape}")
    if min_ndim is not None and a.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {a.shape}")
    if square and (a.ndim < 2 or a.shape[-1] != a.shape[-2]):
        raise ValueError(f"{name} must be square (..., D, D), got shape {a.shape}")
    return a.astype(np.float64)


def _check_rng(rng, name: str = "rng", optional: bool = False):
    """``rng`` must be a NumPy random Generator (or None where ``optional``): TypeError otherwise."""
    if optional and rng is None:
        return None
    if not isinstance(rng, (np.random.Generator, np.random.RandomState)):
        raise TypeError(f"{name} must be {'None or ' if optional else ''}a numpy.random.Generator "
                        f"(e.g. np.random.default_rng(0)), got {type(rng).__name__}")
    return rng


def _check_pow2(d) -> int:
    if not is_power_of_two(d):
        raise ValueError(f"head dim d={d!r} is not a power of two; the Walsh-Hadamard matrix and the "
                         f"bit-reversal permutation need d in (1, 2, 4, ..., 128, 256, ...)")
    return int(d)


def bit_reverse(k: int, n_bits: int) -> int:
    """``k`` with its lowest ``n_bits`` bits in reverse order (bit 0 <-> bit n_bits - 1).

    ``n_bits`` an int >= 0; ``k`` an int in [0, 2**n_bits) (higher bits would be dropped silently)."""
    n_bits = checks.int_arg(n_bits, "n_bits", lo=0)
    k = checks.int_arg(k, "k", lo=0)
    if k >> n_bits:
        raise ValueError(f"k={k} must be < 2**n_bits = 2**{n_bits} (it has {k.bit_length()} bits)")
    out = 0
    for _ in range(n_bits):
        out = (out << 1) | (k & 1)
        k >>= 1
    return out


def bit_reversal(d: int) -> np.ndarray:
    """The bit-reversal permutation beta of {0, ..., d-1} (d a power of two), int64 (d,).

    ``beta[k] = bit_reverse(k, log2 d)``; for d = 128: beta[0..7] = 0, 64, 32, 96, 16, 80, 48, 112.
    """
    d = _check_pow2(d)
    n_bits = d.bit_length() - 1
    return np.array([bit_reverse(k, n_bits) for k in range(d)], dtype=np.int64)


def pbr_matrix(d: int) -> np.ndarray:
    """P_br (d, d) float64: ``P[k, beta(k)] = 1``, so ``(A P)[:, beta(k)] = A[:, k]``.

    With A's columns sorted by descending eigenvalue, the column of the k-th largest lands at position
    ``beta(k)`` (App. A.4: ``(P_K)_{:, beta(k)} = e_{sigma(k)}`` with sigma the identity after sorting).
    """
    beta = bit_reversal(d)
    P = np.zeros((d, d))
    P[np.arange(d), beta] = 1.0
    return P


def hadamard64(d: int) -> np.ndarray:
    """The normalized Walsh-Hadamard matrix (App. A.1) in float64: signs from Sylvester's recursion
    (``hadamard.hadamard_matrix``), magnitude ``1 / sqrt(d)`` rounded once in float64. Raises
    ValueError when d is not a power of two."""
    _check_pow2(d)
    return np.sign(hadamard_matrix(d)).astype(np.float64) / np.sqrt(np.float64(d))


def eig_desc(C) -> tuple[np.ndarray, np.ndarray]:
    """Eigendecomposition ``C = U diag(lam) U^T`` of symmetric C (..., D, D), sorted descending.

    Float64. Returns ``(lam (..., D), U (..., D, D))``, column j of U the j-th eigenvector. Signs are
    fixed so that each eigenvector's entry of largest magnitude is positive (eigenvectors are defined up
    to sign; this makes the result deterministic). Raises on NaN / inf, a non-square or a non-real C
    (complex, bool, strings).
    """
    C = as_real64(C, "C", square=True)
    nx.check_finite(C, "C")
    lam, U = np.linalg.eigh((C + np.swapaxes(C, -1, -2)) / 2)     # ascending
    lam, U = lam[..., ::-1], U[..., ::-1]
    big = np.take_along_axis(U, np.abs(U).argmax(axis=-2)[..., None, :], axis=-2)   # (..., 1, D)
    U = U * np.where(big < 0, -1.0, 1.0)
    return np.ascontiguousarray(lam), np.ascontiguousarray(U)


def random_orthogonal(d: int, rng) -> np.ndarray:
    """A Haar-random orthogonal (d, d) float64 matrix: QR of a Gaussian matrix, signs fixed by diag(R).

    ``d`` an int >= 0; ``rng`` a ``numpy.random.Generator`` (or a legacy ``RandomState``)."""
    d = checks.int_arg(d, "d", lo=0)
    rng = _check_rng(rng)
    Z = rng.standard_normal((d, d))
    Qm, Rm = np.linalg.qr(Z)
    return Qm * np.sign(np.diag(Rm))


def compose(kind: str, U=None, d: int | None = None, rng=None) -> np.ndarray:
    """The rotation of one ablation ``kind`` (see ``ROTATIONS``), float64 (..., D, D).

    ``U`` (..., D, D): an eigenbasis from :func:`eig_desc` (needed by every kind with U in it); ``d``:
    the head dim when U is not given; ``rng``: a NumPy Generator for ``"random"`` (default seed 0).
    ``"oscar"`` is ``U @ H @ P_br`` (eq. 3); the others drop factors as their names say. U must be
    finite and square; ``d``, where given with U, must be U's size.
    """
    if not isinstance(kind, str) or kind not in ROTATIONS:
        raise ValueError(f"rotation kind={kind!r} is unknown; choose one of {tuple(ROTATIONS)}")
    factors = ROTATIONS[kind]
    d = checks.int_arg(d, "d", lo=1, optional=True)
    rng = _check_rng(rng, optional=True)
    if U is not None:
        U = as_real64(U, "U", square=True)
        nx.check_finite(U, "U")
        if d is not None and d != U.shape[-1]:
            raise ValueError(f"d={d} does not match U of shape {U.shape}; give one of them")
        d = U.shape[-1]
    elif "U" in factors:
        raise ValueError(f"rotation kind={kind!r} needs an eigenbasis U")
    if d is None:
        raise ValueError("give U or the head dim d")
    if kind == "random":
        return random_orthogonal(d, np.random.default_rng(0) if rng is None else rng)
    make = {"U": lambda: U, "H": lambda: hadamard64(d), "P": lambda: pbr_matrix(d)}
    R = np.eye(d)
    for f in factors:                       # left to right: U, then H, then P_br
        R = R @ make[f]()
    return R


def rotate(x, R) -> np.ndarray:
    """``x @ R`` in fp32 as a fixed-order reduction: ``acc = x_0 R_0``, then ``acc = acc + x_i R_i``
    for i = 1 .. D-1 (row i of R), one rounded multiply and one rounded add each, then ``+ 0.0``.

    x: (..., D) float16 / float32. R: fp32 (D, D), or (..., D, D) broadcastable against x's leading
    axes as ``R[..., i, :]`` against ``x[..., i:i+1]`` (e.g. (H, 1, D, D) for per-head rotations of
    (B, H, T, D)). The order makes every token's result independent of how many tokens are rotated at
    once (streaming equals bulk) and gives a fast tier an order it may mirror; the contract (rule 7)
    lets it use another, and compares against float64.
    """
    x = nx.as_f32(x, "x")
    if x.ndim == 0:
        raise ValueError("x is a scalar (0-d); rotate takes vectors (..., D)")
    R = np.asarray(R)
    if R.dtype != np.float32:
        raise TypeError(f"R has dtype {R.dtype}; the cache keeps its rotations in float32")
    D = x.shape[-1]
    if R.shape[-2:] != (D, D):
        raise ValueError(f"R has shape {R.shape}; rotating vectors of length {D} needs (..., {D}, {D})")
    try:
        np.broadcast_shapes(x.shape[:-1], R.shape[:-2])
    except ValueError:
        raise ValueError(f"R has shape {R.shape}; its leading axes {R.shape[:-2]} do not broadcast against "
                         f"x's {x.shape[:-1]} (x is {x.shape}; per-head rotations of (B, H, T, D) are "
                         f"(H, 1, D, D))") from None
    acc = nx.mul(x[..., 0:1], R[..., 0, :])
    for i in range(1, D):
        acc = nx.add(acc, nx.mul(x[..., i:i + 1], R[..., i, :]))
    return nx.canonical_zero(acc)


def frozen_surrogate(R, C, E) -> float:
    """Theorem 1's frozen-error surrogate ``tr(R^T C R E)``, float64 (all three (D, D), real; NaN
    propagates)."""
    R, C, E = (as_real64(a, n, ndim=2, square=True) for a, n in ((R, "R"), (C, "C"), (E, "E")))
    if not R.shape == C.shape == E.shape:
        raise ValueError(f"R {R.shape}, C {C.shape} and E {E.shape} must all be (D, D) with the same D")
    return float(np.trace(R.T @ C @ R @ E))


def _group_mean(C, H_kv: int):
    """(H_q, D, D) per query head -> (H_kv, D, D): the mean over each GQA group's query heads."""
    return C.reshape(H_kv, C.shape[0] // H_kv, *C.shape[1:]).mean(axis=1)


def target_covariances(q, k, v, *, per_head: bool = False, scale=None, causal: bool = True) -> dict:
    """The covariance targets of one layer, float64: ``C_Q``, ``C_S`` (attention-aware, section 3)
    and ``C_K``, ``C_V`` (raw-cache targets, Table 4's ``K^T K`` / ``V^T V`` ablation).

    ``C_Q = (1/N) sum_n q_n^T q_n`` averaged over the query heads of each GQA group;
    ``C_S = (1/N) V^T S^T S V = (1/N) (SV)^T (SV)`` with ``S = softmax(Q K^T / sqrt(D) + causal mask)``
    per query head, averaged the same way; N = B * T tokens (``causal=False``: no mask, for a
    bidirectional encoder such as MiniLM; the default True is the paper's decoders).
    ``per_head=False`` (the paper's production metric) also averages over KV heads: (D, D) each;
    ``per_head=True`` keeps (H_kv, D, D).
    """
    q, k, v = (metrics.as_f64(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    attn.check_shapes(q.shape, k.shape, v.shape)
    B, _, T, _ = k.shape
    H_kv, N = k.shape[1], B * T
    if N == 0:
        raise ValueError("no calibration tokens (T = 0)")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True (a decoder) or False (an encoder), got {causal!r}")
    O = attn.attention(q, k, v, causal=bool(causal), scale=scale)  # (B, H_q, T, D) = S V per head
    cov = {"C_Q": _group_mean(np.einsum("bhtd,bhte->hde", q, q) / N, H_kv),
           "C_S": _group_mean(np.einsum("bhtd,bhte->hde", O, O) / N, H_kv),
           "C_K": np.einsum("bhtd,bhte->hde", k, k) / N,
           "C_V": np.einsum("bhtd,bhte->hde", v, v) / N}             # each (H_kv, D, D)
    return cov if per_head else {n: C.mean(axis=0) for n, C in cov.items()}


def rotation_table(q, k, rotations: dict, group_size: int, bits: int = 2, clip: float = 1.0) -> dict:
    """Table 10: what each rotation does to what the quantizer sees, for keys k (B, H_kv, T, D).

    Per rotation (name -> R, (D, D) or (H_kv, D, D), float64 or float32), with ``K~ = k R`` in float64:
    ``max_abs`` = max |K~|; ``group_range`` = mean over tokens and groups of G channels of
    max - min; ``importance`` = max_i / mean_i of diag(R^T C_Q R) (C_Q averaged over each GQA group,
    then over KV heads when R is (D, D)); ``tr_E`` = tr(E_K) per token, E_K = sum_t e_t^T e_t with
    e = Q(clip(K~)) - K~ (INT2, fp32 metadata: the quantizer's error, not the fp16 rounding).
    """
    q64, k64 = metrics.as_f64(q, "q"), metrics.as_f64(k, "k")
    B, H, T, D = k64.shape
    C = _group_mean(np.einsum("bhtd,bhte->hde", q64, q64) / (B * T), H)          # (H, D, D)
    out = {}
    for name, R in rotations.items():
        R = np.asarray(R, dtype=np.float64)
        Rh = np.broadcast_to(R, (H, D, D))
        x = np.einsum("bhtd,hde->bhte", k64, Rh)                                 # (B, H, T, D)
        g = x.reshape(B, H, T, D // group_size, group_size)
        Cm = C.mean(axis=0, keepdims=True) if R.ndim == 2 else C
        imp = np.diagonal(np.swapaxes(Rh, -1, -2) @ Cm @ Rh, axis1=-2, axis2=-1)    # (H, D)
        xc, _ = percentile_clip(x.astype(np.float32), clip, axis=-1)
        codes, s, m = quantize(xc, bits, group_size, axis=-1, meta_dtype=np.float32)
        e = dequantize(codes, s, m, group_size, -1, np.float32).astype(np.float64) - x
        out[name] = {"max_abs": float(np.abs(x).max()),
                     "group_range": float((g.max(-1) - g.min(-1)).mean()),
                     "importance": float((imp.max(-1) / imp.mean(-1)).mean()),
                     "tr_E": float((e ** 2).sum() / (B * T * H))}
    return out


def broadcast_heads(R, H: int):
    """A rotation (D, D) as is, or (H, D, D) as (H, 1, D, D) to broadcast over (B, H, T, D)."""
    R = np.asarray(R)
    return R if R.ndim == 2 else R[:, None]


def head_matrices(R, H: int):
    """(D, D) or (H, D, D) -> (H, D, D) float64."""
    R = np.asarray(R, dtype=np.float64)
    return np.broadcast_to(R, (H,) + R.shape[-2:])


def quantize_tokens(x_rot, clip: float, group_size: int, bits: int = 2, meta_dtype="float16"):
    """App. A.5 on rotated tokens (..., D): per-token percentile clip at ``quantile_clip(|x~|)``
    (``quant.percentile_clip``), then per-token asymmetric ``bits``-bit quantization in groups of
    ``group_size`` channels (``quant.quantize``, the numerics contract). Returns ``(codes (..., D)
    uint8, scale, mn (..., D / G))``. ``clip``: a ratio in (0, 1] (1 = no clip)."""
    clip = checks.real_arg(clip, "clip", 0.0, 1.0, lo_open=True)
    xc, _ = percentile_clip(x_rot, clip, axis=-1)
    return quantize(xc, bits, group_size, axis=-1, meta_dtype=meta_dtype)


def fake_quantize(x, R, clip: float, group_size: int, bits: int = 2) -> np.ndarray:
    """``x_hat = Q(clip(fp16(x R))) R^T`` as the cache computes it, for x (B, H, T, D) and R fp32
    (D, D) or (H, D, D): the reconstruction of App. A.5 in the original frame, fp32. A per-head R needs
    x (B, H, T, D) with H = R.shape[0]."""
    x = nx.as_f32(x, "x")
    if x.ndim == 0:
        raise ValueError("x is a scalar (0-d); fake_quantize takes tokens (B, H, T, D)")
    R = as_real64(R, "R", ndim=(2, 3), square=True).astype(np.float32)
    if R.shape[-1] != x.shape[-1]:
        raise ValueError(f"R has shape {R.shape}; tokens of x {x.shape} need ({x.shape[-1]}, {x.shape[-1]})")
    if R.ndim == 3 and (x.ndim != 4 or x.shape[1] != R.shape[0]):
        raise ValueError(f"R has shape {R.shape} (one rotation per KV head); x must be (B, H={R.shape[0]}, T, D), "
                         f"got {x.shape}")
    clip = checks.real_arg(clip, "clip", 0.0, 1.0, lo_open=True)
    H = R.shape[0] if R.ndim == 3 else 1
    with np.errstate(over="ignore"):              # |x| > 65504 becomes +-inf in fp16: the cast's rule, no warning
        xr = rotate(x, broadcast_heads(R, H)).astype(np.float16)
    codes, s, m = quantize_tokens(xr, clip, group_size, bits)
    xq = dequantize(codes, s, m, group_size, -1, np.float32)
    return rotate(xq, broadcast_heads(np.ascontiguousarray(np.swapaxes(R, -1, -2)), H))


# ---------------------------------------------------------------------------------------------------
# Figs. 2 and 8: errors of the quantizer alone, per method


def error_table(q, k, v, methods: dict, group_size: int = 128, bits: int = 2, scale=None, *,
                causal: bool = True) -> dict:
    """The errors of Figs. 2 and 8 for each method (name -> OSCARCalibration), the quantizer alone
    (every token quantized, no sink / window): relative MSE of K and V (``fake_quantize``), the
    logit MSE of ``q k^T * scale``, the attention KL, the SV MSE (exact keys, quantized values:
    eq. 2) and the attention-output MSE (both quantized). float64 metrics (``metrics.py``).

    ``causal``: the model's attention. True (the default, the paper's decoders) applies the causal mask
    to the KL and the output errors; False is a bidirectional encoder (BERT / MiniLM), where every
    query attends to every key. Set it from the model, e.g. ``kvq.integrations.models.is_causal(model)``:
    a causal KL on an encoder scores attention the model never computes. The logit MSE and the K / V
    errors take no mask either way.

    Returns ``{name: {"k_rel_mse", "v_rel_mse", "logit_mse", "attention_kl", "sv_mse", "output_mse"}}``.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True (a decoder) or False (an encoder), got {causal!r}")
    causal = bool(causal)
    out = {}
    for name, c in methods.items():
        k_hat = fake_quantize(k, c.R_K, c.clip_k, group_size, bits)
        v_hat = fake_quantize(v, c.R_V, c.clip_v, group_size, bits)
        out[name] = {"k_rel_mse": metrics.relative_mse(k, k_hat), "v_rel_mse": metrics.relative_mse(v, v_hat),
                     "logit_mse": metrics.logit_mse(q, k, k_hat, scale),
                     "attention_kl": metrics.attention_kl(q, k, k_hat, causal=causal, scale=scale),
                     "sv_mse": metrics.output_mse(q, k, v, k, v_hat, causal=causal, scale=scale),
                     "output_mse": metrics.output_mse(q, k, v, k_hat, v_hat, causal=causal, scale=scale)}
    return out
