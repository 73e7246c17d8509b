"""Triton HIGGS (AQUA-KV §4.1): pad, RMS scale, FWHT, nearest grid point, in ONE kernel per token group.

Mirrors ``kvq.reference.higgs`` bit for bit under the numerics contract (DESIGN.md section 2): every
step is the reference's fp32 operation in the reference's order, launched with
``enable_fp_fusion=False`` (no FMA), divisions by ``tl.div_rn``, the square root by ``tl.sqrt_rn``:

1. ``ss``: ``x*x``, then the halving tree ``a[:h] + a[h:]`` for h = g/2, ..., 1 (``_halving_sum``);
2. ``rms = sqrt_rn(div_rn(ss, g))``, rounded to the metadata dtype;
3. ``z = div_rn(fwht(x), scale)`` with the butterflies of ``hadamard.butterfly_stages`` and one multiply
   by ``fwht_scale(g)``; ``z = 0`` where the stored scale is 0;
4. ``nearest``: for j = 0 .. n-1, ``dist = sum_k (v_k - c_jk)**2`` accumulated over k in order, kept on
   a strict ``<`` (ties to the lowest index); indices stored in ``index_dtype(n)`` (never wrapped).

Decode: ``grid[idx] * scale`` (one rounded multiply), the same butterflies and multiply, rounded into
the output dtype.

    from kvq.fast.triton import higgs
    cfg = higgs.HiggsConfig(d=2, n=16)
    idx, scale = higgs.quantize(cfg, x)                         # x (..., F) torch -> uint8 (..., n_g, g/d)
    x_hat = higgs.dequantize(cfg, idx, scale, F=x.shape[-1])    # (..., F) fp32
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvq.fast import common as C
from kvq.reference import higgs as RG
from kvq.reference import numerics as nx
from kvq.reference.higgs import SHIPPED_GRIDS, HiggsConfig  # noqa: F401  (data: the reference's objects)

from kvq.fast.caches.higgs import (CONTAINER, check_scale, grid_tensor, check_idx_range, dequant_args,  # noqa: F401
                             index_dtype, load_grid)

from kvq.fast.common import cdiv as _cdiv, next_pow2 as _np2  # host grid arithmetic
from .hadamard import butterfly_stages, fwht_scale
from .quant import OUT_KIND_CODE, load_f32, store_out, interpreting

__all__ = ["SHIPPED_GRIDS", "HiggsConfig", "load_grid", "index_dtype", "group_sum_of_squares",
           "nearest", "quantize", "dequantize", "bits_per_value"]




# ----------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _halve(a, R: tl.constexpr, H: tl.constexpr):
    """One level of the halving tree on a (R, 2H): a[:H] + a[H:] -> (R, H)."""
    lo, hi = tl.split(tl.permute(tl.reshape(a, (R, 2, H)), (0, 2, 1)))   # [row, i, half]: a[i], a[H + i]
    return lo + hi


@triton.jit
def _halving_sum(a, R: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """Row sums of a (R, N) by the reference's halving tree: a = a[:h] + a[h:] for h = N/2, ..., 1 -> (R,)."""
    for s in tl.static_range(LOG2N):
        a = _halve(a, R, N >> (s + 1))
    return tl.reshape(a, (R,))


@triton.jit
def _pick(sq, kk, k: tl.constexpr):
    """Column k of sq (M, BLOCK_D): a sum of one value and zeros (exact: sq >= +0 or NaN)."""
    return tl.sum(tl.where(kk == k, sq, 0.0), axis=1)


