"""Assignment 4: OSCAR's bit-reversal placement and Lemma 1 (see README.md beside this file).

Write every function with NumPy only; do not use the kvq package (the autograder compares your results with
``kvq.reference.rotations`` and with its own independent computations).
"""

import numpy as np


def bit_reversal_permutation(D) -> np.ndarray:
    """The bit-reversal permutation beta of {0, ..., D-1}: ``beta[k]`` = k with its lowest log2(D) bits
    reversed. Returns an int64 array (D,); for D = 8: [0, 4, 2, 6, 1, 5, 3, 7].

    Raises ValueError (message containing "power of two") unless D is a positive integer power of two.
    """
    raise NotImplementedError


def pbr_matrix(D) -> np.ndarray:
    """P_br as a float64 (D, D) matrix with ``P[k, beta(k)] = 1`` (so ``(A @ P)[:, beta(k)] = A[:, k]``)."""
    raise NotImplementedError


def group_of_direction(D, G) -> np.ndarray:
    """int64 (D,): entry k = the quantization group (G consecutive channels; channel c is in group
    c // G) where column k of ``U H`` lands after ``P_br``. G divides D (both powers of two)."""
    raise NotImplementedError


def hadamard(D) -> np.ndarray:
    """Claim 1: the normalized Walsh-Hadamard matrix (D, D) float64 by Sylvester's recursion
    ``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]] / sqrt 2``. Orthogonal, every |entry| = 1/sqrt(D)."""
    raise NotImplementedError


def congruence_diagonal(lam, M) -> np.ndarray:
    """Claim 2: ``sum_j M[j, i]**2 * lam[j]`` for every i, float64 (D,), which equals the diagonal of
    ``M.T @ diag(lam) @ M`` for any square M. Do not form the D x D product."""
    raise NotImplementedError


def lemma1_check(lam) -> tuple[np.ndarray, float]:
    """Claim 3 (Lemma 1): returns ``(diag, target)``: ``diag`` (D,) float64 = diagonal of
    ``H^T diag(lam) H`` (H from :func:`hadamard`), ``target`` = ``sum(lam) / D`` (a float)."""
    raise NotImplementedError


def rotated_importance(C) -> np.ndarray:
    """Claim 4: for symmetric PSD C (D, D), ``R = U H P_br`` with U the eigenvectors of C sorted by
    descending eigenvalue; returns ``diag(R^T C R)`` (D,) float64 (every entry is tr(C) / D)."""
    raise NotImplementedError


def group_ranges(D, G) -> np.ndarray:
    """Claim 5: (D, D // G) float64; entry (r, g) = max - min of row r of ``H @ P_br`` over the G
    channels of group g (channels g*G .. g*G + G - 1)."""
    raise NotImplementedError
