"""The OSCAR paper's statements, executable (App. A.2, A.4, A.6, eqs. 1-2), plus the rotation pieces.

Proposition 1 (top-r eigenvectors maximize tr(U^T A U)); Lemma 1 (H^T Lambda H has the constant
diagonal tr(Lambda)/d, exactly: in integers with the +-1 Sylvester matrix); Theorem 1 (no orthogonal R
beats U on tr(R^T C R E) for diagonal ascending E: a randomized search, the doubly stochastic matrix
of the proof, and the rearrangement over all permutations); the bit-reversal balance property and the
d = 128 placement of App. A.4; the logit identity (1) and the output identity (2).
"""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.reference import quant
from kvq.reference import rotations as rot

FAST = settings(max_examples=25, deadline=None)


def psd(d, rng, decay=1.0):
    """A random symmetric PSD matrix with distinct eigenvalues."""
    O = rot.random_orthogonal(d, rng)
    lam = np.sort(rng.uniform(0.1, 3.0, d) * (1 + np.arange(d)) ** -decay)[::-1]
    return O @ np.diag(lam) @ O.T


# ---------------------------------------------------------------------------------------------------
# Proposition 1 (App. A.2)


@FAST
@given(seed=st.integers(0, 2**32 - 1), d=st.integers(2, 12), data=st.data())
def test_proposition1_top_r_eigenvectors_maximize_the_trace(seed, d, data):
    r = data.draw(st.integers(1, d))
    rng = np.random.default_rng(seed)
    A = psd(d, rng)
    lam, V = rot.eig_desc(A)
    best = lam[:r].sum()
    np.testing.assert_allclose(np.trace(V[:, :r].T @ A @ V[:, :r]), best, rtol=1e-12)    # attained
    for _ in range(20):
        U = rot.random_orthogonal(d, rng)[:, :r]                  # U^T U = I_r
        P = (V.T @ U) @ (V.T @ U).T                                # the proof's projection B B^T
        w = np.diag(P)
        assert np.all(w >= -1e-12) and np.all(w <= 1 + 1e-12)
        np.testing.assert_allclose(w.sum(), r, rtol=1e-12)
        val = np.trace(U.T @ A @ U)
        np.testing.assert_allclose(val, lam @ w, rtol=1e-10)       # tr(U^T A U) = sum_i lam_i P_ii
        assert val <= best * (1 + 1e-12)


# ---------------------------------------------------------------------------------------------------
# Lemma 1 (App. A.4) and the Hadamard matrix (App. A.1)


@FAST
@given(n=st.integers(0, 7), seed=st.integers(0, 2**32 - 1))
def test_lemma1_constant_diagonal_exactly(n, seed):
    d = 2 ** n
    S = np.sign(rot.hadamard64(d)).astype(np.int64)                # +-1 Sylvester matrix, H = S / sqrt(d)
    lam = np.random.default_rng(seed).integers(0, 1000, d)        # an integer diagonal Lambda
    M = S.T @ np.diag(lam) @ S                                     # exact integer arithmetic
    assert np.all(np.diag(M) == lam.sum())                         # (H^T Lambda H)_ii = tr(Lambda) / d
    # in floating point the diagonal, summed in one order for every i, is the same number for every i
    H = rot.hadamard64(d)
    diag = ((H * H) * lam[:, None].astype(np.float64)).sum(axis=0)
    assert np.all(diag == diag[0])
    np.testing.assert_allclose(diag[0], lam.sum() / d, rtol=1e-14)


def test_lemma1_applied_to_the_oscar_rotation():
    """After U_Q the importance metric is Lambda_Q; after U_Q H its diagonal is tr(C_Q) / d."""
    rng = np.random.default_rng(0)
    C = psd(64, rng, decay=1.5)
    lam, U = rot.eig_desc(C)
    np.testing.assert_allclose(np.diag(U.T @ C @ U), lam, atol=1e-12)
    for kind in ("eigen_hadamard", "oscar"):
        R = rot.compose(kind, U)
        np.testing.assert_allclose(np.diag(R.T @ C @ R), np.trace(C) / 64, rtol=1e-10)
    assert np.ptp(np.diag(rot.hadamard64(64).T @ C @ rot.hadamard64(64))) > 1e-3     # H alone: not equalized


