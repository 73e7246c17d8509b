"""kvq.fast.triton.higgs and kvq.fast.triton.hadamard against kvq.reference.higgs / .hadamard, bit for bit.

The fused HIGGS quantizer (pad, halving-tree sum of squares, RMS scale, FWHT, nearest grid point) and
the decoder repeat the reference's fp32 operations in its order without FMA, so indices, scales and
dequantized values are bit-identical: over the shipped grids, group sizes, odd feature counts
(padding), zero groups, huge / tiny values, constructed ties in ``nearest``, index dtypes (a grid of
n = 300 has uint16 indices above 255) and NaN / inf errors. ``fwht`` over every power-of-two length
1 .. 1024 and several axes, and the multi-launch path for long rows.

Targets: Triton through the interpreter (CI, CPU) and on the GPU (``pytest -m gpu``), and the CuPy
kernels (``kvq.fast.cupy.higgs`` / ``.hadamard``) on the GPU; ``_fg`` / ``_fh`` name the target's backend.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import kvq.fast as kvq_fast

from kvq.reference import hadamard as RH
from kvq.reference import higgs as RG

from .cases import assert_bits_equal


_BACKEND = "triton"          # the backend of the running test's target (set by the ``target`` fixture)


@pytest.fixture
def target(fast_target, monkeypatch):
    backend = fast_target[0]
    if kvq_fast.NOT_YET_IMPLEMENTED[backend].get("higgs") or kvq_fast.NOT_YET_IMPLEMENTED[backend].get("hadamard"):
        pytest.skip(f"kvq.fast.{backend}.higgs / hadamard are listed in NOT_YET_IMPLEMENTED[{backend!r}]")
    monkeypatch.setattr(importlib.import_module(__name__), "_BACKEND", backend)
    return fast_target


def _fg():
    return importlib.import_module(f"kvq.fast.{_BACKEND}.higgs")


def _fh():
    return importlib.import_module(f"kvq.fast.{_BACKEND}.hadamard")


def _t(a: np.ndarray, device: str, dtype=None) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return (t if dtype is None else t.to(dtype)).to(device)


def _roundtrip(cfg, x: np.ndarray, device: str, dtype=torch.float32, out_dtype=np.float32):
    """Quantize and dequantize with both tiers; assert every output equal bit for bit."""
    xt = _t(x, device, dtype)
    xr = xt.float().cpu().numpy() if dtype == torch.bfloat16 else xt.cpu().numpy()
    i_ref, s_ref = RG.quantize(cfg, xr)
    i_fast, s_fast = _fg().quantize(cfg, xt)
    assert i_fast.dtype == _fg().index_dtype(cfg.n)
    assert_bits_equal(i_fast, i_ref, "idx")
    assert_bits_equal(s_fast, s_ref, "scale")
    F = x.shape[-1]
    y_ref = RG.dequantize(cfg, i_ref, s_ref, F, out_dtype)
    y_fast = _fg().dequantize(cfg, i_fast, s_fast, F, out_dtype)
    assert_bits_equal(y_fast, y_ref, f"dequantize ({np.dtype(out_dtype).name if out_dtype != 'bfloat16' else 'bf16'})")
    return i_ref, s_ref


# ----------------------------------------------------------------------------------------------------
# fwht


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_fwht_every_length(target, dtype):
    rng = np.random.default_rng(1)
    for k in range(11):                                       # d = 1 .. 1024
        d = 2 ** k
        x = _t((rng.standard_normal((3, d)) * 7).astype(np.float32), target[1], dtype)
        ref = RH.fwht(x.float().cpu().numpy())
        assert_bits_equal(_fh().fwht(x), ref, f"fwht d={d}")


@pytest.mark.parametrize("shape,axis", [((4, 8, 3), 1), ((16, 2, 5), 0), ((2, 3, 64), -1), ((32, 5), -2)])
def test_fwht_axes(target, shape, axis):
    x = (np.random.default_rng(2).standard_normal(shape) * 100).astype(np.float32)
    y = _fh().fwht(_t(x, target[1]), axis)
    assert y.is_contiguous()
    assert_bits_equal(y, RH.fwht(x, axis), f"fwht axis={axis}")


def test_fwht_long_rows_multi_launch(target, monkeypatch):
    """Rows longer than MAX_BLOCK: the late stages run one launch each, the same bits."""
    monkeypatch.setattr(_fh(), "MAX_BLOCK", 16 if target[1] == "cpu" else 1024)
    d = 256 if target[1] == "cpu" else 16384
    x = (np.random.default_rng(3).standard_normal((3, d)) * 3).astype(np.float32)
    assert_bits_equal(_fh().fwht(_t(x, target[1])), RH.fwht(x), "fwht long rows")


def test_fwht_bad_length_and_thin_mirrors(target):
    with pytest.raises(ValueError, match="power of two"):
        _fh().fwht(torch.zeros(2, 6, device=target[1]))
    for d in (1, 2, 64, 1024):
        assert _fh().is_power_of_two(d) == RH.is_power_of_two(d)
        assert _fh().fwht_scale(d) == RH.fwht_scale(d) and type(_fh().fwht_scale(d)) is np.float32
        assert_bits_equal(_fh().hadamard_matrix(d), RH.hadamard_matrix(d), f"hadamard_matrix({d})")
    assert not _fh().is_power_of_two(12) and not _fh().is_power_of_two(True)


# ----------------------------------------------------------------------------------------------------
# quantize / dequantize


@pytest.mark.parametrize("d,n", RG.SHIPPED_GRIDS, ids=lambda v: str(v))
@pytest.mark.parametrize("g", [32, 256])
def test_shipped_grids(target, d, n, g):
    cfg = RG.HiggsConfig(d=d, n=n, group_size=g)
    F = 2 * g + 7                                             # odd: the last group is zero-padded
    x = (np.random.default_rng(10 * d + n + g).standard_normal((3, F)) * 2).astype(np.float32)
    _roundtrip(cfg, x, target[1])


def test_paper_group_1024_and_meta_dtypes(target):
    x = np.random.default_rng(5).standard_normal((2, 2, 1500)).astype(np.float32)
    _roundtrip(RG.HiggsConfig(d=2, n=16), x, target[1], torch.float16)
    _roundtrip(RG.HiggsConfig(d=2, n=64, meta_dtype="float32"), x, target[1], torch.bfloat16, "bfloat16")


@pytest.mark.parametrize("g", [1, 2, 4, 8, 64])
def test_small_groups_and_d1(target, g):
    x = (np.random.default_rng(g).standard_normal((5, 37)) * 3).astype(np.float32)
    _roundtrip(RG.HiggsConfig(d=2 if g > 1 else 1, n=4, group_size=g,
                              grid=np.linspace(-1.5, 1.5, 4 * (2 if g > 1 else 1), dtype=np.float32)
                              .reshape(4, -1)), x, target[1])


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16, "bfloat16"], ids=str)
def test_out_dtypes(target, out_dtype):
    x = (np.random.default_rng(6).standard_normal((4, 100)) * 10).astype(np.float32)
    _roundtrip(RG.HiggsConfig(d=2, n=16, group_size=64), x, target[1], out_dtype=out_dtype)


def test_zero_groups_and_scale_underflow(target):
    x = np.random.default_rng(7).standard_normal((4, 128)).astype(np.float32)
    x[0] = 0.0                                                 # all-zero token: scale 0, z = 0
    x[1, :64] = -0.0                                           # a group of -0.0
    x[2, 64:] = 1e-9                                           # fp16 scale rounds to 0: z = 0
    x[3, :64] = 3e-7                                           # fp16 subnormal scale
    _, s = _roundtrip(RG.HiggsConfig(d=2, n=16, group_size=64), x, target[1])
    assert s[0, 0] == 0 and s[2, 1] == 0


@pytest.mark.parametrize("kind", ["huge16", "huge32", "tiny32", "denorm32"])
def test_huge_and_tiny(target, kind):
    rng = np.random.default_rng(8)
    base = rng.standard_normal((3, 96)).astype(np.float32)
    mag, meta = {"huge16": (3e4, "float16"), "huge32": (1e18, "float32"), "tiny32": (1e-30, "float32"),
                 "denorm32": (1e-39, "float32")}[kind]
    x = (base * np.float32(mag)).astype(np.float32)
    _roundtrip(RG.HiggsConfig(d=2, n=64, group_size=32, meta_dtype=meta), x, target[1])


def test_scale_overflow_raises(target):
    x = np.full((1, 64), 7e4, np.float32)                    # rms 7e4 > fp16 max
    with pytest.raises(ValueError, match="overflows float16"):
        RG.quantize(RG.HiggsConfig(d=2, n=16, group_size=64), x)
    with pytest.raises(ValueError, match="overflows float16"):
        _fg().quantize(RG.HiggsConfig(d=2, n=16, group_size=64), _t(x, target[1]))
    x = np.full((1, 64), 1e20, np.float32)                   # x * x overflows fp32: rms inf
    with pytest.raises(ValueError, match="overflows float32"):
        _fg().quantize(RG.HiggsConfig(d=2, n=16, group_size=64, meta_dtype="float32"), _t(x, target[1]))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises(target, bad):
    x = np.random.default_rng(9).standard_normal((2, 70)).astype(np.float32)
    x[1, 65] = bad
    cfg = RG.HiggsConfig(d=2, n=16, group_size=32)
    with pytest.raises(ValueError, match="non-finite"):
        RG.quantize(cfg, x)
    with pytest.raises(ValueError, match="non-finite"):
        _fg().quantize(cfg, _t(x, target[1]))
    from kvq.fast import validation
    with validation(False):                                   # the kernel propagates into the scale
        _, s = _fg().quantize(cfg, _t(x, target[1]))
    assert not bool(torch.isfinite(s[1, 2])) and bool(torch.isfinite(s[0]).all())


def test_n300_uint16_indices(target):
    """A 300-point grid: indices up to 299 in uint16 (the reference's dtype), never wrapped at 256."""
    rng = np.random.default_rng(11)
    grid = np.sort(rng.standard_normal((300, 2)).astype(np.float32) * 1.5, axis=0)
    cfg = RG.HiggsConfig(d=2, n=300, group_size=64, grid=grid)
    x = rng.standard_normal((8, 128)).astype(np.float32)
    i_ref, _ = _roundtrip(cfg, x, target[1])
    assert i_ref.dtype == np.uint16 and int(i_ref.max()) > 255
    assert _fg().index_dtype(300) == torch.uint16 and _fg().index_dtype(256) == torch.uint8
    assert _fg().index_dtype(70000) == torch.uint32


def test_nearest_ties_and_kernels(target):
    """Equidistant grid points: the strict scan keeps the lowest index (fast and reference)."""
    grid = np.array([[1, 0], [-1, 0], [0, 1], [0, -1], [1, 0], [2, 2]], np.float32)
    v = np.array([[0, 0], [1, 1], [-1, -1], [1, 0], [0.5, 0.5], [1.5, 1], [1.5, 1.5], [np.float32(1e-30), 0]],
                 np.float32)
    ref = RG.nearest(v, grid)
    fast = _fg().nearest(_t(v, target[1]), _t(grid, target[1]))
    assert_bits_equal(fast, ref, "nearest ties")
    assert list(ref[:4]) == [0, 0, 1, 0]
    # d = 4 and d = 3 (the generic path), random and with ties
    rng = np.random.default_rng(12)
    for d in (1, 3, 4):
        g = np.round(rng.standard_normal((20, d)) * 2).astype(np.float32)
        g[10] = g[3]                                            # an exact duplicate: index 3 must win
        vv = np.round(rng.standard_normal((7, 9, d)) * 2).astype(np.float32) / 2
        assert_bits_equal(_fg().nearest(_t(vv, target[1]), g), RG.nearest(vv, g), f"nearest d={d}")


def test_ties_inside_quantize(target):
    """A group whose rotated, scaled values sit exactly halfway between grid points."""
    grid = np.array([[-1, -1], [-1, 1], [1, -1], [1, 1]], np.float32)
    cfg = RG.HiggsConfig(d=2, n=4, group_size=4, grid=grid, meta_dtype="float32")
    x = np.array([[2, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [2, 2, 2, 2]], np.float32)
    i_ref, _ = _roundtrip(cfg, x, target[1])
    assert (i_ref[1] == 0).all()                               # z = (0, 0): all four tie, index 0 wins
    assert (i_ref[2, 0] == [2, 2]).all()                       # z = (sqrt 2, 0): (1, -1) and (1, 1) tie


def test_group_sum_of_squares(target):
    rng = np.random.default_rng(13)
    for g in (1, 2, 64, 1024):
        xg = (rng.standard_normal((3, 2, g)) * 5).astype(np.float32)
        assert_bits_equal(_fg().group_sum_of_squares(_t(xg, target[1])), RG.group_sum_of_squares(xg),
                          f"sum of squares g={g}")


def test_thin_mirrors_and_errors(target):
    F = _fg()
    assert F.HiggsConfig is RG.HiggsConfig and F.SHIPPED_GRIDS is RG.SHIPPED_GRIDS
    for d, n in RG.SHIPPED_GRIDS:
        assert_bits_equal(F.load_grid(d, n), RG.load_grid(d, n), f"grid d={d} n={n}")
    with pytest.raises(ValueError, match="no shipped HIGGS grid"):
        F.load_grid(3, 16)
    cfg = RG.HiggsConfig(d=2, n=16)
    assert F.bits_per_value(cfg, 1024) == RG.bits_per_value(cfg, 1024)
    dev = target[1]
    with pytest.raises(ValueError, match="empty"):
        F.quantize(cfg, torch.zeros(3, 0, device=dev))
    with pytest.raises(TypeError, match="dtype"):
        F.quantize(cfg, torch.zeros(3, 8, dtype=torch.float64, device=dev))
    cfg = RG.HiggsConfig(d=2, n=16, group_size=32)
    idx, s = F.quantize(cfg, torch.ones(2, 40, device=dev))
    with pytest.raises(ValueError, match="do not fit"):
        F.dequantize(cfg, idx, s, 70)
    with pytest.raises(TypeError, match="stores indices"):
        F.dequantize(cfg, idx.to(torch.int32), s, 40)
    bad = idx.clone()
    bad[0, 0, 0] = 16
    with pytest.raises(ValueError, match="outside the grid"):
        F.dequantize(cfg, bad, s, 40)
