"""CuPy OSCAR cache: mirrors ``kvq.reference.oscar`` (OSCAR section 4) on torch tensors, bit-exact state.

The CuPy twin of ``kvq.fast.triton.oscar``: the same state (``OSCARTensorState``) and the same routing
(sink, window ring, pages allocated page-major then batch), written once in ``kvq.fast.caches.oscar``, run
with the raw CUDA kernels of this backend: the fixed-order rotation ``kvq.fast.cupy.rotate`` (the
reference's operations in its order, so the same bits), the fused clip + quantize + pack of
``kvq.fast.cupy.oscar_quant``, and decode by the tensor-core kernel of ``kvq.fast.cupy.oscar_decode`` over
the packed pages (2-bit codes, G = D = 128, fp16 / bf16 q; otherwise the history is read back by
``packing.unpack_dequantize`` and attended by ``attention.decode_attention``).

    from kvq.fast.cupy import oscar
    cfg = oscar.CONFIGS["OSCAR"]; st = oscar.init(cfg, batch=1, kv_heads=8, head_dim=128)
    oscar.append(cfg, calib, st, k, v); out, lse = oscar.decode_attention(cfg, calib, st, q)
"""

from __future__ import annotations

import torch

from kvq.fast.caches import oscar as _O
from kvq.fast.caches.oscar import OSCARTensorState, counts, identity_calibration  # noqa: F401
from kvq.reference.oscar import (CLIP_GRID, CONFIGS, DEFAULT_CLIP_K, DEFAULT_CLIP_V,  # noqa: F401
                                 OSCARCalibration, OSCARConfig)              # (the reference's objects)

from . import attention as A
from . import oscar_append as OA
from . import oscar_decode as OD
from . import oscar_quant as OQ
from . import packing as P
from .rotate import rotate

__all__ = ["DEFAULT_CLIP_K", "DEFAULT_CLIP_V", "CLIP_GRID", "OSCARCalibration", "identity_calibration",
           "quantize_tokens", "OSCARConfig", "CONFIGS", "OSCARTensorState", "counts", "init", "append",
           "dequantize", "decode_attention"]



def fused_decode(cfg, st, q_rot, *, scale=None, precise: bool = True, out_dtype=torch.float32, R_out=None):
    """The decode of ``kvq.fast.caches.oscar.decode_attention`` (``OscarOps.fused_decode``): ``(out, lse)``, out
    in the rotated frame (``R_out`` None) or rotated by ``R_out`` (``oscar_decode.rotate_heads``' sums), in
    ``out_dtype`` (rounded once from fp32), lse fp32. The tensor-core kernel where it applies
    (``oscar_decode.supported``) and q is half precision (``precise=False``), its merge rotating the
    output in the same launch; else the history is dequantized and the three segments attended in fp32
    (the precise path for float32 q: double accumulators), then rotated by ``rotate_heads``."""
    if not precise and OD.supported(cfg, st, q_rot):
        return OD.decode(cfg, st, q_rot, scale=scale, out_dtype=out_dtype, R_out=R_out)
    out, lse = A.decode_attention(q_rot, _O.segments(OPS, cfg, st), scale=scale)
    return (out.to(out_dtype) if R_out is None else OD.rotate_heads(out, R_out, out_dtype)), lse


#: this backend's kernels for the shared OSCAR cache code (``kvq.fast.caches.oscar``)
OPS = _O.OscarOps("cupy", rotate, OQ, P, A, lambda: False, fused_decode=fused_decode, fused_append=OA,
                   rotate_heads=OD.rotate_heads)


def quantize_tokens(x_rot, clip: float, group_size: int, bits: int = 2, meta_dtype="float16"):
    """Mirrors `kvq.reference.oscar.quantize_tokens`: per-token percentile clip + per-token INT-b codes.

    Differences: torch CUDA tensors; ONE fused kernel (``kvq.fast.cupy.oscar_quant.quantize_tokens``
    with ``packed=False``: the reference's unpacked uint8 codes (..., D)); the same bits.
    """
    return OQ.quantize_tokens(x_rot, clip, group_size, bits, meta_dtype, packed=False)


