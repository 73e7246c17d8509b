"""HIGGS: Hadamard-rotated, RMS-scaled vector quantization onto a Gaussian-optimal grid (AQUA-KV §4.1).

AQUA-KV's default backbone (Malinovskii et al., 2024b, adapted to KV caches in the AQUA-KV paper,
sections 2 and 4.1, App. H). Each token's vector (its KV heads concatenated, F numbers) is cut into
groups of ``group_size`` (1024 in the paper, zero-padded at the end); each group is scaled by its RMS
(L2 norm / sqrt(group_size)) and Walsh-Hadamard transformed, so that its entries are about N(0, 1);
the result is split into d-dimensional vectors and each one is replaced by the index of its nearest
point in a Gaussian-MSE-optimal grid of n points (``data/make_higgs_grids.py`` computes the grids).

    cfg = HiggsConfig(d=2, n=16)                          # 2 bits per value + 16 bits per group
    idx, scale = quantize(cfg, x)                         # x (..., F) -> idx (..., n_groups, g/d), scale (..., n_groups)
    x_hat = dequantize(cfg, idx, scale, F=x.shape[-1])    # (..., F) fp32

Arithmetic, stated so that a GPU tier can be bit-identical (every step fp32, each operation rounded
once, no FMA):

1. ``ss`` = sum of ``x*x`` over the group by a halving tree: ``a[:h] + a[h:]`` for h = g/2, g/4, ..., 1
   (g a power of two: :func:`group_sum_of_squares` refuses other lengths).
2. ``rms = sqrt(ss / g)`` (IEEE division and correctly rounded sqrt); ``scale_s = to_meta(rms)``.
3. ``z = fwht(group) / scale_s`` (``hadamard.fwht``: fixed butterfly order, then one multiply by
   ``float32(1/sqrt(g))``). A group whose stored scale is 0 gets ``z = 0``.
4. Nearest grid point of each d-vector ``v``: ``dist_j = sum_k (v_k - c_jk)**2`` accumulated over
   k = 0, 1, ..., d-1 (subtract, square, add: each rounded); **ties go to the lowest index j** (a
   strict ``<`` scan over j = 0, 1, ..., n-1).
5. Decode: ``fwht(grid[idx] * scale_s)``, then round into the output dtype.

Indices are stored in the smallest unsigned type that holds ``n - 1`` (uint8 up to n = 256, then
uint16, uint32): never wrapped. The accounting :func:`bits_per_value` counts ``log2(n)/d`` bits per
value (as a bit-packed format would store them) plus the scale's share; the reference keeps one index
per byte-aligned element, which ``index_dtype`` names.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from . import checks
from . import numerics as nx
from .data.make_higgs_grids import CONFIGS as SHIPPED_GRIDS
from .data.make_higgs_grids import grid_path
from .hadamard import fwht, is_power_of_two

F32 = nx.F32

__all__ = ["SHIPPED_GRIDS", "HiggsConfig", "load_grid", "index_dtype", "group_sum_of_squares",
           "nearest", "quantize", "dequantize", "bits_per_value"]


@functools.lru_cache(maxsize=None)
def _load(d: int, n: int) -> np.ndarray:
    g = np.load(grid_path(d, n))
    g.setflags(write=False)
    return g


def load_grid(d: int, n: int) -> np.ndarray:
    """The shipped (n, d) float32 grid (read-only), one of ``SHIPPED_GRIDS``."""
    d = checks.int_arg(d, "d", lo=1)
    n = checks.int_arg(n, "n", lo=1)
    if (d, n) not in SHIPPED_GRIDS:
        raise ValueError(f"no shipped HIGGS grid for d={d}, n={n}; shipped: {SHIPPED_GRIDS} "
                         f"(make others with kvq/reference/data/make_higgs_grids.py and pass grid=)")
    g = _load(int(d), int(n))
    assert g.shape == (n, d) and g.dtype == F32, (g.shape, g.dtype)
    return g


def index_dtype(n: int) -> np.dtype:
    """The smallest unsigned dtype that holds the indices 0 .. n-1 (uint8 for n <= 256)."""
    n = checks.int_arg(n, "n", lo=1)
    for dt in (np.uint8, np.uint16, np.uint32):
        if n - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"n={n} grid points need more than 32-bit indices")


@dataclass(frozen=True)
class HiggsConfig:
    """A HIGGS quantizer.

    Attributes:
        d: dimension of the grid's vectors (2 or 4 in the paper).
        n: number of grid points; ``log2(n) / d`` bits per value.
        group_size: g, values per Hadamard group (a power of two, a multiple of d; 1024 in the paper).
        meta_dtype: dtype of the per-group scale, "float16" (default; the paper's 2.02 bits = 2 + 16/1024)
            or "float32".
        grid: an explicit (n, d) float32 grid, or None for the shipped one.
    """

    d: int = 2
    n: int = 16
    group_size: int = 1024
    meta_dtype: str = "float16"
    grid: np.ndarray | None = None

    def __post_init__(self):
        for name in ("d", "n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not is_power_of_two(self.group_size) or self.group_size % self.d:
            raise ValueError(f"group_size={self.group_size!r} must be a power of two and a multiple of d={self.d}")
        if nx.dtype_name(self.meta_dtype) not in nx.META_DTYPES:
            raise ValueError(f"meta_dtype={self.meta_dtype!r} is not supported; choose one of {nx.META_DTYPES}")
        if self.grid is None:
            load_grid(self.d, self.n)                   # raises for an unshipped (d, n)
        else:
            g = np.asarray(self.grid)
            if g.shape != (self.n, self.d) or g.dtype != F32 or not np.all(np.isfinite(g)):
                raise ValueError(f"grid must be a finite float32 array of shape (n, d) = {(self.n, self.d)}; "
                                 f"got {g.dtype} {g.shape}")

    def codebook(self) -> np.ndarray:
        """(n, d) float32 grid points."""
        return load_grid(self.d, self.n) if self.grid is None else np.asarray(self.grid)

    def n_groups(self, F: int) -> int:
        """Groups per token vector of F values (the last one zero-padded)."""
        return -(-F // self.group_size)

    @property
    def label(self) -> str:
        return f"HIGGS d={self.d} n={self.n} g={self.group_size}"


def check_config(cfg, name: str = "cfg") -> HiggsConfig:
    """``cfg`` must be a :class:`HiggsConfig` (TypeError naming it otherwise); shared with the fast tiers."""
    if not isinstance(cfg, HiggsConfig):
        raise TypeError(f"{name} must be a HiggsConfig, got {type(cfg).__name__}")
    return cfg


def group_sum_of_squares(xg: np.ndarray) -> np.ndarray:
    """Sum of squares over the last axis by the halving tree of step 1: (..., g) -> (...,) fp32.

    The tree ``a[:h] + a[h:]`` is defined for g a power of two only (the group size of a
    :class:`HiggsConfig`, whose last group :func:`quantize` zero-pads to g). Another length raises
    ValueError: halving it would pair the wrong elements (for three ones, ``[1] + [1, 1]`` broadcasts
    to ``[2, 2]``, summed to 4); zero-pad the group to the next power of two first, as quantize does.
    float16 input is widened exactly (rule 1); other dtypes raise TypeError.
    """
    xg = nx.as_f32(xg, "xg")
    if xg.ndim == 0 or not is_power_of_two(xg.shape[-1]):
        raise ValueError(f"xg has shape {xg.shape}; the halving tree needs a power-of-two last axis "
                         f"(zero-pad each group to the next power of two, as quantize does)")
    a = nx.mul(xg, xg)
    while a.shape[-1] > 1:
        h = a.shape[-1] // 2
        a = nx.add(a[..., :h], a[..., h:])
    return a[..., 0]


def nearest(v, grid) -> np.ndarray:
    """Index of the nearest grid point of each d-vector: v (..., d) fp32, grid (n, d) fp32 -> (...,) int64.

    Squared distances accumulate over coordinates 0..d-1 in fp32 (each subtraction, square and addition
    rounded once); the scan over j = 0..n-1 keeps the first minimum, so ties go to the lowest index.
    Raises TypeError unless both are float32, ValueError unless v is (..., d) and grid (n, d), n >= 1.
    """
    v = np.asarray(v)
    grid = np.asarray(grid)
    if v.dtype != F32 or grid.dtype != F32:
        raise TypeError(f"v and grid must be float32; got {v.dtype} and {grid.dtype}")
    if v.ndim == 0 or grid.ndim != 2 or grid.shape[0] == 0 or v.shape[-1] != grid.shape[1]:
        raise ValueError(f"v {v.shape} and grid {grid.shape}: need v (..., d) and grid (n, d) with n >= 1")
    nx.check_finite(v, "v")                              # rule 8: a NaN distance is never "better" (index 0)
    nx.check_finite(grid, "grid")
    best = np.full(v.shape[:-1], np.inf, F32)
    idx = np.zeros(v.shape[:-1], np.int64)
    for j in range(grid.shape[0]):
        diff = nx.sub(v[..., 0], grid[j, 0])
        dist = nx.mul(diff, diff)
        for k in range(1, grid.shape[1]):
            diff = nx.sub(v[..., k], grid[j, k])
            dist = nx.add(dist, nx.mul(diff, diff))
        better = dist < best                             # strict: an equal distance keeps the lower index
        best = np.where(better, dist, best)
        idx = np.where(better, j, idx)
    return idx


def _padded_groups(cfg: HiggsConfig, x: np.ndarray) -> np.ndarray:
    """(..., F) -> (..., n_groups, g), zero-padded."""
    F, g = x.shape[-1], cfg.group_size
    n_g = cfg.n_groups(F)
    pad = np.zeros(x.shape[:-1] + (n_g * g - F,), F32)
    return np.concatenate([x, pad], axis=-1).reshape(x.shape[:-1] + (n_g, g))


def quantize(cfg: HiggsConfig, x):
    """HIGGS-quantize every token vector: x (..., F) float16 / float32 -> ``(idx, scale)``.

    Returns:
        idx: (..., n_groups, g / d) in ``index_dtype(n)``; scale: (..., n_groups) in ``cfg.meta_dtype``.
    Raises:
        TypeError on a non-float dtype; ValueError on an empty array, NaN / inf, or a scale that
        overflows the metadata dtype.
    """
    check_config(cfg)
    xf = nx.as_f32(x)
    if xf.ndim == 0 or xf.size == 0:
        raise ValueError(f"x is empty or a scalar (shape {xf.shape}); HIGGS quantizes (..., F) vectors")
    nx.check_finite(xf)
    g = cfg.group_size
    xg = _padded_groups(cfg, xf)                                           # (..., n_g, g)
    rms = np.sqrt(nx.div(group_sum_of_squares(xg), F32(g)))                # (..., n_g)
    scale_s = nx.to_meta(rms, cfg.meta_dtype, "scale")                     # (..., n_g) meta dtype
    s32 = scale_s.astype(F32)[..., None]                                   # (..., n_g, 1)
    z = nx.div(fwht(xg), s32)                                              # (..., n_g, g), about N(0, 1)
    z = np.where(s32 == 0, F32(0), z)
    v = z.reshape(z.shape[:-1] + (g // cfg.d, cfg.d))                      # (..., n_g, g/d, d)
    idx = nearest(v, cfg.codebook()).astype(index_dtype(cfg.n))
    return idx, scale_s


def dequantize(cfg: HiggsConfig, idx, scale, F: int, out_dtype=np.float32) -> np.ndarray:
    """Inverse of :func:`quantize`: ``fwht(grid[idx] * scale)`` per group, padding dropped -> (..., F).

    F is the token vector's length (an int >= 1); TypeError / ValueError name a bad argument.
    """
    check_config(cfg)
    F = checks.int_arg(F, "F", lo=1)
    idx, scale = np.asarray(idx), np.asarray(scale)
    g, d = cfg.group_size, cfg.d
    n_g = cfg.n_groups(F)
    if idx.shape[-2:] != (n_g, g // d) or scale.shape != idx.shape[:-1]:
        raise ValueError(f"idx {idx.shape} / scale {scale.shape} do not fit F={F} with {cfg.label}: "
                         f"expected (..., {n_g}, {g // d}) and (..., {n_g})")
    if idx.dtype != index_dtype(cfg.n):
        raise TypeError(f"idx has dtype {idx.dtype}; {cfg.label} stores indices as {index_dtype(cfg.n)}")
    if idx.size and int(idx.max()) >= cfg.n:
        raise ValueError(f"idx holds {int(idx.max())}, outside the grid's 0..{cfg.n - 1}")
    c = cfg.codebook()[idx.astype(np.int64)]                               # (..., n_g, g/d, d)
    y = nx.mul(c.reshape(idx.shape[:-1] + (g,)), scale.astype(F32)[..., None])   # (..., n_g, g)
    x = fwht(y).reshape(idx.shape[:-2] + (n_g * g,))[..., :F]
    return nx.to_out(x, out_dtype)


def bits_per_value(cfg: HiggsConfig, F: int) -> Fraction:
    """Bits per stored value of a token vector of F values: ``log2(n)/d`` per (padded) value plus one
    scale per group, divided by F. F = 1024 (Llama 3.2 3B: 8 KV heads x 128) with d = 2, n = 16:
    2 + 16/1024 = 2.0156 (the paper's "2.02")."""
    check_config(cfg)
    if isinstance(F, bool) or not isinstance(F, (int, np.integer)) or F < 1:
        raise ValueError(f"F must be a positive int, got {F!r}")
    meta_bits = 8 * np.dtype(nx.dtype_name(cfg.meta_dtype)).itemsize
    log2n = math.log2(cfg.n)
    per_value = Fraction(int(log2n), cfg.d) if log2n.is_integer() else Fraction(log2n) / cfg.d
    n_g = cfg.n_groups(F)
    return (per_value * n_g * cfg.group_size + n_g * meta_bits) / F
