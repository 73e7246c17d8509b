"""Specs of the per-layer caches (KIVI, Kitty, OSCAR, BitDecoding), of AQUA-KV's cross-layer cache and
of their configurations.

Every cache spec builds a small valid state (a few tokens already appended with the tier's own append),
then breaks one argument: k / v (NaN, dtype, device, shape, too many tokens), the config (another
method's, or the same method's with other sizes: a state does not fit another config's buffers), the
state (another method's, another config's), the calibration. A rejected call must leave the state
bit-identical; an accepted one (e.g. float64 input, an empty append) must give the canonical call's state.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ._core import OK_OR_ERROR, all_finite, snapshot, snapshot_diff
from .engine import Arg, Skip, Spec, alt, like, np_of
from .strategies import STYLES, orthogonal, values

F16, F32 = np.float16, np.float32
BOTH = ("reference", "triton")
STATE_WORDS = ("state", "st", "cfg", "config", "cache", "buffers", "shape")
CFG_WORDS = ("cfg", "config", "state", "cache")


# ---------------------------------------------------------------------------------------------------
# configs drawn small


def draw_cfg(d, method: str):
    """(cfg, D) of a small valid configuration of ``method``."""
    from kvq.reference import bitdecoding, kitty, kivi, oscar

    if method == "kivi":
        D = d.choice((16, 32))
        kb = d.choice((2, 4))
        return (
            kivi.KIVIConfig(
                k_bits=kb,
                v_bits=d.choice((2, 4)),
                group_size=d.choice((4, 8)),
                residual=d.choice((2, 4)),
                sink=d.choice((0, 2)),
                max_tokens=40,
            ),
            D,
        )
    if method == "kitty":
        D = d.choice((16, 32))
        return (
            kitty.KittyConfig(
                boost_rate=d.choice((0.125, 0.25)),
                selection=d.choice(("magnitude", "random")),
                group_size=d.choice((4, 8)),
                residual=d.choice((2, 4)),
                sink=d.choice((0, 2)),
                v_bits=d.choice((2, 4)),
                max_tokens=40,
            ),
            D,
        )
    if method == "oscar":
        D = d.choice((16, 32))
        return (
            oscar.OSCARConfig(
                sink=d.choice((0, 2)),
                window=d.choice((2, 4)),
                group_size=d.choice((D, D // 2)),
                page_size=d.choice((2, 4)),
                bits=d.choice((2, 4)),
                max_tokens=40,
            ),
            D,
        )
    if method == "bitdecoding":
        bits = d.choice((4, 4, 2))
        D = 32 if bits == 4 else 64
        n_r = 32 if bits == 4 else 64
        mode = d.choice(("channel", "tensor"))
        return (
            bitdecoding.BitDecodingConfig(
                bits=bits,
                k_mode=mode,
                k_group=d.choice((8, 16)),
                v_group=d.choice((8, 16, 32)),
                warps_n=1,
                max_tokens=2 * n_r,
            ),
            D,
        )
    raise ValueError(method)


def small_cfg(method: str, D: int):
    """A fixed small config of ``method`` that serves head dim ``D`` (for 'another method's state')."""
    from kvq.reference import bitdecoding, kitty, kivi, oscar

    if method == "kivi":
        return kivi.KIVIConfig(group_size=4, residual=2, max_tokens=40)
    if method == "kitty":
        return kitty.KittyConfig(group_size=4, residual=2, sink=2, max_tokens=40)
    if method == "oscar":
        return oscar.OSCARConfig(sink=2, window=2, group_size=D, page_size=2, max_tokens=40)
    if method == "bitdecoding":
        if D % 32:
            return None
        return bitdecoding.BitDecodingConfig(bits=4, warps_n=1, k_group=8, v_group=8, max_tokens=64)
    raise ValueError(method)


#: same method, other sizes: (field, new value function)
MISMATCH = {
    "kivi": (
        ("group_size", lambda c: 8 if c.group_size == 4 else 4),
        ("residual", lambda c: c.residual + 2),
        ("sink", lambda c: c.sink + 2),
        ("k_bits", lambda c: 4 if c.k_bits == 2 else 2),
        ("v_bits", lambda c: 4 if c.v_bits == 2 else 2),
        ("max_tokens", lambda c: c.max_tokens * 2),
    ),
    "kitty": (
        ("group_size", lambda c: 8 if c.group_size == 4 else 4),
        ("residual", lambda c: c.residual + 2),
        ("sink", lambda c: c.sink + 2),
        ("v_bits", lambda c: 4 if c.v_bits == 2 else 2),
        ("max_tokens", lambda c: c.max_tokens * 2),
    ),
    "oscar": (
        ("sink", lambda c: c.sink + 2),
        ("window", lambda c: c.window + 2),
        ("page_size", lambda c: c.page_size * 2),
        ("group_size", lambda c: c.group_size // 2),
        ("bits", lambda c: 4 if c.bits == 2 else 2),
        ("max_tokens", lambda c: c.max_tokens * 2),
    ),
    "bitdecoding": (
        ("k_mode", lambda c: "tensor" if c.k_mode == "channel" else "channel"),
        ("k_group", lambda c: 16 if c.k_group == 8 else 8),
        ("v_group", lambda c: 16 if c.v_group == 8 else 8),
        ("bits", lambda c: 2 if c.bits == 4 else 4),
        ("warps_n", lambda c: 2),
        ("max_tokens", lambda c: c.max_tokens * 2),
    ),
}
METHODS = ("kivi", "kitty", "oscar", "bitdecoding")


def _calib(seed: int, kind: str, H: int, D: int):
    from kvq.reference import oscar

    if kind == "identity":
        return oscar.identity_calibration(D)
    lead = (H,) if kind == "per_head" else ()
    return oscar.OSCARCalibration(orthogonal(seed, D, lead), orthogonal(seed + 1, D, lead), 0.9, 0.95)


class Setup:
    """One drawn cache: config, shape, tokens already appended, and the tier's module."""

    def __init__(self, d, tier, method: str, t0=(0, 12), nonempty: bool = False):
        self.tier, self.method = tier, method
        self.cfg, self.D = draw_cfg(d, method)
        self.B, self.H = d.int(1, 2), d.choice((1, 2))
        lo, hi = t0
        if method == "bitdecoding":
            hi = min(self.cfg.max_tokens - 8, self.cfg.n_r + 4)
        self.T0 = d.int(max(lo, 1 if nonempty else 0), hi)
        self.T = d.int(1, 6)
        self.seed, self.style = d.seed(), d.choice(STYLES)
        self.dtype = d.choice((F16, F32))
        self.calib_kind = d.choice(("identity", "shared", "per_head")) if method == "oscar" else None

    @property
    def mod(self):
        return self.tier.mod(self.method)

    def calib(self):
        return _calib(self.seed, self.calib_kind, self.H, self.D) if self.method == "oscar" else None

    def kv(self, T, seed_off=0):
        shape = (self.B, self.H, T, self.D)
        return (
            self.tier.arr(values(self.seed + 10 + seed_off, shape, self.dtype, self.style)),
            self.tier.arr(values(self.seed + 20 + seed_off, shape, self.dtype, self.style)),
        )

    def state(self, cfg=None, T0=None):
        cfg = self.cfg if cfg is None else cfg
        st = self.tier.init(self.method, cfg, self.B, self.H, self.D)
        T0 = self.T0 if T0 is None else T0
        if T0:
            k, v = self.kv(T0, 1)
            if self.method == "oscar":
                self.mod.append(cfg, self.calib(), st, k, v)
            else:
                self.mod.append(cfg, st, k, v)
        return st

    def head(self):
        """The leading kwargs: cfg (and calib for OSCAR)."""
        kw = {"cfg": self.cfg}
        if self.method == "oscar":
            kw["calib"] = self.calib()
        return kw


def _mismatch_alts(method):
    out = []
    for fname, new in MISMATCH[method]:

        def f(x, c, fname=fname, new=new):
            try:
                return dataclasses.replace(x, **{fname: new(x)})
            except (ValueError, TypeError):
                raise Skip("not a valid config")

        out.append(alt(f"cfg_other_{fname}", f))
    return out


def _other_method_cfg_alts(method):
    from kvq.reference import aqua

    out = []
    for m in METHODS:
        if m != method:
            out.append(alt(f"{m}_cfg", lambda x, c, m=m: small_cfg(m, 32) or small_cfg("kivi", 32)))
    out.append(alt("aqua_cfg", lambda x, c: aqua.AquaConfig(buffer=4, max_tokens=40)))
    return out


def _other_state_alts(method):
    out = []
    for m in METHODS:
        if m == method:
            continue

        def f(x, c, m=m):
            B, H, D = tuple(x.shape)[-3:]
            cfg = small_cfg(m, D)
            if cfg is None:
                raise Skip("head dim not served")
            return c.tier.init(m, cfg, B, H, D)

        out.append(alt(f"{m}_state", f))

    def aqua_state(x, c):
        from kvq.reference import aqua

        B, H, D = tuple(x.shape)[-3:]
        cfg = aqua.AquaConfig(backbone=aqua.Uniform(2, D), first_layer=aqua.Uniform(4, D), buffer=4, max_tokens=40)
        return c.tier.init("aqua_cache", cfg, 1, B, H, D)

    out.append(alt("aqua_state", aqua_state))

    def other_cfg_state(x, c):
        cfg = c.kwargs["cfg"]
        for fname, new in MISMATCH[c.extra_method]:
            try:
                other = dataclasses.replace(cfg, **{fname: new(cfg)})
            except (ValueError, TypeError):
                continue
            B, H, D = tuple(x.shape)[-3:]
            return c.tier.init(c.extra_method, other, B, H, D)
        raise Skip("no mismatch")

    out.append(alt("state_of_other_config", other_cfg_state))
    return out


def _over_capacity(x, c):
    cfg = c.kwargs["cfg"]
    a = np_of(x)
    return like(x, np.zeros(a.shape[:2] + (cfg.max_tokens + 1,) + a.shape[3:], a.dtype))


def _other_T(x, c):
    a = np_of(x)
    return like(x, np.zeros(a.shape[:2] + (a.shape[2] + 1,) + a.shape[3:], a.dtype))


def _heads_plus(x, c):
    a = np_of(x)
    return like(x, np.zeros((a.shape[0], a.shape[1] + 1) + a.shape[2:], a.dtype))


def _f16max(x, c):
    a = np_of(x).astype(F16)
    a = a.copy()
    a[..., 0] = F16(65504)
    a[..., -1] = F16(-65504)
    return like(x, a)


def _append_check(method):
    def check(result, kw, tier):
        if result is None:
            return "append returned None"
        mod = tier.mod(method)
        st = kw["state"]
        if getattr(st, "length", 0) == 0:
            return None
        try:
            out = mod.dequantize(kw["cfg"], kw["calib"], st) if method == "oscar" else mod.dequantize(kw["cfg"], st)
        except Exception as e:  # noqa: BLE001
            return f"dequantize after the append raised {type(e).__name__}: {str(e)[:200]}"
        return all_finite(out)

    return check


def cache_specs(method: str):
    """init / append / dequantize / decode_attention of one method's cache, on both tiers."""

    def setup_base(d, tier, nonempty=False):
        return Setup(d, tier, method, nonempty=nonempty)

    def append_base(d, tier):
        s = setup_base(d, tier)

        def make():
            kw = s.head()
            kw["state"] = s.state()
            kw["k"], kw["v"] = s.kv(s.T)
            return kw

        return make

    def _empty(x, c):
        a = np_of(x)
        return like(x, np.zeros(a.shape[:2] + (0,) + a.shape[3:], a.dtype))

    kv_alts = [
        alt(
            "other_head_dim",
            lambda x, c: like(x, np.zeros(np_of(x).shape[:3] + (np_of(x).shape[3] + 8,), np_of(x).dtype)),
        ),
        alt(
            "other_batch", lambda x, c: like(x, np.zeros((np_of(x).shape[0] + 1,) + np_of(x).shape[1:], np_of(x).dtype))
        ),
        alt("other_heads", _heads_plus),
        alt("other_T_than_v", _other_T),
        alt("over_capacity", _over_capacity),
        alt("f16max", _f16max, OK_OR_ERROR, oracle=lambda r, c: None),
    ]

    def kv_arg(name):
        alts = (
            list(kv_alts)
            if name == "k"
            else [a for a in kv_alts if a.id in ("alt:other_head_dim", "alt:other_T_than_v")]
        )
        alts.append(alt("empty", _empty, OK_OR_ERROR, canonical=None, oracle=None))
        return Arg(name, "data", names=(name, "k and v", "K", "V"), alts=alts)

    state_alts = _other_state_alts(method)
    for a in state_alts:
        f = a.apply

        def g(x, c, f=f):
            c.extra_method = method
            return f(x, c)

        a.apply = g

    cfg_arg = Arg("cfg", "object", names=CFG_WORDS, alts=_mismatch_alts(method) + _other_method_cfg_alts(method))
    state_arg = Arg("state", "object", names=STATE_WORDS, alts=state_alts)
    calib_args = []
    if method == "oscar":
        from kvq.reference import oscar as RO

        calib_args = [
            Arg(
                "calib",
                "object",
                names=("calib", "calibration", "R_K", "rotations"),
                alts=[
                    alt("other_head_dim", lambda x, c: RO.identity_calibration(np.shape(x.R_K)[-1] * 2)),
                    alt(
                        "per_head_other_H",
                        lambda x, c: RO.OSCARCalibration(
                            orthogonal(1, np.shape(x.R_K)[-1], (5,)), orthogonal(2, np.shape(x.R_K)[-1], (5,)), 0.9, 0.9
                        ),
                    ),
                ],
            )
        ]

    def empty_fix(spec):
        # the 'empty' alternative of k / v: the state must be unchanged, whatever the result
        for a in spec.args:
            for m in a.alts:
                if m.id == "alt:empty":
                    m.oracle = state_unchanged_oracle
        return spec

    specs = []
    append = Spec(
        f"{method}.append",
        append_base,
        [cfg_arg] + calib_args + [state_arg, kv_arg("k"), kv_arg("v")],
        states=("state",),
        check=_append_check(method),
        tiers=BOTH,
    )
    specs.append(empty_fix(append))

    def read_base(with_q):
        def base(d, tier):
            s = Setup(d, tier, method, nonempty=True)
            Hq = s.H * d.choice((1, 2))
            Tq = d.int(1, 2)

            def make():
                kw = s.head()
                kw["state"] = s.state()
                if with_q:
                    kw["q"] = tier.arr(values(s.seed + 5, (s.B, Hq, Tq, s.D), s.dtype))
                    kw["scale"] = None
                return kw

            return make

        return base

    empty_state = alt(
        "empty_state",
        lambda x, c: c.tier.init(method, c.kwargs["cfg"], *tuple(x.shape)[-3:]),
        OK_OR_ERROR,
        oracle=lambda r, c: None,
    )
    specs.append(
        Spec(
            f"{method}.dequantize",
            read_base(False),
            [cfg_arg] + calib_args + [Arg("state", "object", names=STATE_WORDS, alts=state_alts + [empty_state])],
            states=("state",),
            check=lambda r, kw, t: all_finite(r),
            tiers=BOTH,
        )
    )

    def q_heads_bad(x, c):
        a = np_of(x)
        H = tuple(c.kwargs["state"].shape)[-2]
        if H < 2:
            raise Skip("every H_q is a multiple of 1")
        return like(x, np.zeros((a.shape[0], H + 1) + a.shape[2:], a.dtype))

    specs.append(
        Spec(
            f"{method}.decode_attention",
            read_base(True),
            [cfg_arg]
            + calib_args
            + [
                Arg(
                    "state",
                    "object",
                    names=STATE_WORDS,
                    alts=state_alts
                    + [alt("empty_state", lambda x, c: c.tier.init(method, c.kwargs["cfg"], *tuple(x.shape)[-3:]))],
                ),
                Arg(
                    "q",
                    "data",
                    alts=[
                        alt(
                            "other_head_dim",
                            lambda x, c: like(
                                x, np.zeros(np_of(x).shape[:3] + (np_of(x).shape[3] + 8,), np_of(x).dtype)
                            ),
                        ),
                        alt("heads_not_multiple", q_heads_bad),
                    ],
                ),
                Arg("scale", "scale"),
            ],
            states=("state",),
            check=lambda r, kw, t: all_finite(r),
            tiers=BOTH,
        )
    )

    def init_base(d, tier):
        s = Setup(d, tier, method)
        return lambda: dict(cfg=s.cfg, batch=s.B, kv_heads=s.H, head_dim=s.D)

    bad_D = alt("incompatible", lambda x, c: x + 1)
    init = Spec(
        f"{method}.init",
        init_base,
        [
            Arg("cfg", "object", names=CFG_WORDS, alts=_other_method_cfg_alts(method)),
            Arg("batch", "int"),
            Arg("kv_heads", "int"),
            Arg("head_dim", "int", alts=[bad_D]),
        ],
        tiers=BOTH,
    )
    init.fn = lambda tier, m=method: (lambda **kw: tier.init(m, *kw.values()))
    specs.append(init)
    for sp in specs:
        sp.method = method
    return specs


def state_unchanged_oracle(result, c):
    """An accepted no-op (an empty append): the state equals a fresh build of the same call's state."""
    twin = c.make()
    diff = snapshot_diff(snapshot(twin["state"]), snapshot(c.kwargs["state"]))
    return None if not diff else f"an empty append changed the state at {diff}"


# ---------------------------------------------------------------------------------------------------
# config constructors


def _cfg_spec(label, kwargs, args):
    return Spec(label, lambda d, t: (lambda: dict(kwargs)), args)


def config_specs():
    from kvq.reference import aqua, higgs

    return [
        _cfg_spec(
            "kivi.KIVIConfig",
            dict(
                k_bits=2,
                v_bits=2,
                group_size=8,
                residual=4,
                sink=0,
                v_group_size=None,
                meta_dtype="float16",
                max_tokens=64,
            ),
            [
                Arg("k_bits", "int", dict(bad=(1, 3, 16))),
                Arg("v_bits", "int", dict(bad=(1, 3, 16))),
                Arg("group_size", "int", dict(bad=(3, 6))),
                Arg("residual", "int", dict(lo=0)),
                Arg("sink", "int", dict(lo=0)),
                Arg("v_group_size", "int", dict(none_ok=True)),
                Arg("meta_dtype", "dtype", names=("meta_dtype", "dtype")),
                Arg("max_tokens", "int"),
            ],
        ),
        _cfg_spec(
            "kitty.KittyConfig",
            dict(
                boost_rate=0.125,
                selection="magnitude",
                seed=0,
                group_size=8,
                residual=4,
                sink=2,
                v_bits=2,
                meta_dtype="float16",
                max_tokens=64,
            ),
            [
                Arg("boost_rate", "ratio", dict(lo_open=False), names=("boost_rate",)),
                Arg("selection", "choice"),
                Arg("seed", "int", dict(lo=0)),
                Arg("group_size", "int", dict(bad=(3, 6))),
                Arg("residual", "int", dict(lo=0)),
                Arg("sink", "int", dict(lo=0)),
                Arg("v_bits", "int", dict(bad=(1, 3))),
                Arg("meta_dtype", "dtype", names=("meta_dtype", "dtype")),
                Arg("max_tokens", "int"),
            ],
        ),
        _cfg_spec(
            "oscar.OSCARConfig",
            dict(sink=2, window=4, group_size=16, page_size=4, bits=2, meta_dtype="float16", max_tokens=64),
            [
                Arg("sink", "int", dict(lo=0)),
                Arg("window", "int", dict(lo=0)),
                Arg("group_size", "int"),
                Arg("page_size", "int"),
                Arg("bits", "int", dict(bad=(1, 3))),
                Arg("meta_dtype", "dtype", names=("meta_dtype", "dtype")),
                Arg("max_tokens", "int"),
            ],
        ),
        _cfg_spec(
            "bitdecoding.BitDecodingConfig",
            dict(bits=4, k_mode="channel", k_group=8, v_group=8, warps_n=1, max_tokens=64),
            [
                Arg("bits", "int", dict(bad=(1, 3, 8))),
                Arg("k_mode", "choice"),
                Arg("k_group", "int", dict(bad=(12,))),
                Arg("v_group", "int", dict(bad=(12,))),
                Arg("warps_n", "int"),
                Arg("max_tokens", "int"),
            ],
        ),
        _cfg_spec(
            "aqua.Uniform",
            dict(bits=2, group_size=16, meta_dtype="float16"),
            [
                Arg("bits", "int", dict(bad=(1, 3))),
                Arg("group_size", "int"),
                Arg("meta_dtype", "dtype", names=("meta_dtype", "dtype")),
            ],
        ),
        _cfg_spec(
            "aqua.Higgs",
            dict(cfg=higgs.HiggsConfig(group_size=16)),
            [Arg("cfg", "object", names=("cfg", "config", "HiggsConfig"))],
        ),
        _cfg_spec(
            "aqua.AquaConfig",
            dict(
                backbone=aqua.Uniform(2, 16),
                first_layer=aqua.Uniform(4, 16),
                sink=2,
                buffer=4,
                pre_rope=True,
                rope_theta=10000.0,
                predict_keys=True,
                predict_values=True,
                max_tokens=64,
            ),
            [
                Arg("backbone", "object", names=("backbone",)),
                Arg("first_layer", "object", names=("first_layer",)),
                Arg("sink", "int", dict(lo=0)),
                Arg("buffer", "int"),
                Arg("max_tokens", "int"),
                Arg(
                    "rope_theta",
                    None,
                    alts=[
                        alt("nan", lambda x, c: float("nan")),
                        alt("neg", lambda x, c: -1.0),
                        alt("zero", lambda x, c: 0.0),
                        alt("str", lambda x, c: "1e4"),
                        alt("True", lambda x, c: True),
                    ],
                ),
                Arg("pre_rope", None, alts=[alt("str", lambda x, c: "yes")]),
                Arg("predict_keys", None, alts=[alt("str", lambda x, c: "no")]),
            ],
        ),
    ]


# ---------------------------------------------------------------------------------------------------
# small functions of the cache modules


def _counts_base(module):
    def base(d, tier):
        from kvq.reference import kivi, oscar

        cfg = (
            oscar.OSCARConfig(sink=2, window=4, group_size=16, page_size=4, max_tokens=64)
            if module == "oscar"
            else kivi.KIVIConfig(group_size=8, residual=4, max_tokens=64)
        )
        T = d.int(0, 64)
        return lambda: {"cfg": cfg, "T": T}

    return base


def _bd_cfg(d):
    from kvq.reference import bitdecoding

    return bitdecoding.BitDecodingConfig(
        bits=4,
        k_mode=d.choice(("channel", "tensor")),
        k_group=d.choice((8, 16)),
        v_group=d.choice((8, 16, 32)),
        warps_n=1,
        max_tokens=64,
    )


def _bd_page_base(which):
    def base(d, tier):
        cfg, s, lead = _bd_cfg(d), d.seed(), d.choice(((), (2,), (1, 2)))

        def make():
            x = values(s, lead + (cfg.n_r, 32), F16)
            if which in ("pack_keys", "pack_values"):
                return {"cfg": cfg, ("k" if which == "pack_keys" else "v"): tier.arr(x)}
            from kvq.reference import bitdecoding as RB

            kw, kp = RB.pack_keys(cfg, x)
            vw, vp = RB.pack_values(cfg, x)
            if which == "unpack_keys":
                return {"cfg": cfg, "k_words": tier.arr(kw)}
            if which == "unpack_values":
                return {"cfg": cfg, "v_words": tier.arr(vw)}
            return {
                "cfg": cfg,
                "k_words": tier.arr(kw),
                "k_params": tier.arr(kp),
                "v_words": tier.arr(vw),
                "v_params": tier.arr(vp),
            }

        return make

    return base


def _words_alts(rows_matter: bool = True):
    """Packed words with a row missing (an error where the rows are fixed by the layout or must match the
    parameters; ``unpack_values`` alone unpacks any number of token rows), int32 instead of uint16, None."""
    rows = {} if rows_matter else dict(expect=OK_OR_ERROR, oracle=lambda r, c: None)
    return [
        alt("wrong_rows", lambda x, c: like(x, np_of(x)[..., :-1, :]), **rows),
        alt("int32", lambda x, c: like(x, np_of(x).astype(np.int32)), OK_OR_ERROR, canonical=lambda x, c: x),
        alt("none", lambda x, c: None),
    ]


def _qt_base(d, tier):
    B, Hkv, g, T, D, s = d.int(1, 2), d.choice((1, 2)), d.choice((1, 2)), d.int(1, 3), d.choice((8, 16)), d.seed()
    return lambda: {"q": tier.arr(values(s, (B, Hkv * g, T, D), F16)), "kv_heads": Hkv}


def _qu_base(d, tier):
    B, Hkv, g, T, D, s = d.int(1, 2), d.choice((1, 2)), d.choice((1, 2)), d.int(1, 3), d.choice((8, 16)), d.seed()
    return lambda: {"o": tier.arr(values(s, (B, Hkv, g * T, D), F32)), "q_heads": Hkv * g}


def misc_specs():
    return [
        Spec(
            "oscar.counts",
            _counts_base("oscar"),
            [Arg("cfg", "object", names=CFG_WORDS), Arg("T", "int", dict(lo=0))],
            tiers=BOTH,
        ),
        Spec(
            "paged.counts", _counts_base("kivi"), [Arg("cfg", "object", names=CFG_WORDS), Arg("T", "int", dict(lo=0))]
        ),
        Spec(
            "paged.max_pages",
            lambda d, t: (lambda: {"cfg": _counts_base("kivi")(d, t)()["cfg"]}),
            [Arg("cfg", "object", names=CFG_WORDS)],
        ),
        Spec(
            "paged.segment_bounds",
            _counts_base("kivi"),
            [Arg("cfg", "object", names=CFG_WORDS), Arg("T", "int", dict(lo=0))],
        ),
        Spec(
            "bitdecoding.residual_block_size",
            lambda d, t: (lambda b=d.choice((2, 4)): (lambda: dict(bits=b, warps_n=4, word_bits=16, p_n=8)))(),
            [
                Arg("bits", "int", dict(bad=(1, 3, 8))),
                Arg("warps_n", "int"),
                Arg("word_bits", "int", dict(bad=(7,))),
                Arg("p_n", "int"),
            ],
            tiers=BOTH,
        ),
        Spec(
            "bitdecoding.partition",
            lambda d, t: (lambda L=d.int(0, 300): (lambda: dict(length=L, n_r=64)))(),
            [Arg("length", "int", dict(lo=0)), Arg("n_r", "int")],
            tiers=BOTH,
        ),
        Spec(
            "bitdecoding.pack_keys",
            _bd_page_base("pack_keys"),
            [
                Arg("cfg", "object", names=CFG_WORDS),
                Arg(
                    "k",
                    "data",
                    dict(fixed_ndim=False),
                    names=("k", "head_dim"),
                    alts=[
                        alt("wrong_rows", lambda x, c: like(x, np_of(x)[..., :-1, :])),
                        alt("wrong_dim", lambda x, c: like(x, np_of(x)[..., :-8])),
                    ],
                ),
            ],
            tiers=BOTH,
        ),
        Spec(
            "bitdecoding.pack_values",
            _bd_page_base("pack_values"),
            [
                Arg("cfg", "object", names=CFG_WORDS),
                Arg(
                    "v",
                    "data",
                    dict(fixed_ndim=False),
                    names=("v", "head_dim"),
                    alts=[alt("wrong_rows", lambda x, c: like(x, np_of(x)[..., :-1, :]))],
                ),
            ],
            tiers=BOTH,
        ),
        Spec(
            "bitdecoding.unpack_keys",
            _bd_page_base("unpack_keys"),
            [Arg("cfg", "object", names=CFG_WORDS), Arg("k_words", None, alts=_words_alts())],
            tiers=BOTH,
        ),
        Spec(
            "bitdecoding.unpack_values",
            _bd_page_base("unpack_values"),
            [Arg("cfg", "object", names=CFG_WORDS), Arg("v_words", None, alts=_words_alts(rows_matter=False))],
            tiers=BOTH,
        ),
        Spec(
            "bitdecoding.dequantize_page",
            _bd_page_base("dequantize_page"),
            [
                Arg("cfg", "object", names=CFG_WORDS),
                Arg("k_words", None, alts=_words_alts()),
                Arg("k_params", "meta", names=("k_params", "params")),
                Arg("v_words", None, alts=_words_alts()),
                Arg("v_params", "meta", names=("v_params", "params")),
            ],
            check=lambda r, kw, t: None,
            tiers=BOTH,
        ),
        Spec(
            "bitdecoding.query_transform",
            _qt_base,
            [
                Arg("q", "data", dict(finite="propagate", layout=True)),
                Arg("kv_heads", "int", alts=[alt("not_dividing", lambda x, c: 3)]),
            ],
            tiers=BOTH,
        ),
        Spec(
            "bitdecoding.query_untransform",
            _qu_base,
            [
                Arg("o", "data", dict(finite="propagate", fixed_ndim=False, layout=True)),
                Arg("q_heads", "int", alts=[alt("not_multiple", lambda x, c: x + 1)]),
            ],
            tiers=BOTH,
        ),
    ]


# ---------------------------------------------------------------------------------------------------
# the method families


def all_cache_specs():
    out = []
    for m in METHODS:
        out += cache_specs(m)
    return out + config_specs() + misc_specs() + fp16_extreme_specs()


# ---------------------------------------------------------------------------------------------------
# issue 36 item 4: a group holding the largest fp16 value, read back in fp16


def _f16max_values(seed, shape):
    x = values(seed, shape, F16).copy()
    x[..., 0] = F16(65504)
    x[..., -1] = F16(-65504) if seed % 2 else F16(0)
    return x


def fp16_extreme_specs():
    """Good input with +-65504: quantize -> dequantize to fp16, and a cache's dequantize / decode after
    appending such tokens, must give finite values (or refuse the input with a clear error naming it)."""

    def roundtrip_base(d, tier):
        bits, G, lead, s = d.choice((2, 3, 4, 8)), d.choice((4, 8)), d.int(1, 3), d.seed()
        return lambda: {"x": tier.arr(_f16max_values(s, (lead, G * 2))), "bits": bits, "group_size": G}

    def roundtrip(tier):
        q = tier.mod("quant")

        def f(x, bits, group_size):
            codes, scale, mn = q.quantize(x, bits, group_size, -1)
            return q.dequantize(codes, scale, mn, group_size, -1, np.float16)

        return f

    def cache_base(method):
        def base(d, tier):
            s = Setup(d, tier, method, t0=(0, 0))
            Hq = s.H * d.choice((1, 2))
            T = s.cfg.n_r + 3 if method == "bitdecoding" else d.int(10, 20)

            def make():
                k = tier.arr(_f16max_values(s.seed, (s.B, s.H, T, s.D)))
                v = tier.arr(_f16max_values(s.seed + 1, (s.B, s.H, T, s.D)))
                q = tier.arr(values(s.seed + 2, (s.B, Hq, 1, s.D), F16))
                return dict(**s.head(), state=tier.init(method, s.cfg, s.B, s.H, s.D), k=k, v=v, q=q)

            return make

        return base

    def cache_fn(method):
        def fn(tier):
            mod = tier.mod(method)

            def f(cfg, state, k, v, q, calib=None):
                head = (cfg, calib) if method == "oscar" else (cfg,)
                mod.append(*head, state, k, v)
                K, V = mod.dequantize(*head, state)
                out, lse = mod.decode_attention(*head, state, q)
                return K, V, out, lse

            return f

        return fn

    specs = [
        Spec(
            "quant.quantize+dequantize(+-65504, fp16 out)",
            roundtrip_base,
            [],
            check=lambda r, kw, t: all_finite(r),
            tiers=BOTH,
            fn=roundtrip,
        )
    ]
    for m in METHODS:
        specs.append(
            Spec(
                f"{m}.append+dequantize+decode_attention(+-65504 keys)",
                cache_base(m),
                [],
                check=lambda r, kw, t: all_finite(r),
                tiers=BOTH,
                fn=cache_fn(m),
            )
        )
    return specs
