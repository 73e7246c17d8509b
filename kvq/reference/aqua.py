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

import math
import weakref
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from . import checks, higgs
from . import numerics as nx
from .memory import CacheFormat, quantized_bits
from .model import apply_rope
from .packing import pack, unpack
from .quant import dequantize as _dequantize
from .quant import quantize as _quantize
from .state import check_config as _check_config

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
        _check_uniform_fields(self, "")

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


def _check_uniform_fields(u, prefix: str) -> None:
    """A Uniform backbone's group_size (a positive int) and meta_dtype (one of ``numerics.META_DTYPES``);
    ``prefix`` names the config field holding it ("backbone." / "first_layer.") or is empty."""
    g = u.group_size
    if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer)) or g < 1:
        raise ValueError(f"{prefix}group_size must be a positive int, got {g!r}")
    try:
        ok = nx.dtype_name(u.meta_dtype) in nx.META_DTYPES
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{prefix}meta_dtype={u.meta_dtype!r} is not supported; choose one of {nx.META_DTYPES}")


@dataclass(frozen=True)
class Higgs:
    """HIGGS (``higgs.py``): Hadamard groups, RMS scale, nearest point of a (d, n) Gaussian grid."""

    cfg: higgs.HiggsConfig = field(default_factory=higgs.HiggsConfig)

    def __post_init__(self):
        if not isinstance(self.cfg, higgs.HiggsConfig):
            raise TypeError(f"cfg must be a kvq.reference.higgs.HiggsConfig, got {type(self.cfg).__name__}")

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
            if isinstance(bb, Uniform):                   # checked at its construction; again for a mutated one
                _check_uniform_fields(bb, f"{name}.")
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
    """``f_key[l]``, ``f_value[l]`` for l = 1..L-1 (index 0 is None): the calibrated adapters.

    Every call checks them (:func:`check_predictors`); their weights' values are read once per object, so
    their arrays must not be modified in place after a call (build a new AquaPredictors instead)."""

    f_key: tuple
    f_value: tuple

    @property
    def n_layers(self) -> int:
        return len(self.f_key)

    @property
    def n_params(self) -> int:
        return sum(p.n_params for p in self.f_key + self.f_value if p is not None)


# ---------------------------------------------------------------------------------------------------
# argument checks: the predictors, the codes, the token vectors (TypeError / ValueError naming the argument)


def check_config(cfg) -> AquaConfig:
    """``cfg`` must be an :class:`AquaConfig` (TypeError naming it otherwise)."""
    _check_config(cfg, AquaConfig)
    return cfg


def _check_predictor_set(P, n_layers: int | None = None) -> int:
    """``P`` must be :class:`AquaPredictors` whose ``f_key`` and ``f_value`` are sequences of one length
    (``n_layers`` when given): one key and one value predictor (or None) per layer. Returns the length."""
    if not isinstance(P, AquaPredictors):
        raise TypeError(f"P must be AquaPredictors, got {type(P).__name__}")
    fk, fv = P.f_key, P.f_value
    if not isinstance(fk, (tuple, list)) or not isinstance(fv, (tuple, list)):
        raise TypeError(f"P.f_key and P.f_value must be tuples of Predictor or None (one per layer), got "
                        f"{type(fk).__name__} and {type(fv).__name__}")
    if n_layers is not None and (len(fk) != n_layers or len(fv) != n_layers):
        raise ValueError(f"predictors are for {len(fk)} layers (f_key) and {len(fv)} (f_value), the cache has "
                         f"{n_layers}")
    if len(fk) != len(fv) or not fk:
        raise ValueError(f"P must hold one key and one value predictor (or None) per layer; got {len(fk)} (f_key) "
                         f"and {len(fv)} (f_value)")
    return len(fk)