def test_hadamard_is_the_recursive_normalized_matrix():
    H = np.ones((1, 1))
    for n in range(1, 9):
        H = np.block([[H, H], [H, -H]]) / np.sqrt(2)               # App. A.1: H_2m = [[H, H], [H, -H]] / sqrt 2
        np.testing.assert_allclose(rot.hadamard64(2 ** n), H, atol=1e-15)
        np.testing.assert_allclose(H.T @ H, np.eye(2 ** n), atol=1e-13)
    for bad in (3, 6, 24, 96, 0):
        with pytest.raises(ValueError, match="power of two"):
            rot.hadamard64(bad)
        with pytest.raises(ValueError, match="power of two"):
            rot.bit_reversal(bad)


# ---------------------------------------------------------------------------------------------------
# Theorem 1 (App. A.6)


@FAST
@given(seed=st.integers(0, 2**32 - 1), d=st.integers(2, 8))
def test_theorem1_no_rotation_beats_the_eigenbasis(seed, d):
    rng = np.random.default_rng(seed)
    C = psd(d, rng)
    lam, U = rot.eig_desc(C)
    mu = np.sort(rng.uniform(0.0, 2.0, d))                         # frozen residual, ascending
    E = np.diag(mu)
    f_U = rot.frozen_surrogate(U, C, E)
    np.testing.assert_allclose(f_U, lam @ mu, rtol=1e-10)          # largest lambda paired with smallest mu
    for _ in range(30):                                            # randomized search over O(d)
        Z = rot.random_orthogonal(d, rng)
        W = Z ** 2                                                 # the proof's doubly stochastic matrix
        np.testing.assert_allclose(W.sum(0), 1, rtol=1e-12)
        np.testing.assert_allclose(W.sum(1), 1, rtol=1e-12)
        f = rot.frozen_surrogate(U @ Z, C, E)
        np.testing.assert_allclose(f, mu @ W.T @ lam, rtol=1e-10)  # eq. (4): sum_ij mu_i lam_j z_ji^2
        assert f >= f_U * (1 - 1e-12) - 1e-12
    for eps in (1e-3, 1e-1):                                       # and near U: a local minimum
        A = rng.standard_normal((d, d))
        Qm, _ = np.linalg.qr(np.eye(d) + eps * (A - A.T))
        assert rot.frozen_surrogate(U @ Qm, C, E) >= f_U * (1 - 1e-12) - 1e-12


def test_theorem1_rearrangement_over_all_permutations():
    rng = np.random.default_rng(1)
    d = 6
    lam = np.sort(rng.uniform(0.5, 5.0, d))[::-1]
    mu = np.sort(rng.uniform(0.1, 2.0, d))
    vals = {p: float(np.sum(lam[list(p)] * mu)) for p in itertools.permutations(range(d))}
    best = min(vals, key=vals.get)
    assert best == tuple(range(d))                                 # the identity pairing is the minimum


# ---------------------------------------------------------------------------------------------------
# the permuted bit-reversal (App. A.4)


def test_bit_reversal_placement_d128():
    beta = rot.bit_reversal(128)
    assert beta[:8].tolist() == [0, 64, 32, 96, 16, 80, 48, 112]   # App. A.4
    assert np.array_equal(beta[beta], np.arange(128))              # an involution
    A = np.random.default_rng(0).standard_normal((128, 128))
    AP = A @ rot.pbr_matrix(128)
    for k in range(128):
        assert np.array_equal(AP[:, beta[k]], A[:, k])             # k-th column to position beta(k)


