"""Make the HIGGS grids: Gaussian-MSE-optimal codebooks of n points in d dimensions (Lloyd / k-means).

HIGGS (used as AQUA-KV's backbone, AQUA-KV paper section 4.1) rounds each d-dimensional piece of a
Hadamard-rotated, RMS-normalized vector, whose entries are about N(0, 1), to the nearest of n grid
points chosen to minimize the expected squared error under N(0, I_d). kvq computes these grids itself
with this script and ships the result beside it as ``higgs_grid_d{d}_n{n}.npy`` (float32, (n, d)).

    python -m kvq.reference.data.make_higgs_grids            # rewrites the .npy files in this folder
    grid = make_grid(d=2, n=16)                              # (16, 2) float32, bit-identical to the file

Settings (fixed; a test reruns them and compares the files bit for bit):

* samples: ``N = SAMPLES_PER_POINT * n`` draws of N(0, I_d) from ``np.random.default_rng(SEED + 1000*d + n)``
  (``standard_normal``, float64);
* initialization: k-means++ (the first center is sample 0, then each next center is drawn with
  probability proportional to the squared distance to the nearest chosen center, from the same
  generator);
* ``ITERATIONS`` Lloyd steps: assign every sample to its nearest center (squared distance summed over
  coordinates in order 0..d-1, elementwise float64, no BLAS; ties go to the lowest index), then move
  each center to the mean of its samples (``np.bincount``: a sequential sum); a center with no sample
  stays where it is;
* the result is rounded once to float32 and its points sorted lexicographically (by coordinate 0, then
  1, ...), so index 0 is the point with the smallest first coordinate.

Only elementwise IEEE operations and sequential sums are used, so the output does not depend on the
BLAS library or the thread count. The whole run takes about 10-15 s on one CPU core; ``MSE`` in the
printout is the mean squared error per coordinate on a fresh held-out sample (for comparison: the
scalar Lloyd-Max quantizer of N(0, 1) has MSE 0.1175 at 2 bits, 0.03454 at 3 bits, 0.009497 at 4 bits).
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

#: the (d, n) configurations of the AQUA-KV paper: d = 2 with n in {16, 64, 256} (2, 3, 4 bits per
#: value, fast GPU support) and d = 4 with n = 256 (2 bits per value, "slow grid")
CONFIGS = ((2, 16), (2, 64), (2, 256), (4, 256))
SEED = 20250101
SAMPLES_PER_POINT = 256
ITERATIONS = 40
CHUNK = 8192
HERE = pathlib.Path(__file__).resolve().parent


def grid_path(d: int, n: int) -> pathlib.Path:
    """Where the (d, n) grid lives: ``kvq/reference/data/higgs_grid_d{d}_n{n}.npy``."""
    return HERE / f"higgs_grid_d{d}_n{n}.npy"


def _sq_dist(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Squared distances (N, n) between samples x (N, d) and centers c (n, d), coordinates summed in order."""
    dist = np.zeros((x.shape[0], c.shape[0]), np.float64)
    for j in range(x.shape[1]):
        diff = x[:, j, None] - c[None, :, j]                 # (N, n)
        dist += diff * diff
    return dist


def _nearest(x: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index (N,) of the nearest center (lowest index on ties) and the squared distance (N,), in chunks."""
    idx = np.empty(x.shape[0], np.int64)
    best = np.empty(x.shape[0], np.float64)
    for s in range(0, x.shape[0], CHUNK):
        dist = _sq_dist(x[s:s + CHUNK], c)                   # (chunk, n)
        idx[s:s + CHUNK] = np.argmin(dist, axis=1)           # first minimum = lowest index
        best[s:s + CHUNK] = dist[np.arange(dist.shape[0]), idx[s:s + CHUNK]]
    return idx, best


def _kmeans_pp(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding: (n, d) centers drawn from the samples."""
    centers = [x[0]]
    d2 = _sq_dist(x, x[:1])[:, 0]                            # (N,) distance to the nearest center
    for _ in range(1, n):
        cum = np.cumsum(d2)
        i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
        i = min(i, x.shape[0] - 1)
        centers.append(x[i])
        d2 = np.minimum(d2, _sq_dist(x, x[i:i + 1])[:, 0])
    return np.array(centers)


def lloyd(x: np.ndarray, n: int, rng: np.random.Generator, iterations: int = ITERATIONS) -> np.ndarray:
    """Lloyd's algorithm on samples x (N, d): (n, d) float64 centers."""
    c = _kmeans_pp(x, n, rng)
    for _ in range(iterations):
        idx, _ = _nearest(x, c)
        counts = np.bincount(idx, minlength=n)                           # (n,)
        for j in range(x.shape[1]):
            sums = np.bincount(idx, weights=x[:, j], minlength=n)        # (n,) sequential sums
            c[:, j] = np.where(counts > 0, sums / np.maximum(counts, 1), c[:, j])
    return c


def make_grid(d: int, n: int) -> np.ndarray:
    """The (n, d) float32 HIGGS grid for dimension d and n points, computed with the fixed settings above."""
    rng = np.random.default_rng(SEED + 1000 * d + n)
    x = rng.standard_normal((SAMPLES_PER_POINT * n, d))                  # (N, d) float64
    c = lloyd(x, n, rng).astype(np.float32)
    order = np.lexsort(c.T[::-1])                                        # sort by coordinate 0, then 1, ...
    return np.ascontiguousarray(c[order])


def held_out_mse(grid: np.ndarray, samples: int = 200_000, seed: int = 7) -> float:
    """Mean squared error per coordinate of rounding fresh N(0, I_d) samples to the grid."""
    x = np.random.default_rng(seed).standard_normal((samples, grid.shape[1]))
    _, best = _nearest(x, grid.astype(np.float64))
    return float(best.mean() / grid.shape[1])


def main(argv=None) -> int:
    for d, n in CONFIGS:
        grid = make_grid(d, n)
        np.save(grid_path(d, n), grid)
        print(f"d={d} n={n}: {np.log2(n) / d:g} bits per value, MSE {held_out_mse(grid):.5f} "
              f"-> {grid_path(d, n).name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
