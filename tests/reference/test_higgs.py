"""kvq.reference.higgs and its grids: reproducible, Gaussian-optimal, the stated arithmetic, the paper's bits."""

from fractions import Fraction

import numpy as np
import pytest

from kvq.reference import higgs
from kvq.reference.hadamard import fwht
from kvq.reference.data import make_higgs_grids as mk

#: MSE per coordinate of the scalar Lloyd-Max quantizer of N(0, 1) at 2, 3, 4 bits (Max, 1960)
LLOYD_MAX = {2: 0.1175, 3: 0.03454, 4: 0.009497}


def test_the_script_reproduces_the_shipped_grids():
    for d, n in mk.CONFIGS:
        shipped = higgs.load_grid(d, n)
        assert shipped.shape == (n, d) and shipped.dtype == np.float32
        assert np.array_equal(mk.make_grid(d, n).view(np.uint32), shipped.view(np.uint32)), (d, n)


@pytest.mark.parametrize("d, n", mk.CONFIGS)
def test_grids_beat_scalar_lloyd_max_on_gaussians(d, n):
    grid = higgs.load_grid(d, n)
    bits = int(np.log2(n)) // d
    mse = mk.held_out_mse(grid, samples=50_000)
    assert mse < LLOYD_MAX[bits], (d, n, mse)
    assert len(np.unique(grid, axis=0)) == n                          # no collapsed points
    # Lloyd's centroid condition on fresh samples: each point is the mean of its Voronoi cell, up to
    # the sampling noise of the fresh cell mean and of the grid's own training sample (256 per point)
    x = np.random.default_rng(11).standard_normal((100_000, d)).astype(np.float32)
    idx = higgs.nearest(x, grid)
    counts = np.bincount(idx, minlength=n)
    assert counts.min() > 0
    means = np.stack([np.bincount(idx, weights=x[:, j], minlength=n) for j in range(d)], 1) / counts[:, None]
    sq = np.stack([np.bincount(idx, weights=x[:, j] ** 2, minlength=n) for j in range(d)], 1) / counts[:, None]
    std = np.sqrt(np.maximum(sq - means ** 2, 0))                     # (n, d) spread of each cell
    tol = 5 * std * np.sqrt(1 / counts[:, None] + 1 / mk.SAMPLES_PER_POINT)
    assert np.all(np.abs(means - grid) <= tol), np.max(np.abs(means - grid) / tol)


def test_bits_per_value_matches_the_paper():
    """HIGGS-2b/3b/4b-gs1024 and the d=4 "slow grid": 2.02 / 3.02 / 4.02 / 2.02 (Tables 1-2): log2(n)/d
    plus one fp16 scale per 1024 values."""
    want = {(2, 16): Fraction(2) + Fraction(16, 1024), (2, 64): Fraction(3) + Fraction(16, 1024),
            (2, 256): Fraction(4) + Fraction(16, 1024), (4, 256): Fraction(2) + Fraction(16, 1024)}
    for (d, n), b in want.items():
        got = higgs.bits_per_value(higgs.HiggsConfig(d, n), 1024)
        assert got == b and round(float(got), 2) == round(float(b), 2) == {2: 2.02, 3: 3.02, 4: 4.02}[int(b)]
    # padding and fp32 scales count too: F = 100 in groups of 64 -> 2 groups of 64 values
    cfg = higgs.HiggsConfig(2, 16, group_size=64, meta_dtype="float32")
    assert higgs.bits_per_value(cfg, 100) == Fraction(2 * 128 + 2 * 32, 100)


