"""Autograder of assignment 4 (OSCAR's bit-reversal placement and Lemma 1).

Every part compares the submission with ``kvq.reference.rotations`` or with an independent computation
here (exact integer arithmetic for Lemma 1), on fixed-seed random inputs and edge cases; a failure says
what differed and where. ``PROOF.md`` is not graded here (a teacher reads it).

    python assignments/04_oscar_bit_reversal/autograde.py [--solution | --file F]
"""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))     # the repository, for kvq

import grading  # noqa: E402
from kvq.reference import rotations as rot  # noqa: E402

POW2 = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024]


def _arr(x, name, shape):
    a = np.asarray(x)
    assert a.shape == shape, f"{name} has shape {a.shape}, expected {shape}"
    return a


def _first_diff(got, want, what, *, rtol=0.0, atol=0.0):
    """Assert got == want (within tolerances); the message names the first differing index."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    bad = ~np.isclose(got, want, rtol=rtol, atol=atol) if (rtol or atol) else got != want
    if np.any(bad):
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} entries differ; first at index {idx}: "
                             f"got {float(got[idx])!r}, expected {float(want[idx])!r}")


def _psd(D, rng, decay=1.5, repeat=False):
    O = rot.random_orthogonal(D, rng)
    lam = np.sort(rng.uniform(0.1, 3.0, D) * (1 + np.arange(D)) ** -decay)[::-1]
    if repeat:
        lam[D // 2:] = lam[D // 2]                                 # a degenerate spectrum
    return O @ np.diag(lam) @ O.T


def part_bit_reversal(sub):
    for D in POW2:
        got = _arr(sub.bit_reversal_permutation(D), f"bit_reversal_permutation({D})", (D,))
        assert np.issubdtype(got.dtype, np.integer), f"bit_reversal_permutation({D}) has dtype {got.dtype}; expected integers"
        _first_diff(got, rot.bit_reversal(D), f"bit_reversal_permutation({D})")
    top = np.asarray(sub.bit_reversal_permutation(128))[:8].tolist()
    assert top == [0, 64, 32, 96, 16, 80, 48, 112], f"D=128: beta[:8] = {top}, expected [0, 64, 32, 96, 16, 80, 48, 112]"


def part_bad_D(sub):
    for bad in (0, 3, 6, 12, 96, -4, 2.5):
        try:
            sub.bit_reversal_permutation(bad)
        except ValueError as e:
            assert "power of two" in str(e), f"bit_reversal_permutation({bad!r}) raised ValueError({str(e)!r}); the message should say 'power of two'"
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"bit_reversal_permutation({bad!r}) raised {type(e).__name__}: {e}; expected ValueError") from None
        else:
            raise AssertionError(f"bit_reversal_permutation({bad!r}) returned; expected ValueError ('power of two')")


def part_pbr(sub):
    rng = np.random.default_rng(40)
    for D in (1, 2, 8, 64, 128):
        P = _arr(sub.pbr_matrix(D), f"pbr_matrix({D})", (D, D))
        _first_diff(P, rot.pbr_matrix(D), f"pbr_matrix({D})")
        A = rng.standard_normal((D, D))
        beta = rot.bit_reversal(D)
        _first_diff((A @ P)[:, beta], A, f"(A @ pbr_matrix({D}))[:, beta] vs A (column k must move to beta(k))")


def part_groups(sub):
    for D in POW2[:9]:
        for G in [g for g in POW2 if g <= D]:
            got = _arr(sub.group_of_direction(D, G), f"group_of_direction({D}, {G})", (D,))
            _first_diff(got, rot.bit_reversal(D) // G, f"group_of_direction({D}, {G})")
    got = np.asarray(sub.group_of_direction(128, 32))[:4].tolist()
    assert got == [0, 2, 1, 3], f"D=128, G=32: the top-4 directions land in groups {got}, expected [0, 2, 1, 3]"


def part_claim1(sub):
    for D in POW2:
        H = _arr(sub.hadamard(D), f"hadamard({D})", (D, D))
        _first_diff(H, rot.hadamard64(D), f"hadamard({D}) vs the normalized Sylvester matrix", atol=1e-15)
        _first_diff(np.abs(H), np.full((D, D), 1 / np.sqrt(D)), f"|hadamard({D})| vs 1/sqrt({D})", rtol=1e-15)
        _first_diff(H.T @ H, np.eye(D), f"hadamard({D})^T hadamard({D}) vs I", atol=1e-12)


def part_claim2(sub):
    rng = np.random.default_rng(41)
    for D in (1, 3, 7, 16, 33):
        for _ in range(3):
            M, lam = rng.standard_normal((D, D)), rng.standard_normal(D) * 5
            got = _arr(sub.congruence_diagonal(lam, M), f"congruence_diagonal (D={D})", (D,))
            _first_diff(got, np.einsum("ji,j,ji->i", M, lam, M), f"congruence_diagonal (D={D}) vs sum_j M_ji^2 lam_j", rtol=1e-10, atol=1e-12)
            _first_diff(got, np.diag(M.T @ np.diag(lam) @ M), f"congruence_diagonal (D={D}) vs diag(M^T Lambda M)", rtol=1e-9, atol=1e-10)


def part_claim3(sub):
    rng = np.random.default_rng(42)
    for D in POW2[:9]:
        S = np.sign(rot.hadamard64(D)).astype(np.int64)              # +-1 Sylvester matrix: exact integers
        lam = rng.integers(0, 1000, D)
        exact = np.diag(S.T @ np.diag(lam) @ S) / D                   # = tr(Lambda) / D everywhere
        diag, target = sub.lemma1_check(lam.astype(np.float64))
        diag = _arr(diag, f"lemma1_check diag (D={D})", (D,))
        _first_diff(diag, exact, f"lemma1_check(integer spectrum, D={D}) diag vs exact diag(S^T Lambda S)/D", rtol=1e-12)
        _first_diff(float(target), lam.sum() / D, f"lemma1_check(integer spectrum, D={D}) target vs tr(Lambda)/D", rtol=1e-14)
        for decay in (0.0, 1.0, 3.0):                                 # flat, and steep float spectra
            lam = np.sort(rng.uniform(0.0, 4.0, D) * (1 + np.arange(D)) ** -decay)[::-1]
            diag, target = sub.lemma1_check(lam)
            H = rot.hadamard64(D)
            _first_diff(_arr(diag, "diag", (D,)), np.diag(H.T @ np.diag(lam) @ H), f"lemma1_check(decay={decay}, D={D}) diag vs diag(H^T Lambda H)", rtol=1e-12, atol=1e-15)
            _first_diff(diag, np.full(D, lam.sum() / D), f"lemma1_check(decay={decay}, D={D}) diag vs tr(Lambda)/D (Lemma 1)", rtol=1e-12, atol=1e-15)
            assert np.isclose(float(target), lam.sum() / D, rtol=1e-14), f"lemma1_check(D={D}) target {target} != tr(Lambda)/D = {lam.sum() / D}"


def part_claim4(sub):
    rng = np.random.default_rng(43)
    for D, repeat in ((1, False), (8, False), (32, False), (64, False), (64, True)):
        C = _psd(D, rng, repeat=repeat)
        got = _arr(sub.rotated_importance(C), f"rotated_importance (D={D})", (D,))
        R = rot.compose("oscar", rot.eig_desc(C)[1])
        _first_diff(got, np.diag(R.T @ C @ R), f"rotated_importance(D={D}{', repeated eigenvalues' if repeat else ''}) vs diag(R^T C R)", rtol=1e-9, atol=1e-13)
        _first_diff(got, np.full(D, np.trace(C) / D), f"rotated_importance(D={D}) vs tr(C)/D", rtol=1e-9, atol=1e-13)


def part_claim5(sub):
    for D in POW2[:9]:
        HP = (rot.hadamard64(D) @ rot.pbr_matrix(D)).reshape(D, -1, 1)
        for G in [g for g in POW2 if g <= D]:
            g = HP.reshape(D, D // G, G)
            got = _arr(sub.group_ranges(D, G), f"group_ranges({D}, {G})", (D, D // G))
            _first_diff(got, np.ptp(g, axis=-1), f"group_ranges({D}, {G})", atol=1e-15)
            _first_diff(got[:D // G], np.zeros((D // G, D // G)), f"group_ranges({D}, {G}) top {D // G} rows (must be exactly 0)")
            top = sorted(np.asarray(sub.group_of_direction(D, G))[:D // G].tolist())
            assert top == list(range(D // G)), f"D={D}, G={G}: the top {D // G} directions land in groups {top}; expected each group once"


PARTS = [
    ("bit_reversal_permutation matches the reference", 2, part_bit_reversal),
    ("bit_reversal_permutation rejects D not a power of two", 1, part_bad_D),
    ("pbr_matrix moves column k to beta(k)", 1, part_pbr),
    ("group_of_direction: the placement after U H P_br", 2, part_groups),
    ("claim 1: hadamard is the normalized Sylvester matrix", 1, part_claim1),
    ("claim 2: diagonal of a congruence", 1, part_claim2),
    ("claim 3: Lemma 1 on random spectra", 2, part_claim3),
    ("claim 4: Lemma 1 applied to R = U H P_br", 2, part_claim4),
    ("claim 5: top Walsh rows constant on groups; balance", 1, part_claim5),
]

if __name__ == "__main__":
    raise SystemExit(grading.main(PARTS, pathlib.Path(__file__).parent))
