"""AQUA-KV, one layer, on torch tensors (``kvq.reference.aqua``, AQUA-KV §3.2 and Algorithms 2-3),
shared by both fast backends.

Backbones (the reference's ``Uniform`` / ``Higgs`` / ``KeepFP16`` objects: their codes as torch tensors
of the reference's names, dtypes and shapes), the predictors on the device (``x @ W ... + b``, fp32),
and Algorithms 2 and 3 for one layer are written once here; a backend passes its kernels as
:class:`AquaOps`: the fused decode ``reconstruct`` (HIGGS grid lookup or uniform unpack + dequantize,
scale, inverse Hadamard, plus the predictor's product and intercept: one kernel), ``higgs.quantize``,
``packing.quantize_pack`` and ``attention.decode_attention``. The cache over all layers is
``aqua_cache.py``; the public, documented functions are ``kvq.fast.triton.aqua`` / ``aqua_cache`` and
``kvq.fast.cupy.aqua`` / ``aqua_cache``.

    from kvq.fast.triton import aqua                            # (these call into here)
    Kq, Vq, K_hat, V_hat = aqua.encode(cfg, P, l, K, V, K_prev_hat, V_prev_hat)

Numerics. Given the same inputs, the backbone codes are the reference's bit for bit (the HIGGS and
uniform kernels follow the contract), and so is ``reconstruct`` given the same product. The predictors
are fp32 matrix products (torch, TF32 off), an order-dependent reduction outside bit-exactness
(contract rule 7): a residual code may differ from the reference's by one step where the reference's
pre-rounding value lies within the products' rounding of a boundary, and the reconstructions of layers
>= 1 follow the tolerance rule.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import numpy as np
import torch

from kvq.fast import common as C
from kvq.fast.caches.higgs import index_dtype
from kvq.reference import aqua as RA
from kvq.reference import checks
from kvq.reference.quant import check_groups

F16 = torch.float16


@dataclass(frozen=True)
class AquaOps:
    """A backend's kernels for the AQUA-KV cache."""

    name: str
    reconstruct: Callable            # (backbone, codes, F, y, bias) -> Q^-1(codes) [+ (y + bias)], fp32 (..., F)
    higgs: ModuleType                # quantize
    packing: ModuleType              # quantize_pack
    attention: ModuleType            # decode_attention
    allow_cpu: Callable[[], bool]


# ---------------------------------------------------------------------------------------------------
# backbones: x (..., F) fp32 <-> the reference's code arrays, as torch tensors


def check_backbone(bb, name: str = "backbone") -> None:
    if not isinstance(bb, (RA.Uniform, RA.Higgs, RA.KeepFP16)):
        raise TypeError(f"{name}={bb!r}: the fast tier implements the backbones Uniform, Higgs and KeepFP16")


def encode_codes(ops, bb, x) -> dict:
    """Q(x): x (..., F) fp32 -> the backbone's code tensors (the reference's names, shapes, dtypes, bits)."""
    if isinstance(bb, RA.Higgs):
        idx, scale = ops.higgs.quantize(bb.cfg, x)
        return {"idx": idx, "scale": scale}
    if isinstance(bb, RA.Uniform):
        codes, scale, mn = ops.packing.quantize_pack(x, bb.bits, bb.group_size, -1, bb.meta_dtype)
        return {"codes": codes, "scale": scale, "mn": mn}
    check_backbone(bb)
    C.check_finite(x)
    x16 = x.to(F16)
    if C.validation_enabled() and x16.numel() and not bool(torch.isfinite(x16).all()):
        raise ValueError("x overflows float16 (|x| > 65504)")
    return {"x": x16}


def reconstruct(ops, bb, codes: dict, F: int, y=None, bias=None) -> torch.Tensor:
    """``Q^-1(codes)``, plus ``(y + bias)`` when given (the predictor's product and intercept): (..., F) fp32.
    HIGGS and uniform codes go through the backend's fused kernel; FP16 codes are widened by torch."""
    if isinstance(bb, RA.KeepFP16):
        x = codes["x"].float()
        return x if y is None else x + (y + bias)
    return ops.reconstruct(bb, codes, F, y, bias)


