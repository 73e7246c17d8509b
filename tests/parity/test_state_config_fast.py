"""A fast cache state knows its configuration, and every call validates everything before the first
kernel launch (issue 36, items 1 and 2), in both fast backends (``kvq.fast.{triton,cupy}``).

For every method (KIVI, Kitty, OSCAR, BitDecoding, AQUA-KV): ``init`` records ``cfg`` and takes the
cache's ``device``; ``append`` / ``dequantize`` / ``decode_attention`` refuse another configuration of
the same method (the reference's error, same type and message), another method's configuration or
state, the other tier's state, a calibration / predictors that do not fit, and bad inputs (dtype,
shape, k vs v, capacity, NaN / inf, float16 overflow, NumPy arrays); after each refusal every tensor
of the state is bit-identical to its snapshot (``tests/state_cases.py``). The reproducer of issue 36
(the Triton OSCAR append with another configuration wrote out of bounds and killed the interpreter
process) now raises a clean ValueError.

Targets: Triton through the interpreter (CI, CPU) and, on the GPU (``pytest -m gpu``), Triton and CuPy.
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
import torch

from kvq.reference import aqua as RA
from kvq.reference import aqua_cache as RAC
from kvq.reference import bitdecoding as RB
from kvq.reference import kitty as RT
from kvq.reference import kivi as RK
from kvq.reference import oscar as RO

from ..state_cases import (CONFIGS, METHODS, PAIRS, SPECS, Tier, bad_kv, bad_q, build, other_configs, predictors,
                           query, rejects, snapshot, tokens)
from .cases import assert_same_error

REF = Tier({"kivi": RK, "kitty": RT, "oscar": RO, "bitdecoding": RB, "aqua_cache": RAC}, lambda a: a)


@pytest.fixture
def tier(fast_target):
    """The fast tier of ``fast_target``'s backend, inputs on its device."""
    backend, device = fast_target
    if backend == "cupy":
        pytest.importorskip("cupy")
    mods = {m: importlib.import_module(f"kvq.fast.{backend}.{m}") for m in METHODS}
    t = Tier(mods, lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device), fast=True)
    t.device = device
    return t


@pytest.fixture(params=METHODS)
def method(request):
    return request.param


def test_init_records_the_configuration(tier, method):
    cfg, dims, extra, st = build(tier, method)
    assert st.cfg is cfg and st.copy().cfg is cfg
    assert "cfg" not in st.arrays()
    assert st.device.type == tier.device


def test_other_configuration_is_refused(tier, method):
    """The reference's error (type and message), before any launch; the state unchanged."""
    cfg, dims, extra, st = build(tier, method)
    _, _, _, rs = build(REF, method)
    snap = snapshot(st)
    k, v = tokens(method, dims, 5, seed=3)
    q = query(method, dims)
    for other in other_configs(method):
        assert_same_error(lambda: REF.append(method, other, extra, rs, k, v),
                          lambda: tier.append(method, other, extra, st, k, v))
        rejects(lambda: tier.append(method, other, extra, st, k, v), ValueError, "cfg differs", st, snap, "append")
        assert_same_error(lambda: REF.dequantize(method, other, extra, rs),
                          lambda: tier.dequantize(method, other, extra, st))
        rejects(lambda: tier.dequantize(method, other, extra, st), ValueError, "cfg differs", st, snap, "dequantize")
        rejects(lambda: tier.decode(method, other, extra, st, q), ValueError, "cfg differs", st, snap, "decode")
    tier.append(method, dataclasses.replace(cfg), extra, st, k, v)          # an equal configuration is fine
    assert st.length == SPECS[method][2] + 5


