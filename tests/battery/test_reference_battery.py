"""Bad input to every public function of ``kvq.reference``: a clear error or a correct result, never an
unclear exception, and a bit-identical state after a rejected call (see ``_core.py`` for the rules).

One test per (function, argument); hypothesis draws valid calls (shapes, dtypes, values, configs),
deterministically, and every mutation of the argument breaks each of them.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ._core import Recorder
from .engine import REFERENCE, run_case
from .specs import all_specs, by_label
from .strategies import BATTERY_SETTINGS, HypothesisDraw

CASES = [
    pytest.param(s.label, a, muts, id=f"{s.label}-{a}")
    for s in all_specs()
    if "reference" in s.tiers
    for a, muts in s.groups(REFERENCE)
]


@pytest.mark.parametrize("label,arg,muts", CASES)
def test_reference_bad_input(label, arg, muts):
    spec = by_label()[label]
    rec = Recorder("reference", label)

    @BATTERY_SETTINGS
    @given(data=st.data())
    def run(data):
        d = HypothesisDraw(data)
        for mut in muts:
            run_case(rec, spec, REFERENCE, arg, mut, d.fork())

    run()
    rec.assert_clean()


# ---------------------------------------------------------------------------------------------------
# good input: streaming equals bulk


def _stream_case(d, method):
    """(append(state, k, v), init(), k, v, chunks) of one drawn cache and sequence."""
    import numpy as np

    from .specs_aqua import AquaSetup
    from .specs_caches import Setup

    if method == "aqua_cache":
        s = AquaSetup(d, REFERENCE)
        mod = REFERENCE.mod("aqua_cache")
        T = d.int(1, s.cfg.max_tokens)
        K, V = s.KV(T)
        P = s.P()
        return (
            (lambda st, k, v: mod.append(s.cfg, P, st, k, v)),
            (lambda: REFERENCE.init("aqua_cache", s.cfg, s.L, s.B, s.H, s.D)),
            K,
            V,
            3,
        )
    s = Setup(d, REFERENCE, method, t0=(0, 0))
    mod = s.mod
    T = d.int(1, s.cfg.max_tokens)
    k, v = s.kv(T)
    head = s.head()
    append = (
        (lambda st, a, b: mod.append(head["cfg"], head["calib"], st, a, b))
        if method == "oscar"
        else (lambda st, a, b: mod.append(head["cfg"], st, a, b))
    )
    del np
    return append, (lambda: REFERENCE.init(method, s.cfg, s.B, s.H, s.D)), k, v, 2


@pytest.mark.parametrize("method", ["kivi", "kitty", "oscar", "bitdecoding", "aqua_cache"])
def test_streaming_equals_bulk(method):
    """Appending tokens one at a time, or in random chunks, gives the state of one bulk append, bit for bit."""
    import numpy as np

    from ._core import snapshot, snapshot_diff

    rec = Recorder("reference", f"{method}.append (streaming equals bulk)")

    @BATTERY_SETTINGS
    @given(data=st.data())
    def run(data):
        d = HypothesisDraw(data)
        append, init, k, v, axis = _stream_case(d, method)
        T = k.shape[axis]
        bulk = init()
        append(bulk, k, v)
        one = init()
        for t in range(T):
            sl = (slice(None),) * axis + (slice(t, t + 1),)
            append(one, k[sl], v[sl])
        rng = np.random.default_rng(T)
        chunked, t = init(), 0
        while t < T:
            n = int(rng.integers(1, 6))
            sl = (slice(None),) * axis + (slice(t, t + n),)
            append(chunked, k[sl], v[sl])
            t += n
        for case, st_ in (("one token at a time", one), ("random chunks", chunked)):
            diff = snapshot_diff(snapshot(bulk), snapshot(st_))
            rec.check(f"T={T} {case}", not diff, "wrong_result", f"the state differs from a bulk append at {diff}")

    run()
    rec.assert_clean()
