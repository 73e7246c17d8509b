"""The rule by which bitdecoding_decode.cu dequantizes with one fp16 fma: a NumPy model of ``bd_unsafe2``,
checked against the contract on the CPU.

The contract's dequantized value is ``fp16(fp32(code) * scale + mn)`` (rule 3): an exact product, one
fp32 rounding of the sum, one fp16 rounding. ``fma.rn.f16x2`` rounds the exact ``code * scale + mn``
once. The contract saturates fp16 output at +-65504 (rule 3, ``numerics.to_out``) where the fma would
round to inf. The kernel takes the fma where ``bd_unsafe2`` is 0 for every param pair of a page (E_s - 8
<= E_m <= E_s + 12 with E(x) = max(floor(log2 |x|), -14), or scale or min zero; and E_s <= 10, E_m <= 14,
so that no code reaches the fp16 range's end) and the fp32 path (with the saturation) elsewhere.
Here: wherever the model says safe, fma == contract for every code (sampled over every pair of
exponents and at random), with no exception for large values; and the fp32 path is needed: an unsafe
pair where the two differ, rounding or overflow.
"""

from __future__ import annotations

import numpy as np

from kvq.reference import numerics as nx

F16 = np.float16


def _biased_e(x: np.ndarray) -> np.ndarray:
    """The exponent field of fp16 x, subnormals and zero as 1 (bd_unsafe2's __vmaxu2 with 1)."""
    return np.maximum((x.astype(F16).view(np.uint16).astype(np.int32) >> 10) & 31, 1)


def unsafe(s, m) -> np.ndarray:
    """bd_unsafe2, elementwise: True where fma(c, s, m) may differ from the contract's saturated
    fp16(fp32(c s) + m): outside the exponent rule, or where c s + m may leave the fp16 range."""
    s, m = np.asarray(s, F16), np.asarray(m, F16)
    es, em = _biased_e(s), _biased_e(m)
    ok = (em + 8 >= es) & (es + 12 >= em)
    zero = (s.view(np.uint16) & 0x7FFF == 0) | (m.view(np.uint16) & 0x7FFF == 0)
    big = (es > 25) | (em > 29)                                 # E_s > 10 or E_m > 14 (__vcmpgtu2)
    return ~(ok | zero) | big


def fma16(c, s, m) -> np.ndarray:
    """fp16 of the exact c s + m (exact in float64: at most 15 + 40 bits apart), rounded once."""
    with np.errstate(over="ignore"):
        return (np.asarray(c, np.float64) * np.asarray(s, F16).astype(np.float64)
                + np.asarray(m, F16).astype(np.float64)).astype(F16)


def contract16(c, s, m) -> np.ndarray:
    """fp16(fp32(c) * scale + mn) in float32 operations, saturated at +-65504, as
    kvq.reference.quant.dequantize (numerics.to_out) and the kernel's fp32 path (sat_f16)."""
    with np.errstate(over="ignore", invalid="ignore"):
        x = (np.asarray(c, np.float32) * np.asarray(s, F16).astype(np.float32)
             + np.asarray(m, F16).astype(np.float32))
    return nx.to_out(x, F16)


def _halves(e: np.ndarray, rng, neg: bool) -> np.ndarray:
    """Random fp16 numbers with exponent fields e (0: subnormal), random significands and signs."""
    bits = (e.astype(np.uint16) << 10) | rng.integers(0, 1024, e.shape).astype(np.uint16)
    if neg:
        bits |= (rng.integers(0, 2, e.shape).astype(np.uint16) << 15)
    return bits.view(F16)


def _same(a, b) -> np.ndarray:
    return a.view(np.uint16) == b.view(np.uint16)


def test_safe_pairs_agree_for_every_exponent_pair():
    rng = np.random.default_rng(0)
    es, em = np.meshgrid(np.arange(0, 31), np.arange(0, 31), indexing="ij")
    es, em = np.repeat(es.ravel(), 64), np.repeat(em.ravel(), 64)
    s = np.abs(_halves(es, rng, neg=False))                    # scales are >= 0
    m = _halves(em, rng, neg=True)
    safe = ~unsafe(s, m)
    assert safe.sum() > 25000
    for c in range(16):
        f, r = fma16(c, s, m), contract16(c, s, m)
        assert np.isfinite(r).all()                              # saturated: finite params, finite output
        assert _same(f, r)[safe].all(), c


def test_safe_pairs_agree_at_random():
    rng = np.random.default_rng(1)
    n = 400_000
    s = np.abs(rng.integers(0, 0x7C00, n).astype(np.uint16).view(F16))
    m = rng.integers(0, 0x10000, n).astype(np.uint16).view(F16)
    m = np.where(np.isfinite(m), m, F16(0))
    c = rng.integers(0, 16, n)
    safe = ~unsafe(s, m)
    f, r = fma16(c, s, m), contract16(c, s, m)
    assert _same(f, r)[safe].all()


