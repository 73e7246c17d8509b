"""Host-side helpers of the HIGGS / Hadamard fast tier, shared by both backends (no kernels here).

Grids on the device, the index dtypes and their signed containers, and the checks that run after a
kernel (``kvq.fast.triton.higgs`` and ``kvq.fast.cupy.higgs`` import them; the public functions
carry the "Mirrors ..." docstrings both backends export).
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast import common as C
from kvq.reference import hadamard as RH
from kvq.reference import higgs as RG
from kvq.reference.higgs import HiggsConfig

_TORCH_INDEX = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16,
                np.dtype(np.uint32): torch.uint32}
#: index dtype -> (the signed container the kernels write / read, its bits)
CONTAINER = {torch.uint8: (torch.uint8, 8), torch.uint16: (torch.int16, 16), torch.uint32: (torch.int32, 32)}
_GRIDS: dict = {}


def grid_tensor(cfg: HiggsConfig, device) -> torch.Tensor:
    """The config's (n, d) fp32 grid on ``device`` (shipped grids cached per device)."""
    device = torch.device(device)
    if cfg.grid is not None:
        return torch.from_numpy(np.ascontiguousarray(cfg.codebook())).to(device)
    key = (cfg.d, cfg.n, str(device))
    if key not in _GRIDS:
        _GRIDS[key] = torch.from_numpy(np.array(RG.load_grid(cfg.d, cfg.n))).to(device)
    return _GRIDS[key]


def load_grid(d: int, n: int) -> torch.Tensor:
    """Mirrors `kvq.reference.higgs.load_grid`: the same (n, d) float32 values (the same error for an
    unshipped grid), as a torch tensor on the default device (CUDA when present, else the CPU);
    a tensor cannot be read-only, so a fresh copy is returned."""
    g = RG.load_grid(d, n)
    return torch.from_numpy(np.array(g)).to(_default_device())


def index_dtype(n: int) -> torch.dtype:
    """Mirrors `kvq.reference.higgs.index_dtype`: the same choice (uint8 up to n = 256, then uint16,
    uint32), as the torch dtype (torch.uint8 / torch.uint16 / torch.uint32)."""
    return _TORCH_INDEX[RG.index_dtype(n)]


def check_scale(x: torch.Tensor, scale: torch.Tensor, meta: str) -> None:
    """After the quantize kernel: a non-finite scale means NaN / inf input, or a metadata overflow."""
    if not C.validation_enabled() or bool(torch.isfinite(scale).all()):
        return
    C.check_finite(x)                                            # the reference's NaN / inf error first
    raise ValueError(f"scale overflows {meta} metadata (the group RMS is beyond {meta}'s range); "
                     f"use meta_dtype=np.float32 or rescale the input")


def _idx_max(idx: torch.Tensor) -> int:
    cont, bits = CONTAINER[idx.dtype]
    w = idx.view(cont).to(torch.int64)
    if bits < 64:
        w = w & ((1 << bits) - 1)
    return int(w.max())


def dequant_args(cfg: HiggsConfig, idx, scale, F: int, out_dtype, *, allow_cpu: bool = False):
    """The checks of either backend's ``higgs.dequantize`` (the reference's errors, in its order):
    idx (..., n_groups, g / d) in ``index_dtype(n)``, scale (..., n_groups) float16 / float32, a
    supported ``out_dtype``. Returns ``(index dtype, torch output dtype)``."""
    from kvq.reference import checks
    from kvq.reference import numerics as nx

    RG.check_config(cfg)                                         # the reference's first checks, its messages
    F = checks.int_arg(F, "F", lo=1)
    C.check_tensor(idx, "idx", allow_cpu=allow_cpu)
    C.check_tensor(scale, "scale", allow_cpu=allow_cpu)
    g, d = cfg.group_size, cfg.d
    n_g = cfg.n_groups(F)
    if tuple(idx.shape[-2:]) != (n_g, g // d) or tuple(scale.shape) != tuple(idx.shape[:-1]):
        raise ValueError(f"idx {tuple(idx.shape)} / scale {tuple(scale.shape)} do not fit F={F} with "
                         f"{cfg.label}: expected (..., {n_g}, {g // d}) and (..., {n_g})")
    itype = index_dtype(cfg.n)
    if idx.dtype != itype:
        raise TypeError(f"idx has dtype {idx.dtype}; {cfg.label} stores indices as {itype}")
    if scale.dtype not in (torch.float16, torch.float32):
        raise TypeError(f"scale has dtype {scale.dtype}; expected float16 or float32 metadata")
    if nx.dtype_name(out_dtype) not in nx.OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype!r} is not supported; choose one of {nx.OUT_DTYPES}")
    return itype, C.torch_dtype(out_dtype)


def check_idx_range(cfg: HiggsConfig, idx) -> None:
    """Indices outside the grid raise ValueError (a reduction: only while validation is on)."""
    if C.validation_enabled() and idx.numel() and _idx_max(idx) >= cfg.n:
        raise ValueError(f"idx holds {_idx_max(idx)}, outside the grid's 0..{cfg.n - 1}")


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def hadamard_matrix(d: int) -> torch.Tensor:
    """Mirrors `kvq.reference.hadamard.hadamard_matrix`: the same (d, d) float32 values, as a torch
    tensor on the default device (CUDA when present, else the CPU). Built on the host by the reference
    (entries are exactly +-fwht_scale(d)) and copied; not a kernel."""
    return torch.from_numpy(RH.hadamard_matrix(d)).to(_default_device())
