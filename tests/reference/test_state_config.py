"""A cache state knows its configuration, and every call validates everything before the first write
(issue 36, items 1 and 2), in the reference tier.

For every method (KIVI, Kitty, OSCAR, BitDecoding, AQUA-KV): ``init`` records ``cfg``; ``append`` /
``dequantize`` / ``decode_attention`` refuse another configuration of the same method, another method's
configuration or state, a calibration / predictors that do not fit, and bad inputs, and the state is
bit-identical after each refusal (``tests/state_cases.py``). Configurations validate every field at
construction (a bool is not an int, enumerations are checked, ...).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvq.reference import aqua as RA
from kvq.reference import aqua_cache as RAC
from kvq.reference import bitdecoding as RB
from kvq.reference import kitty as RT
from kvq.reference import kivi as RK
from kvq.reference import oscar as RO
from kvq.reference import state as S

from ..state_cases import (CONFIGS, METHODS, PAIRS, SPECS, Tier, bad_kv, bad_q, build, other_configs, predictors, query,
                           rejects, snapshot, tokens)

REF = Tier({"kivi": RK, "kitty": RT, "oscar": RO, "bitdecoding": RB, "aqua_cache": RAC}, lambda a: a)


@pytest.fixture(params=METHODS)
def method(request):
    return request.param


def test_init_records_the_configuration(method):
    cfg, dims, extra, st = build(REF, method)
    assert st.cfg is cfg
    assert "cfg" not in st.arrays()                                     # parity comparisons are unchanged
    assert st.copy().cfg is cfg and "cfg=" not in repr(st)


def test_other_configuration_is_refused(method):
    cfg, dims, extra, st = build(REF, method)
    snap = snapshot(st)
    k, v = tokens(method, dims, 5, seed=3)
    for other in other_configs(method):
        assert other != cfg
        rejects(lambda: REF.append(method, other, extra, st, k, v), ValueError, "cfg differs", st, snap,
                f"append with {other}")
        rejects(lambda: REF.dequantize(method, other, extra, st), ValueError, "cfg differs", st, snap, "dequantize")
        if REF.has_decode(method):
            rejects(lambda: REF.decode(method, other, extra, st, query(method, dims)), ValueError, "cfg differs",
                    st, snap, "decode_attention")
    # an equal configuration (another object) is the same configuration
    REF.append(method, dataclasses.replace(cfg), extra, st, k, v)
    assert st.length == SPECS[method][2] + 5


def test_message_names_the_fields():
    cfg, dims, extra, st = build(REF, "oscar")
    other = dataclasses.replace(cfg, sink=0, window=8)
    with pytest.raises(ValueError, match=r"sink=0 \(state: 2\); window=8 \(state: 4\)\. .*pass state\.cfg"):
        RO.append(other, *extra, st, *tokens("oscar", dims, 5))


@pytest.mark.parametrize("method,other", PAIRS, ids=[f"{m}-{o}" for m, o in PAIRS])
def test_other_method_is_refused(method, other):
    """Another method's state (KIVI's given to Kitty, OSCAR's to KIVI, ...) or configuration: TypeError."""
    cfg, dims, extra, st = build(REF, method)
    ocfg, odims, oextra, ost = build(REF, other)
    snap, osnap = snapshot(st), snapshot(ost)
    k, v = tokens(other, odims, 3)
    # this method's function given the other method's state (with this method's cfg, or the other's)
    rejects(lambda: REF.append(method, cfg, extra, ost, k, v), TypeError, "state", ost, osnap, "foreign state")
    rejects(lambda: REF.dequantize(method, cfg, extra, ost), TypeError, "state", ost, osnap, "foreign state")
    rejects(lambda: REF.append(method, ocfg, extra, ost, k, v), TypeError, "cfg must be", ost, osnap, "foreign cfg")
    # this method's state given another method's configuration
    k, v = tokens(method, dims, 3)
    rejects(lambda: REF.append(method, CONFIGS[other], extra, st, k, v), TypeError, "cfg must be", st, snap,
            "foreign cfg")
    if REF.has_decode(method):
        rejects(lambda: REF.decode(method, cfg, extra, ost, query(method, dims)), TypeError, "state", ost, osnap,
                "decode of a foreign state")


