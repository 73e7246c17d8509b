"""Autograder of assignment 3 (Kitty key pages): ``channel_scores``, ``select_boost``, ``encode_page``
and ``dequantize_page`` against ``kvq.reference.kitty``, every field bit for bit.

    python assignments/03_kitty_pages/autograde.py               # grades starter.py
    python assignments/03_kitty_pages/autograde.py --solution    # grades solutions/03_kitty_pages.py
    python assignments/03_kitty_pages/autograde.py --file my.py  # grades any file
"""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import grading  # noqa: E402

from kvq.reference import kitty  # noqa: E402

FIELDS = ("low", "high", "idx", "scale", "mn")


def check_exact(what, got, want):
    """Assert arrays equal bit for bit (shape, dtype, every element); name the first difference."""
    assert isinstance(got, np.ndarray), f"{what}: expected a numpy array, got {type(got).__name__}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    g, w = np.ascontiguousarray(got), np.ascontiguousarray(want)
    if g.dtype.kind == "f":
        g, w = g.view(f"u{g.itemsize}"), w.view(f"u{w.itemsize}")
    bad = np.argwhere(g != w)
    if bad.size:
        i = tuple(int(j) for j in bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {got.size} elements differ; first at index {i}: "
                             f"got {got[i]!r}, expected {want[i]!r}")


def random_page(rng, shape, dtype=np.float32, n_outliers=2):
    k = rng.standard_normal(shape).astype(np.float32)
    D = shape[-1]
    ch = rng.choice(D, n_outliers, replace=False)
    k[..., ch] = k[..., ch] * 4 + 6
    return k.astype(dtype)


def random_boost(rng, lead, D, d_boost):
    """(lead..., D) masks with exactly ``d_boost`` random channels per row."""
    order = np.argsort(rng.random(lead + (D,)), axis=-1)
    mask = np.zeros(lead + (D,), bool)
    np.put_along_axis(mask, order[..., :d_boost], True, axis=-1)
    return mask