def _check_predictor(p, where: str, f_in: int, F: int) -> None:
    """One predictor's layout: a :class:`Predictor` (or None: no prediction) mapping f_in -> F values, its
    float32 matrices chained from f_in rows to F columns and an (F,) float32 intercept."""
    if p is None:
        return
    if not isinstance(p, Predictor):
        raise TypeError(f"{where} must be a Predictor or None, got {type(p).__name__}")
    mats = tuple(p.mats) if isinstance(p.mats, (tuple, list)) else ()
    dims, ok = [f_in], len(mats) >= 1
    for m in mats:
        matrix = isinstance(m, np.ndarray) and m.ndim == 2
        ok = ok and matrix and m.dtype == np.float32 and m.shape[0] == dims[-1]
        dims.append(m.shape[-1] if matrix else -1)
    b = p.bias
    ok = ok and dims[-1] == F and isinstance(b, np.ndarray) and b.dtype == np.float32 and b.shape == (F,)
    if not ok:
        got = [f"{getattr(m, 'dtype', type(m).__name__)} {np.shape(m)}" for m in mats]
        raise ValueError(f"{where} must map {f_in} -> {F} values (float32 matrices chained from {f_in} "
                         f"rows to {F} columns, an ({F},) float32 bias); got matrices {got}, bias "
                         f"{getattr(b, 'dtype', type(b).__name__)} {np.shape(b)} (F = kv_heads * head_dim)")


#: the AquaPredictors whose values :func:`_check_predictor_values` has read, by identity (weak references:
#: an entry goes with its object, so a later object at the same address is read again)
#: largest |weight| or |bias| of an AQUA-KV predictor: 1e6 (``kvq.calibration``'s loader enforces it too). Ridge fits on activations give weights of
#: order one (a layer's keys from the previous layer's); a weight of 1e6 already maps any realistic
#: activation (|x| ~ 1..100) to a prediction beyond fp16's 65504, whose residual's scale then overflows the
#: fp16 metadata. Larger values (1e30, ...) are corruption, never calibration.
MAX_PREDICTOR_ABS = 1e6

_VALUES_CHECKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _check_predictor_values(P: AquaPredictors) -> None:
    """Every matrix and intercept of P's predictors (layers >= 1) is finite, with |w| <= MAX_PREDICTOR_ABS
    (1e6: no ridge fit gives larger weights; NaN or 1e30 weights are a
    corrupted calibration, whose predictions would be NaN or overflow float16), else ValueError naming it.

    The values are read once per AquaPredictors object, remembered by identity (one read of every weight
    per call would cost more than a decode step): P and its Predictors are frozen, and their arrays must
    not be modified in place after a call (the fast tier keeps device copies of them too)."""
    if _VALUES_CHECKED.get(id(P)) is P:
        return
    for role in ("f_key", "f_value"):
        for l, p in enumerate(getattr(P, role)):
            if l == 0 or not isinstance(p, Predictor):
                continue
            parts = [(f".mats[{i}]", m) for i, m in enumerate(p.mats)] if isinstance(p.mats, (tuple, list)) else []
            for part, a in parts + [(".bias", p.bias)]:
                if not isinstance(a, np.ndarray) or a.dtype.kind != "f" or a.size == 0:
                    continue                                    # (a layout error, found by _check_predictor)
                top = float(np.max(np.abs(a)))
                if not math.isfinite(top):
                    raise ValueError(f"P.{role}[{l}]{part} holds NaN or inf weights; predictors must be finite "
                                     f"(a corrupted calibration? recalibrate: `kvq calibrate aqua`)")
                if top > MAX_PREDICTOR_ABS:
                    raise ValueError(f"P.{role}[{l}]{part} holds |w| = {top:.3g} > kvq.calibration."
                                     f"MAX_PREDICTOR_ABS = {MAX_PREDICTOR_ABS:g}: no ridge fit gives such weights "
                                     f"(its predictions would overflow float16)")
    _VALUES_CHECKED[id(P)] = P