@pytest.mark.parametrize("method,other", PAIRS, ids=[f"{m}-{o}" for m, o in PAIRS])
def test_other_method_is_refused(tier, method, other):
    cfg, dims, extra, st = build(tier, method)
    ocfg, odims, oextra, ost = build(tier, other)
    snap, osnap = snapshot(st), snapshot(ost)
    k, v = tokens(other, odims, 3)
    rejects(lambda: tier.append(method, cfg, extra, ost, k, v), TypeError, "state", ost, osnap, "foreign state")
    rejects(lambda: tier.dequantize(method, cfg, extra, ost), TypeError, "state", ost, osnap, "foreign state")
    rejects(lambda: tier.decode(method, cfg, extra, ost, query(other, odims)), TypeError, "state", ost, osnap,
            "decode of a foreign state")
    rejects(lambda: tier.append(method, ocfg, extra, ost, k, v), TypeError, "cfg must be", ost, osnap, "foreign cfg")
    k, v = tokens(method, dims, 3)
    rejects(lambda: tier.append(method, CONFIGS[other], extra, st, k, v), TypeError, "cfg must be", st, snap,
            "foreign cfg")


def test_the_other_tiers_state_is_refused(tier, method):
    cfg, dims, extra, st = build(tier, method)
    _, _, _, rs = build(REF, method)
    snap, rsnap = snapshot(st), snapshot(rs)
    k, v = tokens(method, dims, 3)
    rejects(lambda: tier.append(method, cfg, extra, rs, k, v), TypeError, r"state must be a kvq\.fast\.", rs, rsnap,
            "a reference state to the fast tier")
    rejects(lambda: tier.dequantize(method, cfg, extra, rs), TypeError, "state must be", rs, rsnap, "dequantize")
    rejects(lambda: REF.append(method, cfg, extra, st, k, v), TypeError, r"state must be a kvq\.reference\.", st,
            snap, "a fast state to the reference")


def test_bad_inputs_leave_the_state_unchanged(tier, method):
    cfg, dims, extra, st = build(tier, method)
    snap = snapshot(st)
    for label, k, v, exc, match in bad_kv(method, dims, cfg, fast=True):
        rejects(lambda: tier.append(method, cfg, extra, st, k, v), exc, match, st, snap, label)
    k, v = tokens(method, dims, 3)
    mod = tier.mods[method]
    rejects(lambda: mod.append(cfg, *extra, st, k, v), TypeError, "torch.Tensor", st, snap, "NumPy k, v")
    for label, q, exc, match in bad_q(method, dims):
        rejects(lambda: tier.decode(method, cfg, extra, st, q), exc, match, st, snap, label)
    rejects(lambda: tier.decode(method, cfg, extra, st, query(method, dims, np.float64)), TypeError, "dtype", st,
            snap, "float64 q")
    tier.append(method, cfg, extra, st, k, v)                              # still a working cache
    assert st.length == SPECS[method][2] + 3


def test_issue_36_reproducer(tier):
    """Triton OSCAR append with another configuration: an out-of-bounds write before; a ValueError now."""
    mod = tier.mods["oscar"]
    cal = RO.identity_calibration(32)
    cfg = RO.OSCARConfig(sink=2, window=8, group_size=32, page_size=8, max_tokens=64)
    st = mod.init(cfg, 1, 2, 32)
    g = torch.Generator().manual_seed(0)
    T = lambda *s: torch.randn(*s, generator=g).half().to(tier.device)           # noqa: E731
    mod.append(cfg, cal, st, T(1, 2, 13, 32), T(1, 2, 13, 32))
    snap = snapshot(st)
    other = RO.OSCARConfig(sink=0, window=4, group_size=32, page_size=4, max_tokens=64)
    rejects(lambda: mod.append(other, cal, st, T(1, 2, 5, 32), T(1, 2, 5, 32)), ValueError,
            r"cfg differs.*sink=0 \(state: 2\); window=4 \(state: 8\); page_size=4 \(state: 8\)", st, snap, "issue 36")
    for kc in (RK.KIVIConfig(2, 2, group_size=8, residual=4, max_tokens=64),
               RT.KittyConfig(group_size=8, residual=4, sink=2, max_tokens=64)):
        m = tier.mods["kivi" if isinstance(kc, RK.KIVIConfig) else "kitty"]
        s = m.init(kc, 1, 2, 32)
        m.append(kc, s, T(1, 2, 13, 32), T(1, 2, 13, 32))
        snap = snapshot(s)
        for bad in (dataclasses.replace(kc, group_size=16), dataclasses.replace(kc, residual=8)):
            rejects(lambda: m.append(bad, s, T(1, 2, 9, 32), T(1, 2, 9, 32)), ValueError, "cfg differs", s, snap,
                    "kivi / kitty with another configuration")


