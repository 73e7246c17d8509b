"""CuPy HIGGS (AQUA-KV §4.1): pad, RMS scale, FWHT, nearest grid point, in ONE raw CUDA kernel per tile.

Mirrors ``kvq.reference.higgs`` bit for bit under the numerics contract (DESIGN.md section 2), with
the kernels of ``higgs.cu`` (PTX arithmetic without FMA or ftz): ``higgs_quant`` does the halving-tree
sum of squares, ``rms = sqrt_rn(div_rn(ss, g))`` rounded to the metadata dtype, the butterflies of
``hadamard.fwht`` and one multiply by ``fwht_scale(g)``, ``z = div_rn(., scale)`` (0 where the stored
scale is 0) and the strict-``<`` nearest-point scan (ties to the lowest index), for a tile of token
groups held in shared memory; ``higgs_dequant`` is ``fwht(grid[idx] * scale)``. The host side (index
dtypes, grid caching, scale and index checks) is shared with the Triton backend (``kvq.fast.caches.higgs``).

    from kvq.fast.cupy import higgs
    cfg = higgs.HiggsConfig(d=2, n=16)
    idx, scale = higgs.quantize(cfg, x)                         # x (..., F) torch CUDA -> uint8 (..., n_g, g/d)
    x_hat = higgs.dequantize(cfg, idx, scale, F=x.shape[-1])    # (..., F) fp32
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast import common as C
from kvq.fast.caches import higgs as TG
from kvq.reference import higgs as RG
from kvq.reference import numerics as nx
from kvq.reference.higgs import SHIPPED_GRIDS, HiggsConfig  # noqa: F401  (data: the reference's objects)

from . import _loader as L
from .hadamard import fwht_scale

__all__ = ["SHIPPED_GRIDS", "HiggsConfig", "load_grid", "index_dtype", "group_sum_of_squares",
           "nearest", "quantize", "dequantize", "bits_per_value"]

_SRC = "higgs.cu"
_NT = 256               # threads per block (NT in higgs.cu)
_TILE = 8192            # fp32 values per block (TILE in higgs.cu): the largest group size
_MAXR = 256             # token groups per block at most (MAXR in higgs.cu)
_MAXD = 16              # the largest vector dimension d (MAXD in higgs.cu)


def groups_per_block(g: int) -> int:
    """Token groups per block: rows_per_block in higgs.cu."""
    return min(_MAXR, _TILE // g)


def check_group(g: int) -> None:
    if g > _TILE:
        raise ValueError(f"group_size={g}: the CuPy HIGGS kernels keep a group in shared memory, "
                         f"at most {_TILE} values (use the Triton backend for longer groups)")


def check_d(d: int) -> None:
    if d > _MAXD:
        raise ValueError(f"d={d}: the CuPy HIGGS kernels search grids of vectors of at most {_MAXD} values")


def load_grid(d: int, n: int) -> torch.Tensor:
    """Mirrors `kvq.reference.higgs.load_grid`: the same (n, d) float32 values (the same error for an
    unshipped grid), as a torch tensor on the default device (CUDA when present, else the CPU);
    a tensor cannot be read-only, so a fresh copy is returned."""
    return TG.load_grid(d, n)


def index_dtype(n: int) -> torch.dtype:
    """Mirrors `kvq.reference.higgs.index_dtype`: the same choice (uint8 up to n = 256, then uint16,
    uint32), as the torch dtype (torch.uint8 / torch.uint16 / torch.uint32)."""
    return TG.index_dtype(n)


def bits_per_value(cfg: HiggsConfig, F: int):
    """Mirrors `kvq.reference.higgs.bits_per_value`: the same Fraction (host arithmetic; no difference)."""
    return RG.bits_per_value(cfg, F)


def group_sum_of_squares(xg) -> torch.Tensor:
    """Mirrors `kvq.reference.higgs.group_sum_of_squares`: the same halving tree in a kernel, bit-identical.

    ``xg`` (..., g) float32 torch CUDA tensor -> (...,) fp32; g must be a power of two (ValueError
    otherwise, as the reference). Differences: g at most 8192 (one group in shared memory); bfloat16
    input is also widened exactly (the reference: float16 / float32).
    """
    C.check_float(xg, "xg")
    if xg.dim() == 0 or not RG.is_power_of_two(xg.shape[-1]):
        raise ValueError(f"xg has shape {tuple(xg.shape)}; the halving tree needs a power-of-two last axis "
                         f"(zero-pad each group to the next power of two, as quantize does)")
    g = xg.shape[-1]
    check_group(g)
    x = xg.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    R = out.numel()
    if R == 0:
        return out
    fn = L.kernel(_SRC, f"higgs_ss<{L.DT[x.dtype]}>")
    L.run(fn, (-(-R // groups_per_block(g)),), (_NT,), (x, out, np.int64(R), np.int32(g.bit_length() - 1)),
          x.device)
    return out


def nearest(v, grid) -> torch.Tensor:
    """Mirrors `kvq.reference.higgs.nearest`: the same distance order and tie rule, in a kernel.

    ``v`` (..., d) float32 torch CUDA tensor; ``grid`` (n, d) float32 (torch tensor or NumPy array,
    copied to v's device) -> (...,) int64 indices, bit-identical; wrong dtypes / shapes raise
    TypeError / ValueError, as the reference. Differences: torch tensors; d is at most 16.
    """
    C.check_tensor(v, "v")
    g = grid if isinstance(grid, torch.Tensor) else torch.from_numpy(np.array(grid))   # a copy: grids may be read-only
    if v.dtype != torch.float32 or g.dtype != torch.float32:
        raise TypeError(f"v and grid must be float32; got {v.dtype} and {g.dtype}")
    if v.dim() == 0 or g.dim() != 2 or g.shape[0] == 0 or v.shape[-1] != g.shape[1]:
        raise ValueError(f"v {tuple(v.shape)} and grid {tuple(g.shape)}: need v (..., d) and grid (n, d) "
                         f"with n >= 1")
    D = int(g.shape[1])
    check_d(D)
    g = g.to(v.device).contiguous()
    x = v.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.int64, device=x.device)
    M = out.numel()
    if M == 0:
        return out
    L.run(L.kernel(_SRC, "higgs_nearest"), (L.grid_1d(M, _NT),), (_NT,),
          (x, g, out, np.int64(M), np.int32(g.shape[0]), np.int32(D)), x.device)
    return out


def quantize(cfg: HiggsConfig, x):
    """Mirrors `kvq.reference.higgs.quantize`: ONE fused kernel per tile of token groups, bit-identical.

    ``x`` (..., F) float16 / bfloat16 / float32 torch CUDA tensor. Returns ``(idx, scale)``: idx
    (..., n_groups, g / d) in ``index_dtype(n)`` (torch.uint8 up to n = 256, torch.uint16 /
    torch.uint32 above), scale (..., n_groups) in ``cfg.meta_dtype``. Differences: torch tensors; bf16
    input accepted (widened exactly); group_size at most 8192 and d at most 16 (ValueError); NaN / inf
    and a scale overflow are detected from the stored scales (the kernel propagates them into the
    scale) and raise ValueError while ``kvq.fast.validation`` is on (the overflow message omits the
    reference's largest |scale|); with it off such groups get a NaN / inf scale. The grid is copied
    to x's device (shipped grids once per device, an explicit ``cfg.grid`` on every call).
    """
    C.check_float(x, "x")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"x is empty or a scalar (shape {tuple(x.shape)}); HIGGS quantizes (..., F) vectors")
    g, d = cfg.group_size, cfg.d
    check_group(g)
    check_d(d)
    F = x.shape[-1]
    n_g = cfg.n_groups(F)
    lead = tuple(x.shape[:-1])
    meta = nx.dtype_name(cfg.meta_dtype)
    itype = index_dtype(cfg.n)
    cont, bits = TG.CONTAINER[itype]
    xc = x.contiguous()
    idx = torch.empty(lead + (n_g, g // d), dtype=cont, device=x.device)
    scale = torch.empty(lead + (n_g,), dtype=C.torch_dtype(meta), device=x.device)
    NGR = scale.numel()
    grid = TG.grid_tensor(cfg, x.device)
    fn = L.kernel(_SRC, f"higgs_quant<{L.DT[xc.dtype]}, {bits}>")
    L.run(fn, (-(-NGR // groups_per_block(g)),), (_NT,),
          (xc, grid, idx, scale, np.int64(NGR), np.int64(F), np.int64(n_g), np.float32(fwht_scale(g)),
           np.int32(cfg.n), np.int32(g.bit_length() - 1), np.int32(d.bit_length() - 1),
           np.int32(scale.dtype == torch.float16)), x.device)
    TG.check_scale(xc, scale, meta)
    return (idx if cont == itype else idx.view(itype)), scale


def dequantize(cfg: HiggsConfig, idx, scale, F: int, out_dtype=np.float32) -> torch.Tensor:
    """Mirrors `kvq.reference.higgs.dequantize`: ``fwht(grid[idx] * scale)`` per group in one kernel,
    padding dropped -> (..., F), bit-identical.

    ``idx`` in ``index_dtype(n)``, ``scale`` float16 / float32, torch CUDA tensors on one device.
    Differences: torch tensors; group_size at most 8192 and d at most 16 (ValueError); a bf16
    ``out_dtype`` returns a torch.bfloat16 tensor (the reference: float32 values that are exactly
    bf16); the range check of idx (ValueError, as the reference) costs a reduction and runs only while
    ``kvq.fast.validation`` is on; with it off the kernel clamps indices into the grid.
    """
    itype, out = TG.dequant_args(cfg, idx, scale, F, out_dtype)
    check_group(cfg.group_size)
    check_d(cfg.d)
    TG.check_idx_range(cfg, idx)
    g, d, n_g = cfg.group_size, cfg.d, cfg.n_groups(F)
    lead = tuple(idx.shape[:-2])
    o = torch.empty(lead + (F,), dtype=out, device=idx.device)
    NGR = scale.numel()
    if NGR == 0 or F == 0:
        return o
    cont, bits = TG.CONTAINER[itype]
    ic = idx.contiguous().view(cont)
    sc = scale.contiguous()
    grid = TG.grid_tensor(cfg, idx.device)
    fn = L.kernel(_SRC, f"higgs_dequant<{L.DT[out]}, {bits}>")
    L.run(fn, (-(-NGR // groups_per_block(g)),), (_NT,),
          (ic, sc, grid, o, np.int64(NGR), np.int64(F), np.int64(n_g), np.float32(fwht_scale(g)),
           np.int32(cfg.n), np.int32(g.bit_length() - 1), np.int32(d.bit_length() - 1),
           np.int32(sc.dtype == torch.float16)), idx.device)
    return o
