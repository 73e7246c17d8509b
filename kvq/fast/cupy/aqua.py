"""CuPy AQUA-KV, one layer (AQUA-KV §3.2-3.3, Algorithms 2-3): the fused decode kernel and encode / decode.

The CuPy twin of ``kvq.fast.triton.aqua``: the same backend-neutral code (``kvq.fast.caches.aqua``) run with
the raw CUDA kernels of this backend. ``aqua.cu`` holds the fused decode: for a tile of token groups,
HIGGS grid lookup, scale and inverse Hadamard in shared memory (``higgs.cuh``, shared with ``higgs.cu``)
or uniform unpack + dequantize, then ``+ (y + bias)`` (y = the predictor's fp32 matrix product from
torch): given the same ``y``, bit for bit the reference's ``nx.add(decode(codes), nx.add(y, bias))``.
Encode is ``higgs.quantize`` / ``packing.quantize_pack`` of this backend on ``x - (y + bias)``.

    from kvq.fast.cupy import aqua
    Kq, Vq, K_hat, V_hat = aqua.encode(cfg, P, l, K, V, K_prev_hat, V_prev_hat)    # (..., F) torch CUDA
    K_hat, V_hat = aqua.decode(cfg, P, l, Kq, Vq, F, K_prev_hat, V_prev_hat)
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast.caches import aqua as _A
from kvq.fast.caches.aqua import from_tokens, to_tokens  # noqa: F401  (layout helpers, shared)
from kvq.fast.caches.higgs import CONTAINER, grid_tensor
from kvq.reference.aqua import (AquaConfig, AquaPredictors, Higgs, KeepFP16,  # noqa: F401
                                Predictor, Uniform)                           # (the reference's objects)

from . import _loader as L
from . import attention as A
from . import higgs as HG
from . import packing as PK
from .hadamard import fwht_scale

__all__ = ["Uniform", "Higgs", "KeepFP16", "AquaConfig", "Predictor", "AquaPredictors", "to_tokens",
           "from_tokens", "encode", "decode", "reconstruct"]

_SRC = "aqua.cu"
_NT = 256               # threads per block (NT in higgs.cuh)


def reconstruct(backbone, codes: dict, F: int, y=None, bias=None) -> torch.Tensor:
    """The fused AQUA-KV decode: ``Q^-1(codes)`` of token vectors, plus ``y + bias`` when given.

    ``backbone``: the reference's ``Higgs`` or ``Uniform``; ``codes``: its code tensors (``idx``, ``scale``
    / ``codes``, ``scale``, ``mn``) of (..., F) token vectors, as ``encode`` returns them; ``y`` (..., F)
    float32 (the predictor's matrix product) and ``bias`` (F,) float32 (its intercept), or both None.
    Returns (..., F) fp32: ``nx.add(backbone.decode(codes), nx.add(y, bias))`` of the reference bit for bit
    (one kernel of ``aqua.cu``). HIGGS groups of at most 8192 values and d <= 16 (``higgs.py``'s limits).
    No reference function of this name: ``kvq.reference.aqua.decode`` runs the same steps one array
    operation at a time.
    """
    lead, codes, y, bias = _A.reconstruct_operands(backbone, codes, F, y, bias, allow_cpu=False)
    dev = next(iter(codes.values())).device
    out = torch.empty(lead + (F,), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out
    rows = out.numel() // F
    has = y is not None
    yy, bb = (y, bias) if has else (out, out)                              # unused pointers without a predictor
    if isinstance(backbone, Higgs):
        cfg = backbone.cfg
        g, d = cfg.group_size, cfg.d
        HG.check_group(g)
        HG.check_d(d)
        NG = cfg.n_groups(F)
        NGR = rows * NG
        cont, bits = CONTAINER[codes["idx"].dtype]
        sc = codes["scale"]
        L.run(L.kernel(_SRC, f"aqua_higgs<{bits}>"), (-(-NGR // HG.groups_per_block(g)),), (_NT,),
              (codes["idx"].view(cont), sc, grid_tensor(cfg, dev), yy, bb, out, np.int64(NGR), np.int64(F),
               np.int64(NG), np.float32(fwht_scale(g)), np.int32(cfg.n), np.int32(g.bit_length() - 1),
               np.int32(d.bit_length() - 1), np.int32(sc.dtype == torch.float16), np.int32(has)), dev)
        return out
    sc, mn = codes["scale"], codes["mn"]
    if sc.dtype != mn.dtype:
        raise TypeError(f"scale and mn must share one dtype; got {sc.dtype} and {mn.dtype}")
    G = F // sc.shape[-1]
    nbytes = codes["codes"].numel()
    L.run(L.kernel(_SRC, f"aqua_uniform<{backbone.bits}>"), (L.grid_1d(nbytes, _NT),), (_NT,),
          (codes["codes"], sc, mn, yy, bb, out, np.int64(nbytes), np.int64(F), np.int32(G),
           np.int32(sc.dtype == torch.float16), np.int32(has)), dev)
    return out


#: this backend's kernels for the shared AQUA-KV code (``kvq.fast.caches.aqua``)
OPS = _A.AquaOps("cupy", reconstruct, HG, PK, A, lambda: False)


def encode(cfg: AquaConfig, P: AquaPredictors, l: int, K, V, K_prev_hat=None, V_prev_hat=None):
    """Mirrors `kvq.reference.aqua.encode`: Algorithm 2 and its reconstruction for layer l, as
    ``kvq.fast.triton.aqua.encode`` (the same shared code) with this backend's kernels: the HIGGS quantizer
    of ``higgs.cu`` / ``packing.quantize_pack`` on the residual, the fused decode of ``aqua.cu``.

    Returns ``(Kq, Vq, K_hat, V_hat)``: code tensors (the reference's names, dtypes, shapes) and (..., F)
    fp32 reconstructions (equal to :func:`decode` of the codes for the same shapes).
    Differences: torch CUDA tensors; the predictions are fp32 matrix products (rule 7: residual codes of
    layers >= 1 may differ from the reference's by one step near a boundary; a given residual's codes are
    bit-identical); HIGGS groups of at most 8192 values; backbones Uniform, Higgs, KeepFP16.
    """
    return _A.encode(OPS, cfg, P, l, K, V, K_prev_hat, V_prev_hat)


def decode(cfg: AquaConfig, P: AquaPredictors, l: int, Kq: dict, Vq: dict, F: int, K_prev_hat=None,
           V_prev_hat=None):
    """Mirrors `kvq.reference.aqua.decode`: Algorithm 3 for layer l, one fused kernel of ``aqua.cu`` per
    K / V after the predictor's product -> ``(K_hat, V_hat)`` (..., F) fp32.

    Differences: torch CUDA tensors; the products follow the tolerance rule (contract rule 7); ``Q^-1`` and
    the additions are bit-identical given the same product.
    """
    return _A.decode(OPS, cfg, P, l, Kq, Vq, F, K_prev_hat, V_prev_hat)