def test_kivi_kitty_share_a_class_not_a_cache():
    """KIVI and Kitty states are both PagedState: the recorded configuration tells them apart."""
    _, dims, _, kst = build(REF, "kivi")
    _, _, _, tst = build(REF, "kitty")
    k, v = tokens("kivi", dims, 3)
    snap = snapshot(tst)
    rejects(lambda: RK.append(CONFIGS["kivi"], tst, k, v), TypeError, "state is a Kitty cache", tst, snap, "kitty st")
    snap = snapshot(kst)
    rejects(lambda: RT.append(CONFIGS["kitty"], kst, k, v), TypeError, "state is a KIVI cache", kst, snap, "kivi st")
    rejects(lambda: RT.decode_attention(CONFIGS["kitty"], kst, query("kivi", dims)), TypeError, "KIVI cache", kst,
            snap, "decode")


def test_bad_inputs_leave_the_state_unchanged(method):
    cfg, dims, extra, st = build(REF, method)
    snap = snapshot(st)
    for label, k, v, exc, match in bad_kv(method, dims, cfg, fast=False):
        rejects(lambda: REF.append(method, cfg, extra, st, k, v), exc, match, st, snap, label)
    if REF.has_decode(method):
        for label, q, exc, match in bad_q(method, dims):
            rejects(lambda: REF.decode(method, cfg, extra, st, q), exc, match, st, snap, label)


def _layout(method, cfg, dims):
    return {n: (a.shape, a.dtype) for n, a in REF.init(method, cfg, dims).arrays().items()}


def test_a_state_built_field_by_field(method):
    """A state without ``cfg`` (built around another tier's arrays) is checked array by array against the
    layout init gives the configuration: one that fits is used, one that does not is refused."""
    cfg, dims, extra, st = build(REF, method)
    bare = dataclasses.replace(st.copy(), cfg=None)
    snap = snapshot(bare)
    k, v = tokens(method, dims, 2)
    refused = 0
    for other in other_configs(method):
        try:
            fits = _layout(method, other, dims) == _layout(method, cfg, dims)
        except ValueError:                                  # the other configuration does not take these dims
            fits = False
        if not fits:
            refused += 1
            rejects(lambda: REF.append(method, other, extra, bare, k, v), ValueError,
                    "does not record its configuration", bare, snap, f"bare state with {other}")
            rejects(lambda: REF.dequantize(method, other, extra, bare), ValueError,
                    "does not record its configuration", bare, snap, "dequantize")
    assert refused >= 2
    REF.append(method, cfg, extra, bare, k, v)
    REF.append(method, cfg, extra, st, k, v)
    assert snapshot(dataclasses.replace(bare, cfg=cfg)) == snapshot(st)        # the same bytes as with cfg
    empty = type(st)(**{f.name: getattr(st, f.name) for f in dataclasses.fields(st) if f.name not in ("shape", "cfg")})
    rejects(lambda: REF.append(method, cfg, extra, empty, k, v), ValueError, "does not fit its shape", empty,
            snapshot(empty), "a bare state without its shape")


def test_a_counter_changed_by_hand(method):
    cfg, dims, extra, st = build(REF, method)
    for bad in (-1, cfg.max_tokens + 1, 2.0, None):
        st2 = dataclasses.replace(st, length=bad)
        rejects(lambda: REF.append(method, cfg, extra, st2, *tokens(method, dims, 1)), ValueError, "state.length",
                st2, snapshot(st2), f"length={bad!r}")