def test_oscar_calibration_must_fit(tier):
    cfg, dims, (cal,), st = build(tier, "oscar")
    _, _, _, rs = build(REF, "oscar")
    snap = snapshot(st)
    k, v = tokens("oscar", dims, 5)
    q = query("oscar", dims)
    eye = np.eye(32, dtype=np.float32)
    for bad in (RO.identity_calibration(64), RO.OSCARCalibration(np.stack([eye] * 3), np.stack([eye] * 3)), None):
        assert_same_error(lambda: RO.append(cfg, bad, rs, k, v), lambda: tier.append("oscar", cfg, (bad,), st, k, v))
        assert_same_error(lambda: RO.dequantize(cfg, bad, rs), lambda: tier.dequantize("oscar", cfg, (bad,), st))
        rejects(lambda: tier.append("oscar", cfg, (bad,), st, k, v), (TypeError, ValueError), "calib", st, snap, "cal")
        rejects(lambda: tier.mods["oscar"].dequantize(cfg, bad, st, rotated=True), (TypeError, ValueError), "calib",
                st, snap, "dequantize rotated")
        rejects(lambda: tier.decode("oscar", cfg, (bad,), st, q), (TypeError, ValueError), "calib", st, snap, "decode")


def test_aqua_predictors_must_fit(tier):
    cfg, (L, B, H, D), (P,), st = build(tier, "aqua_cache")
    _, _, _, rs = build(REF, "aqua_cache")
    snap = snapshot(st)
    k, v = tokens("aqua_cache", (L, B, H, D), 9)
    mod = tier.mods["aqua_cache"]
    q = tier.T(query("aqua_cache", (L, B, H, D)))
    for bad in (predictors(L + 1, H * D), predictors(L, 2 * H * D), RA.AquaPredictors(P.f_key, (None, P.f_key[1])),
                RA.AquaPredictors((None, "f"), P.f_value), None):
        assert_same_error(lambda: RAC.append(cfg, bad, rs, k, v),
                          lambda: tier.append("aqua_cache", cfg, (bad,), st, k, v))
        assert_same_error(lambda: RAC.dequantize(cfg, bad, rs), lambda: mod.dequantize(cfg, bad, st))
        with pytest.raises((TypeError, ValueError), match="predictors|Predictor|AquaPredictors"):
            mod.decode_layer(cfg, bad, st, 1)
        with pytest.raises((TypeError, ValueError), match="predictors|Predictor|AquaPredictors"):
            mod.decode_attention(cfg, bad, st, 0, q)
        assert snapshot(st) == snap


def test_init_device(tier, method):
    """``device``: where the cache lives (a CUDA device; the CPU only under the Triton interpreter)."""
    cfg, dims = SPECS[method][0], SPECS[method][1]
    mod = tier.mods[method]
    if tier.device == "cpu":
        assert mod.init(cfg, *dims, device="cpu").device == torch.device("cpu")
        assert mod.init(cfg, *dims, device=torch.device("cpu")).cfg is cfg
        with pytest.raises(ValueError, match="device"):
            mod.init(cfg, *dims, device="cuda:0")                           # no GPU on this machine
    else:
        idx = torch.cuda.device_count() - 1
        assert mod.init(cfg, *dims, device=f"cuda:{idx}").device == torch.device("cuda", idx)
        with pytest.raises(ValueError, match="device"):
            mod.init(cfg, *dims, device="cpu")
    with pytest.raises(ValueError, match="device"):
        mod.init(cfg, *dims, device="meta")
    other = next(c for c in CONFIGS.values() if type(c) is not type(cfg))
    with pytest.raises(TypeError, match="cfg must be"):
        mod.init(other, *dims)