def page_cases():
    """(name, kpage, boost): random pages of several shapes and boost counts, then edge cases."""
    rng = np.random.default_rng(0)
    for shape, dtype in (((16, 8), np.float32), ((2, 3, 32, 16), np.float16), ((4, 64, 32), np.float32),
                         ((1, 2, 128, 24), np.float16)):
        D = shape[-1]
        for d_boost in sorted({1, D // 8 or 1, D // 4, D // 2}):
            k = random_page(rng, shape, dtype)
            yield f"random {np.dtype(dtype).name} page {shape}, d_boost={d_boost}", k, \
                random_boost(rng, shape[:-2], D, d_boost)
    k = random_page(rng, (2, 16, 8))
    yield "d_boost=0 (no boosted channel)", k, np.zeros((2, 8), bool)
    yield "d_boost=D (every channel boosted)", k, np.ones((2, 8), bool)
    kc = random_page(rng, (2, 16, 8))
    kc[..., 1] = 3.0
    kc[..., 4] = -0.0
    kc[0, :, 6] = 0.0
    yield "constant channels (scale 0), boosted and not", kc, np.array([[0, 1, 0, 0, 1, 0, 0, 0],
                                                                        [1, 0, 0, 0, 0, 0, 1, 0]], bool)
    yield "scores' own selection", k, kitty.select_boost(kitty.channel_scores(k), 2)


def part_scores(sub):
    """channel_scores against kitty.channel_scores (fp32, relative tolerance 1e-5)."""
    rng = np.random.default_rng(1)
    for shape in ((16, 8), (2, 3, 32, 16), (128, 128)):
        for dtype in (np.float16, np.float32):
            k = random_page(rng, shape, dtype)
            got, want = sub.channel_scores(k), kitty.channel_scores(k)
            what = f"channel_scores(page {shape} {np.dtype(dtype).name})"
            assert isinstance(got, np.ndarray), f"{what}: expected a numpy array, got {type(got).__name__}"
            assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
            assert got.dtype == np.float32, f"{what}: dtype {got.dtype}, expected float32"
            bad = np.argwhere(~np.isclose(got, want, rtol=1e-5, atol=0))
            if bad.size:
                i = tuple(int(j) for j in bad[0])
                raise AssertionError(f"{what}: {len(bad)} scores differ; first at index {i}: got {got[i]!r}, "
                                     f"expected {want[i]!r}")


def part_select(sub):
    """select_boost against kitty.select_boost: random scores, ties (lower channel first), d_boost 0 and D."""
    rng = np.random.default_rng(2)
    cases = [(rng.random((3, 4, 32)).astype(np.float32), d) for d in (0, 1, 4, 8, 32)]
    ties = rng.integers(0, 3, size=(5, 16)).astype(np.float32)      # many equal scores
    cases += [(ties, d) for d in (1, 3, 7, 16)]
    cases.append((np.ones(8, np.float32), 3))
    for scores, d in cases:
        got = sub.select_boost(scores, d)
        check_exact(f"select_boost(scores {scores.shape}, d_boost={d})", np.asarray(got),
                    kitty.select_boost(scores, d))
    for d in (-1, 9):
        try:
            sub.select_boost(np.ones(8, np.float32), d)
        except NotImplementedError:
            raise
        except ValueError:
            continue
        except Exception as e:
            raise AssertionError(f"select_boost(8 scores, d_boost={d}) raised {type(e).__name__}, "
                                 f"expected ValueError") from None
        raise AssertionError(f"select_boost(8 scores, d_boost={d}) returned normally, expected ValueError")


def _encode_part(edge):
    def part(sub):
        for name, k, boost in page_cases():
            if name.startswith("random") == edge:
                continue
            got = sub.encode_page(k, boost)
            want = kitty.encode_page(k, boost)
            assert isinstance(got, dict), f"encode_page({name}) returned {type(got).__name__}, expected a dict"
            missing = [f for f in FIELDS if f not in got]
            assert not missing, f"encode_page({name}): the page lacks field(s) {missing}"
            for f in FIELDS:
                check_exact(f"encode_page({name})[{f!r}]", got[f], want[f])
    part.__doc__ = ("encode_page edge cases: d_boost 0 and D, constant channels" if edge else
                    "encode_page on random pages: every field bit-exact")
    return part


def part_encode_refuses(sub):
    """A boost mask with different counts per page is refused with ValueError."""
    k = np.zeros((2, 8, 8), np.float32)
    boost = np.zeros((2, 8), bool)
    boost[0, :2] = True
    boost[1, :3] = True
    try:
        sub.encode_page(k, boost)
    except NotImplementedError:
        raise
    except ValueError:
        return
    except Exception as e:
        raise AssertionError(f"encode_page(boost counts 2 and 3) raised {type(e).__name__}, expected ValueError") \
            from None
    raise AssertionError("encode_page(boost counts 2 and 3) returned normally, expected ValueError")


def random_byte_pages():
    """Pages of random bytes (any low / high bits, random fp16 scale and min), with a valid index."""
    rng = np.random.default_rng(3)
    for lead, G, D, d_boost in (((), 16, 8, 2), ((2, 3), 32, 16, 4), ((2,), 8, 8, 0), ((2,), 8, 8, 8)):
        boost = random_boost(rng, lead, D, d_boost)
        idx = np.where(boost, np.cumsum(boost, axis=-1) - 1, d_boost).astype(np.uint8)
        yield f"random bytes, lead {lead}, G={G}, D={D}, d_boost={d_boost}", G, {
            "low": rng.integers(0, 256, lead + (D, G // 4), dtype=np.uint8),
            "high": rng.integers(0, 256, lead + (d_boost, G // 4), dtype=np.uint8),
            "idx": idx,
            "scale": (rng.random(lead + (D,)) * 2).astype(np.float16),
            "mn": (rng.standard_normal(lead + (D,)) * 3).astype(np.float16)}


def part_dequantize(sub):
    """Algorithm 1 bit-exact: on reference-encoded pages and on pages of random bytes."""
    for name, k, boost in page_cases():
        page = kitty.encode_page(k, boost)
        G = k.shape[-2]
        check_exact(f"dequantize_page(reference page of {name}, {G})", sub.dequantize_page(page, G),
                    kitty.dequantize_page(page, G))
    for name, G, page in random_byte_pages():
        check_exact(f"dequantize_page({name})", sub.dequantize_page(page, G), kitty.dequantize_page(page, G))


def part_round_trip(sub):
    """Your own pipeline: dequantize_page(encode_page(k, select_boost(channel_scores(k), d))) == reference."""
    rng = np.random.default_rng(4)
    for shape, d in (((2, 32, 16), 2), ((64, 32), 8)):
        k = random_page(rng, shape)
        boost = sub.select_boost(sub.channel_scores(k), d)
        got = sub.dequantize_page(sub.encode_page(k, boost), shape[-2])
        ref_boost = kitty.select_boost(kitty.channel_scores(k), d)
        want = kitty.dequantize_page(kitty.encode_page(k, ref_boost), shape[-2])
        check_exact(f"your pipeline on page {shape}, d_boost={d}", got, want)


PARTS = [
    ("channel_scores (eq. 2)", 2, part_scores),
    ("select_boost: top d_boost, ties, 0 and D", 2, part_select),
    ("encode_page: random pages, every field", 4, _encode_part(edge=False)),
    ("encode_page: edge cases", 2, _encode_part(edge=True)),
    ("encode_page refuses unequal boost counts", 1, part_encode_refuses),
    ("dequantize_page (Algorithm 1)", 4, part_dequantize),
    ("end to end with your own functions", 1, part_round_trip),
]

if __name__ == "__main__":
    raise SystemExit(grading.main(PARTS, pathlib.Path(__file__).parent))
