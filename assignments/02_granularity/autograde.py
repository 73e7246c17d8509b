"""Autograder of assignment 2 (granularity): per-channel and per-token key quantization bit for bit
against ``kvq.reference.quant`` (axis 2 / 3), relative errors against ``kvq.reference.metrics``.

    python assignments/02_granularity/autograde.py               # grades starter.py
    python assignments/02_granularity/autograde.py --solution    # grades solutions/02_granularity.py
    python assignments/02_granularity/autograde.py --file my.py  # grades any file
"""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import grading  # noqa: E402

from kvq.reference import metrics, quant  # noqa: E402

AXES = {"per_channel": 2, "per_token": 3}


def outlier_keys(seed, shape=(2, 2, 64, 32), dtype=np.float16, n_outliers=3):
    """Gaussian keys (B, H, T, D) with ``n_outliers`` channels per head shifted and scaled ~10x."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal(shape).astype(np.float32)
    for h in range(shape[1]):
        ch = rng.choice(shape[3], n_outliers, replace=False)
        k[:, h, :, ch] = k[:, h, :, ch] * 3 + rng.choice([-1, 1], n_outliers)[:, None, None] * 12
    return k.astype(dtype)


def reference(k, bits, group, axis):
    codes, scale, mn = quant.quantize(k, bits, group, axis=axis)
    return quant.dequantize(codes, scale, mn, group, axis=axis, out_dtype=np.float32)


def check_bits_equal(what, got, want):
    """Assert float arrays equal bit for bit (shape, dtype, every element); name the first difference."""
    assert isinstance(got, np.ndarray), f"{what}: expected a numpy array, got {type(got).__name__}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    gb = np.ascontiguousarray(got).view(np.uint32)
    wb = np.ascontiguousarray(want).view(np.uint32)
    bad = np.argwhere(gb != wb)
    if bad.size:
        i = tuple(int(j) for j in bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {got.size} values differ in their bits; first at index "
                             f"(b, h, t, d)={i}: got {got[i]!r} (0x{int(gb[i]):08x}), expected {want[i]!r} "
                             f"(0x{int(wb[i]):08x})")


def _random_part(scheme):
    axis = AXES[scheme]

    def part(sub):
        fn = getattr(sub, "quantize_" + scheme)
        seed = 0
        for dtype in (np.float16, np.float32):
            for bits in (2, 3, 4, 8):
                for group in (8, 16, 32):
                    seed += 1
                    k = outlier_keys(seed, dtype=dtype)
                    what = f"quantize_{scheme}(k {k.shape} {np.dtype(dtype).name}, bits={bits}, group={group})"
                    check_bits_equal(what, fn(k, bits, group), reference(k, bits, group, axis))
        k = outlier_keys(99, shape=(1, 3, 24, 12), dtype=np.float32, n_outliers=1)   # odd-ish shape
        for group in (4, 12):
            check_bits_equal(f"quantize_{scheme}(k {k.shape}, bits=2, group={group})", fn(k, 2, group),
                             reference(k, 2, group, axis))
    part.__doc__ = f"{scheme}: bit-exact against kvq.reference.quant with axis={axis}"
    return part


def edge_keys():
    """(name, k) edge cases, (1, 1, 8, 8) keys whose groups of 4 are constant, signed zeros, or ties."""
    const = np.full((1, 1, 8, 8), 1.5, np.float32)
    zeros = np.zeros((1, 1, 8, 8), np.float32)
    zeros[..., ::2, 1::2] = -0.0
    zeros[..., 1::2, ::2] = -0.0
    neg_zero = np.full((1, 1, 8, 8), -0.0, np.float32)
    # 2-bit groups spanning [0, 3]: scale = 1 exactly, so 0.5, 1.5, 2.5 are exact ties (round half to even)
    tie = np.array([0, 0.5, 1.5, 3, 0, 2.5, 1.5, 3], np.float32)
    ties = np.broadcast_to(tie, (8, 8)).copy()
    ties = np.maximum(ties, ties.T)[None, None]                     # ties along both axes
    mixed = np.random.default_rng(5).standard_normal((1, 1, 8, 8)).astype(np.float32)
    mixed[..., :4, :] = 2.0                                         # constant blocks beside random ones
    tiny = (np.random.default_rng(6).standard_normal((1, 1, 8, 8)) * 1e-6 + 1).astype(np.float32)
    return [("constant 1.5", const), ("+0.0 / -0.0 mix", zeros), ("all -0.0", neg_zero),
            ("exact .5 ties", ties), ("constant and random groups", mixed), ("tiny range near 1", tiny)]


def part_edges(sub):
    """Constant groups (scale 0), signed zeros, exact ties, a range below fp16's resolution."""
    for name, k in edge_keys():
        for scheme, axis in AXES.items():
            for bits in (2, 4):
                check_bits_equal(f"quantize_{scheme}({name} keys, bits={bits}, group=4)",
                                 getattr(sub, "quantize_" + scheme)(k, bits, 4), reference(k, bits, 4, axis))


def part_errors(sub):
    """errors(k, bits, group) against kvq.reference.metrics.relative_mse (relative tolerance 1e-6)."""
    for seed, (bits, group) in enumerate([(2, 32), (4, 16), (3, 8), (2, 16)]):
        k = outlier_keys(200 + seed)
        got = sub.errors(k, bits, group)
        assert isinstance(got, dict), f"errors(...) returned {type(got).__name__}, expected a dict"
        assert set(got) >= set(AXES), f"errors(...) returned keys {sorted(got)}, expected {sorted(AXES)}"
        for scheme, axis in AXES.items():
            want = metrics.relative_mse(k, reference(k, bits, group, axis))
            g = float(got[scheme])
            assert np.isclose(g, want, rtol=1e-6, atol=0), (
                f"errors(k {k.shape}, bits={bits}, group={group})[{scheme!r}] = {g!r}, expected {want!r}")


def part_outliers(sub):
    """On keys with outlier channels, per-channel error < per-token error (every seed, 2 and 4 bits)."""
    for seed in range(4):
        for bits in (2, 4):
            k = outlier_keys(300 + seed)
            e = sub.errors(k, bits, 32)
            assert float(e["per_channel"]) < float(e["per_token"]), (
                f"seed {300 + seed}, bits={bits}: per_channel error {float(e['per_channel']):.4g} is not below "
                f"per_token error {float(e['per_token']):.4g} on keys with outlier channels")


PARTS = [
    ("per-channel quantization, bit-exact", 4, _random_part("per_channel")),
    ("per-token quantization, bit-exact", 4, _random_part("per_token")),
    ("edge cases: constant groups, signed zeros, ties", 3, part_edges),
    ("errors() matches metrics.relative_mse", 2, part_errors),
    ("per-channel beats per-token on outlier keys", 1, part_outliers),
]

if __name__ == "__main__":
    raise SystemExit(grading.main(PARTS, pathlib.Path(__file__).parent))