def test_oscar_calibration_must_fit():
    cfg, dims, (cal,), st = build(REF, "oscar")
    snap = snapshot(st)
    k, v = tokens("oscar", dims, 5)
    q = query("oscar", dims)
    wide = RO.identity_calibration(64)
    eye = np.eye(32, dtype=np.float32)
    per_head = RO.OSCARCalibration(np.stack([eye] * 3), np.stack([eye] * 3))          # 3 KV heads, the cache has 2
    for bad, exc, match in ((wide, ValueError, "calibration"), (per_head, ValueError, "calibration"),
                            (None, TypeError, "OSCARCalibration"), ("identity", TypeError, "OSCARCalibration")):
        rejects(lambda: RO.append(cfg, bad, st, k, v), exc, match, st, snap, f"append calib {bad!r:.20}")
        rejects(lambda: RO.dequantize(cfg, bad, st), exc, match, st, snap, "dequantize calib")
        rejects(lambda: RO.dequantize(cfg, bad, st, rotated=True), exc, match, st, snap, "dequantize calib")
        rejects(lambda: RO.decode_attention(cfg, bad, st, q), exc, match, st, snap, "decode calib")


def test_aqua_predictors_must_fit():
    cfg, (L, B, H, D), (P,), st = build(REF, "aqua_cache")
    snap = snapshot(st)
    k, v = tokens("aqua_cache", (L, B, H, D), 9)                 # fills a chunk: the predictors would run
    F = H * D
    good, gv = P.f_key[1], P.f_value[1]
    wrong_f = predictors(L, 2 * F)                               # calibrated for twice the heads
    f64 = RA.AquaPredictors(P.f_key, (None, RA.Predictor((gv.mats[0].astype(np.float64),), gv.bias)))
    odd = RA.AquaPredictors((None, "f"), P.f_value)
    for bad, exc, match in ((predictors(L + 1, F), ValueError, "predictors are for 3 layers"),
                            (wrong_f, ValueError, r"f_key\[1\] must map 32 -> 32"),
                            (RA.AquaPredictors(P.f_key, (None, good)), ValueError, r"f_value\[1\] must map 64"),
                            (f64, ValueError, r"f_value\[1\] must map 64 -> 32.*float64"),
                            (odd, TypeError, "Predictor or None"),
                            (None, TypeError, "AquaPredictors")):
        rejects(lambda: RAC.append(cfg, bad, st, k, v), exc, match, st, snap, f"append P {bad!r:.20}")
        rejects(lambda: RAC.dequantize(cfg, bad, st), exc, match, st, snap, "dequantize P")
    # predictors the configuration does not use are not read: predict_values=False ignores f_value
    k13, v13 = tokens("aqua_cache", (L, B, H, D), 13)           # sink 2 + one chunk of 8 + 3
    cfg2 = dataclasses.replace(cfg, predict_values=False)
    st2 = RAC.init(cfg2, L, B, H, D)
    RAC.append(cfg2, RA.AquaPredictors(P.f_key, (None, good)), st2, k13, v13)
    # None means no prediction for that layer
    st3 = RAC.init(cfg, L, B, H, D)
    RAC.append(cfg, RA.AquaPredictors((None, None), (None, None)), st3, k13, v13)
    assert st2.length == st3.length == 13


def test_aqua_uniform_backbone_must_fit_the_heads():
    cfg = RA.AquaConfig(backbone=RA.Uniform(2, 48), first_layer=RA.Uniform(4, 32), sink=2, buffer=8, max_tokens=48)
    with pytest.raises(ValueError, match="backbone: uniform groups of 48"):
        RAC.init(cfg, 2, 1, 2, 16)


def test_init_checks_its_arguments(method):
    cfg, dims, _, _ = SPECS[method][0], SPECS[method][1], None, None
    mod = REF.mods[method]
    other = next(c for m, c in CONFIGS.items() if type(c) is not type(cfg))
    with pytest.raises(TypeError, match="cfg must be"):
        mod.init(other, *dims)
    for i in range(len(dims)):
        for bad in (0, -1, True, 2.0, "2"):
            d = list(dims)
            d[i] = bad
            with pytest.raises(ValueError, match="must be a positive int"):
                mod.init(cfg, *d)
    assert mod.init(cfg, *dims, device="cpu").cfg is cfg
    with pytest.raises(ValueError, match="host"):
        mod.init(cfg, *dims, device="cuda:0")


