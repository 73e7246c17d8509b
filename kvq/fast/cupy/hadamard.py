"""CuPy fast Walsh-Hadamard transform in the reference's fixed butterfly order (AQUA-KV §4.1, HIGGS).

Mirrors ``kvq.reference.hadamard``: ``fwht`` runs the same ``log2(d)`` butterfly stages in the same
order (stage s: stride h = 2**s, ``(a, b) -> (a + b, a - b)``, each one rounded fp32 add / subtract),
then one rounded multiply by ``fwht_scale(d)`` (the same fp32 constant, computed on the host), in the
raw CUDA kernels of ``higgs.cu`` (``fwht_rows``, ``fwht_stage``: PTX arithmetic without FMA or ftz):
bit-identical to the reference. The host-side helpers are shared with the Triton backend (``kvq.fast.caches.higgs``).

    from kvq.fast.cupy.hadamard import fwht, hadamard_matrix
    y = fwht(x)                    # x (..., d) torch CUDA fp16 / bf16 / fp32, d a power of two -> fp32
    y = fwht(x, axis=1)            # along another axis
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast import common as C
from kvq.fast.caches.higgs import hadamard_matrix  # noqa: F401  (host-side: the same for both backends)
from kvq.reference import hadamard as RH
from kvq.reference import numerics as nx

from . import _loader as L

__all__ = ["is_power_of_two", "hadamard_matrix", "fwht_scale", "fwht"]

_SRC = "higgs.cu"
_NT = 256               # threads per block (NT in higgs.cu)
_TILE = 8192            # fp32 values per fwht_rows block (TILE in higgs.cu)

#: longest row one ``fwht_rows`` block transforms (at most _TILE); longer rows run their first
#: log2(MAX_BLOCK) stages there and each later stage as one elementwise ``fwht_stage`` launch
MAX_BLOCK = 4096


def fwht_rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """Normalized FWHT of the contiguous rows of ``x`` (numel a multiple of d): fp32, same shape.

    The internal entry point of ``fwht`` (no axis handling, no checks beyond the dtype)."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    total = x.numel()
    if total == 0:
        return out
    fs = np.float32(RH.fwht_scale(d))
    nb = min(d, MAX_BLOCK, _TILE)
    fn = L.kernel(_SRC, f"fwht_rows<{L.DT[x.dtype]}>")
    L.run(fn, (-(-total // _TILE),), (_NT,),
          (x, out, np.int64(total), np.int32(nb.bit_length() - 1), fs, np.int32(nb == d)), x.device)
    h = nb
    P = total // 2
    stage = L.kernel(_SRC, "fwht_stage")
    while h < d:                                             # the late stages, one launch each
        L.run(stage, (L.grid_1d(P, _NT),), (_NT,),
              (out, np.int64(P), np.int64(d // 2), np.int64(h), fs, np.int32(2 * h == d)), x.device)
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

    ``x``: float16 / bfloat16 / float32 torch CUDA tensor whose ``axis`` has a power-of-two length d.
    Returns a new contiguous fp32 tensor of x's shape. Differences: torch tensors; bf16 input is
    accepted (widened exactly to fp32, as the reference takes bf16 values); rows longer than
    ``MAX_BLOCK`` run the late stages (stride >= MAX_BLOCK) as one elementwise launch each (the same
    operations in the same stage order, so the same bits).
    """
    C.check_float(x, "x")
    axis = nx.normalize_axis(axis, x.dim())
    d = x.shape[axis]
    RH.fwht_scale(d)                                         # the reference's error for a bad length
    y = torch.movedim(x, axis, -1).contiguous()              # (..., d)
    out = fwht_rows(y, d)
    return torch.movedim(out, -1, axis).contiguous()
