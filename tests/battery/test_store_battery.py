"""Bad input to ``kvq.integrations.methods.KVStore`` (every method, reference backend): a clear error and
a store bit-identical to before, or the canonical call's result; and after a rejected call the store must
keep working: a good step on it gives what it gives on an untouched twin (AQUA-KV's waiting tokens, the
FP16 store's dtype, the memo are part of what is compared).

The issue's reproducers are cases here: ``update(..., dtype="float16")`` appending before failing (item 2),
AQUA-KV jammed by tokens near 6e4 or by NaN predictors (item 3), 65504 read back as inf (item 4), the FP16
store taking NaN in its own dtype (item 5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq.integrations import methods as M

from ..integrations.small import SMALL
from ._core import ERROR, OK_OR_ERROR, Recorder, all_finite, results_close, snapshot, snapshot_diff

L, B, H, D, CAP = 2, 1, 2, 64, 128
KW = dict(n_layers=L, batch=B, kv_heads=H, head_dim=D, max_tokens=CAP, backend="reference")
NAMES = list(M.METHODS)
CALIBRATED = {n for n, s in M.METHODS.items() if s.calibration}


def tokens(T, seed, dtype=np.float32, scale=1.0):
    rng = np.random.default_rng(seed)
    return tuple((rng.standard_normal((B, H, T, D)) * scale).astype(dtype) for _ in range(2))


def predictors(F=H * D, fill=None, scale=0.05):
    from kvq.reference import aqua

    rng = np.random.default_rng(0)

    def mat(n_in):
        m = (rng.standard_normal((n_in, F)) * scale).astype(np.float32)
        if fill is not None:
            m[:] = fill
        return m

    return aqua.AquaPredictors(
        (None,) + tuple(aqua.Predictor((mat(F),), np.zeros(F, np.float32)) for _ in range(L - 1)),
        (None,) + tuple(aqua.Predictor((mat(2 * F),), np.zeros(F, np.float32)) for _ in range(L - 1)),
    )


def calibration(name):
    if name == "OSCAR":
        return "identity"
    if M.METHODS[name].family == "aqua":
        return predictors()
    return None


def build(name, T0):
    store = M.KVStore(name, **KW, calibration=calibration(name), **SMALL[name])
    if T0:
        for l in range(L):
            store.append(l, *tokens(T0, 100 + l))
    return store


def good_step(store, seed=7):
    """One decode-like step on every layer: update (append then read), as a transformer does."""
    return [store.update(l, *tokens(3, seed + l)) for l in range(L)]


def followup(victim, twin):
    """None if a good step gives the same results and state on the victim as on the twin."""
    try:
        got = good_step(victim)
    except Exception as e:  # noqa: BLE001
        return f"a good update afterwards raised {type(e).__name__}: {str(e)[:200]}"
    want = good_step(twin)
    why = results_close(got, want, rtol=0)
    if why:
        return f"a good update afterwards returned other keys / values than on an untouched twin: {why}"
    diff = snapshot_diff(snapshot(twin), snapshot(victim))
    return None if not diff else f"after a good update the store differs from an untouched twin at {diff}"


def _kv_finite(store):
    for l in range(L):
        why = all_finite(store.keys_values(l))
        if why:
            return f"keys_values({l}): {why}"
    return None


# ---------------------------------------------------------------------------------------------------
# the catalogue: (case, call(store), words, expect, canonical call or None, check or None)


def _mut_k(f):
    """A call appending a mutated k (v good) to layer 0."""

    def call(s):
        k, v = tokens(4, 5)
        return s.append(0, f(k), v)

    return call


def _both(f, T=4):
    def call(s):
        k, v = tokens(T, 5)
        return s.append(0, f(k), f(v))

    return call


def _canon_append(f=lambda a: a):
    def call(s):
        k, v = tokens(4, 5)
        return s.append(0, f(k), f(v))

    return call


def _set(a, value, dtype=None):
    a = a.astype(dtype or a.dtype).copy()
    a.flat[0] = value
    return a


def _t(a, dtype=None):
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if dtype is None else t.to(dtype)


def _noncontig(a):
    big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    big[..., ::2] = a
    return torch.from_numpy(big)[..., ::2]


def _extreme(value, everywhere=False):
    """fp16 tokens holding +-value (in two channels, or everywhere with random signs)."""

    def f(a):
        b = a.astype(np.float16).copy()
        if everywhere:
            b[...] = np.where(np.random.default_rng(0).random(b.shape) < 0.5, -value, value)
        else:
            b[..., 0] = value
            b[..., 1] = -value
        return b

    return f


def catalogue():
    K = ("k", "K", "k and v", "tokens", "token")
    out = []
    for bad in (-1, L, True, 1.0, "0", None):
        out.append((f"layer={bad!r}", lambda s, bad=bad: s.append(bad, *tokens(2, 1)), ("layer",), ERROR, None, None))
    out += [
        ("k:nan", _mut_k(lambda a: _set(a, np.nan)), K, ERROR, None, None),
        ("k:inf", _mut_k(lambda a: _set(a, np.inf)), K, ERROR, None, None),
        ("k:1e5_overflows_fp16", _mut_k(lambda a: _set(a, 1e5)), K, ERROR, None, None),
        ("k:torch_nan_fp16", _mut_k(lambda a: _t(_set(a, np.nan, np.float16))), K, ERROR, None, None),
        ("k:torch_nan_bf16", _mut_k(lambda a: _t(_set(a, np.nan), torch.bfloat16)), K, ERROR, None, None),
        (
            "k:other_head_dim",
            _mut_k(lambda a: np.zeros(a.shape[:3] + (D + 8,), a.dtype)),
            K + ("shape",),
            ERROR,
            None,
            None,
        ),
        (
            "k:other_heads",
            _mut_k(lambda a: np.zeros((B, H + 1) + a.shape[2:], a.dtype)),
            K + ("shape",),
            ERROR,
            None,
            None,
        ),
        (
            "k:other_batch",
            _mut_k(lambda a: np.zeros((B + 1,) + a.shape[1:], a.dtype)),
            K + ("shape",),
            ERROR,
            None,
            None,
        ),
        ("k:3d", _mut_k(lambda a: a[0]), K + ("shape",), ERROR, None, None),
        ("k:int32", _mut_k(lambda a: a.astype(np.int32)), K, ERROR, None, None),
        ("k:bool", _mut_k(lambda a: a > 0), K, ERROR, None, None),
        ("k:complex", _mut_k(lambda a: a.astype(np.complex64)), K, ERROR, None, None),
        ("k:strings", _mut_k(lambda a: np.full(a.shape, "a")), K, ERROR, None, None),
        ("k:none", _mut_k(lambda a: None), K, ERROR, None, None),
        ("k:torch_int", _mut_k(lambda a: _t(a.astype(np.int32))), K, ERROR, None, None),
        ("k:meta_device", _mut_k(lambda a: _t(a).to("meta")), K + ("device",), ERROR, None, None),
        (
            "k_v:T_mismatch",
            lambda s: s.append(0, *[tokens(4, 5)[0], tokens(5, 6)[1]]),
            K + ("shape", "v"),
            ERROR,
            None,
            None,
        ),
        (
            "k_v:over_capacity",
            lambda s: s.append(0, *tokens(CAP + 1, 5)),
            K + ("capacity", "max_tokens"),
            ERROR,
            None,
            None,
        ),
        ("k_v:float64", _both(lambda a: a.astype(np.float64)), K, OK_OR_ERROR, _canon_append(), None),
        ("k_v:list", _both(lambda a: a.tolist()), K, OK_OR_ERROR, _canon_append(), None),
        (
            "k_v:torch_fp16",
            _both(lambda a: _t(a.astype(np.float16))),
            K,
            OK_OR_ERROR,
            _canon_append(lambda a: a.astype(np.float16)),
            None,
        ),
        (
            "k_v:torch_bf16",
            _both(lambda a: _t(a, torch.bfloat16)),
            K,
            OK_OR_ERROR,
            _canon_append(lambda a: _t(a, torch.bfloat16).float().numpy()),
            None,
        ),
        ("k_v:noncontig", _both(_noncontig), K, OK_OR_ERROR, _canon_append(), None),
        ("k_v:empty", lambda s: s.append(0, *tokens(0, 5)), K, OK_OR_ERROR, lambda s: None, None),
        ("k_v:fp16_max_65504", _both(_extreme(65504)), K, OK_OR_ERROR, None, _kv_finite),
        # 20 tokens: enough to fill AQUA-KV's buffer (16 in SMALL), so that a chunk holding them is compressed
        ("k_v:near_6e4", _both(_extreme(60000), T=20), K, OK_OR_ERROR, None, _kv_finite),
        ("k_v:6e4_everywhere", _both(_extreme(60000, everywhere=True), T=20), K, OK_OR_ERROR, None, _kv_finite),
        (
            "update:dtype='float16'",
            lambda s: s.update(0, *tokens(3, 5), dtype="float16"),
            ("dtype",),
            OK_OR_ERROR,
            lambda s: s.update(0, *tokens(3, 5), dtype=torch.float16),
            None,
        ),
        ("update:dtype='bogus'", lambda s: s.update(0, *tokens(3, 5), dtype="bogus"), ("dtype",), ERROR, None, None),
        ("update:dtype=int32", lambda s: s.update(0, *tokens(3, 5), dtype=torch.int32), ("dtype",), ERROR, None, None),
        ("update:layer=True", lambda s: s.update(True, *tokens(3, 5)), ("layer",), ERROR, None, None),
        ("update:k_nan", lambda s: s.update(0, _set(tokens(3, 5)[0], np.nan), tokens(3, 5)[1]), K, ERROR, None, None),
        ("keys_values:layer=5", lambda s: s.keys_values(5), ("layer",), ERROR, None, None),
        ("keys_values:dtype='bogus'", lambda s: s.keys_values(0, "bogus"), ("dtype",), ERROR, None, None),
    ]
    return out


CATALOGUE = catalogue()


#: cases also run on a fresh store (the first append decides the FP16 store's dtype, AQUA-KV's first commit)
FRESH = {
    "k:nan",
    "k:torch_nan_bf16",
    "k:1e5_overflows_fp16",
    "k:other_head_dim",
    "k:int32",
    "k:numpy",
    "k:meta_device",
    "k_v:torch_bf16",
    "k_v:float64",
    "k_v:empty",
    "k_v:fp16_max_65504",
    "k_v:near_6e4",
    "k_v:6e4_everywhere",
    "update:dtype='float16'",
    "update:dtype='bogus'",
    "update:k_nan",
}


@pytest.mark.parametrize("T0", [0, 20], ids=["fresh", "T0=20"])
@pytest.mark.parametrize("name", NAMES)
def test_store_bad_calls(name, T0):
    rec = Recorder("store", f"KVStore({name}).append/update/keys_values")
    for case, call, words, expect, canonical, check in CATALOGUE:
        if T0 == 0 and case not in FRESH and not case.startswith("layer="):
            continue
        if name == "FP16" and T0 == 0 and case == "k_v:torch_bf16":
            canonical = call  # a first bf16 append makes a bf16 store: by design
        victim, twin = build(name, T0), build(name, T0)

        def oracle(result, canonical=canonical, check=check, victim=victim, twin=twin):
            if check is not None:
                return check(victim)
            if canonical is not None:
                want = canonical(twin)
                why = results_close(result, want, rtol=0)
                if why:
                    return f"result differs from the canonical call's: {why}"
                diff = snapshot_diff(snapshot(twin), snapshot(victim))
                if diff:
                    return f"the store differs from the canonical call's at {diff}"
            return None

        rec.call(
            case,
            lambda: call(victim),
            names=words,
            expect=expect,
            oracle=oracle,
            states=[victim],
            followup=lambda: followup(victim, twin),
        )
    rec.assert_clean()


def _ctor_cases(name):
    from kvq.reference import oscar

    out = []
    for field in ("n_layers", "batch", "kv_heads", "head_dim", "max_tokens"):
        for bad in (0, -1, True, 2.0, "2", None):
            out.append((f"{field}={bad!r}", {field: bad}, (field,), ERROR))
    out += [
        ("backend='bogus'", {"backend": "bogus"}, ("backend",), ERROR),
        ("override bogus_field", {"bogus_field": 1}, ("bogus_field", "option"), ERROR),
        ("calibration='bogus'", {"calibration": "bogus"}, ("calibration",), ERROR),
        ("calibration=3", {"calibration": 3}, ("calibration",), ERROR),
    ]
    if name == "OSCAR":
        out += [
            ("calibration=None", {"calibration": None}, ("calibration",), ERROR),
            ("calibration: one layer short", {"calibration": [oscar.identity_calibration(D)]}, ("calibration",), ERROR),
            (
                "calibration: other head dim",
                {"calibration": [oscar.identity_calibration(32)] * L},
                ("calibration", "head_dim"),
                ERROR,
            ),
        ]
    if M.METHODS[name].family == "aqua":
        out += [
            (
                "calibration: NaN predictors",
                {"calibration": predictors(fill=np.nan)},
                ("calibration", "predictor", "predictors", "f_key", "f_value"),
                ERROR,
            ),
            (
                "calibration: inf predictors",
                {"calibration": predictors(fill=np.inf)},
                ("calibration", "predictor", "predictors", "f_key", "f_value"),
                ERROR,
            ),
            (
                "calibration: 1e30 predictors",
                {"calibration": predictors(fill=1e30)},
                ("calibration", "predictor", "predictors", "f_key", "f_value"),
                OK_OR_ERROR,
            ),
            (
                "calibration: other F",
                {"calibration": predictors(F=2 * H * D)},
                ("calibration", "f_key", "f_value"),
                ERROR,
            ),
        ]
    over = {
        "KIVI-K2V2": "group_size",
        "Kitty": "group_size",
        "OSCAR": "page_size",
        "AQUA-KV": "buffer",
        "BitDecoding-4": "k_group",
    }
    if name in over:
        for bad in (0, -1, True, "8"):
            out.append((f"override {over[name]}={bad!r}", {over[name]: bad}, (over[name],), ERROR))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_store_constructor(name):
    rec = Recorder("store", f"KVStore({name}).__init__")
    for case, change, words, expect in _ctor_cases(name):
        kw = {**KW, "calibration": calibration(name), **SMALL[name], **change}

        def make(kw=kw):
            store = M.KVStore(name, **kw)
            if expect == OK_OR_ERROR:  # a store that was accepted must work and stay finite
                good_step(store)
            return store

        rec.call(case, make, names=words, expect=expect, oracle=lambda s: _kv_finite(s))
    rec.assert_clean()


@pytest.mark.parametrize("name", [n for n in NAMES if M.METHODS[n].family not in ("fp16",)])
def test_store_fp16_baseline_and_aqua_recover(name):
    """After a rejected first append (bf16 NaN), the store's dtype and batch are not fixed by it, and AQUA-KV's
    waiting tokens of a rejected commit do not stay behind (checked by ``followup`` in the catalogue too;
    here the FP16 store, item 5, and the order layer 0 then layer 1)."""
    rec = Recorder("store", f"KVStore({name}) layer order")
    victim, twin = build(name, 0), build(name, 0)
    k, v = tokens(20, 3)
    victim.append(0, k, v)
    twin.append(0, k, v)
    bad = _extreme(60000, everywhere=True)
    rec.call(
        "layer 1 near 6e4 after a good layer 0",
        lambda: victim.append(1, bad(k), bad(v)),
        names=("k", "K", "tokens", "token"),
        expect=OK_OR_ERROR,
        oracle=lambda r: _kv_finite(victim),
        states=[victim],
        followup=lambda: _followup_layers(victim, twin, k, v),
    )
    rec.assert_clean()


def _followup_layers(victim, twin, k, v):
    try:
        victim.append(1, k, v)
    except Exception as e:  # noqa: BLE001
        return f"a good append to layer 1 afterwards raised {type(e).__name__}: {str(e)[:200]}"
    twin.append(1, k, v)
    return followup(victim, twin)


def test_store_fp16_dtype_rules():
    """FP16: NaN / inf refused in the store's own dtype (item 5); a rejected first bf16 append does not fix the
    store's dtype (item 2)."""
    rec = Recorder("store", "KVStore(FP16) dtype rules")
    s = build("FP16", 0)
    s.append(0, _t(tokens(2, 1)[0].astype(np.float16)), _t(tokens(2, 1)[1].astype(np.float16)))
    for case, bad in (("fp16 NaN into an fp16 store", np.nan), ("fp16 inf into an fp16 store", np.inf)):
        k, v = tokens(2, 2)
        rec.call(
            case,
            lambda bad=bad: s.append(0, _t(_set(k, bad, np.float16)), _t(v.astype(np.float16))),
            names=("k",),
            expect=ERROR,
            states=[s],
        )
    victim, twin = build("FP16", 0), build("FP16", 0)
    k, v = tokens(2, 3)
    rec.call(
        "rejected first bf16 append",
        lambda: victim.append(0, _t(_set(k, np.nan), torch.bfloat16), _t(v, torch.bfloat16)),
        names=("k",),
        expect=ERROR,
        states=[victim],
        followup=lambda: followup(victim, twin),
    )
    rec.assert_clean()
