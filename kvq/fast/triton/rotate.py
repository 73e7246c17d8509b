"""Triton fixed-order rotation ``x R`` (OSCAR section 4): bit for bit ``kvq.reference.rotations.rotate``.

The reference rotates every token row ``x`` (1, D) by an fp32 matrix R (D, D) as a fixed-order
reduction over the input channel: ``acc = x_0 R_0``, then ``acc = acc + x_i R_i`` for i = 1 .. D-1
(R_i = row i of R), each a separately rounded fp32 multiply and add, then ``acc + 0.0`` (-0.0 -> +0.0).
The kernel does exactly these operations in exactly this order (a sequential loop over i, launched with
``enable_fp_fusion=False`` so that no multiply-add is contracted into an FMA), so its result equals the
reference's bit for bit on the GPU as under the interpreter. A helper of ``kvq.fast.triton.oscar``
(not a mirrored module: the reference's ``rotate`` lives in ``rotations.py`` with the calibration
tools, which have no fast version).

    from kvq.fast.triton.rotate import rotate
    y = rotate(k, R)          # k (B, H, T, D) fp16 / bf16 / fp32; R (D, D) or (H_R, D, D) fp32 -> fp32
    o = rotate(out, R_V_t)    # (B, H_q, T_q, D) with per-KV-head R (H_kv, D, D): head h uses R[h // (H_q / H_kv)]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.fast import common as C

from kvq.fast.common import cdiv as _cdiv, next_pow2 as _np2  # host grid arithmetic
from . import _launch as L
from .quant import interpreting

__all__ = ["rotate"]


# Fixed-order rotation: one program takes BLOCK_T token rows of one (batch, head) and all D outputs.
# Computes: acc[t, :] = x[t, 0] * R[0, :]; for i in 1..D-1: acc = acc + x[t, i] * R[i, :] (rounded mul,
#   rounded add: launch with enable_fp_fusion=False); out = acc, with -0.0 written as +0.0 (= acc + 0.0).
# Grid: (B * H, cdiv(T, BLOCK_T)); R is R_ptr + (h // RATIO) * R_SH (R_SH = 0: one shared matrix).
# Bytes: reads B*H*T*D inputs (each x element once) and D*D fp32 of R per program (L2-resident);
#   writes B*H*T*D fp32.
@triton.jit
def _rotate_kernel(x_ptr, r_ptr, o_ptr, T, H, RATIO, R_SH, sx_b, sx_h, sx_t, sx_d,
                   D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    tm = t < T
    dm = d < D
    xrow = x_ptr + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h + t.to(tl.int64) * sx_t   # (BLOCK_T,)
    rb = r_ptr + (h // RATIO).to(tl.int64) * R_SH
    x0 = tl.load(xrow, mask=tm, other=0.0).to(tl.float32)
    r0 = tl.load(rb + d, mask=dm, other=0.0)
    acc = x0[:, None] * r0[None, :]                                    # (BLOCK_T, BLOCK_D)
    for i in range(1, D):
        xi = tl.load(xrow + i * sx_d, mask=tm, other=0.0).to(tl.float32)
        ri = tl.load(rb + i * D + d, mask=dm, other=0.0)
        acc = acc + xi[:, None] * ri[None, :]
    acc = tl.where(acc == 0.0, 0.0, acc)                               # acc + 0.0: -0.0 -> +0.0, NaN stays
    orow = (pid.to(tl.int64) * T + t.to(tl.int64)) * D
    tl.store(o_ptr + orow[:, None] + d[None, :], acc, mask=tm[:, None] & dm[None, :])


def _block_t(T: int, D: int) -> int:
    """Token rows per program: the accumulator (BLOCK_T, D) fp32 stays at <= 64 registers a thread
    (4 warps) on the GPU; the interpreter takes bigger tiles (fewer Python-level programs)."""
    if interpreting():
        return max(16, min(_np2(max(T, 1)), 128))
    return max(16, min(8192 // _np2(D), 64))


def rotate(x: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """``x @ R`` in fp32 in the fixed order of ``kvq.reference.rotations.rotate``: bit-identical.

    Args:
        x: (..., D) float16 / bfloat16 / float32 torch tensor (any strides); with a per-head R,
            (B, H, T, D) with H a multiple of H_R.
        R: float32 (D, D), or (H_R, D, D): head h of x uses ``R[h // (H / H_R)]`` (per-KV-head
            rotations, and the GQA mapping of query heads onto them), on x's device.
    Returns:
        fp32 (..., D), contiguous. Differences from the reference: torch tensors on a CUDA device (the
        CPU under ``TRITON_INTERPRET=1``); the per-head form is (H_R, D, D) with the GQA mapping
        built in (the reference broadcasts (H, 1, D, D)); bf16 input is widened to fp32 first (exact).
    """
    if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
        x = x.float()                                                  # exact
    x4, Rc, out, ratio, r_sh, shape = C.rotation_operands(x, R, allow_cpu=interpreting())
    B, H, T, D = x4.shape
    if out.numel() == 0:
        return out.view(shape)
    BT = _block_t(T, D)
    L.launch(_rotate_kernel, (B * H, _cdiv(T, BT)),
        x4, Rc, out, T, H, ratio, r_sh, *x4.stride(), D=D, BLOCK_T=BT, BLOCK_D=_np2(D),
        num_warps=4, enable_fp_fusion=False)
    return out.view(shape)