def reconstruct_operands(bb, codes: dict, F: int, y, bias, *, allow_cpu: bool):
    """Checks of the fused decode's operands (Higgs / Uniform codes of token vectors of F values).

    Returns ``(lead, codes, y, bias)``: the leading shape (..., ) and the tensors made contiguous;
    y (..., F) and bias (F,) float32 on the codes' device, or both None."""
    if isinstance(bb, RA.Higgs):
        cfg = bb.cfg
        want = {"idx": (cfg.n_groups(F), cfg.group_size // cfg.d), "scale": (cfg.n_groups(F),)}
    elif isinstance(bb, RA.Uniform):
        G = check_groups((F,), 0, bb.group_size)
        if (F * bb.bits) % 8:
            raise ValueError(f"F={F} values of {bb.bits} bits do not fill whole bytes")
        want = {"codes": (F * bb.bits // 8,), "scale": (F // G,), "mn": (F // G,)}
    else:
        raise TypeError(f"the fused AQUA-KV decode takes Higgs or Uniform codes, not {type(bb).__name__}")
    if not isinstance(codes, dict) or set(codes) != set(want):
        raise ValueError(f"codes must be a dict with the keys {sorted(want)}; got "
                         f"{sorted(codes) if isinstance(codes, dict) else type(codes).__name__}")
    first = next(iter(want))
    C.check_tensor(codes[first], first, allow_cpu=allow_cpu)
    lead = tuple(codes[first].shape[:codes[first].dim() - len(want[first])])
    for name, tail in want.items():
        a = codes[name]
        C.check_tensor(a, name, allow_cpu=allow_cpu)
        if tuple(a.shape) != lead + tail:
            raise ValueError(f"{name} has shape {tuple(a.shape)}; {bb.label} codes of F={F} values need "
                             f"{lead + tail}")
        if a.device != codes[first].device:
            raise ValueError(f"{name} is on {a.device}; {first} is on {codes[first].device}")
    if isinstance(bb, RA.Higgs):
        if codes["idx"].dtype != index_dtype(bb.cfg.n):
            raise TypeError(f"idx has dtype {codes['idx'].dtype}; {bb.label} stores {index_dtype(bb.cfg.n)}")
        metas = ("scale",)
    else:
        if codes["codes"].dtype != torch.uint8:
            raise TypeError(f"codes have dtype {codes['codes'].dtype}; expected uint8")
        metas = ("scale", "mn")
    for name in metas:
        if codes[name].dtype not in (torch.float16, torch.float32):
            raise TypeError(f"{name} has dtype {codes[name].dtype}; expected float16 or float32 metadata")
    if (y is None) != (bias is None):
        raise ValueError("y and bias come together (the predictor's product and its intercept) or not at all")
    if y is not None:
        for name, a, shape in (("y", y, lead + (F,)), ("bias", bias, (F,))):
            C.check_tensor(a, name, allow_cpu=allow_cpu)
            if a.dtype != torch.float32 or tuple(a.shape) != shape or a.device != codes[first].device:
                raise ValueError(f"{name} must be a float32 tensor of shape {shape} on {codes[first].device}; "
                                 f"got {a.dtype} {tuple(a.shape)} on {a.device}")
        y, bias = y.contiguous(), bias.contiguous()
    return lead, {n: a.contiguous() for n, a in codes.items()}, y, bias


# ---------------------------------------------------------------------------------------------------
# predictors: y = x @ W_1 @ ... @ W_m (fp32), on the device once per (predictors, device)


@dataclass(frozen=True)
class DevicePredictor:
    """A :class:`kvq.reference.aqua.Predictor` on a device: fp32 matrices and intercept."""

    mats: tuple
    bias: torch.Tensor


_WEIGHTS: OrderedDict = OrderedDict()
_MAX_CACHED = 4


def weights(P, device) -> tuple:
    """``(f_key, f_value)`` of :class:`AquaPredictors` P as :class:`DevicePredictor` tuples (None kept).

    Copied to ``device`` once and cached (the last few (P, device) pairs, keyed by identity): the arrays of
    a cached P must not be modified in place."""
    key = (id(P), str(device))
    hit = _WEIGHTS.get(key)
    if hit is not None and hit[0] is P:
        _WEIGHTS.move_to_end(key)
        return hit[1]

    def conv(p):
        if p is None:
            return None
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(device)   # noqa: E731
        return DevicePredictor(tuple(t(m) for m in p.mats), t(p.bias))

    w = (tuple(conv(p) for p in P.f_key), tuple(conv(p) for p in P.f_value))
    _WEIGHTS[key] = (P, w)
    while len(_WEIGHTS) > _MAX_CACHED:
        _WEIGHTS.popitem(last=False)
    return w


@contextlib.contextmanager
def _fp32_matmul():
    """fp32 products (no TF32) inside, whatever the process-wide setting."""
    old = torch.get_float32_matmul_precision()
    if old == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def predict(pred: DevicePredictor, parts) -> torch.Tensor:
    """``[parts[0]; parts[1]; ...] @ mats[0] @ mats[1] ...`` in fp32, without the intercept.

    ``parts`` (..., F_i) are the predictor's input cut along the channels (the reference concatenates
    them: ``[V_prev_hat; K_hat]``); each part multiplies its own rows of the first matrix and the
    products are accumulated (one GEMM, then GEMMs with beta = 1), so nothing is concatenated."""
    W = pred.mats[0]
    lead = tuple(parts[0].shape[:-1])
    if sum(p.shape[-1] for p in parts) != W.shape[0]:
        raise ValueError(f"the predictor takes {W.shape[0]} input values per token; got "
                         f"{' + '.join(str(p.shape[-1]) for p in parts)}")
    with _fp32_matmul():
        y, r0 = None, 0
        for p in parts:
            f = p.shape[-1]
            p2 = p.reshape(-1, f)
            y = torch.mm(p2, W[r0:r0 + f]) if y is None else y.addmm_(p2, W[r0:r0 + f])
            r0 += f
        for m in pred.mats[1:]:
            y = torch.mm(y, m)
    return y.reshape(lead + (y.shape[-1],))


def _layer_predictors(cfg, P, l: int, device, K_prev_hat, V_prev_hat):
    """(f_key, f_value) of layer l >= 1 on the device (None where the config ablates them); the previous
    layer's reconstructions must be given where a predictor reads them."""
    f_key, f_value = weights(P, device)
    fk, fv = (f_key[l] if cfg.predict_keys else None), (f_value[l] if cfg.predict_values else None)
    if (fk is not None and K_prev_hat is None) or (fv is not None and V_prev_hat is None):
        raise ValueError(f"layer {l} is predicted from layer {l - 1}: give K_prev_hat and V_prev_hat "
                         f"(layer {l - 1}'s reconstructions)")
    return fk, fv


# ---------------------------------------------------------------------------------------------------
# Algorithms 2 and 3, one layer


def _encode_codes(ops, bb, x, what: str) -> dict:
    """:func:`encode_codes`; a refusal (NaN, a scale beyond the metadata dtype) names what was quantized,
    with the reference's message (``aqua._backbone_encode``)."""
    try:
        return encode_codes(ops, bb, x)
    except ValueError as e:
        raise ValueError(f"{what} cannot be quantized by the {bb.label} backbone: {e}") from e


def _encode_one(ops, bb, x, pred, parts, what: str):
    """(codes, x_hat) of one of K / V: ``Q(x - pred)``, ``Q^-1(codes) + pred`` (pred = 0 without predictor:
    the reference's ``x - 0`` and ``Q^-1(codes) + 0``, which turns -0.0 into +0.0)."""
    F = x.shape[-1]
    if pred is None:
        q = _encode_codes(ops, bb, x, what)
        return q, reconstruct(ops, bb, q, F) + 0.0
    y = predict(pred, parts)
    q = _encode_codes(ops, bb, x - (y + pred.bias), what)
    return q, reconstruct(ops, bb, q, F, y, pred.bias)


def _decode_one(ops, bb, q, F, pred, parts):
    if pred is None:
        return reconstruct(ops, bb, q, F)
    return reconstruct(ops, bb, q, F, predict(pred, parts), pred.bias)


def _tokens(x, name: str, allow_cpu: bool) -> None:
    """Token vectors (..., F): a float16 / bfloat16 / float32 tensor on an allowed device, F >= 1."""
    C.check_float(x, name, allow_cpu=allow_cpu)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must be token vectors (..., F) with F >= 1, got shape {tuple(x.shape)}")


def _prev_hat(x, name: str, l: int, shape: tuple, device, allow_cpu: bool, validate: bool) -> torch.Tensor:
    """The previous layer's reconstruction ``name`` of the same tokens: a float tensor of ``shape`` on
    ``device`` (fp32 out), finite when ``validate`` (and validation is on)."""
    if x is None:
        raise ValueError(f"layer {l} is predicted from layer {l - 1}: give K_prev_hat and V_prev_hat "
                         f"(layer {l - 1}'s reconstructions)")
    C.check_float(x, name, allow_cpu=allow_cpu)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (layer {l - 1}'s reconstruction of the same "
                         f"tokens), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}; the codes / token vectors are on {device}")
    if validate:
        C.check_finite(x, name, "predict from them")
    return x.float()


def encode(ops, cfg, P, l: int, K, V, K_prev_hat=None, V_prev_hat=None):
    """Algorithm 2 and its reconstruction for layer l: token vectors (..., F) -> (Kq, Vq, K_hat, V_hat).

    The reference's checks first (``kvq.reference.aqua.encode``: cfg, P and its predictors of layer l, l,
    K and V of one shape, the previous layer's reconstructions where they are read), on tensor shapes,
    dtypes and devices; the NaN / inf checks of K, V and the reconstructions while validation is on."""
    allow = ops.allow_cpu()
    RA.check_config(cfg)
    _tokens(K, "K", allow)
    _tokens(V, "V", allow)
    if tuple(K.shape) != tuple(V.shape):
        raise ValueError(f"K and V must have the same shape (..., F), got {tuple(K.shape)} and {tuple(V.shape)}")
    if V.device != K.device:
        raise ValueError(f"V is on {V.device}; K is on {K.device}")
    l = RA.check_layer(cfg, P, l, K.shape[-1])
    C.check_finite(K, "K")
    C.check_finite(V, "V")
    if l and cfg.predict_keys and P.f_key[l] is not None:
        K_prev_hat = _prev_hat(K_prev_hat, "K_prev_hat", l, K.shape, K.device, allow, True)
    if l and cfg.predict_values and P.f_value[l] is not None:
        V_prev_hat = _prev_hat(V_prev_hat, "V_prev_hat", l, K.shape, K.device, allow, True)
    return encode_checked(ops, cfg, P, l, K.float(), V.float(), K_prev_hat, V_prev_hat)


def encode_checked(ops, cfg, P, l: int, K, V, K_prev_hat=None, V_prev_hat=None):
    """:func:`encode` on checked fp32 arguments (the cache calls it for every chunk)."""
    F = K.shape[-1]
    if l == 0:
        Kq = _encode_codes(ops, cfg.first_layer, K, "K of layer 0")
        Vq = _encode_codes(ops, cfg.first_layer, V, "V of layer 0")
        return Kq, Vq, reconstruct(ops, cfg.first_layer, Kq, F), reconstruct(ops, cfg.first_layer, Vq, F)
    fk, fv = _layer_predictors(cfg, P, l, K.device, K_prev_hat, V_prev_hat)
    Kq, K_hat = _encode_one(ops, cfg.backbone, K, fk, [K_prev_hat], RA.residual_label("K", l, fk, "f_key"))
    Vq, V_hat = _encode_one(ops, cfg.backbone, V, fv, [V_prev_hat, K_hat], RA.residual_label("V", l, fv, "f_value"))
    return Kq, Vq, K_hat, V_hat


def _tensor_dtype(a) -> str:
    """A tensor's dtype as the reference names it: "uint8", "float16", ..."""
    return str(a.dtype).replace("torch.", "")


def decode(ops, cfg, P, l: int, Kq: dict, Vq: dict, F: int, K_prev_hat=None, V_prev_hat=None):
    """Algorithm 3 for layer l: codes (and the previous layer's reconstructions) -> (K_hat, V_hat) (..., F).

    The reference's checks first (``kvq.reference.aqua.decode``: cfg, P, l, F, the codes' names, dtypes and
    shapes, the reconstructions' shapes), on tensor metadata only: no value is read on the host."""
    allow = ops.allow_cpu()
    RA.check_config(cfg)
    F = checks.int_arg(F, "F", lo=1)
    l = RA.check_layer(cfg, P, l, F)
    bb = cfg.first_layer if l == 0 else cfg.backbone
    lead = None
    for name, codes in (("Kq", Kq), ("Vq", Vq)):
        lead = RA.check_codes(bb, codes, name, F, lead, array_type=torch.Tensor, dtype_name=_tensor_dtype)
        for n, a in codes.items():
            C.check_tensor(a, f"{name}[{n!r}]", allow_cpu=allow)
    devices = {a.device for codes in (Kq, Vq) for a in codes.values()}
    if len(devices) > 1:
        raise ValueError(f"Kq and Vq must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices), None)
    if lead is not None and l:
        if cfg.predict_keys and P.f_key[l] is not None:
            K_prev_hat = _prev_hat(K_prev_hat, "K_prev_hat", l, lead + (F,), device, allow, False)
        if cfg.predict_values and P.f_value[l] is not None:
            V_prev_hat = _prev_hat(V_prev_hat, "V_prev_hat", l, lead + (F,), device, allow, False)
    return decode_checked(ops, cfg, P, l, Kq, Vq, F, K_prev_hat, V_prev_hat)


def decode_checked(ops, cfg, P, l: int, Kq: dict, Vq: dict, F: int, K_prev_hat=None, V_prev_hat=None):
    """:func:`decode` on checked arguments (the cache calls it for every layer)."""
    if l == 0:
        return reconstruct(ops, cfg.first_layer, Kq, F), reconstruct(ops, cfg.first_layer, Vq, F)
    fk, fv = _layer_predictors(cfg, P, l, next(iter(Kq.values())).device, K_prev_hat, V_prev_hat)
    K_hat = _decode_one(ops, cfg.backbone, Kq, F, fk, [K_prev_hat])
    return K_hat, _decode_one(ops, cfg.backbone, Vq, F, fv, [V_prev_hat, K_hat])


def _layout_tensor(x, name: str, ndim: int, dims: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__} (the reference tier "
                        f"kvq.reference takes NumPy arrays)")
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name} is on {x.device}; expected a CUDA device or the CPU")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {dims}, got shape {tuple(x.shape)}")


def to_tokens(x) -> torch.Tensor:
    """Mirrors `kvq.reference.aqua.to_tokens`: (B, H, T, D) -> (B, T, H * D), each token's heads
    concatenated, contiguous. Differences: a torch tensor (the same values) on a CUDA device or the CPU."""
    _layout_tensor(x, "x", 4, "(B, H, T, D)")
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D).contiguous()


def from_tokens(x, H: int) -> torch.Tensor:
    """Mirrors `kvq.reference.aqua.from_tokens`: (B, T, H * D) -> (B, H, T, D), contiguous.
    Differences: a torch tensor (the same values) on a CUDA device or the CPU."""
    _layout_tensor(x, "x", 3, "(B, T, H * D)")
    H = checks.int_arg(H, "H", lo=1)
    B, T, F = x.shape
    if F % H:
        raise ValueError(f"H={H} does not divide x.shape[-1]={F} (token vectors of H * D values)")
    return x.reshape(B, T, H, F // H).transpose(1, 2).contiguous()
