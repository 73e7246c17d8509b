"""CuPy backend: affine quantization in groups along an axis, as raw CUDA kernels (``quant.cu``).

Mirrors ``kvq.reference.quant`` bit for bit (numerics contract, DESIGN.md section 2) on torch CUDA
tensors; kernels get the tensors' device addresses (zero-copy; `_loader.ARG_MODE` selects DLPack views
instead) and launch on torch's current stream.

    from kvq.fast.cupy.quant import quantize, dequantize
    codes, scale, mn = quantize(k, bits=2, group_size=128, axis=2)      # k: (B, H_kv, T, D), per-channel
    k_hat = dequantize(codes, scale, mn, group_size=128, axis=2, out_dtype=torch.float16)

Kernels: the tensor is seen as (outer, n, inner). ``inner == 1`` (groups of G contiguous elements, e.g.
per-token values) runs ``quant_rows``: a team of lanes of one warp per group, 16-byte loads, warp
shuffles for min / max. ``inner > 1`` (groups of G elements at stride inner, e.g. per-channel keys)
runs ``quant_cols``: threads along the columns (coalesced), slices of the group's tokens along
threadIdx.y, min / max combined in shared memory. The same kernels, with PB < 8, are the fused
``quantize_pack`` of ``packing.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast import common as C
from kvq.reference import numerics as nx
from kvq.reference.quant import check_groups

from . import _loader as L

__all__ = ["quantize", "dequantize", "quantile", "percentile_clip"]

_SRC = "quant.cu"
_THREADS = 256          # rows kernels: 8 warps per block
_CACHED = 4             # rows / cols kernels: chunks a thread keeps in registers (K in quant.cu)
_MAXTY = 8              # cols kernels: token slices per block (MAXTY in quant.cu, 256 threads)
_R = 4                  # cols kernels: tokens per chunk (R in quant.cu)
MAX_SORT = 4096         # longest row sorted by one block (OSCAR_MAX_SORT in oscar.cu); longer: torch.sort


def pow2_ceil(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def _team_log2(nchunks: int, cached: int) -> int:
    """log2 of the lanes sharing one group in a rows kernel: enough that each lane's chunks fit its
    ``cached`` registers, at least 4 (64 contiguous bytes per access) when the group has that many
    chunks, at most a warp."""
    ts = pow2_ceil(-(-nchunks // cached))
    ts = max(ts, min(4, pow2_ceil(nchunks)))
    return min(ts, 32).bit_length() - 1


def out_dtype_of(out_dtype) -> torch.dtype:
    """The torch dtype of a dequantization output, with the reference's error for others."""
    name = nx.dtype_name(out_dtype)
    if name not in nx.OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype!r} is not supported; choose one of {nx.OUT_DTYPES}")
    return C.torch_dtype(name)


