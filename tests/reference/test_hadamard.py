"""kvq.reference.hadamard: Sylvester's matrix, and the fast transform in its stated butterfly order."""

import numpy as np
import pytest

from kvq.reference.hadamard import fwht, fwht_scale, hadamard_matrix, is_power_of_two

DIMS = [1, 2, 4, 8, 16, 64, 1024]


@pytest.mark.parametrize("d", DIMS)
def test_matrix_is_sylvester_normalized_symmetric_orthogonal(d):
    H = hadamard_matrix(d)
    assert H.dtype == np.float32 and H.shape == (d, d)
    i, j = np.meshgrid(np.arange(d), np.arange(d), indexing="ij")
    popcount = np.vectorize(lambda n: bin(int(n)).count("1"))(i & j)
    np.testing.assert_array_equal(H, np.where(popcount % 2, -fwht_scale(d), fwht_scale(d)))
    np.testing.assert_array_equal(H, H.T)
    H64 = H.astype(np.float64)
    np.testing.assert_allclose(H64 @ H64, np.eye(d), atol=4e-7 * np.sqrt(d))


def test_matrix_recursion():
    h4, h8 = hadamard_matrix(4), hadamard_matrix(8)
    top = np.block([[h4, h4], [h4, -h4]]) / np.sqrt(2)
    np.testing.assert_allclose(h8, top, rtol=1e-6)


@pytest.mark.parametrize("bad", [0, 3, 6, 12, -4, 2.0, True, "8"])
def test_non_power_of_two_is_refused(bad):
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(bad)
    assert not is_power_of_two(bad)


def test_fwht_refuses_bad_length_and_float64():
    with pytest.raises(ValueError, match="power of two"):
        fwht(np.zeros((2, 6), np.float32))
    with pytest.raises(TypeError, match="float64"):
        fwht(np.zeros(8))


@pytest.mark.parametrize("d", DIMS)
def test_fwht_equals_matrix_product(d):
    x = np.random.default_rng(d).standard_normal((5, d)).astype(np.float32)
    y = fwht(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    truth = x.astype(np.float64) @ hadamard_matrix(d).astype(np.float64)
    np.testing.assert_allclose(y, truth, atol=1e-6 * np.sqrt(np.log2(d) + 1) * np.abs(x).max() * 4)
    np.testing.assert_allclose(fwht(y), x, atol=2e-6 * np.abs(x).max() * (np.log2(d) + 1))


def test_fwht_axis_and_input_untouched():
    x = np.random.default_rng(0).standard_normal((3, 16, 5)).astype(np.float16)
    x0 = x.copy()
    y = fwht(x, axis=1)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(y, np.moveaxis(fwht(np.moveaxis(x, 1, -1)), -1, 1))


def _butterfly_by_hand(x):
    """The module docstring's order, one scalar fp32 operation at a time."""
    a = [np.float32(v) for v in x]
    d = len(a)
    h = 1
    while h < d:
        for j in range(0, d, 2 * h):
            for i in range(j, j + h):
                u, w = a[i], a[i + h]
                a[i], a[i + h] = np.float32(u + w), np.float32(u - w)
        h *= 2
    s = fwht_scale(d)
    return np.array([np.float32(v * s) for v in a], np.float32)


@pytest.mark.parametrize("d", [2, 8, 32, 128])
def test_fwht_is_bit_exact_to_the_stated_order(d):
    x = (np.random.default_rng(d).standard_normal((4, d)) * 3).astype(np.float32)
    y = fwht(x)
    for r in range(4):
        assert np.array_equal(y[r].view(np.uint32), _butterfly_by_hand(x[r]).view(np.uint32))


def test_scale_is_exact_power_of_two_for_even_log2():
    for d in (1, 4, 16, 64, 256, 1024):
        assert float(fwht_scale(d)) == 2.0 ** (-np.log2(d) / 2)
    e = np.zeros(16, np.float32)
    e[0] = 1
    np.testing.assert_array_equal(fwht(e), np.full(16, 0.25, np.float32))