def check_predictors(cfg: AquaConfig, P, F: int, n_layers: int | None = None) -> None:
    """``P`` must be :class:`AquaPredictors` (for ``n_layers`` layers when given) whose predictors, where
    ``cfg`` uses them (None = no prediction for that layer), map token vectors of F values: ``f_key[l]``
    F -> F, ``f_value[l]`` 2F -> F ([V_prev_hat; K_hat]), fp32 matrices chained and an (F,) fp32
    intercept, every weight finite with |w| <= ``kvq.calibration.MAX_PREDICTOR_ABS``. TypeError /
    ValueError naming P (its ``f_key`` / ``f_value``) before anything is read or written."""
    L = _check_predictor_set(P, n_layers)
    for role, preds, used, f_in in (("f_key", P.f_key, cfg.predict_keys, F),
                                    ("f_value", P.f_value, cfg.predict_values, 2 * F)):
        for l in range(1, L) if used else ():
            _check_predictor(preds[l], f"predictors {role}[{l}]", f_in, F)
    _check_predictor_values(P)


def check_layer(cfg: AquaConfig, P, l, F: int) -> int:
    """The checks of a call on one layer (``encode`` / ``decode``, both tiers): ``cfg`` an AquaConfig,
    ``P`` AquaPredictors whose predictors of layer ``l`` (where cfg uses them) map token vectors of F
    values and whose weights are finite and bounded (:func:`check_predictors`' rules), ``l`` an int in
    [0, P.n_layers). Returns l as an int."""
    check_config(cfg)
    L = _check_predictor_set(P)
    l = checks.int_arg(l, "l")
    if not 0 <= l < L:
        raise ValueError(f"layer index l={l} is outside [0, {L}) (P holds predictors for {L} layers)")
    if l:
        if cfg.predict_keys:
            _check_predictor(P.f_key[l], f"P.f_key[{l}]", F, F)
        if cfg.predict_values:
            _check_predictor(P.f_value[l], f"P.f_value[{l}]", 2 * F, F)
    _check_predictor_values(P)
    return l


_META = ("float16", "float32")