def launch_quantize(x, bits: int, G: int, axis: int, meta_dtype: torch.dtype, symmetric: bool, pb: int):
    """Run the quantize kernel with codes packed ``pb`` bits each (8 = one code per byte).

    Arguments are already validated (``G`` divides the axis; with ``pb < 8``, ``G % (8 // pb) == 0``).
    Returns ``(out, scale, mn)``: uint8 ``out`` with ``n * pb / 8`` entries along ``axis``; scale and
    mn in ``meta_dtype``, shaped like x with the axis length replaced by ``n // G``.
    """
    xc = x.contiguous()
    shape = tuple(xc.shape)
    outer, n, inner = C.axis_view(shape, axis)
    per = 8 // pb
    out_shape = list(shape)
    out_shape[axis] = n // per
    out = torch.empty(out_shape, dtype=torch.uint8, device=xc.device)
    scale = torch.empty(C.meta_shape(shape, axis, G), dtype=meta_dtype, device=xc.device)
    mn = torch.empty_like(scale)
    dt = L.DT[xc.dtype]
    flags = (np.int32(bits), np.int32(1 if symmetric else 0), np.int32(meta_dtype == torch.float16))
    if inner == 1:
        esz = xc.element_size()
        vec = (G * esz) % 16 == 0 and xc.data_ptr() % 16 == 0
        nchunks = G // (16 // esz if vec else per)
        log2_ts = _team_log2(nchunks, _CACHED)
        ngroups = outer * (n // G)
        grid = L.grid_1d(ngroups, (_THREADS // 32) * (32 >> log2_ts))
        fn = L.kernel(_SRC, f"quant_rows<{dt}, {pb}, {'true' if vec else 'false'}>")
        L.run(fn, (grid,), (_THREADS,),
              (xc, out, scale, mn, np.int64(ngroups), np.int64(G), np.int32(log2_ts), *flags), xc.device)
    else:
        vc = 2 if xc.element_size() == 2 and inner % 2 == 0 and xc.data_ptr() % 4 == 0 else 1
        ty = max(1, min(_MAXTY, -(-G // (_R * _CACHED))))
        nblk = outer * (n // G) * -(-inner // (32 * vc))
        fn = L.kernel(_SRC, f"quant_cols<{dt}, {pb}, {vc}>")
        L.run(fn, (L.grid_1d(nblk, 1),), (32, ty),
              (xc, out, scale, mn, np.int64(outer), np.int64(n), np.int64(inner), np.int64(G), *flags),
              xc.device)
    return out, scale, mn


def launch_dequantize(packed, scale, mn, G: int, axis: int, out_dtype: torch.dtype, pb: int):
    """Run the dequantize kernel on codes packed ``pb`` bits each (8 = one code per byte).

    Arguments are already validated (shapes; with ``pb < 8``, ``G % (8 // pb) == 0``). Returns the
    values in ``out_dtype``, ``8 / pb`` times longer than ``packed`` along ``axis``.
    """
    pc = packed.contiguous()
    outer, nb, inner = C.axis_view(tuple(pc.shape), axis)
    per = 8 // pb
    n = nb * per
    shape = list(pc.shape)
    shape[axis] = n
    out = torch.empty(shape, dtype=out_dtype, device=pc.device)
    if scale.dtype != mn.dtype:                         # fp16 -> fp32 is exact
        scale, mn = scale.float(), mn.float()
    sc, mc = scale.contiguous(), mn.contiguous()
    meta_half = np.int32(sc.dtype == torch.float16)
    dto = L.DT[out_dtype]
    if inner == 1:
        E = 16 // out.element_size()
        vec = G % E == 0 and pc.data_ptr() % 16 == 0
        nchunks = G // (E if vec else per)
        log2_ts = _team_log2(nchunks, 1)
        ngroups = outer * (n // G)
        grid = L.grid_1d(ngroups, (_THREADS // 32) * (32 >> log2_ts))
        fn = L.kernel(_SRC, f"dequant_rows<{dto}, {pb}, {'true' if vec else 'false'}>")
        L.run(fn, (grid,), (_THREADS,),
              (pc, sc, mc, out, np.int64(ngroups), np.int64(G), np.int32(log2_ts), meta_half), pc.device)
    else:
        ty = max(1, min(_MAXTY, -(-G // _R)))
        nblk = outer * (n // G) * -(-inner // 32)
        fn = L.kernel(_SRC, f"dequant_cols<{dto}, {pb}>")
        L.run(fn, (L.grid_1d(nblk, 1),), (32, ty),
              (pc, sc, mc, out, np.int64(outer), np.int64(n), np.int64(inner), np.int64(G), meta_half),
              pc.device)
    return out


def quantize(x, bits: int, group_size, axis: int = -1, meta_dtype=np.float16, *, symmetric: bool = False):
    """Mirrors `kvq.reference.quant.quantize`: ``(codes, scale, mn)`` for groups along ``axis``.

    Same arithmetic, bit for bit: codes uint8 shaped like ``x``; scale and mn (torch.float16 or
    torch.float32) shaped like ``x`` with ``shape[axis]`` replaced by ``shape[axis] // group_size``.
    Differences: torch CUDA tensors (float16 / bfloat16 / float32; bfloat16 is native here, not
    carried in float32); NaN / inf input is detected from the metadata after the kernel (the kernel
    propagates NaN into the group's scale) and raises only while ``kvq.fast.validation`` is on.
    """
    axis, bits, G, mdt = C.quant_args(x, bits, group_size, axis, meta_dtype, allow_cpu=False)
    codes, scale, mn = launch_quantize(x, bits, G, axis, mdt, symmetric, 8)
    C.check_meta(x, scale, mn)
    return codes, scale, mn


def dequantize(codes, scale, mn, group_size, axis: int = -1, out_dtype=np.float16):
    """Mirrors `kvq.reference.quant.dequantize`: ``float32(code) * scale_s + mn_s`` rounded to ``out_dtype``.

    Same arithmetic, bit for bit (multiply, then add, no FMA; float16 output saturates at +-65504,
    ``numerics.to_out``). Differences: torch CUDA tensors; a
    ``"bfloat16"`` / ``torch.bfloat16`` output is a torch.bfloat16 tensor (the reference returns fp32
    values that are exactly bf16); scale and mn of different dtypes are both read as fp32.
    """
    C.check_codes(codes)
    axis = nx.normalize_axis(axis, codes.dim())
    G = check_groups(tuple(codes.shape), axis, group_size, "codes")
    C.check_meta_shapes(tuple(codes.shape), scale, mn, G, axis)
    return launch_dequantize(codes, scale, mn, G, axis, out_dtype_of(out_dtype), 8)


# ----------------------------------------------------------------------------------------------------
# quantiles (OSCAR App. A.5): oscar.cu quantile_rows


def sort_threads(bs: int) -> int:
    """Threads of a block that sorts ``bs`` keys (a power of two): one per key pair, 32 to 256."""
    return max(32, min(256, bs // 2))


def launch_quantile_rows(x: torch.Tensor, n: int, rho, clip: bool):
    """Quantile (of |x| when ``clip``) of each contiguous row of ``n`` elements of contiguous ``x``.

    Returns ``(tau (rows,) fp32, clipped fp32 like x or None)``. Rows longer than :data:`MAX_SORT` are
    sorted by ``torch.sort`` (exact; NaN last as in NumPy) and interpolated by torch's fp32 ops.
    """
    rows = x.numel() // n
    lo, hi, frac = quantile_index(n, rho)
    tau = torch.empty(rows, dtype=torch.float32, device=x.device)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device) if clip else None
    if rows == 0:
        return tau, out
    if n > MAX_SORT:
        xf = x.reshape(rows, n).float()
        v = xf.abs() if clip else xf
        s = torch.sort(v, dim=1).values
        s_lo, s_hi = s[:, lo], s[:, hi]
        f = torch.tensor(frac, dtype=torch.float32, device=x.device)
        tau.copy_(torch.add(s_lo, torch.mul(f, torch.sub(s_hi, s_lo))))
        if clip:
            t = tau[:, None]
            y = torch.where((xf > -t) | torch.isnan(xf), xf, -t)
            out.copy_(torch.where((y < t) | torch.isnan(y), y, t).reshape(x.shape))
        return tau, out
    bs = pow2_ceil(n)
    fn = L.kernel("oscar.cu", f"quantile_rows<{L.DT[x.dtype]}>")
    L.run(fn, (L.grid_1d(rows, 1),), (sort_threads(bs),),
          (x, tau, out if clip else tau, np.int64(rows), np.int32(n), np.int32(bs), np.int32(lo), np.int32(hi),
           np.float32(frac), np.int32(bool(clip)), np.int32(bool(clip))), x.device)
    return tau, out


def quantile(a, rho: float, axis: int = -1):
    """Mirrors `kvq.reference.quant.quantile`: the ``rho``-quantile along ``axis``, linear interpolation.

    The same rule and op order: the values sorted (a bitonic sort of their monotone int32 bit patterns
    in shared memory: exact), ``h = (n - 1) * rho`` in float64 on the host, ``tau = s[lo] + frac *
    (s[hi] - s[lo])`` as three rounded fp32 operations (PTX, no FMA, no ftz); NaN input raises the
    reference's ValueError. Differences: ``a`` is a torch float16 / bfloat16 / float32 CUDA tensor; the
    result is a torch.float32 tensor (0-d for 1-D input); the NaN check costs a read of ``a`` and runs
    only while ``kvq.fast.validation`` is on (with it off NaN sorts last, as in NumPy). One kernel, one
    block per row; rows longer than ``MAX_SORT`` are sorted by ``torch.sort`` and interpolated by torch's
    fp32 elementwise ops.
    """
    return C.quantile_rows(a, rho, axis, _launch_quantile_no_nan, clip=False)


def _launch_quantile_no_nan(x: torch.Tensor, n: int, rho, clip: bool):
    """``launch_quantile_rows`` after the NaN check (run once the arguments have passed theirs)."""
    C.check_no_nan(x, "a")
    return launch_quantile_rows(x, n, rho, clip)


def percentile_clip(x, ratio: float, axis: int = -1):
    """Mirrors `kvq.reference.quant.percentile_clip`: ``tau = quantile_ratio(|x|)`` per row along ``axis``, then clip.

    Returns ``(x_clipped, tau)`` as torch.float32 tensors (x's shape; tau without ``axis``), in ONE
    kernel (sort, interpolate, clip). The clip is ``min(max(x, -tau), tau)`` with NumPy's choice
    between equal arguments (the second), so zero signs agree; comparisons are PTX ``setp`` without
    ftz, so subnormals compare as in NumPy. Differences: torch CUDA tensors (see :func:`quantile`);
    NaN / inf raise ValueError while ``kvq.fast.validation`` is on (a full read of ``x``); with it off
    NaN propagates into the clipped values and tau.
    """
    return C.quantile_rows(x, ratio, axis, launch_quantile_rows, clip=True)


quantile_index = C.quantile_index     # host-side, shared with the other backend (kvq.fast.common)
check_ratio = C.check_ratio