def init(cfg: OSCARConfig, batch: int, kv_heads: int, head_dim: int, *, device=None) -> OSCARTensorState:
    """Mirrors `kvq.reference.oscar.init`: an empty cache with every buffer and the page pool preallocated.

    Differences: returns an :class:`OSCARTensorState` (the reference's fields as torch tensors) on
    ``device`` (a CUDA device, e.g. "cuda:1"); None: the current CUDA device.
    """
    return _O.init(OPS, cfg, batch, kv_heads, head_dim, device=device)


def append(cfg: OSCARConfig, calib: OSCARCalibration, state: OSCARTensorState, k, v) -> OSCARTensorState:
    """Mirrors `kvq.reference.oscar.append`: append (B, H_kv, T_new, D) tokens; the state is bit-identical.

    Every token is rotated (``fp16(k R_K)``, ``fp16(v R_V)``, the reference's fixed order); the first S0
    go to the sink, the others to the window ring; tokens leaving the window (old window tokens and new
    ones) are clipped and quantized into their page slots, pages allocated page-major then batch as the
    reference. ONE fused kernel per call for K and one for V does all of it
    (``kvq.fast.cupy.oscar_append``, where it supports the configuration: see its ``supported``); else
    (or with ``kvq.fast.caches.oscar.FUSED_APPEND = False``) the unfused path: the rotation kernel
    ``kvq.fast.cupy.rotate``, ``oscar_quant``'s fused quantizer on the tokens leaving, torch writes. Both
    give the reference's bits.
    Differences: k, v are float16 / float32 torch CUDA tensors on the cache's device; the NaN / inf and
    float16-overflow checks run while ``kvq.fast.validation`` is on (the fused kernel then runs only
    where a norm bound proves the rotated tokens finite; a larger token takes the unfused path, which
    raises on a real overflow). Validation comes before any write, so bad input leaves the state
    unchanged.
    """
    return _O.append(OPS, cfg, calib, state, k, v)


def dequantize(cfg: OSCARConfig, calib: OSCARCalibration, state: OSCARTensorState, *, rotated: bool = False):
    """Mirrors `kvq.reference.oscar.dequantize`: (K, V) fp32 (B, H_kv, T, D) in token order, bit-identical.

    ``rotated=True``: the rotated frame (exactly what attention reads); else rotated back by R_K^T,
    R_V^T with the fixed-order kernel (the reference's order, so also bit-identical).
    Differences: torch CUDA tensors on the cache's device.
    """
    return _O.dequantize(OPS, cfg, calib, state, rotated=rotated)


def decode_attention(cfg: OSCARConfig, calib: OSCARCalibration, state: OSCARTensorState, q, *, scale=None,
                     rotate_back: bool = True):
    """Mirrors `kvq.reference.oscar.decode_attention`: ``(out, lse)`` of q (B, H_q, T_q, D) over the cache.

    q is rotated by R_K (one float64 batched matmul; query head h uses the R_K of KV head h // (H_q / H_kv)).
    fp16 / bf16 q over a 2-bit cache with one group per token (G = D = 128), pages of 128 tokens, fp16
    metadata and at most 8 query rows per KV head: the tensor-core kernel ``oscar_decode_mma`` reads the
    packed pages (key scores on the s8 tensor cores: the codes times the rotated query's base-256 digits,
    exact integer sums; scale and min per token in fp32), the FP16 sink and window go through
    ``attention.cu``'s split kernel beside it, one log-sum-exp merge. Otherwise (and for float32 q, the
    precise path) the history is unpacked and dequantized into fp32 (bit-exact,
    ``packing.unpack_dequantize``) and the three segments are attended in fp32 by
    ``kvq.fast.cupy.attention.decode_attention``. The output is rotated back by R_V^T unless
    ``rotate_back=False``.
    Differences: torch CUDA tensors; q float16 / bfloat16 / float32 (float64 is refused: the reference
    computes the float64 truth); out comes back in q's dtype (fp32 inside; the reference returns
    float32), lse float32; attention is an order-dependent reduction (tolerance rule, contract rule 7);
    D must be one of the CuPy attention kernel's fp32 head dims (16, 32, 64, 128).
    """
    return _O.decode_attention(OPS, cfg, calib, state, q, scale=scale, rotate_back=rotate_back)