def code_layout(bb, F: int) -> dict | None:
    """The codes a backbone stores for one token vector of F values: ``{name: (tail shape, dtype names)}``
    (the arrays are (..., *tail)); None for a backbone other than Uniform / Higgs / KeepFP16. ValueError
    where F does not fit the backbone (uniform groups that do not divide F or fill whole bytes)."""
    if isinstance(bb, Uniform):
        g = bb.group_size
        if F % g or (F * bb.bits) % 8:
            raise ValueError(f"F={F} does not fit {bb.label} codes: the group size must divide F and F values of "
                             f"{bb.bits} bits fill whole bytes")
        return {"codes": ((F * bb.bits // 8,), ("uint8",)), "scale": ((F // g,), _META), "mn": ((F // g,), _META)}
    if isinstance(bb, Higgs):
        c = bb.cfg
        n_g = c.n_groups(F)
        return {"idx": ((n_g, c.group_size // c.d), (np.dtype(higgs.index_dtype(c.n)).name,)),
                "scale": ((n_g,), _META)}
    if isinstance(bb, KeepFP16):
        return {"x": ((F,), ("float16",))}
    return None


def check_codes(bb, codes, name: str, F: int, lead: tuple | None = None, *, array_type=np.ndarray,
                dtype_name=lambda a: a.dtype.name) -> tuple | None:
    """``codes`` (``Kq`` / ``Vq``) must be a dict of the arrays ``bb`` stores for token vectors of F values
    (:func:`code_layout`: the names, the dtypes, shapes (..., *tail) with one leading shape, ``lead`` when
    given). Returns the leading shape (None for a backbone of unknown layout). ``array_type`` /
    ``dtype_name``: the array class and dtype naming of the tier (the fast tiers pass torch's)."""
    if not isinstance(codes, dict):
        raise TypeError(f"{name} must be a dict of code arrays (as encode returns), got {type(codes).__name__}")
    layout = code_layout(bb, F)
    if layout is None:
        return None
    if set(codes) != set(layout):
        raise ValueError(f"{name} must hold exactly the arrays {sorted(layout)} ({bb.label} codes); got "
                         f"{sorted(str(k) for k in codes)}")
    for n, (tail, dtypes) in layout.items():
        a = codes[n]
        if not isinstance(a, array_type):
            raise TypeError(f"{name}[{n!r}] must be a {array_type.__module__}.{array_type.__name__}, got "
                            f"{type(a).__name__}")
        if dtype_name(a) not in dtypes:
            raise TypeError(f"{name}[{n!r}] has dtype {dtype_name(a)}; {bb.label} codes store {' or '.join(dtypes)}")
        shape = tuple(a.shape)
        k = len(shape) - len(tail)
        if k < 0 or shape[k:] != tail or (lead is not None and shape[:k] != lead):
            want = "(" + ", ".join((["..."] if lead is None else [str(d) for d in lead]) + [str(d) for d in tail]) + ")"
            raise ValueError(f"{name}[{n!r}] has shape {shape}; {bb.label} codes of F={F} values need {want}")
        lead = shape[:k]
    return lead


def _tokens(x, name: str) -> np.ndarray:
    """Token vectors (..., F) as fp32 (float16 / float32 in; others refused by ``nx.as_f32``)."""
    if x is None:
        raise TypeError(f"{name} must be an array of token vectors (..., F), got None")
    a = nx.as_f32(x, name)
    if a.ndim == 0 or a.shape[-1] == 0:
        raise ValueError(f"{name} must be token vectors (..., F) with F >= 1, got shape {a.shape}")
    return a


def _prev_hat(x, name: str, l: int, shape: tuple | None, F: int) -> np.ndarray:
    """The previous layer's reconstruction ``name`` (K_prev_hat / V_prev_hat) of the same tokens: fp32,
    finite, of ``shape`` ((..., F) when None)."""
    if x is None:
        raise ValueError(f"layer {l} is predicted from layer {l - 1}: give K_prev_hat and V_prev_hat "
                         f"(layer {l - 1}'s reconstructions)")
    a = nx.as_f32(x, name)
    fits = a.shape == tuple(shape) if shape is not None else (a.ndim >= 1 and a.shape[-1] == F)
    if not fits:
        want = tuple(shape) if shape is not None else f"(..., {F})"
        raise ValueError(f"{name} must have shape {want} (layer {l - 1}'s reconstruction of the same tokens), "
                         f"got {a.shape}")
    nx.check_finite(a, name)
    return a


def real_matrix(x, name: str, *, finite: bool) -> np.ndarray:
    """``x`` as a float64 (N, F) matrix with N, F >= 1: float or integer dtype (bool, complex, strings and
    objects refused), finite where ``finite``."""
    if x is None:
        raise TypeError(f"{name} must be a real matrix (N, F), got None")
    a = np.asarray(x)
    if a.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be a real matrix (float or integer dtype), got dtype {a.dtype}")
    if a.ndim != 2 or 0 in a.shape:
        raise ValueError(f"{name} must be a non-empty matrix (N, F), got shape {a.shape}")
    a = a.astype(np.float64)
    if finite and not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains non-finite values ({int(np.isnan(a).sum())} NaN, "
                         f"{int(np.isinf(a).sum())} inf); a regression on them gives NaN predictors")
    return a


# ---------------------------------------------------------------------------------------------------
# fitting the predictors


def _centered(X, Y):
    X, Y = real_matrix(X, "X", finite=True), real_matrix(Y, "Y", finite=True)
    if X.shape[0] != Y.shape[0] or X.shape[0] < 2:
        raise ValueError(f"X {X.shape} and Y {Y.shape} must be (N, F_in) and (N, F_out) with N >= 2")
    mx, my = X.mean(0), Y.mean(0)
    return X - mx, Y - my, mx, my


def _ridge_solution(Xc, Yc, ridge: float):
    A = Xc.T @ Xc                                                # (F_in, F_in)
    lam = ridge * np.trace(A) / A.shape[0]                       # relative to the mean diagonal
    try:
        return np.linalg.solve(A + lam * np.eye(A.shape[0]), Xc.T @ Yc)
    except np.linalg.LinAlgError:
        raise ValueError(f"X gives a singular system (Xc^T Xc + lam I, ridge={ridge}): X is constant in every "
                         f"column, or ridge=0 with linearly dependent columns") from None


def fit_ridge(X, Y, ridge: float = 1e-3) -> Predictor:
    """Closed-form ridge regression with intercept: X (N, F_in), Y (N, F_out) -> Predictor.

    ``W = (Xc^T Xc + lam I)^-1 Xc^T Yc`` on centered data, ``lam = ridge * mean(diag(Xc^T Xc))``, the
    intercept ``b = mean(Y) - mean(X) W`` unregularized. Solved in float64 (offline, once), stored fp32.
    X, Y: finite float or integer matrices, N >= 2; ridge: a finite real >= 0. ValueError for a singular
    system (X constant in every column, or ridge=0 with dependent columns).
    """
    ridge = checks.real_arg(ridge, "ridge", 0.0)
    Xc, Yc, mx, my = _centered(X, Y)
    W = _ridge_solution(Xc, Yc, ridge)
    return Predictor((W.astype(F32),), (my - mx @ W).astype(F32))


def fit_reduced_rank(X, Y, rank: int, ridge: float = 1e-3) -> Predictor:
    """Reduced-rank (ridge) regression (Reinsel & Velu, 1998): the ridge W projected onto the top-``rank``
    right singular vectors of the fitted values ``Xc W``; stored as factors (F_in, r) and (r, F_out).
    Arguments as :func:`fit_ridge`; rank an int in [1, F_out]."""
    ridge = checks.real_arg(ridge, "ridge", 0.0)
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


def _layout_array(x, name: str, ndim: int, dims: str) -> np.ndarray:
    """``x`` as an ndarray of ``ndim`` dimensions (any dtype: the layout helpers only move values)."""
    if x is None:
        raise TypeError(f"{name} must be an array {dims}, got None")
    a = np.asarray(x)
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {dims}, got shape {a.shape}")
    return a


def to_tokens(x) -> np.ndarray:
    """(B, H, T, D) -> (B, T, H * D): each token's heads concatenated (any dtype; ValueError naming x for
    another number of dimensions)."""
    a = _layout_array(x, "x", 4, "(B, H, T, D)")
    B, H, T, D = a.shape
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(B, T, H * D))


def from_tokens(x, H: int) -> np.ndarray:
    """(B, T, H * D) -> (B, H, T, D); H an int >= 1 dividing x.shape[-1]."""
    a = _layout_array(x, "x", 3, "(B, T, H * D)")
    H = checks.int_arg(H, "H", lo=1)
    B, T, F = a.shape
    if F % H:
        raise ValueError(f"H={H} does not divide x.shape[-1]={F} (token vectors of H * D values)")
    return np.ascontiguousarray(a.reshape(B, T, H, F // H).transpose(0, 2, 1, 3))


def kv_pairs(kv) -> list:
    """``kv``: an iterable of (K_l, V_l) pairs, float16 / float32 (B, H, T, D) of the same sequences (B, T)
    -> fp32 pairs."""
    if kv is None or isinstance(kv, (str, bytes, dict)) or not hasattr(kv, "__iter__"):
        raise TypeError(f"kv must be a list of (K, V) pairs, one per layer, got {type(kv).__name__}")
    out = []
    for i, pair in enumerate(kv):
        if isinstance(pair, (str, bytes, dict)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise TypeError(f"kv[{i}] must be a (K, V) pair, got {type(pair).__name__}")
        K, V = nx.as_f32(pair[0], "K"), nx.as_f32(pair[1], "V")
        if K.ndim != 4 or V.ndim != 4 or (K.shape[0], K.shape[2]) != (V.shape[0], V.shape[2]):
            raise ValueError(f"kv[{i}]: K and V must be (B, H, T, D) of the same sequences, got {K.shape} and "
                             f"{V.shape}")
        out.append((K, V))
    return out


def calibration_tokens(cfg: AquaConfig, kv) -> list:
    """Clean ``[(K_l, V_l)]`` (B, H, T, D), K post-RoPE -> ``[(K_l, V_l)]`` token matrices (N, F) fp32.

    The first ``cfg.sink`` tokens are left out (they stay FP16 and are never predicted); with
    ``pre_rope`` the keys' RoPE is undone at their positions.
    """
    check_config(cfg)
    out = []
    for K, V in kv_pairs(kv):
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


def _backbone_encode(bb, x, what: str) -> dict:
    """``bb.encode(x)``; a refusal (NaN, a scale beyond the metadata dtype) names what was quantized."""
    try:
        return bb.encode(x)
    except ValueError as e:
        raise ValueError(f"{what} cannot be quantized by the {bb.label} backbone: {e}") from e


def residual_label(name: str, l: int, pred, role: str) -> str:
    """The vector a backbone quantizes at layer l: ``name`` itself, or its residual after the prediction."""
    return f"{name} of layer {l}" + (f" minus its prediction by P.{role}[{l}]" if pred is not None else "")


def _backbone_decode(bb, codes: dict, F: int, name: str) -> np.ndarray:
    """``bb.decode(codes, F)``; a refusal (an index outside the grid, ...) names the codes' argument."""
    try:
        return bb.decode(codes, F)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{name}: {e}") from e


def encode(cfg: AquaConfig, P: AquaPredictors, l: int, K, V, K_prev_hat=None, V_prev_hat=None):
    """Algorithm 2 (and its reconstruction, Algorithm 4 line 14): one layer's token vectors (..., F).

    Layer 0 goes through ``cfg.first_layer`` directly. Layer l >= 1: ``K_pred = f_key(K_prev_hat)``,
    ``Kq = Q(K - K_pred)``, ``K_hat = Q^-1(Kq) + K_pred``; ``V_pred = f_value([V_prev_hat; K_hat])``,
    ``Vq = Q(V - V_pred)``, ``V_hat = Q^-1(Vq) + V_pred``. Returns ``(Kq, Vq, K_hat, V_hat)``; the
    hats equal :func:`decode` of the codes bit for bit.

    Checks first (TypeError / ValueError naming the argument): ``cfg`` an AquaConfig; ``P`` AquaPredictors
    whose predictors of layer l map F -> F (keys) and 2F -> F (values), every weight finite and bounded
    (:func:`check_predictors`); ``l`` an int in [0, P.n_layers); K, V finite float16 / float32 (..., F) of
    one shape; K_prev_hat, V_prev_hat (where layer l is predicted) finite, of K's shape.
    """
    check_config(cfg)
    K, V = _tokens(K, "K"), _tokens(V, "V")
    if K.shape != V.shape:
        raise ValueError(f"K and V must have the same shape (..., F), got {K.shape} and {V.shape}")
    l = check_layer(cfg, P, l, K.shape[-1])
    nx.check_finite(K, "K")
    nx.check_finite(V, "V")
    fk, fv = _predictions(cfg, P, l)
    if fk is not None:
        K_prev_hat = _prev_hat(K_prev_hat, "K_prev_hat", l, K.shape, K.shape[-1])
    if fv is not None:
        V_prev_hat = _prev_hat(V_prev_hat, "V_prev_hat", l, K.shape, K.shape[-1])
    return encode_checked(cfg, P, l, K, V, K_prev_hat, V_prev_hat)


def encode_checked(cfg: AquaConfig, P: AquaPredictors, l: int, K, V, K_prev_hat=None, V_prev_hat=None):
    """:func:`encode` on checked arguments (the cache and the calibration call it directly)."""
    F = K.shape[-1]
    if l == 0:
        Kq = _backbone_encode(cfg.first_layer, K, "K of layer 0")
        Vq = _backbone_encode(cfg.first_layer, V, "V of layer 0")
        return Kq, Vq, cfg.first_layer.decode(Kq, F), cfg.first_layer.decode(Vq, F)
    fk, fv = _predictions(cfg, P, l)
    K_pred = fk(K_prev_hat) if fk is not None else np.zeros_like(K)
    Kq = _backbone_encode(cfg.backbone, nx.sub(K, K_pred), residual_label("K", l, fk, "f_key"))
    K_hat = nx.add(cfg.backbone.decode(Kq, F), K_pred)
    V_pred = fv(np.concatenate([V_prev_hat, K_hat], axis=-1)) if fv is not None else np.zeros_like(V)
    Vq = _backbone_encode(cfg.backbone, nx.sub(V, V_pred), residual_label("V", l, fv, "f_value"))
    V_hat = nx.add(cfg.backbone.decode(Vq, F), V_pred)
    return Kq, Vq, K_hat, V_hat


def decode(cfg: AquaConfig, P: AquaPredictors, l: int, Kq: dict, Vq: dict, F: int, K_prev_hat=None,
           V_prev_hat=None):
    """Algorithm 3: codes of layer l (and the previous layer's reconstructions) -> ``(K_hat, V_hat)`` (..., F).

    Checks first, as :func:`encode`: ``cfg``, ``P``, ``l``; F an int >= 1; Kq, Vq dicts of the arrays
    the layer's backbone stores for token vectors of F values (its names, dtypes and shapes, one leading
    shape); K_prev_hat, V_prev_hat (where layer l is predicted) finite, (..., F) of the codes' leading shape.
    """
    check_config(cfg)
    F = checks.int_arg(F, "F", lo=1)
    l = check_layer(cfg, P, l, F)
    bb = cfg.first_layer if l == 0 else cfg.backbone
    lead = check_codes(bb, Kq, "Kq", F)
    lead = check_codes(bb, Vq, "Vq", F, lead)
    fk, fv = _predictions(cfg, P, l)
    shape = lead + (F,) if lead is not None else None
    if fk is not None:
        K_prev_hat = _prev_hat(K_prev_hat, "K_prev_hat", l, shape, F)
    if fv is not None:
        V_prev_hat = _prev_hat(V_prev_hat, "V_prev_hat", l, shape, F)
    return decode_checked(cfg, P, l, Kq, Vq, F, K_prev_hat, V_prev_hat)


def decode_checked(cfg: AquaConfig, P: AquaPredictors, l: int, Kq: dict, Vq: dict, F: int, K_prev_hat=None,
            V_prev_hat=None):
    """:func:`decode` on checked arguments (the cache calls it directly)."""
    if l == 0:
        return _backbone_decode(cfg.first_layer, Kq, F, "Kq"), _backbone_decode(cfg.first_layer, Vq, F, "Vq")
    fk, fv = _predictions(cfg, P, l)
    K_hat = _backbone_decode(cfg.backbone, Kq, F, "Kq")
    if fk is not None:
        K_hat = nx.add(K_hat, fk(K_prev_hat))
    V_hat = _backbone_decode(cfg.backbone, Vq, F, "Vq")
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
    ridge = checks.real_arg(ridge, "ridge", 0.0)
    rank = checks.int_arg(rank, "rank", lo=1, optional=True)
    quantizer_agnostic = checks.bool_arg(quantizer_agnostic, "quantizer_agnostic")
    if not toks:
        raise ValueError("kv is empty: calibration needs the keys and values of at least one layer")
    fit = (lambda X, Y: fit_ridge(X, Y, ridge)) if rank is None else (lambda X, Y: fit_reduced_rank(X, Y, rank, ridge))
    f_key, f_value = [None], [None]
    _, _, K_hat, V_hat = encode_checked(cfg, AquaPredictors((None,), (None,)), 0, *toks[0])
    for l in range(1, len(toks)):
        K, V = toks[l]                                                       # (N, F) clean, layer l
        if quantizer_agnostic:
            K_prev, V_prev = toks[l - 1]
            fk = fit(K_prev, K)
            fv = fit(np.concatenate([V_prev, K], axis=-1), V)
        else:
            fk = fit(K_hat, K)                                               # line 13
            K_pred = fk(K_hat) if cfg.predict_keys else np.zeros_like(K)
            what = residual_label("K", l, fk if cfg.predict_keys else None, "f_key")
            Kq = _backbone_encode(cfg.backbone, nx.sub(K, K_pred), what)
            K_rec = nx.add(cfg.backbone.decode(Kq, K.shape[-1]), K_pred)     # lines 14-15
            fv = fit(np.concatenate([V_hat, K_rec], axis=-1), V)             # line 17
        f_key.append(fk)
        f_value.append(fv)
        P = AquaPredictors(tuple(f_key), tuple(f_value))
        _, _, K_hat, V_hat = encode_checked(cfg, P, l, K, V, K_hat, V_hat)          # lines 14-19, 21
    return AquaPredictors(tuple(f_key), tuple(f_value))