def test_zero_scale_or_min_is_safe():
    s = np.array([0.0, 2.0e3, 0.0, 2.0 ** -24, 0.0], F16)
    m = np.array([2.0 ** -24, 0.0, -0.0, 0.0, 3.0e4], F16)
    assert not unsafe(s, m).any()
    # ... unless the result may overflow: 15 * 3e4 is beyond fp16 (the fma's inf, the contract's 65504)
    assert unsafe(np.array([3.0e4], F16), np.array([0.0], F16)).all()


def test_the_fp32_path_is_needed():
    """s = 1 + 3 2^-10, c = 3: c s = 3 + 4.5 2^-9 is a tie of the fp16 grid; mn = 2^-24 (a subnormal) is below
    half an fp32 ulp at 3, so the contract's fp32 sum is the tie itself and rounds to even (down), while
    the fma rounds the exact sum, just above the tie, up. bd_unsafe2 flags this pair."""
    s, m = np.array([1 + 3 * 2.0 ** -10], F16), np.array([2.0 ** -24], F16)
    assert float(s[0]) * 3 == 3 + 4.5 * 2.0 ** -9
    f, r = fma16(3, s, m), contract16(3, s, m)
    assert not _same(f, r).all()
    assert float(r[0]) == 3 + 4 * 2.0 ** -9 and float(f[0]) == 3 + 5 * 2.0 ** -9
    assert unsafe(s, m).all()


def test_unsafe_pairs_do_differ_at_random():
    """Beyond the constructed case: among random pairs that bd_unsafe2 flags, some differ (the rule is not
    vacuous), and no safe pair does (checked above). A difference needs |mn| below half an fp32 ulp of
    c s, so large scales (exponent fields 24 .. 29) beside subnormal minima."""
    rng = np.random.default_rng(2)
    es = rng.integers(24, 30, 200_000)
    s = np.abs(_halves(es, rng, neg=False))
    m = _halves(np.zeros_like(es), rng, neg=True)             # subnormal minima: E_m = -14
    c = rng.integers(1, 16, es.shape)
    flagged = unsafe(s, m)
    f, r = fma16(c, s, m), contract16(c, s, m)
    fin = np.isfinite(r)
    assert flagged[m != 0].all()
    assert (~_same(f, r) & fin & flagged).sum() > 0


def test_overflow_goes_to_the_fp32_path():
    """Issue 36: a page holding 65504 has scale 21840 (65504 / 3 rounded up); code 3 gives 65520 exactly,
    which the fma rounds to inf and the contract saturates to 65504. bd_unsafe2 flags the pair, so the
    kernel takes the fp32 path (sat_f16, then cvt.rn)."""
    s, m = np.array([21840.0], F16), np.array([0.0], F16)
    assert float(s[0]) * 3 == 65520.0
    assert np.isinf(fma16(3, s, m)).all()
    assert float(contract16(3, s, m)[0]) == 65504.0
    assert unsafe(s, m).all()
    # a large min: 4 * 8192 + 40000 = 72768 overflows; its E_m = 15 is flagged
    s, m = np.array([8192.0], F16), np.array([40000.0], F16)
    assert np.isinf(fma16(4, s, m)).all() and float(contract16(4, s, m)[0]) == 65504.0
    assert unsafe(s, m).all()
    # negative: -15 * 4096 - 30000 = -91440 saturates to -65504 (a negative scale, as a hand-made page)
    s, m = np.array([-4096.0], F16), np.array([-30000.0], F16)
    assert float(contract16(15, s, m)[0]) == -65504.0 and unsafe(s, m).all()


def test_no_safe_pair_leaves_the_fp16_range():
    """The bound behind ``big``: wherever the rule says safe, every code's exact c s + m stays below
    65504 in magnitude (so the fma, which rounds that exact value once, never reaches inf), over every
    pair of exponent fields with the largest significands and both signs of the min."""
    es, em = np.meshgrid(np.arange(0, 31), np.arange(0, 31), indexing="ij")
    top = (np.stack([es.ravel(), em.ravel()]).astype(np.uint16) << 10) | np.uint16(0x3FF)   # largest of each
    s = top[0].view(F16)
    for sign in (0, 0x8000):
        m = (top[1] | np.uint16(sign)).view(F16)
        safe = ~unsafe(s, m)
        exact = 15 * s.astype(np.float64) + m.astype(np.float64)
        assert (np.abs(exact[safe]) < 65504).all()
        assert (np.abs(exact[~safe]) >= 65504).any()            # the rule is not vacuous at the top
