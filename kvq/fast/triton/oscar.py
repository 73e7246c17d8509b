"""Triton OSCAR cache: mirrors ``kvq.reference.oscar`` (OSCAR section 4) on torch tensors, bit-exact state.

The cache lives in the rotated frame: sink and recent window hold ``fp16(k R_K)`` / ``fp16(v R_V)``, and
every token leaving the window is clipped per token at the ``c``-quantile of its ``|entries|`` and
quantized per token to INT2 in groups of G channels into its page slot. The rotation is the fixed-order
fp32 product of ``kvq.reference.rotations.rotate`` (``kvq.fast.triton.rotate``: the same operations in
the same order, so the same bits), the clip + quantize + pack is the fused kernel of
``kvq.fast.triton.oscar_quant``; sink / window ring / page routing and page ids follow the reference
exactly (written once for both backends in ``kvq.fast.caches.oscar``), so after the same appends every
tensor of the state equals the reference state's array.

    from kvq.fast.triton import oscar
    cfg = oscar.CONFIGS["OSCAR"]; st = oscar.init(cfg, batch=1, kv_heads=8, head_dim=128)
    oscar.append(cfg, calib, st, k, v); out, lse = oscar.decode_attention(cfg, calib, st, q)

``calib`` is the reference's :class:`OSCARCalibration` (host data: calibration is offline, the
reference's ``calibrate`` serves it); its fp32 rotations are copied to the cache's device per call.
"""

from __future__ import annotations

from kvq.fast.caches import oscar as _O
from kvq.fast.caches.oscar import OSCARTensorState, counts, identity_calibration  # noqa: F401
from kvq.reference import checks
from kvq.reference.oscar import (CLIP_GRID, CONFIGS, DEFAULT_CLIP_K, DEFAULT_CLIP_V,  # noqa: F401
                                 OSCARCalibration, OSCARConfig)              # (the reference's objects)

from . import attention as A
from . import oscar_append as OA
from . import oscar_decode as OD
from . import oscar_quant as OQ
from . import packing as P
from .quant import interpreting
from .rotate import rotate

__all__ = ["DEFAULT_CLIP_K", "DEFAULT_CLIP_V", "CLIP_GRID", "OSCARCalibration", "identity_calibration",
           "quantize_tokens", "OSCARConfig", "CONFIGS", "OSCARTensorState", "counts", "init", "append",
           "dequantize", "decode_attention"]

#: this backend's kernels for the shared OSCAR cache code (``kvq.fast.caches.oscar``)
OPS = _O.OscarOps("triton", rotate, OQ, P, A, interpreting, fused_decode=OD.decode, fused_append=OA,
                   rotate_heads=OD.rotate_heads)


def quantize_tokens(x_rot, clip: float, group_size: int, bits: int = 2, meta_dtype="float16"):
    """Mirrors `kvq.reference.oscar.quantize_tokens`: per-token percentile clip + per-token INT-b codes.

    Differences: torch tensors; ONE fused kernel (``kvq.fast.triton.oscar_quant.quantize_tokens`` with
    ``packed=False``: the reference's unpacked uint8 codes (..., D)); the same bits. ``clip`` is checked
    as the reference checks it (a ratio in (0, 1]; a bool or a string is refused).
    """
    clip = checks.real_arg(clip, "clip", 0.0, 1.0, lo_open=True)
    return OQ.quantize_tokens(x_rot, clip, group_size, bits, meta_dtype, packed=False)


def init(cfg: OSCARConfig, batch: int, kv_heads: int, head_dim: int, *, device=None) -> OSCARTensorState:
    """Mirrors `kvq.reference.oscar.init`: an empty cache with every buffer and the page pool preallocated.

    Differences: returns an :class:`OSCARTensorState` (the reference's fields as torch tensors) on
    ``device`` (a CUDA device, e.g. "cuda:1"; the CPU only under the Triton interpreter); None: the
    current CUDA device (the CPU under the interpreter).
    """
    return _O.init(OPS, cfg, batch, kv_heads, head_dim, device=device)


def append(cfg: OSCARConfig, calib: OSCARCalibration, state: OSCARTensorState, k, v) -> OSCARTensorState:
    """Mirrors `kvq.reference.oscar.append`: append (B, H_kv, T_new, D) tokens; the state is bit-identical.

    Every token is rotated (``fp16(k R_K)``, ``fp16(v R_V)``, the reference's fixed order); the first S0
    go to the sink, the others to the window ring; tokens leaving the window (old window tokens and new
    ones) are clipped and quantized into their page slots, pages allocated page-major then batch as the
    reference. ONE fused kernel per call for K and one for V does all of it
    (``kvq.fast.triton.oscar_append``, where it supports the configuration: see its ``supported``); else
    (or with ``kvq.fast.caches.oscar.FUSED_APPEND = False``) the unfused path: the rotation kernel
    ``kvq.fast.triton.rotate``, ``oscar_quant``'s fused quantizer on the tokens leaving, torch writes.
    Both give the reference's bits.
    Differences: k, v are float16 / float32 torch tensors on the cache's device; the NaN / inf and
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
    Differences: torch tensors on the cache's device.
    """
    return _O.dequantize(OPS, cfg, calib, state, rotated=rotated)


def decode_attention(cfg: OSCARConfig, calib: OSCARCalibration, state: OSCARTensorState, q, *, scale=None,
                     rotate_back: bool = True):
    """Mirrors `kvq.reference.oscar.decode_attention`: ``(out, lse)`` of q (B, H_q, T_q, D) over the cache.

    q is rotated by R_K (one float64 batched matmul; query head h uses the R_K of KV head h // (H_q / H_kv));
    the INT-b history is read packed by the fused kernel of ``kvq.fast.triton.oscar_decode`` (pages
    through the page table, unpacked and dequantized in registers, online softmax, split along the
    sequence, all query heads of a KV head together), the FP16 sink and recent window by the
    flash-decoding partial kernel of ``kvq.fast.triton.attention`` in its precise fp32 mode, and all
    partials are merged by log-sum-exp (the paper's two kernels plus merge); the output is rotated back
    by R_V^T unless ``rotate_back=False``.
    Differences: torch tensors; q float16 / bfloat16 / float32 (float64 is refused: the reference
    computes the float64 truth); out comes back in q's dtype (fp32 inside; the reference returns
    float32), lse float32; attention is an order-dependent reduction (tolerance rule, contract rule 7):
    fp32 q takes the exact-dequantization IEEE fp32 path, fp16 / bf16 q the tensor-core path (codes
    against hi + lo fp16 parts of the fp32 factors, see ``oscar_decode``); D must be a power of two in
    [16, 256] (the kernels').
    """
    return _O.decode_attention(OPS, cfg, calib, state, q, scale=scale, rotate_back=rotate_back)