@given(n=st.integers(0, 10), data=st.data())
@settings(max_examples=60, deadline=None)
def test_bit_reversal_balance(n, data):
    """For every power-of-two G dividing d, the top d/G positions land in d/G distinct groups of G."""
    d = 2 ** n
    G = 2 ** data.draw(st.integers(0, n))
    beta = rot.bit_reversal(d)
    groups = beta[:d // G] // G
    assert sorted(groups.tolist()) == list(range(d // G))


@given(n=st.integers(1, 8), data=st.data())
@settings(max_examples=40, deadline=None)
def test_top_walsh_rows_are_constant_on_groups(n, data):
    """Why P_br helps an asymmetric group quantizer: after H P_br, Walsh rows 0 .. d/G - 1 (the ones the
    top d/G eigendirections of U feed) are constant on every group of G channels, so those components
    of a token only shift each group and never widen its range; rows d/G and up are not."""
    d = 2 ** n
    G = 2 ** data.draw(st.integers(0, n))
    HP = (rot.hadamard64(d) @ rot.pbr_matrix(d)).reshape(d, d // G, G)    # (row, group, member)
    assert np.all(np.ptp(HP[:d // G], axis=-1) == 0)
    if G > 1:
        assert np.all(np.ptp(HP[d // G:], axis=-1).max(axis=-1) > 0)


# ---------------------------------------------------------------------------------------------------
# the identities (1) and (2), and A.4's rotated form


def test_logit_and_output_identities():
    rng = np.random.default_rng(2)
    T, D = 40, 32
    Q, K, V = (rng.standard_normal((T, D)) for _ in range(3))
    K_hat, V_hat = K + 0.1 * rng.standard_normal((T, D)), V + 0.1 * rng.standard_normal((T, D))
    np.testing.assert_allclose(np.sum((Q @ K.T - Q @ K_hat.T) ** 2),
                               np.trace((K - K_hat) @ Q.T @ Q @ (K - K_hat).T), rtol=1e-10)     # eq. (1)
    S = np.exp(Q @ K.T / np.sqrt(D))
    S /= S.sum(1, keepdims=True)
    np.testing.assert_allclose(np.sum((S @ V - S @ V_hat) ** 2),
                               np.trace((V - V_hat).T @ S.T @ S @ (V - V_hat)), rtol=1e-10)     # eq. (2)
    # A.4: with K~ = K R and K_hat = Q(K~) R^T, the logit error is tr(R^T Q^T Q R E_K), E_K = sum e^T e
    R = rot.compose("oscar", rot.eig_desc(Q.T @ Q)[1])
    Kt = (K @ R).astype(np.float32)
    codes, s, m = quant.quantize(Kt, 2, 16, axis=-1, meta_dtype=np.float32)
    e = quant.dequantize(codes, s, m, 16, -1, np.float32).astype(np.float64) - Kt
    K_hat = (Kt + e) @ R.T
    np.testing.assert_allclose(np.sum((Q @ Kt.astype(np.float64).dot(R.T).T - Q @ K_hat.T) ** 2),
                               np.trace(R.T @ Q.T @ Q @ R @ (e.T @ e)), rtol=1e-9)


def test_rotate_is_fixed_order_and_row_independent():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 2, 7, 16)).astype(np.float32)
    R = rot.compose("oscar", rot.eig_desc(psd(16, rng))[1]).astype(np.float32)
    y = rot.rotate(x, R)
    for t in range(7):
        assert np.array_equal(y[:, :, t:t + 1], rot.rotate(x[:, :, t:t + 1], R))
    np.testing.assert_allclose(y, x.astype(np.float64) @ R.astype(np.float64), atol=1e-5)
    Rh = np.stack([R, R.T.copy()])                                 # per-head rotations (H, 1, D, D)
    np.testing.assert_allclose(rot.rotate(x, Rh[:, None])[:, 1], x[:, 1] @ R.T.astype(np.float64), atol=1e-5)
    with pytest.raises(TypeError, match="float32"):
        rot.rotate(x, R.astype(np.float64))
    with pytest.raises(ValueError, match="16"):
        rot.rotate(x[..., :8], R)
