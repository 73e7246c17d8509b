"""CuPy fixed-order rotation ``x R`` (OSCAR section 4): bit for bit ``kvq.reference.rotations.rotate``.

The reference rotates every token row ``x`` (1, D) by an fp32 matrix R (D, D) as a fixed-order
reduction over the input channel: ``acc = x_0 R_0``, then ``acc = acc + x_i R_i`` for i = 1 .. D-1
(R_i = row i of R), each a separately rounded fp32 multiply and add, then ``acc + 0.0`` (-0.0 -> +0.0).
The kernel ``rotate_rows`` of ``oscar.cu`` does exactly these operations in exactly this order (PTX
``mul.rn`` / ``add.rn``: never contracted into an FMA, no ftz), so its result equals the reference's bit
for bit. The CuPy mirror of ``kvq.fast.triton.rotate`` (a helper of ``kvq.fast.cupy.oscar``).

    from kvq.fast.cupy.rotate import rotate
    y = rotate(k, R)          # k (B, H, T, D) fp16 / bf16 / fp32; R (D, D) or (H_R, D, D) fp32 -> fp32
    o = rotate(out, R_V_t)    # (B, H_q, T_q, D) with per-KV-head R (H_kv, D, D): head h uses R[h // (H_q / H_kv)]
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast import common as C

from . import _loader as L

__all__ = ["rotate"]

_TT = 32                # token rows per block (ROT_TT in oscar.cu)
_THREADS = 128          # ROT_THREADS in oscar.cu


def rotate(x: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """``x @ R`` in fp32 in the fixed order of ``kvq.reference.rotations.rotate``: bit-identical.

    Args:
        x: (..., D) float16 / bfloat16 / float32 torch CUDA tensor (any strides); with a per-head R,
            (B, H, T, D) with H a multiple of H_R.
        R: float32 (D, D), or (H_R, D, D): head h of x uses ``R[h // (H / H_R)]`` (per-KV-head
            rotations, and the GQA mapping of query heads onto them), on x's device.
    Returns:
        fp32 (..., D), contiguous. Differences from the reference: torch CUDA tensors; the per-head
        form is (H_R, D, D) with the GQA mapping built in (the reference broadcasts (H, 1, D, D));
        fp16 / bf16 inputs are converted to fp32 inside the kernel (exact).
    """
    x4, Rc, out, ratio, r_sh, shape = C.rotation_operands(x, R, allow_cpu=False)
    B, H, T, D = x4.shape
    if out.numel() == 0:
        return out.view(shape)
    ntiles = -(-T // _TT)
    fn = L.kernel("oscar.cu", f"rotate_rows<{L.DT[x4.dtype]}>")
    L.run(fn, (B * H * ntiles,), (_THREADS,),
          (x4, Rc, out, np.int64(T), np.int32(H), np.int32(ratio), np.int64(r_sh),
           *(np.int64(s) for s in x4.stride()), np.int32(D), np.int64(ntiles)), x.device)
    return out.view(shape)
