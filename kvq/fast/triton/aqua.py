"""Triton AQUA-KV, one layer (AQUA-KV §3.2-3.3, Algorithms 2-3): the fused decode kernel and encode / decode.

Mirrors ``kvq.reference.aqua`` on torch tensors. A layer's keys (values) are reconstructed as
``Q^-1(codes) + f(prev)``; the fused kernel does, for a tile of token vectors, everything after the
predictor's matrix product in one pass: HIGGS grid lookup, scale, inverse Hadamard (the fixed
butterflies of ``hadamard.py``, then one multiply by ``fwht_scale(g)``) or uniform unpack + dequantize,
then ``+ (y + bias)`` (the product ``y = prev @ W`` comes from torch, fp32, TF32 off; the intercept is
added in the kernel in the reference's order), launched with ``enable_fp_fusion=False``: given the same
``y``, the output is the reference's ``nx.add(decode(codes), nx.add(y, bias))`` bit for bit. Encode is
the HIGGS quantizer of ``higgs.py`` / the fused ``packing.quantize_pack`` on ``x - (y + bias)``.

    from kvq.fast.triton import aqua
    Kq, Vq, K_hat, V_hat = aqua.encode(cfg, P, l, K, V, K_prev_hat, V_prev_hat)    # (..., F) torch fp32
    K_hat, V_hat = aqua.decode(cfg, P, l, Kq, Vq, F, K_prev_hat, V_prev_hat)

Predictor weights (the reference's NumPy :class:`AquaPredictors`) are copied to the device once per
(P, device) and cached (``kvq.fast.caches.aqua.weights``). The cache over all layers is ``aqua_cache.py``;
the backend-neutral code both backends share is ``kvq.fast.caches.aqua`` / ``_aqua_cache``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.fast.caches import aqua as _A
from kvq.fast.caches.aqua import from_tokens, to_tokens  # noqa: F401  (layout helpers, shared)
from kvq.fast.caches.higgs import CONTAINER, grid_tensor
from kvq.reference.aqua import (AquaConfig, AquaPredictors, Higgs, KeepFP16,  # noqa: F401
                                Predictor, Uniform)                           # (the reference's objects)

from kvq.fast.common import cdiv as _cdiv, next_pow2 as _np2  # host grid arithmetic
from . import attention as A
from . import higgs as HG
from . import packing as PK
from .quant import unpack_last, interpreting

__all__ = ["Uniform", "Higgs", "KeepFP16", "AquaConfig", "Predictor", "AquaPredictors", "to_tokens",
           "from_tokens", "encode", "decode", "reconstruct"]


# Fused AQUA-KV decode, HIGGS backbone: one program takes BLOCK_R token groups of G values.
# Computes: x = fwht(grid[idx] * scale) (``higgs.decode_groups``: lookup, one rounded multiply, the
#   butterflies, one multiply by FS); if HAS_PRED, x = x + (y + bias) (two rounded adds, that order);
#   fp32 out, the padding past F dropped.
# Grid: (cdiv(rows * NG, BLOCK_R),). Bytes: reads rows*NG*G/D indices, rows*NG scales, the grid and
#   (HAS_PRED) rows*F fp32 products + F intercepts; writes rows*F fp32.
@triton.jit
def _higgs_kernel(i_ptr, s_ptr, grid_ptr, y_ptr, b_ptr, o_ptr, NGR, F, NG, N, FS,
                  G: tl.constexpr, LOG2G: tl.constexpr, D: tl.constexpr, IDX_BITS: tl.constexpr,
                  HAS_PRED: tl.constexpr, BLOCK_R: tl.constexpr):
    gi = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    gm = gi < NGR
    col = (gi % NG)[:, None] * G + tl.arange(0, G)[None, :]
    m = gm[:, None] & (col < F)
    offs = (gi // NG)[:, None] * F + col
    x = HG.decode_groups(i_ptr, s_ptr, grid_ptr, gi, gm, N, FS, G, LOG2G, D, IDX_BITS, BLOCK_R)
    if HAS_PRED:
        x = x + (tl.load(y_ptr + offs, mask=m, other=0.0) + tl.load(b_ptr + col, mask=m, other=0.0))
    tl.store(o_ptr + offs, x, mask=m)


# Fused AQUA-KV decode, uniform backbone: a program takes BLOCK_R token vectors x BLOCK_J code bytes.
# Computes: PER = 8 / BITS codes per byte (code i of a byte in bits [BITS*i, BITS*i + BITS)), channel e
#   of group e // G: x = float(code) * scale + mn (two rounded fp32 ops, no FMA); if HAS_PRED,
#   x = x + (y + bias); fp32 out.
# Grid: (cdiv(rows, BLOCK_R), cdiv(F / PER, BLOCK_J)). Bytes: reads rows*F/PER code bytes, 2 rows*F/G
#   metadata and (HAS_PRED) rows*F fp32 products + F intercepts; writes rows*F fp32.
@triton.jit
def _uniform_kernel(q_ptr, s_ptr, m_ptr, y_ptr, b_ptr, o_ptr, R, F, NGF, G,
                    BITS: tl.constexpr, PER: tl.constexpr, HAS_PRED: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    jb = tl.program_id(1) * BLOCK_J
    NJ = F // PER
    j = jb + tl.arange(0, BLOCK_J)[None, :]
    byte = tl.load(q_ptr + r * NJ + j, mask=(r < R) & (j < NJ), other=0).to(tl.int32)
    code = unpack_last(byte, BLOCK_R, BLOCK_J, PER, BITS)                  # (BLOCK_R, BLOCK_J * PER)
    e = jb * PER + tl.arange(0, BLOCK_J * PER)[None, :]
    m = (r < R) & (e < F)
    g = r * NGF + e // G
    x = code.to(tl.float32) * tl.load(s_ptr + g, mask=m, other=0.0).to(tl.float32) \
        + tl.load(m_ptr + g, mask=m, other=0.0).to(tl.float32)
    offs = r * F + e
    if HAS_PRED:
        x = x + (tl.load(y_ptr + offs, mask=m, other=0.0) + tl.load(b_ptr + e, mask=e < F, other=0.0))
    tl.store(o_ptr + offs, x, mask=m)


def _p2(n: int) -> int:
    return _np2(max(int(n), 1))


def reconstruct(backbone, codes: dict, F: int, y=None, bias=None) -> torch.Tensor:
    """The fused AQUA-KV decode: ``Q^-1(codes)`` of token vectors, plus ``y + bias`` when given.

    ``backbone``: the reference's ``Higgs`` or ``Uniform``; ``codes``: its code tensors (``idx``, ``scale``
    / ``codes``, ``scale``, ``mn``) of (..., F) token vectors, as ``encode`` returns them; ``y`` (..., F)
    float32 (the predictor's matrix product) and ``bias`` (F,) float32 (its intercept), or both None.
    Returns (..., F) fp32: ``nx.add(backbone.decode(codes), nx.add(y, bias))`` of the reference bit for bit
    (one kernel: lookup / unpack, scale, inverse Hadamard, add). No reference function of this name:
    ``kvq.reference.aqua.decode`` runs the same steps one array operation at a time.
    """
    lead, codes, y, bias = _A.reconstruct_operands(backbone, codes, F, y, bias, allow_cpu=interpreting())
    dev = next(iter(codes.values())).device
    out = torch.empty(lead + (F,), dtype=torch.float32, device=dev)
    rows = out.numel() // max(F, 1)
    if out.numel() == 0:
        return out
    has = y is not None
    yy, bb = (y, bias) if has else (out, out)                              # unused pointers without a predictor
    if isinstance(backbone, Higgs):
        cfg = backbone.cfg
        g, d = cfg.group_size, cfg.d
        NG = cfg.n_groups(F)
        NGR = rows * NG
        cont, bits = CONTAINER[codes["idx"].dtype]
        BR = HG.row_tile(NGR, g)
        _higgs_kernel[(_cdiv(NGR, BR),)](
            codes["idx"].view(cont), codes["scale"], grid_tensor(cfg, dev), yy, bb, out, NGR, F, NG, cfg.n,
            float(HG.fwht_scale(g)), G=g, LOG2G=g.bit_length() - 1, D=d, IDX_BITS=bits, HAS_PRED=has,
            BLOCK_R=BR, num_warps=HG.warps(BR * g), enable_fp_fusion=False)
        return out
    G = F // codes["scale"].shape[-1]
    per = 8 // backbone.bits
    NJ = F // per
    tile = 16384 if interpreting() else 4096
    BJ = min(_p2(NJ), max(1, tile // per))
    BR = max(1, min(_p2(rows), tile // (BJ * per)))
    _uniform_kernel[(_cdiv(rows, BR), _cdiv(NJ, BJ))](
        codes["codes"], codes["scale"], codes["mn"], yy, bb, out, rows, F, F // G, G, BITS=backbone.bits, PER=per,
        HAS_PRED=has, BLOCK_R=BR, BLOCK_J=BJ, num_warps=min(8, max(1, BR * BJ * per // 512)),
        enable_fp_fusion=False)
    return out


#: this backend's kernels for the shared AQUA-KV code (``kvq.fast.caches.aqua``)
OPS = _A.AquaOps("triton", reconstruct, HG, PK, A, interpreting)


def encode(cfg: AquaConfig, P: AquaPredictors, l: int, K, V, K_prev_hat=None, V_prev_hat=None):
    """Mirrors `kvq.reference.aqua.encode`: Algorithm 2 and its reconstruction for layer l.

    Layer 0: ``cfg.first_layer`` codes of K and V. Layer l >= 1: ``K_pred = f_key(K_prev_hat)``,
    ``Kq = Q(K - K_pred)``, ``K_hat`` = the fused decode of Kq plus the prediction; then V from
    ``f_value([V_prev_hat; K_hat])``. Returns ``(Kq, Vq, K_hat, V_hat)``: dicts of code tensors (the
    reference's names, dtypes and shapes) and (..., F) fp32 reconstructions, which equal :func:`decode`
    of the codes bit for bit for the same shapes.
    Differences: torch tensors (float16 / bfloat16 / float32 token vectors, widened exactly; CUDA, or the
    CPU under TRITON_INTERPRET=1); the predictions are fp32 matrix products (torch, TF32 off, the value
    predictor's input rows taken in two products instead of a concatenation): outside bit-exactness
    (contract rule 7), so codes of layers >= 1 may differ from the reference's by one step where its
    pre-rounding value lies within the products' rounding of a boundary; the quantization of a given
    residual is bit-identical (the HIGGS kernel, ``packing.quantize_pack``). Backbones: Uniform, Higgs,
    KeepFP16 (TypeError for others). The reference's argument checks, with its messages; the NaN / inf
    checks of K, V and the previous layer's reconstructions run while ``kvq.fast.validation`` is on.
    """
    return _A.encode(OPS, cfg, P, l, K, V, K_prev_hat, V_prev_hat)


def decode(cfg: AquaConfig, P: AquaPredictors, l: int, Kq: dict, Vq: dict, F: int, K_prev_hat=None,
           V_prev_hat=None):
    """Mirrors `kvq.reference.aqua.decode`: Algorithm 3, codes of layer l -> ``(K_hat, V_hat)`` (..., F) fp32.

    One fused kernel per K / V (:func:`reconstruct`) after the predictor's product.
    Differences: torch tensors; the predictions are fp32 matrix products (tolerance rule, contract rule 7);
    ``Q^-1`` and the additions are bit-identical given the same product. The reference's argument checks on
    tensor metadata (the codes' names, dtypes, shapes, devices); no value is read on the host, so NaN in
    the previous layer's reconstructions propagates (the reference refuses it).
    """
    return _A.decode(OPS, cfg, P, l, Kq, Vq, F, K_prev_hat, V_prev_hat)
