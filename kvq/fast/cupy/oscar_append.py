"""CuPy fused OSCAR append (OSCAR section 4, Algorithm 1 Prefill / DecodeStep): ONE raw CUDA kernel per
append for K and one for V (``oscar_append`` of ``oscar_append.cu``) that rotates the new tokens, rounds
them to fp16 and writes each where it belongs: the sink, the window ring, or (clipped, quantized, packed)
its page slot, together with the OLD window tokens that the new ones push out of the window.

A fast-only helper of ``kvq.fast.caches.oscar.append`` (``OscarOps.fused_append``), the CuPy twin of
``kvq.fast.triton.oscar_append``, not a mirrored module. It fuses what the unfused path does in ~10
launches (``rotate_rows``, the fp16 rounding, the concatenation of the window ring with the new tokens,
``oscar_quant_rows``, the torch scatters into sink / ring / pages) because a decode step appends one
token per sequence: launches, not bytes, set its cost. The bits are the unfused path's, which are the
reference's (``kvq.reference.oscar.append``). A block rotates TT tokens of one (batch, head) (R read
once per tile, as ``rotate_rows``), then one warp per token routes it and, for a token entering a page,
selects the quantile by bisection in registers, clips, quantizes and packs (``oscar_quant_rows``'
arithmetic).

    from kvq.fast.cupy import oscar_append as OA
    if OA.supported(cfg, D): OA.append(cfg, st, 0, k, R_K, calib.clip_k, plan)      # plan: kvq.fast.caches.oscar.AppendPlan

The kernels are compiled here (``NAMES``) from ``oscar_append.cu`` with the loader's source pasting and
options (``_loader.source``, ``_loader.OPTIONS``), on first use.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvq.fast.caches import oscar as _O

from . import _loader as L

__all__ = ["supported", "append", "NAMES"]

DIMS = (32, 64, 128, 256)           # head dims the kernel is built for (a multiple of 32, <= 256)
TILES = (8, 32)                     # tokens per block: 8 for decode-sized appends, 32 otherwise
_THREADS = 128                      # APP_THREADS in oscar_append.cu

#: every kernel name expression of oscar_append.cu (input dtype fp16 / fp32, head dim, tokens per block)
NAMES = tuple(f"oscar_append<{dt}, {D}, {tt}>" for dt in (0, 2) for D in DIMS for tt in TILES)


@functools.lru_cache(maxsize=None)
def _module():
    import cupy

    return cupy.RawModule(code=L.source("oscar_append.cu"), options=L.OPTIONS, name_expressions=NAMES)


@functools.lru_cache(maxsize=None)
def _kernel(expr: str):
    if expr not in NAMES:
        raise ValueError(f"kernel {expr!r} is not built from oscar_append.cu")
    return _module().get_function(expr)


def supported(cfg, D: int) -> bool:
    """Whether the fused kernel takes this configuration: D in DIMS, G a power of two dividing D with at
    least D / 32 channels (a group spans whole lanes of the per-token warp). Otherwise the unfused path."""
    G = cfg.group_size
    return D in DIMS and G > 0 and G & (G - 1) == 0 and D % G == 0 and G >= D // 32


#: the kernel's argument types (``_loader.planned``), oscar_append.cu's order
_KINDS = (torch.Tensor,) * 8 + (np.int32, np.int32) + (np.int64,) * 6 + (np.int32, np.int32, np.int64, np.int64) \
    + (np.int32,) * 6 + (np.float32, np.int32, np.int32, np.int32, np.int64)


def append(cfg, st, kv: int, x: torch.Tensor, R: torch.Tensor, clip: float, plan) -> None:
    """Append the new tokens ``x`` of K (``kv = 0``) or V (``kv = 1``) to the OSCAR state ``st`` in one
    launch of ``oscar_append`` (planned once per shape: ``_loader.run_planned``):
    ``kvq.fast.caches.oscar.OscarOps.fused_append``'s contract."""
    B, H, D = st.shape
    n = x.shape[2]
    if n == 0:
        return
    fo = _O.fused_operands(st, kv, R, clip)
    sink, win, codes, scale, mn = fo.fields
    lo, hi, frac = fo.quantile
    TT = TILES[0] if n <= TILES[0] else TILES[-1]
    ntiles = -(-n // TT)
    dev = L.device_index(x.device)
    values = (x.data_ptr(), R.data_ptr(), sink.data_ptr(), win.data_ptr(), codes.data_ptr(), scale.data_ptr(),
              mn.data_ptr(), st.table.data_ptr(), n, H, fo.r_stride, *x.stride(), plan.T0, plan.n_s, plan.n_old,
              plan.first, plan.e, cfg.window, cfg.sink, cfg.page_size, st.table.shape[1], lo, hi, frac,
              cfg.group_size, cfg.bits, int(scale.dtype == torch.float16), ntiles)
    L.run_planned(_kernel(f"oscar_append<{L.DT[x.dtype]}, {D}, {TT}>"), (B * H * ntiles,), (_THREADS,), _KINDS, values,
                  dev)