@triton.jit
def _nearest(v, grid_ptr, N: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Index (int32, (M,)) of the nearest of the N grid points (N, D) to each row of v (M, BLOCK_D).

    dist_j = (v_0 - c_j0)**2, then + (v_k - c_jk)**2 for k = 1 .. D-1 (each op rounded: no FMA);
    a strict ``<`` scan over j = 0 .. N-1 keeps the first minimum (ties to the lowest index).
    """
    best = tl.full((M,), float("inf"), tl.float32)
    idx = tl.zeros((M,), tl.int32)
    if D == 2 and BLOCK_D == 2:
        v0, v1 = tl.split(v)
        for j in range(N):
            c0 = tl.load(grid_ptr + 2 * j)
            c1 = tl.load(grid_ptr + 2 * j + 1)
            t0 = v0 - c0
            dist = t0 * t0
            t1 = v1 - c1
            dist = dist + t1 * t1
            better = dist < best
            best = tl.where(better, dist, best)
            idx = tl.where(better, j, idx)
    elif D == 4 and BLOCK_D == 4:
        ev, od = tl.split(tl.reshape(v, (M, 2, 2)))           # [m, k // 2] for k even / odd
        v0, v2 = tl.split(ev)
        v1, v3 = tl.split(od)
        for j in range(N):
            t = v0 - tl.load(grid_ptr + 4 * j)
            dist = t * t
            t = v1 - tl.load(grid_ptr + 4 * j + 1)
            dist = dist + t * t
            t = v2 - tl.load(grid_ptr + 4 * j + 2)
            dist = dist + t * t
            t = v3 - tl.load(grid_ptr + 4 * j + 3)
            dist = dist + t * t
            better = dist < best
            best = tl.where(better, dist, best)
            idx = tl.where(better, j, idx)
    else:
        kk = tl.arange(0, BLOCK_D)[None, :]
        for j in range(N):
            c = tl.load(grid_ptr + j * D + kk, mask=kk < D, other=0.0)
            t = v - c
            sq = t * t                                         # (M, BLOCK_D)
            dist = _pick(sq, kk, 0)
            for k in tl.static_range(1, D):
                dist = dist + _pick(sq, kk, k)
            better = dist < best
            best = tl.where(better, dist, best)
            idx = tl.where(better, j, idx)
    return idx


# Fused HIGGS quantizer: one program takes BLOCK_R token groups (row, group) of G values.
# Computes: x zero-padded past F; ss = halving_sum(x * x); rms = sqrt_rn(div_rn(ss, G)); scale stored in
#   the metadata dtype (s32 = stored value); z = div_rn(butterflies(x) * FS, s32) (0 where s32 == 0);
#   idx = nearest(z as G/D vectors of D, grid), stored in the index container (IDX_BITS 8 / 16 / 32).
# NaN / inf input propagates into the scale (ss is NaN / inf), which the Python boundary checks.
# Grid: (cdiv(R * NG, BLOCK_R),). Bytes: reads R*F inputs and the grid (N*D fp32, cached); writes
#   R*NG*G/D indices and R*NG scales.
@triton.jit
def _quantize_kernel(x_ptr, grid_ptr, i_ptr, s_ptr, NGR, F, NG, FS, N: tl.constexpr,
                     G: tl.constexpr, LOG2G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     IDX_BITS: tl.constexpr, IN_BF16: tl.constexpr, BLOCK_R: tl.constexpr):
    GD: tl.constexpr = G // D
    gi = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)   # (BLOCK_R,) token-group ids
    gm = gi < NGR
    row = gi // NG
    col = (gi % NG)[:, None] * G + tl.arange(0, G)[None, :]                 # (BLOCK_R, G)
    m = gm[:, None] & (col < F)
    x = load_f32(x_ptr + row[:, None] * F + col, m, IN_BF16)              # zero padding past F
    ss = _halving_sum(x * x, BLOCK_R, G, LOG2G)                            # group_sum_of_squares
    rms = tl.sqrt_rn(tl.div_rn(ss, G * 1.0))
    scale_st = rms.to(s_ptr.dtype.element_ty)                              # numerics.to_meta
    tl.store(s_ptr + gi, scale_st, mask=gm)
    s32 = scale_st.to(tl.float32)[:, None]
    y = butterfly_stages(x, BLOCK_R, G, LOG2G) * FS                            # hadamard.fwht
    z = tl.where(s32 == 0.0, 0.0, tl.div_rn(y, tl.where(s32 == 0.0, 1.0, s32)))
    v = tl.reshape(z, (BLOCK_R * GD, D))                                   # D divides G: a power of two
    idx = tl.reshape(_nearest(v, grid_ptr, N, BLOCK_R * GD, D, BLOCK_D), (BLOCK_R, GD))
    io = gi[:, None] * GD + tl.arange(0, GD)[None, :]
    im = gm[:, None] & (io >= 0)
    if IDX_BITS == 8:
        tl.store(i_ptr + io, idx.to(tl.uint8), mask=im)
    elif IDX_BITS == 16:
        tl.store(i_ptr + io, idx.to(tl.int16), mask=im)
    else:
        tl.store(i_ptr + io, idx, mask=im)


@triton.jit
def decode_groups(i_ptr, s_ptr, grid_ptr, gi, gm, N, FS, G: tl.constexpr, LOG2G: tl.constexpr,
                   D: tl.constexpr, IDX_BITS: tl.constexpr, BLOCK_R: tl.constexpr):
    """fwht(grid[idx] * scale) of the BLOCK_R token groups ``gi`` (masked by ``gm``) -> (BLOCK_R, G) fp32.

    c = grid[idx] (idx clamped into 0 .. N-1: memory safety only), y = c * scale (rounded), the
    butterflies, one rounded multiply by FS. Shared by the HIGGS decoder and the fused AQUA-KV decode.
    """
    GD: tl.constexpr = G // D
    e = tl.arange(0, G)[None, :]
    ii = tl.load(i_ptr + gi[:, None] * GD + e // D, mask=gm[:, None] & (e < G), other=0).to(tl.int32)
    if IDX_BITS == 16:
        ii = ii & 0xFFFF
    ii = tl.minimum(tl.maximum(ii, 0), N - 1)                             # memory safety only
    c = tl.load(grid_ptr + ii * D + e % D)
    s = tl.load(s_ptr + gi, mask=gm, other=0.0).to(tl.float32)
    y = c * s[:, None]
    return butterfly_stages(y, BLOCK_R, G, LOG2G) * FS


# Fused HIGGS decoder: one program takes BLOCK_R token groups of G values.
# Computes: c = grid[idx] (idx clamped into 0 .. N-1), y = c * scale (rounded), butterflies(y) * FS,
#   rounded into the output dtype, the padding past F dropped.
# Grid: (cdiv(R * NG, BLOCK_R),). Bytes: reads R*NG*G/D indices, R*NG scales, the grid; writes R*F values.
@triton.jit
def _dequantize_kernel(i_ptr, s_ptr, grid_ptr, o_ptr, NGR, F, NG, N, FS,
                       G: tl.constexpr, LOG2G: tl.constexpr, D: tl.constexpr, IDX_BITS: tl.constexpr,
                       OUT_KIND: tl.constexpr, BLOCK_R: tl.constexpr):
    gi = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    gm = gi < NGR
    row = gi // NG
    col = (gi % NG)[:, None] * G + tl.arange(0, G)[None, :]
    y = decode_groups(i_ptr, s_ptr, grid_ptr, gi, gm, N, FS, G, LOG2G, D, IDX_BITS, BLOCK_R)
    store_out(o_ptr + row[:, None] * F + col, y, gm[:, None] & (col < F), OUT_KIND)


# ----------------------------------------------------------------------------------------------------
# host side


def row_tile(n_rows: int, G: int) -> int:
    tile = 16384 if interpreting() else 1024
    return max(1, min(_np2(max(n_rows, 1)), tile // G))


def warps(tile: int) -> int:
    return min(8, max(1, tile // 256))


def _p2(n: int) -> int:
    return _np2(max(int(n), 1))


def bits_per_value(cfg: HiggsConfig, F: int):
    """Mirrors `kvq.reference.higgs.bits_per_value`: the same Fraction (host arithmetic; no difference)."""
    return RG.bits_per_value(cfg, F)


def group_sum_of_squares(xg) -> torch.Tensor:
    """Mirrors `kvq.reference.higgs.group_sum_of_squares`: the same halving tree in a kernel, bit-identical.

    ``xg`` (..., g) float32 torch tensor (CUDA, or the CPU under the interpreter) -> (...,) fp32; g must
    be a power of two (ValueError otherwise, as the reference). Differences: torch tensors; bfloat16
    input is also widened exactly (the reference: float16 / float32).
    """
    C.check_float(xg, "xg", allow_cpu=interpreting())
    if xg.dim() == 0 or not RG.is_power_of_two(xg.shape[-1]):
        raise ValueError(f"xg has shape {tuple(xg.shape)}; the halving tree needs a power-of-two last axis "
                         f"(zero-pad each group to the next power of two, as quantize does)")
    g = xg.shape[-1]
    x = xg.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    R = out.numel()
    if R == 0:
        return out
    BR = row_tile(R, g)
    in_bf16 = x.dtype == torch.bfloat16
    _ss_kernel[(_cdiv(R, BR),)](x.view(torch.int16) if in_bf16 else x, out, R, G=g,
                                      LOG2G=g.bit_length() - 1, IN_BF16=in_bf16, BLOCK_R=BR,
                                      num_warps=warps(BR * g), enable_fp_fusion=False)
    return out


# Sum of squares by the halving tree: one program takes BLOCK_R rows of G values. Grid: (cdiv(R, BLOCK_R),).
@triton.jit
def _ss_kernel(x_ptr, o_ptr, R, G: tl.constexpr, LOG2G: tl.constexpr, IN_BF16: tl.constexpr,
               BLOCK_R: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    e = tl.arange(0, G)[None, :]
    x = load_f32(x_ptr + r[:, None] * G + e, (r < R)[:, None] & (e < G), IN_BF16)
    tl.store(o_ptr + r, _halving_sum(x * x, BLOCK_R, G, LOG2G), mask=r < R)


# Nearest grid point of M vectors of D: one program takes BLOCK_M vectors. Grid: (cdiv(M, BLOCK_M),).
@triton.jit
def _nearest_kernel(v_ptr, grid_ptr, o_ptr, M, N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_D)[None, :]
    v = tl.load(v_ptr + r[:, None] * D + k, mask=(r < M)[:, None] & (k < D), other=0.0)
    idx = _nearest(v, grid_ptr, N, BLOCK_M, D, BLOCK_D)
    tl.store(o_ptr + r, idx.to(tl.int64), mask=r < M)


def nearest(v, grid) -> torch.Tensor:
    """Mirrors `kvq.reference.higgs.nearest`: the same distance order and tie rule, in a kernel.

    ``v`` (..., d) float32 torch tensor; ``grid`` (n, d) float32 (torch tensor or NumPy array, copied to
    v's device) -> (...,) int64 indices, bit-identical; wrong dtypes / shapes raise TypeError /
    ValueError, as the reference. Differences: torch tensors.
    """
    C.check_tensor(v, "v", allow_cpu=interpreting())
    if not isinstance(grid, torch.Tensor):
        ga = np.array(grid)                                      # a copy: grids may be read-only
        if ga.dtype != np.float32:                               # None, strings, objects: no tensor to make
            raise TypeError(f"v and grid must be float32; got {v.dtype} and {ga.dtype}")
        grid = torch.from_numpy(ga)
    g = grid
    if v.dtype != torch.float32 or g.dtype != torch.float32:
        raise TypeError(f"v and grid must be float32; got {v.dtype} and {g.dtype}")
    if v.dim() == 0 or g.dim() != 2 or g.shape[0] == 0 or v.shape[-1] != g.shape[1]:
        raise ValueError(f"v {tuple(v.shape)} and grid {tuple(g.shape)}: need v (..., d) and grid (n, d) "
                         f"with n >= 1")
    C.check_finite(v, "v")                                       # rule 8, as the reference (validation on)
    C.check_finite(g, "grid")
    D = int(g.shape[1])
    g = g.to(v.device).contiguous()
    x = v.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.int64, device=x.device)
    M = out.numel()
    if M == 0:
        return out
    BD = _p2(D)
    BM = row_tile(M, BD)
    _nearest_kernel[(_cdiv(M, BM),)](x, g, out, M, N=int(g.shape[0]), D=D, BLOCK_D=BD, BLOCK_M=BM,
                                           num_warps=warps(BM * BD), enable_fp_fusion=False)
    return out


def quantize(cfg: HiggsConfig, x):
    """Mirrors `kvq.reference.higgs.quantize`: ONE fused kernel per token group, bit-identical.

    ``x`` (..., F) float16 / bfloat16 / float32 torch tensor (CUDA, or the CPU under
    ``TRITON_INTERPRET=1``). Returns ``(idx, scale)``: idx (..., n_groups, g / d) in
    ``index_dtype(n)`` (torch.uint8 up to n = 256, torch.uint16 / torch.uint32 above), scale
    (..., n_groups) in ``cfg.meta_dtype``. Differences: torch tensors; bf16 input accepted (widened
    exactly); NaN / inf and a scale overflow are detected from the stored scales (the kernel propagates
    them into the scale) and raise ValueError while ``kvq.fast.validation`` is on (the overflow message
    omits the reference's largest |scale|); with it off such groups get a NaN / inf scale. The grid is
    copied to x's device (shipped grids once per device, an explicit ``cfg.grid`` on every call).
    """
    RG.check_config(cfg)
    C.check_float(x, "x", allow_cpu=interpreting())
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"x is empty or a scalar (shape {tuple(x.shape)}); HIGGS quantizes (..., F) vectors")
    g, d = cfg.group_size, cfg.d
    F = x.shape[-1]
    n_g = cfg.n_groups(F)
    lead = tuple(x.shape[:-1])
    meta = nx.dtype_name(cfg.meta_dtype)
    itype = index_dtype(cfg.n)
    cont, bits = CONTAINER[itype]
    xc = x.contiguous()
    idx = torch.empty(lead + (n_g, g // d), dtype=cont, device=x.device)
    scale = torch.empty(lead + (n_g,), dtype=C.torch_dtype(meta), device=x.device)
    NGR = scale.numel()
    grid = grid_tensor(cfg, x.device)
    BR = row_tile(NGR, g)
    in_bf16 = xc.dtype == torch.bfloat16
    _quantize_kernel[(_cdiv(NGR, BR),)](
        xc.view(torch.int16) if in_bf16 else xc, grid, idx, scale, NGR, F, n_g, float(fwht_scale(g)), N=cfg.n,
        G=g, LOG2G=g.bit_length() - 1, D=d, BLOCK_D=_p2(d), IDX_BITS=bits, IN_BF16=in_bf16, BLOCK_R=BR,
        num_warps=warps(BR * g), enable_fp_fusion=False)
    check_scale(xc, scale, meta)
    return (idx if cont == itype else idx.view(itype)), scale


def dequantize(cfg: HiggsConfig, idx, scale, F: int, out_dtype=np.float32) -> torch.Tensor:
    """Mirrors `kvq.reference.higgs.dequantize`: ``fwht(grid[idx] * scale)`` per group in one kernel,
    padding dropped -> (..., F), bit-identical.

    ``idx`` in ``index_dtype(n)``, ``scale`` float16 / float32, torch tensors on one device. Differences:
    torch tensors; a bf16 ``out_dtype`` returns a torch.bfloat16 tensor (the reference: float32 values
    that are exactly bf16); the range check of idx (ValueError, as the reference) costs a reduction and
    runs only while ``kvq.fast.validation`` is on; with it off the kernel clamps indices into the grid.
    """
    itype, out = dequant_args(cfg, idx, scale, F, out_dtype, allow_cpu=interpreting())
    check_idx_range(cfg, idx)
    g, d, n_g = cfg.group_size, cfg.d, cfg.n_groups(F)
    lead = tuple(idx.shape[:-2])
    o = torch.empty(lead + (F,), dtype=out, device=idx.device)
    NGR = scale.numel()
    if NGR == 0 or F == 0:
        return o
    cont, bits = CONTAINER[itype]
    ic = idx.contiguous().view(cont)
    sc = scale.contiguous()
    grid = grid_tensor(cfg, idx.device)
    BR = row_tile(NGR, g)
    _dequantize_kernel[(_cdiv(NGR, BR),)](
        ic, sc, grid, o.view(torch.int16) if out == torch.bfloat16 else o, NGR, F, n_g, cfg.n,
        float(fwht_scale(g)), G=g, LOG2G=g.bit_length() - 1, D=d, IDX_BITS=bits, OUT_KIND=OUT_KIND_CODE[out],
        BLOCK_R=BR, num_warps=warps(BR * g), enable_fp_fusion=False)
    return o