# ---------------------------------------------------------------------------------------------------
# configurations validate every field at construction


BAD_CONFIGS = [                                   # (class, the bad field, what the error must say)
    (RK.KIVIConfig, dict(v_group_size=True), "v_group_size"), (RK.KIVIConfig, dict(v_group_size=0), "v_group_size"),
    (RK.KIVIConfig, dict(v_group_size=16.0), "v_group_size"), (RK.KIVIConfig, dict(k_bits=True), "bits=True"),
    (RK.KIVIConfig, dict(sink=-1), "sink"), (RK.KIVIConfig, dict(residual=1.5), "residual"),
    (RK.KIVIConfig, dict(max_tokens=0), "max_tokens"), (RK.KIVIConfig, dict(group_size=False), "group_size"),
    (RK.KIVIConfig, dict(meta_dtype="float64"), "meta_dtype"), (RK.KIVIConfig, dict(name=None), "name"),
    (RT.KittyConfig, dict(selection="random", seed="x"), "seed"), (RT.KittyConfig, dict(seed=-1), "seed"),
    (RT.KittyConfig, dict(seed=True), "seed"), (RT.KittyConfig, dict(seed=1.0), "seed"),
    (RT.KittyConfig, dict(boost_rate="0.5"), "boost_rate"), (RT.KittyConfig, dict(boost_rate=True), "boost_rate"),
    (RT.KittyConfig, dict(boost_rate=float("nan")), "boost_rate"),
    (RT.KittyConfig, dict(boost_rate=-0.1), "boost_rate"),
    (RT.KittyConfig, dict(selection=["magnitude"]), "selection"), (RT.KittyConfig, dict(selection=None), "selection"),
    (RT.KittyConfig, dict(v_bits=3), "bits=3"), (RT.KittyConfig, dict(group_size=6), "group_size"),
    (RT.KittyConfig, dict(max_tokens=True), "max_tokens"), (RT.KittyConfig, dict(name=1), "name"),
    (RO.OSCARConfig, dict(bits=True), "bits=True"), (RO.OSCARConfig, dict(window=-1), "window"),
    (RO.OSCARConfig, dict(page_size=0), "page_size"), (RO.OSCARConfig, dict(group_size=32.0), "group_size"),
    (RO.OSCARConfig, dict(max_tokens=None), "max_tokens"), (RO.OSCARConfig, dict(meta_dtype="int8"), "meta_dtype"),
    (RO.OSCARConfig, dict(name=b"x"), "name"),
    (RB.BitDecodingConfig, dict(bits=8), "bits=8"), (RB.BitDecodingConfig, dict(k_mode=["channel"]), "k_mode"),
    (RB.BitDecodingConfig, dict(k_mode="row"), "k_mode"), (RB.BitDecodingConfig, dict(warps_n=True), "warps_n"),
    (RB.BitDecodingConfig, dict(k_group=12), "k_group"), (RB.BitDecodingConfig, dict(max_tokens=-5), "max_tokens"),
    (RB.BitDecodingConfig, dict(name=None), "name"),
    (RA.AquaConfig, dict(pre_rope="yes"), "pre_rope"), (RA.AquaConfig, dict(predict_keys=1), "predict_keys"),
    (RA.AquaConfig, dict(predict_values=None), "predict_values"), (RA.AquaConfig, dict(rope_theta=0.0), "rope_theta"),
    (RA.AquaConfig, dict(rope_theta=True), "rope_theta"), (RA.AquaConfig, dict(rope_theta="1e4"), "rope_theta"),
    (RA.AquaConfig, dict(rope_theta=float("inf")), "rope_theta"),
    (RA.AquaConfig, dict(pre_rope=False, rope_theta=-1.0), "rope_theta"), (RA.AquaConfig, dict(sink=True), "sink"),
    (RA.AquaConfig, dict(buffer=0), "buffer"), (RA.AquaConfig, dict(max_tokens=2.5), "max_tokens"),
    # a Uniform backbone checks its fields itself (issue 36's battery): refused before any AquaConfig holds it
    (RA.Uniform, dict(bits=2, group_size=0), "group_size"),
    (RA.Uniform, dict(bits=2, group_size=True), "group_size"),
    (RA.Uniform, dict(bits=2, group_size=32, meta_dtype="float64"), "meta_dtype"),
]