def test_round_trip_error_is_the_grid_mse():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((256, 1024)) * rng.uniform(0.1, 10, (256, 1))).astype(np.float32)
    for d, n in mk.CONFIGS:
        cfg = higgs.HiggsConfig(d, n)
        idx, scale = higgs.quantize(cfg, x)
        assert idx.dtype == np.uint8 and idx.shape == (256, 1, 1024 // d) and scale.dtype == np.float16
        x_hat = higgs.dequantize(cfg, idx, scale, 1024)
        rel = ((x_hat - x) ** 2).sum(1) / (x ** 2).sum(1)            # per token, scale-free
        assert abs(rel.mean() / mk.held_out_mse(cfg.codebook(), 50_000) - 1) < 0.1, (d, n)


def test_padding_shapes_and_zero_groups():
    cfg = higgs.HiggsConfig(2, 64, group_size=64)
    x = np.random.default_rng(1).standard_normal((3, 4, 100)).astype(np.float16)
    x[0, 0] = 0
    idx, scale = higgs.quantize(cfg, x)
    assert idx.shape == (3, 4, 2, 32) and scale.shape == (3, 4, 2)
    x_hat = higgs.dequantize(cfg, idx, scale, 100, out_dtype=np.float16)
    assert x_hat.shape == x.shape and x_hat.dtype == np.float16
    assert scale[0, 0, 0] == 0 and np.all(x_hat[0, 0] == 0)
    assert np.mean((x_hat.astype(np.float32) - x) ** 2) < 0.05


def test_scale_is_the_rms_and_the_tree_sum():
    x = np.random.default_rng(2).standard_normal((8, 1024)).astype(np.float32) * 3
    ss = higgs.group_sum_of_squares(x)
    np.testing.assert_allclose(ss, (x.astype(np.float64) ** 2).sum(1), rtol=1e-6)
    _, scale = higgs.quantize(higgs.HiggsConfig(meta_dtype="float32"), x)
    np.testing.assert_allclose(scale[:, 0], np.sqrt((x.astype(np.float64) ** 2).mean(1)), rtol=1e-6)


def test_power_of_two_scaling_gives_the_same_indices():
    cfg = higgs.HiggsConfig(2, 16, group_size=256)
    x = np.random.default_rng(3).standard_normal((16, 256)).astype(np.float32)
    i1, s1 = higgs.quantize(cfg, x)
    i2, s2 = higgs.quantize(cfg, x * np.float32(8))
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(s2, s1 * np.float16(8))


def test_nearest_matches_brute_force_and_breaks_ties_low():
    grid = higgs.load_grid(2, 64)
    v = np.random.default_rng(4).standard_normal((5000, 2)).astype(np.float32) * 1.5
    d2 = ((v[:, None, :].astype(np.float64) - grid[None].astype(np.float64)) ** 2).sum(-1)
    idx = higgs.nearest(v, grid)
    near_tie = np.sort(d2, 1)[:, 1] - np.sort(d2, 1)[:, 0] < 1e-5
    np.testing.assert_array_equal(idx[~near_tie], d2.argmin(1)[~near_tie])
    tie_grid = np.array([[1, 0], [-1, 0], [0, 1], [0, -1]], np.float32)
    assert higgs.nearest(np.zeros((1, 2), np.float32), tie_grid)[0] == 0
    assert higgs.nearest(np.array([[0, 0.5]], np.float32), tie_grid[::-1].copy())[0] == 1


def test_index_dtype_never_wraps():
    assert higgs.index_dtype(256) == np.uint8
    assert higgs.index_dtype(257) == np.uint16
    assert higgs.index_dtype(65537) == np.uint32
    grid = np.random.default_rng(5).standard_normal((300, 2)).astype(np.float32)
    cfg = higgs.HiggsConfig(2, 300, group_size=64, grid=grid)
    x = np.random.default_rng(6).standard_normal((50, 64)).astype(np.float32)
    idx, scale = higgs.quantize(cfg, x)
    assert idx.dtype == np.uint16 and idx.max() > 255
    z = fwht(x) / scale.astype(np.float32)
    np.testing.assert_array_equal(cfg.codebook()[idx.astype(np.int64)].reshape(50, 64)[:, :8].shape, (50, 8))
    np.testing.assert_array_equal(idx[:, 0], higgs.nearest(z.reshape(50, 32, 2), grid))


def test_bad_input():
    cfg = higgs.HiggsConfig()
    with pytest.raises(ValueError, match="non-finite"):
        higgs.quantize(cfg, np.full((1, 8), np.nan, np.float32))
    with pytest.raises(TypeError, match="float64"):
        higgs.quantize(cfg, np.zeros((1, 8)))
    with pytest.raises(ValueError, match="no shipped"):
        higgs.HiggsConfig(2, 32)
    with pytest.raises(ValueError, match="power of two"):
        higgs.HiggsConfig(group_size=1000)
    with pytest.raises(ValueError, match="overflows"):
        higgs.quantize(cfg, np.full((1, 8), 60000, np.float32) * np.float32(20))
    idx, scale = higgs.quantize(cfg, np.ones((1, 8), np.float32))
    with pytest.raises(TypeError, match="uint8"):
        higgs.dequantize(cfg, idx.astype(np.uint16), scale, 8)
    with pytest.raises(ValueError, match="do not fit"):
        higgs.dequantize(cfg, idx, scale, 2000)


def test_group_sum_of_squares_refuses_non_power_of_two():
    """Issue 36: three ones gave 4 ([1] + [1, 1] broadcast to [2, 2], then 2 + 2). The halving tree is
    defined for power-of-two groups (quantize zero-pads to one): any other length raises."""
    for g in (3, 5, 6, 7, 12, 1000):
        with pytest.raises(ValueError, match="power-of-two last axis"):
            higgs.group_sum_of_squares(np.ones((2, g), np.float32))
    with pytest.raises(ValueError, match="power-of-two"):
        higgs.group_sum_of_squares(np.float32(1.0))
    # zero-padded to 4, three ones sum to 3; powers of two are unchanged; fp16 is widened exactly
    assert higgs.group_sum_of_squares(np.array([1, 1, 1, 0], np.float32)) == np.float32(3)
    assert higgs.group_sum_of_squares(np.ones(1, np.float32)) == np.float32(1)
    x16 = np.array([[0.5, 1.5, -2.0, 3.0]], np.float16)
    assert higgs.group_sum_of_squares(x16).tolist() == [0.25 + 2.25 + 4.0 + 9.0]
    with pytest.raises(TypeError, match="float64"):
        higgs.group_sum_of_squares(np.ones(4))


def test_nearest_validates_with_clear_errors():
    grid = higgs.load_grid(2, 16)
    with pytest.raises(TypeError, match="float32; got float64 and float32"):
        higgs.nearest(np.zeros((3, 2)), grid)
    with pytest.raises(TypeError, match="float32"):
        higgs.nearest(np.zeros((3, 2), np.float32), grid.astype(np.float64))
    with pytest.raises(ValueError, match=r"v \(3, 3\) and grid \(16, 2\)"):
        higgs.nearest(np.zeros((3, 3), np.float32), grid)
    with pytest.raises(ValueError, match="grid"):
        higgs.nearest(np.zeros((3, 2), np.float32), grid[0])                   # a 1-D grid
    with pytest.raises(ValueError, match="n >= 1"):
        higgs.nearest(np.zeros((3, 2), np.float32), np.zeros((0, 2), np.float32))
    with pytest.raises(ValueError, match=r"v \(\)"):
        higgs.nearest(np.float32(1.0), grid)


def test_bad_arguments_name_the_argument():
    """Issue 36: a config of another class, a bool or float size, NaN in nearest's vectors: clear errors."""
    from kvq.reference import kivi

    cfg = higgs.HiggsConfig(d=2, n=16, group_size=64)
    x = np.ones((2, 64), np.float32)
    for bad in (kivi.KIVIConfig(), "cfg", None):
        with pytest.raises(TypeError, match="cfg must be a HiggsConfig"):
            higgs.quantize(bad, x)
        with pytest.raises(TypeError, match="cfg must be a HiggsConfig"):
            higgs.bits_per_value(bad, 64)
    idx, scale = higgs.quantize(cfg, x)
    with pytest.raises(TypeError, match="cfg must be a HiggsConfig"):
        higgs.dequantize(kivi.KIVIConfig(), idx, scale, 64)
    for F, err in ((True, TypeError), (64.0, TypeError), ("64", TypeError), (None, TypeError), (0, ValueError)):
        with pytest.raises(err, match="F must be"):
            higgs.dequantize(cfg, idx, scale, F)
    for n, err in ((True, TypeError), (16.0, TypeError), (0, ValueError), (-1, ValueError), (None, TypeError)):
        with pytest.raises(err, match="n must be"):
            higgs.index_dtype(n)
    with pytest.raises(TypeError, match="d must be"):
        higgs.load_grid(2.0, 16)
    grid = higgs.load_grid(2, 16)
    v = np.zeros((3, 2), np.float32)
    v[1, 0] = np.nan                                   # a NaN distance is never "better": it would read index 0
    with pytest.raises(ValueError, match="v contains non-finite"):
        higgs.nearest(v, grid)
