"""Triton fast Walsh-Hadamard transform in the reference's fixed butterfly order (AQUA-KV §4.1, HIGGS).

Mirrors ``kvq.reference.hadamard``: ``fwht`` runs the same ``log2(d)`` butterfly stages in the same
order (stage s: stride h = 2**s, ``(a, b) -> (a + b, a - b)``, each one rounded fp32 add / subtract),
then one rounded multiply by ``fwht_scale(d)`` (the same fp32 constant, computed on the host), launched
with ``enable_fp_fusion=False``: bit-identical to the reference on the GPU and under the interpreter.
The butterfly helper ``butterfly_stages`` is shared with the fused HIGGS kernels (``higgs.py``).

    from kvq.fast.triton.hadamard import fwht, hadamard_matrix
    y = fwht(x)                    # x (..., d) torch fp16 / bf16 / fp32, d a power of two -> fp32
    y = fwht(x, axis=1)            # along another axis
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.fast import common as C
from kvq.reference import hadamard as RH
from kvq.reference import numerics as nx

from kvq.fast.caches.higgs import hadamard_matrix  # noqa: F401

from kvq.fast.common import cdiv as _cdiv, next_pow2 as _np2  # host grid arithmetic
from . import _launch as L
from .quant import load_f32, interpreting

__all__ = ["is_power_of_two", "hadamard_matrix", "fwht_scale", "fwht"]

#: longest row the one-kernel path keeps in registers; longer rows run their first log2(MAX_BLOCK)
#: stages in that kernel (blocks of MAX_BLOCK) and each later stage as one elementwise launch
MAX_BLOCK = 4096


# ----------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _stage(x, R: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """One butterfly stage of stride H on each row of x (R, N): (x[i], x[i+H]) -> (a + b, a - b)."""
    y = tl.reshape(x, (R, N // (2 * H), 2, H))                 # [row, block, half, i]
    y = tl.permute(y, (0, 1, 3, 2))                            # [row, block, i, half]
    a, b = tl.split(y)                                         # x[j + i], x[j + i + H]
    y = tl.join(a + b, a - b)                                  # [row, block, i, half]
    y = tl.permute(y, (0, 1, 3, 2))
    return tl.reshape(y, (R, N))


@triton.jit
def butterfly_stages(x, R: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """Stages s = 0 .. LOG2N - 1 (stride 2**s) on each row of x (R, N), in the reference's order."""
    for s in tl.static_range(LOG2N):
        x = _stage(x, R, N, 1 << s)
    return x


# Row FWHT: one program takes BLOCK_R rows of N (a power of two) contiguous values.
# Computes: the LOG2N butterfly stages (rounded add / sub), then, if SCALE, one rounded multiply by FS.
# Grid: (cdiv(R, BLOCK_R),). Bytes: reads R*N inputs, writes R*N fp32.
@triton.jit
def _fwht_rows_kernel(x_ptr, o_ptr, R, FS, N: tl.constexpr, LOG2N: tl.constexpr, SCALE: tl.constexpr,
                      IN_BF16: tl.constexpr, BLOCK_R: tl.constexpr):
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    r = tl.arange(0, BLOCK_R)[:, None]
    e = tl.arange(0, N)[None, :]
    m = ((r0 + r) < R) & (e < N)
    offs = r0 * N + (r.to(tl.int64) * N + e)
    x = load_f32(x_ptr + offs, m, IN_BF16)
    x = butterfly_stages(x, BLOCK_R, N, LOG2N)
    if SCALE:
        x = x * FS
    tl.store(o_ptr + offs, x, mask=m)


# One late stage (stride H >= MAX_BLOCK) of rows of 2*HALF values, in place: one element pair per lane.
# Computes: (y[i], y[i+H]) -> (a + b, a - b), then, if SCALE (the last stage), each times FS (rounded).
# Grid: (cdiv(P, BLOCK),), P = number of pairs. Bytes: reads and writes 2P fp32.
@triton.jit
def _fwht_stage_kernel(y_ptr, P, HALF, H, FS, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = p < P
    row = p // HALF
    q = p % HALF
    ia = row * (2 * HALF) + (q // H) * (2 * H) + q % H
    a = tl.load(y_ptr + ia, mask=m, other=0.0)
    b = tl.load(y_ptr + ia + H, mask=m, other=0.0)
    s = a + b
    t = a - b
    if SCALE:
        s = s * FS
        t = t * FS
    tl.store(y_ptr + ia, s, mask=m)
    tl.store(y_ptr + ia + H, t, mask=m)


def _rows_per_program(R: int, N: int) -> int:
    tile = 65536 if interpreting() else 2048
    return max(1, min(_np2(max(R, 1)), tile // N))


def _warps(tile: int) -> int:
    return min(8, max(1, tile // 512))


def fwht_rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """Normalized FWHT of the contiguous rows of ``x`` (numel a multiple of d): fp32, same shape.

    The internal entry point of ``fwht`` (no axis handling, no checks beyond the dtype)."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    fs = float(RH.fwht_scale(d))
    in_bf16 = x.dtype == torch.bfloat16
    xin = x.view(torch.int16) if in_bf16 else x
    nb = min(d, MAX_BLOCK)
    Rb = x.numel() // nb
    BR = _rows_per_program(Rb, nb)
    L.launch(_fwht_rows_kernel, (_cdiv(Rb, BR),), xin, out, Rb, fs, N=nb, LOG2N=nb.bit_length() - 1,
                                              SCALE=nb == d, IN_BF16=in_bf16, BLOCK_R=BR,
                                              num_warps=_warps(BR * nb), enable_fp_fusion=False)
    h = nb
    P = x.numel() // 2
    BLOCK = 1024 if not interpreting() else 65536
    while h < d:                                             # the late stages, one launch each
        L.launch(_fwht_stage_kernel, (_cdiv(P, BLOCK),), out, P, d // 2, h, fs, SCALE=2 * h == d, BLOCK=BLOCK,
                                                     num_warps=4, enable_fp_fusion=False)
        h *= 2
    return out


def is_power_of_two(d) -> bool:
    """Mirrors `kvq.reference.hadamard.is_power_of_two` (the same host-side test; no difference)."""
    return RH.is_power_of_two(d)


def fwht_scale(d: int):
    """Mirrors `kvq.reference.hadamard.fwht_scale`: the same fp32 host constant ``float32(1/sqrt(d))``
    (a NumPy float32 scalar; the kernels receive exactly these bits)."""
    return RH.fwht_scale(d)


def fwht(x, axis: int = -1) -> torch.Tensor:
    """Mirrors `kvq.reference.hadamard.fwht`: the normalized FWHT along ``axis``, bit-identical.

    ``x``: float16 / bfloat16 / float32 torch tensor (CUDA, or the CPU under ``TRITON_INTERPRET=1``)
    whose ``axis`` has a power-of-two length d. Returns a new contiguous fp32 tensor of x's shape.
    Differences: torch tensors; bf16 input is accepted (widened exactly to fp32, as the reference takes
    bf16 values); rows longer than ``MAX_BLOCK`` run the late stages (stride >= MAX_BLOCK) as one
    elementwise launch each (the same operations in the same stage order, so the same bits).
    """
    C.check_float(x, "x", allow_cpu=interpreting())
    axis = nx.normalize_axis(axis, x.dim())
    d = x.shape[axis]
    RH.fwht_scale(d)                                         # the reference's error for a bad length
    y = torch.movedim(x, axis, -1).contiguous()              # (..., d)
    out = fwht_rows(y, d)
    return torch.movedim(out, -1, axis).contiguous()
