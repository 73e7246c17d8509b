"""AQUA-KV: linear predictors across layers, quantize only what they cannot predict (AQUA-KV §3, App. A).

Keys of layer l are predicted from the *reconstructed* keys of layer l-1 (``f_key``), values of layer
l from the reconstructed values of layer l-1 and the reconstructed keys of layer l (``f_value``);
only the residuals are quantized, by a backbone quantizer (uniform min-max "Quanto" groups, or HIGGS).
Layer 0 is quantized directly (4 bits by default) or kept in FP16. This module holds the pieces:
predictors (closed-form ridge with intercept; reduced-rank ablation), backbones, Algorithm 1
(calibration) and Algorithms 2-3 (encode / decode one layer); ``aqua_cache.py`` builds the
streaming cache and Algorithm 4 on them, ``aqua_probes.py`` measures what the predictors explain.

    kv = model.collect_kv(tiny, tokens)                          # [(K_l, V_l)], (B, H_kv, T, D)
    P = calibrate(AquaConfig(), kv)                              # Algorithm 1
    Kq, Vq, K_hat, V_hat = encode(cfg, P, l, K, V, K_prev_hat, V_prev_hat)   # Algorithm 2, (..., F)

Vectors are per token: a token's KV heads concatenated, F = H_kv * head_dim numbers. Keys are
predicted and quantized pre-RoPE by default (RoPE undone before, reapplied on read; §3.3).
Predictions are matrix products: outside bit-exactness (numerics rule 7); the backbone steps that
turn a residual into codes follow the contract (``quant.py``, ``higgs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from . import higgs
from . import numerics as nx
from .memory import CacheFormat, quantized_bits
from .model import apply_rope
from .packing import pack, unpack
from .quant import dequantize as _dequantize
from .quant import quantize as _quantize

F32 = nx.F32

__all__ = ["Uniform", "Higgs", "KeepFP16", "AquaConfig", "Predictor", "AquaPredictors", "fit_ridge",
           "fit_reduced_rank", "to_tokens", "from_tokens", "calibration_tokens", "calibrate", "encode",
           "decode"]


# ---------------------------------------------------------------------------------------------------
# backbones: x (..., F) fp32 -> dict of code arrays -> x_hat (..., F) fp32


@dataclass(frozen=True)
class Uniform:
    """Min-max quantization per token in groups of ``group_size`` channels (the paper's "Quanto", gs 64),
    per the numerics contract (``quant.quantize``), codes packed along channels."""

    bits: int = 2
    group_size: int = 64
    meta_dtype: str = "float16"

    def __post_init__(self):
        nx.check_bits(self.bits, (2, 4, 8))

    def encode(self, x) -> dict:
        codes, scale, mn = _quantize(x, self.bits, self.group_size, axis=-1, meta_dtype=self.meta_dtype)
        return {"codes": pack(codes, self.bits, axis=-1), "scale": scale, "mn": mn}

    def decode(self, arrays: dict, F: int) -> np.ndarray:
        codes = unpack(arrays["codes"], self.bits, axis=-1)
        return _dequantize(codes, arrays["scale"], arrays["mn"], self.group_size, axis=-1, out_dtype=np.float32)

    def bits_per_value(self, F: int) -> Fraction:
        """``bits + 2 * 16 / group_size`` (memory.py's accounting): 2.5 for 2 bits in groups of 64."""
        meta = 8 * np.dtype(nx.dtype_name(self.meta_dtype)).itemsize
        return quantized_bits(CacheFormat("uniform", self.bits, self.bits, self.group_size, meta_bits=meta))[1]

    @property
    def label(self) -> str:
        return f"uniform {self.bits}-bit gs{self.group_size}"


@dataclass(frozen=True)
class Higgs:
    """HIGGS (``higgs.py``): Hadamard groups, RMS scale, nearest point of a (d, n) Gaussian grid."""

    cfg: higgs.HiggsConfig = field(default_factory=higgs.HiggsConfig)

    def encode(self, x) -> dict:
        idx, scale = higgs.quantize(self.cfg, x)
        return {"idx": idx, "scale": scale}

    def decode(self, arrays: dict, F: int) -> np.ndarray:
        return higgs.dequantize(self.cfg, arrays["idx"], arrays["scale"], F)

    def bits_per_value(self, F: int) -> Fraction:
        return higgs.bits_per_value(self.cfg, F)

    @property
    def label(self) -> str:
        return self.cfg.label


@dataclass(frozen=True)
class KeepFP16:
    """No quantization: the vector rounded to FP16 (the "keep the first layer in BF16" option)."""

    def encode(self, x) -> dict:
        xf = nx.as_f32(x)
        nx.check_finite(xf)
        with np.errstate(over="ignore"):
            x16 = xf.astype(np.float16)
        if not np.all(np.isfinite(x16)):
            raise ValueError("x overflows float16 (|x| > 65504)")
        return {"x": x16}

    def decode(self, arrays: dict, F: int) -> np.ndarray:
        return arrays["x"].astype(F32)

    def bits_per_value(self, F: int) -> Fraction:
        return Fraction(16)

    label = "FP16"


@dataclass(frozen=True)
class AquaConfig:
    """An AQUA-KV configuration (paper defaults; §3.3, §4.1).

    Attributes:
        backbone: quantizer of the residuals of layers 1..L-1 (default HIGGS d=2, n=16: 2 bits).
        first_layer: quantizer of layer 0 (default HIGGS d=2, n=256: 4 bits; ``KeepFP16()`` keeps it).
        sink: first tokens kept in FP16 (4).
        buffer: recent tokens kept in FP16, quantized in chunks of this size when full (128).
        pre_rope: predict and quantize keys before RoPE (undo it on write, reapply on read).
        rope_theta: the model's RoPE base (needed when ``pre_rope``).
        predict_keys, predict_values: ablations "w/o K predictor" / "w/o V predictor" (Table 1).
        max_tokens: capacity per sequence of the streaming cache.
    """

    backbone: object = field(default_factory=Higgs)
    first_layer: object = field(default_factory=lambda: Higgs(higgs.HiggsConfig(d=2, n=256)))
    sink: int = 4
    buffer: int = 128
    pre_rope: bool = True
    rope_theta: float | None = 10000.0
    predict_keys: bool = True
    predict_values: bool = True
    max_tokens: int = 4096

    def __post_init__(self):
        from .state import check_bool, check_real

        for name, lo in (("sink", 0), ("buffer", 1), ("max_tokens", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        for name in ("backbone", "first_layer"):
            bb = getattr(self, name)
            if not all(hasattr(bb, m) for m in ("encode", "decode", "bits_per_value")):
                raise TypeError(f"{name} must be a backbone (Uniform, Higgs, KeepFP16), got {bb!r}")
            if isinstance(bb, Uniform):                               # (Uniform checks only its bits)
                g = bb.group_size
                if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1:
                    raise ValueError(f"{name}.group_size must be a positive int, got {g!r}")
                if nx.dtype_name(bb.meta_dtype) not in nx.META_DTYPES:
                    raise ValueError(f"{name}.meta_dtype={bb.meta_dtype!r} is not supported; choose one of "
                                     f"{nx.META_DTYPES}")
        for name in ("pre_rope", "predict_keys", "predict_values"):
            check_bool(self, name)
        if self.pre_rope and self.rope_theta is None:
            raise ValueError("pre_rope=True needs the model's rope_theta")
        check_real(self, "rope_theta", 0.0, lo_open=True, optional=True)


# ---------------------------------------------------------------------------------------------------
# predictors: y = x @ W_1 @ ... @ W_m + b, fp32


@dataclass(frozen=True)
class Predictor:
    """A linear predictor ``x @ mats[0] @ mats[1] ... + bias`` (one matrix: ridge; two: rank-r factors)."""

    mats: tuple
    bias: np.ndarray

    def __call__(self, x) -> np.ndarray:
        y = nx.as_f32(x)
        for m in self.mats:
            y = np.matmul(y, m)                                  # (..., F_out), fp32
        return nx.add(y, self.bias)

    @property
    def n_params(self) -> int:
        return int(sum(m.size for m in self.mats) + self.bias.size)


@dataclass(frozen=True)
class AquaPredictors:
    """``f_key[l]``, ``f_value[l]`` for l = 1..L-1 (index 0 is None): the calibrated adapters."""

    f_key: tuple
    f_value: tuple

    @property
    def n_layers(self) -> int:
        return len(self.f_key)

    @property
    def n_params(self) -> int:
        return sum(p.n_params for p in self.f_key + self.f_value if p is not None)


def _centered(X, Y):
    X = np.asarray(X, np.float64)
    Y = np.asarray(Y, np.float64)
    if X.ndim != 2 or Y.ndim != 2 or X.shape[0] != Y.shape[0] or X.shape[0] < 2:
        raise ValueError(f"X {X.shape} and Y {Y.shape} must be (N, F_in) and (N, F_out) with N >= 2")
    mx, my = X.mean(0), Y.mean(0)
    return X - mx, Y - my, mx, my


def _ridge_solution(Xc, Yc, ridge: float):
    A = Xc.T @ Xc                                                # (F_in, F_in)
    lam = ridge * np.trace(A) / A.shape[0]                       # relative to the mean diagonal
    return np.linalg.solve(A + lam * np.eye(A.shape[0]), Xc.T @ Yc)


def fit_ridge(X, Y, ridge: float = 1e-3) -> Predictor:
    """Closed-form ridge regression with intercept: X (N, F_in), Y (N, F_out) -> Predictor.

    ``W = (Xc^T Xc + lam I)^-1 Xc^T Yc`` on centered data, ``lam = ridge * mean(diag(Xc^T Xc))``, the
    intercept ``b = mean(Y) - mean(X) W`` unregularized. Solved in float64 (offline, once), stored fp32.
    """
    Xc, Yc, mx, my = _centered(X, Y)
    W = _ridge_solution(Xc, Yc, ridge)
    return Predictor((W.astype(F32),), (my - mx @ W).astype(F32))


def fit_reduced_rank(X, Y, rank: int, ridge: float = 1e-3) -> Predictor:
    """Reduced-rank (ridge) regression (Reinsel & Velu, 1998): the ridge W projected onto the top-``rank``
    right singular vectors of the fitted values ``Xc W``; stored as factors (F_in, r) and (r, F_out)."""
    Xc, Yc, mx, my = _centered(X, Y)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 1 <= rank <= Yc.shape[1]:
        raise ValueError(f"rank must be an int in [1, F_out={Yc.shape[1]}], got {rank!r}")
    W = _ridge_solution(Xc, Yc, ridge)
    _, _, Vt = np.linalg.svd(Xc @ W, full_matrices=False)
    Vr = Vt[:rank].T                                             # (F_out, r)
    U = W @ Vr                                                   # (F_in, r)
    return Predictor((U.astype(F32), Vr.T.astype(F32)), (my - (mx @ U) @ Vr.T).astype(F32))


# ---------------------------------------------------------------------------------------------------
# layout helpers


def to_tokens(x) -> np.ndarray:
    """(B, H, T, D) -> (B, T, H * D): each token's heads concatenated."""
    B, H, T, D = x.shape
    return np.ascontiguousarray(np.asarray(x).transpose(0, 2, 1, 3).reshape(B, T, H * D))


def from_tokens(x, H: int) -> np.ndarray:
    """(B, T, H * D) -> (B, H, T, D)."""
    B, T, F = x.shape
    return np.ascontiguousarray(x.reshape(B, T, H, F // H).transpose(0, 2, 1, 3))


def calibration_tokens(cfg: AquaConfig, kv) -> list:
    """Clean ``[(K_l, V_l)]`` (B, H, T, D), K post-RoPE -> ``[(K_l, V_l)]`` token matrices (N, F) fp32.

    The first ``cfg.sink`` tokens are left out (they stay FP16 and are never predicted); with
    ``pre_rope`` the keys' RoPE is undone at their positions.
    """
    out = []
    for K, V in kv:
        K, V = nx.as_f32(K, "K"), nx.as_f32(V, "V")
        if cfg.pre_rope:
            K = apply_rope(K, np.arange(K.shape[2]), cfg.rope_theta, inverse=True)
        K, V = to_tokens(K[:, :, cfg.sink:]), to_tokens(V[:, :, cfg.sink:])
        out.append((K.reshape(-1, K.shape[-1]), V.reshape(-1, V.shape[-1])))
    return out


# ---------------------------------------------------------------------------------------------------
# Algorithms 2 and 3: encode / decode one layer; Algorithm 1: calibration


def _predictions(cfg, P, l):
    fk = P.f_key[l] if (l and cfg.predict_keys) else None
    fv = P.f_value[l] if (l and cfg.predict_values) else None
    return fk, fv


def encode(cfg: AquaConfig, P: AquaPredictors, l: int, K, V, K_prev_hat=None, V_prev_hat=None):
    """Algorithm 2 (and its reconstruction, Algorithm 4 line 14): one layer's token vectors (..., F).

    Layer 0 goes through ``cfg.first_layer`` directly. Layer l >= 1: ``K_pred = f_key(K_prev_hat)``,
    ``Kq = Q(K - K_pred)``, ``K_hat = Q^-1(Kq) + K_pred``; ``V_pred = f_value([V_prev_hat; K_hat])``,
    ``Vq = Q(V - V_pred)``, ``V_hat = Q^-1(Vq) + V_pred``. Returns ``(Kq, Vq, K_hat, V_hat)``; the
    hats equal :func:`decode` of the codes bit for bit.
    """
    K, V = nx.as_f32(K, "K"), nx.as_f32(V, "V")
    F = K.shape[-1]
    if l == 0:
        Kq, Vq = cfg.first_layer.encode(K), cfg.first_layer.encode(V)
        return Kq, Vq, cfg.first_layer.decode(Kq, F), cfg.first_layer.decode(Vq, F)
    fk, fv = _predictions(cfg, P, l)
    K_pred = fk(K_prev_hat) if fk is not None else np.zeros_like(K)
    Kq = cfg.backbone.encode(nx.sub(K, K_pred))
    K_hat = nx.add(cfg.backbone.decode(Kq, F), K_pred)
    V_pred = fv(np.concatenate([V_prev_hat, K_hat], axis=-1)) if fv is not None else np.zeros_like(V)
    Vq = cfg.backbone.encode(nx.sub(V, V_pred))
    V_hat = nx.add(cfg.backbone.decode(Vq, F), V_pred)
    return Kq, Vq, K_hat, V_hat


def decode(cfg: AquaConfig, P: AquaPredictors, l: int, Kq: dict, Vq: dict, F: int, K_prev_hat=None,
           V_prev_hat=None):
    """Algorithm 3: codes of layer l (and the previous layer's reconstructions) -> ``(K_hat, V_hat)`` (..., F)."""
    if l == 0:
        return cfg.first_layer.decode(Kq, F), cfg.first_layer.decode(Vq, F)
    fk, fv = _predictions(cfg, P, l)
    K_hat = cfg.backbone.decode(Kq, F)
    if fk is not None:
        K_hat = nx.add(K_hat, fk(K_prev_hat))
    V_hat = cfg.backbone.decode(Vq, F)
    if fv is not None:
        V_hat = nx.add(V_hat, fv(np.concatenate([V_prev_hat, K_hat], axis=-1)))
    return K_hat, V_hat


def calibrate(cfg: AquaConfig, kv, *, ridge: float = 1e-3, rank: int | None = None,
              quantizer_agnostic: bool = False) -> AquaPredictors:
    """Algorithm 1: fit ``f_key[l]``, ``f_value[l]`` sequentially over layers.

    Args:
        kv: clean ``[(K_l, V_l)]`` per layer, (B, H_kv, T, D), keys post-RoPE (``model.collect_kv``).
        ridge: regularizer relative to the mean diagonal of X^T X.  rank: reduced-rank ablation (None = full).
        quantizer_agnostic: the ablation that fits every predictor on *clean* inputs (K_{l-1}, V_{l-1},
            K_l) instead of the reconstructions of the layer before.
    Each predictor of layer l is trained on the reconstructions the cache will hold: layer 0 through
    ``cfg.first_layer``, then ``K_hat = Q^-1(Q(K - f_key(K_prev_hat))) + f_key(K_prev_hat)`` and alike
    for values with ``[V_prev_hat; K_hat]`` as input (``encode`` itself computes them).
    """
    toks = calibration_tokens(cfg, kv)
    fit = (lambda X, Y: fit_ridge(X, Y, ridge)) if rank is None else (lambda X, Y: fit_reduced_rank(X, Y, rank, ridge))
    f_key, f_value = [None], [None]
    _, _, K_hat, V_hat = encode(cfg, AquaPredictors((None,), (None,)), 0, *toks[0])
    for l in range(1, len(toks)):
        K, V = toks[l]                                                       # (N, F) clean, layer l
        if quantizer_agnostic:
            K_prev, V_prev = toks[l - 1]
            fk = fit(K_prev, K)
            fv = fit(np.concatenate([V_prev, K], axis=-1), V)
        else:
            fk = fit(K_hat, K)                                               # line 13
            K_pred = fk(K_hat) if cfg.predict_keys else np.zeros_like(K)
            K_rec = nx.add(cfg.backbone.decode(cfg.backbone.encode(nx.sub(K, K_pred)), K.shape[-1]),
                           K_pred)                                           # lines 14-15
            fv = fit(np.concatenate([V_hat, K_rec], axis=-1), V)             # line 17
        f_key.append(fk)
        f_value.append(fv)
        P = AquaPredictors(tuple(f_key), tuple(f_value))
        _, _, K_hat, V_hat = encode(cfg, P, l, K, V, K_hat, V_hat)           # lines 14-19, 21
    return AquaPredictors(tuple(f_key), tuple(f_value))