@pytest.mark.parametrize("cls,kw,match", BAD_CONFIGS,
                         ids=[f"{c.__name__}-{'-'.join(f'{k}={v!r}' for k, v in kw.items())}"[:60]
                              for c, kw, _ in BAD_CONFIGS])
def test_bad_configuration_fields(cls, kw, match):
    """Every field is checked at construction: never a configuration that fails halfway through an append."""
    with pytest.raises(ValueError, match=match):
        cls(**kw)


def test_good_configurations_still_construct():
    RK.KIVIConfig(v_group_size=np.int64(32), group_size=np.int64(64))
    RT.KittyConfig(boost_rate=np.float32(0.25), seed=np.int64(3), selection="random")
    RT.KittyConfig(boost_rate=1)
    RA.AquaConfig(pre_rope=np.bool_(False), rope_theta=None)
    RA.AquaConfig(rope_theta=500000)
    for m in ("kivi", "kitty", "oscar", "bitdecoding"):
        for c in REF.mods[m].CONFIGS.values():
            assert S.same_config(c, dataclasses.replace(c))


def test_same_config_compares_array_fields():
    from kvq.reference import higgs

    grid = higgs.load_grid(2, 16)
    a = RA.AquaConfig(backbone=RA.Higgs(higgs.HiggsConfig(grid=grid.copy())))
    b = RA.AquaConfig(backbone=RA.Higgs(higgs.HiggsConfig(grid=grid.copy())))
    c = RA.AquaConfig(backbone=RA.Higgs(higgs.HiggsConfig(grid=grid[::-1].copy())))
    assert S.same_config(a, b) and not S.same_config(a, c)
    assert S.config_diff(a, c) and S.config_diff(a, b) == []


def test_every_method_registers_its_layout():
    """state.check_layout reads the layout of a hand-built state from the ``init`` its method's module
    registered (so that kvq.reference.state imports no method); a configuration no method registered is a
    TypeError, not a wrong layout."""
    for cfg_type, mod in ((RK.KIVIConfig, RK), (RT.KittyConfig, RT), (RO.OSCARConfig, RO),
                          (RB.BitDecodingConfig, RB), (RA.AquaConfig, RAC)):
        assert S._LAYOUTS[cfg_type] is mod.init

    @dataclasses.dataclass(frozen=True)
    class StrayConfig:
        max_tokens: int = 8

    st = RK.init(RK.CONFIGS["KIVI-K2V2"], 1, 1, 128)
    with pytest.raises(TypeError, match="no state layout is registered for StrayConfig"):
        S.check_layout(st, StrayConfig())


def test_paged_configurations_share_a_base():
    """The paged cache's counts know KIVI's and Kitty's configurations by their base class
    (``paged.PagedConfig``, no fields of its own), not by importing the methods; others are refused."""
    from kvq.reference import paged as RP
    for cfg in (RK.CONFIGS["KIVI-K2V2"], RT.CONFIGS["Kitty"]):
        assert isinstance(cfg, RP.PagedConfig) and RP.counts(cfg, 300)["n_sink"] == min(300, cfg.sink)
    assert RP.PagedConfig.__slots__ == () and not dataclasses.is_dataclass(RP.PagedConfig)   # no fields of its own
    for cfg in (RO.CONFIGS["OSCAR"], RB.CONFIGS["BitDecoding-KC2"]):
        with pytest.raises(TypeError, match="cfg must be a KIVIConfig or a KittyConfig"):
            RP.counts(cfg, 300)
