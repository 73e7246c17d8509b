"""Reference solution of assignment 4 (OSCAR's bit-reversal placement and Lemma 1).

Written from the definitions, independently of ``kvq.reference.rotations`` (which the autograder uses
to check it): the permutation by index arithmetic on the bits, the Hadamard matrix by the Kronecker
form of Sylvester's recursion.
"""

import numbers

import numpy as np


def _pow2(D):
    if isinstance(D, bool) or not isinstance(D, numbers.Integral) or D < 1 or (int(D) & (int(D) - 1)):
        raise ValueError(f"D={D!r} is not a power of two (1, 2, 4, 8, ...): the bit reversal and the "
                         f"Walsh-Hadamard matrix need one")
    return int(D)


def bit_reversal_permutation(D):
    """beta[k] = k with its lowest log2(D) bits reversed, int64 (D,)."""
    D = _pow2(D)
    n = D.bit_length() - 1
    k = np.arange(D, dtype=np.int64)
    beta = np.zeros(D, dtype=np.int64)
    for b in range(n):                                  # bit b of k goes to bit n-1-b
        beta |= ((k >> b) & 1) << (n - 1 - b)
    return beta


def pbr_matrix(D):
    """P[k, beta(k)] = 1, float64 (D, D)."""
    beta = bit_reversal_permutation(D)
    P = np.zeros((len(beta), len(beta)))
    P[np.arange(len(beta)), beta] = 1.0
    return P


def group_of_direction(D, G):
    """Column k of U H lands at channel beta(k), i.e. in group beta(k) // G."""
    D, G = _pow2(D), _pow2(G)
    if D % G:
        raise ValueError(f"G={G} does not divide D={D}")
    return bit_reversal_permutation(D) // G


def hadamard(D):
    """Sylvester: H_2m = [[H_m, H_m], [H_m, -H_m]] / sqrt 2 = kron([[1, 1], [1, -1]] / sqrt 2, H_m)."""
    D = _pow2(D)
    S = np.ones((1, 1), dtype=np.int64)
    while S.shape[0] < D:
        S = np.kron(np.array([[1, 1], [1, -1]], dtype=np.int64), S)
    return S.astype(np.float64) / np.sqrt(np.float64(D))


def congruence_diagonal(lam, M):
    """sum_j M_ji^2 lam_j for each i."""
    lam, M = np.asarray(lam, dtype=np.float64), np.asarray(M, dtype=np.float64)
    return (M * M).T @ lam


def lemma1_check(lam):
    """(diag(H^T Lambda H), tr(Lambda) / D)."""
    lam = np.asarray(lam, dtype=np.float64)
    D = lam.shape[0]
    return congruence_diagonal(lam, hadamard(D)), float(lam.sum() / D)


def rotated_importance(C):
    """diag(R^T C R) for R = U H P_br."""
    C = np.asarray(C, dtype=np.float64)
    w, V = np.linalg.eigh((C + C.T) / 2)
    U = V[:, np.argsort(w)[::-1]]
    R = U @ hadamard(C.shape[0]) @ pbr_matrix(C.shape[0])
    return np.einsum("ji,jk,ki->i", R, C, R)


def group_ranges(D, G):
    """max - min of each row of H P_br over each group of G channels."""
    D, G = _pow2(D), _pow2(G)
    HP = (hadamard(D) @ pbr_matrix(D)).reshape(D, D // G, G)
    return HP.max(axis=-1) - HP.min(axis=-1)
