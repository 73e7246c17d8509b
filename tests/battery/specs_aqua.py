"""Specs of AQUA-KV: the predictors and backbones (``aqua``), the cross-layer cache (``aqua_cache``).

The cache spec appends (L, B, H_kv, T, D) tokens of every layer to a small state that already holds a few,
and breaks K / V, the predictors (wrong layer count, NaN weights: the "NaN predictors from a calibration
file" of issue 36), the config (another buffer, sink or backbone than the state's) and the state.
"""

from __future__ import annotations

import numpy as np

from ._core import OK_OR_ERROR, all_finite
from .engine import Arg, Skip, Spec, alt, like, np_of
from .specs_caches import CFG_WORDS, STATE_WORDS, small_cfg, state_unchanged_oracle
from .strategies import STYLES, values

F16, F32 = np.float16, np.float32
BOTH = ("reference", "triton")
P_WORDS = ("P", "predictors", "predictor", "f_key", "f_value", "calibration")


def draw_aqua(d, small: bool = False):
    """(cfg, L, B, H, D) of a small AQUA-KV cache (``small``: two layers, uniform backbones only: the
    Triton interpreter is slow)."""
    from kvq.reference import aqua, higgs

    L, B, H, D = (2 if small else d.choice((2, 3))), d.int(1, 2), d.choice((1, 2)), d.choice((8, 16))
    F = H * D
    kind = d.choice(("uniform", "fp16_first") if small else ("uniform", "higgs", "fp16_first"))
    if kind == "uniform":
        bb, first = aqua.Uniform(2, D), aqua.Uniform(4, D)
    elif small:
        bb, first = aqua.Uniform(2, D), aqua.KeepFP16()
    else:
        g = min(F & -F, 16)
        bb = aqua.Higgs(higgs.HiggsConfig(d=2, n=16, group_size=g))
        first = aqua.KeepFP16() if kind == "fp16_first" else aqua.Higgs(higgs.HiggsConfig(d=2, n=256, group_size=g))
    cfg = aqua.AquaConfig(
        backbone=bb,
        first_layer=first,
        sink=d.choice((0, 2)),
        buffer=d.choice((2, 4)),
        pre_rope=d.choice((True, False)),
        rope_theta=10000.0,
        max_tokens=32,
    )
    return cfg, L, B, H, D


def predictors(seed: int, L: int, F: int, scale: float = 0.1):
    from kvq.reference import aqua

    rng = np.random.default_rng(seed)
    fk = [None] + [
        aqua.Predictor((np.asarray(rng.standard_normal((F, F)) * scale, F32),), np.zeros(F, F32)) for _ in range(L - 1)
    ]
    fv = [None] + [
        aqua.Predictor((np.asarray(rng.standard_normal((2 * F, F)) * scale, F32),), np.zeros(F, F32))
        for _ in range(L - 1)
    ]
    return aqua.AquaPredictors(tuple(fk), tuple(fv))


class AquaSetup:
    def __init__(self, d, tier, nonempty=False):
        self.tier = tier
        self.cfg, self.L, self.B, self.H, self.D = draw_aqua(d, small=not tier.ref)
        self.T0 = d.int(1 if nonempty else 0, 9 if tier.ref else 5)
        self.T = d.int(1, 5 if tier.ref else 3)
        self.seed, self.style, self.dtype = d.seed(), d.choice(STYLES), d.choice((F16, F32))

    def P(self):
        return predictors(self.seed, self.L, self.H * self.D)

    def KV(self, T, off=0):
        shape = (self.L, self.B, self.H, T, self.D)
        return (
            self.tier.arr(values(self.seed + 3 + off, shape, self.dtype, self.style)),
            self.tier.arr(values(self.seed + 4 + off, shape, self.dtype, self.style)),
        )

    def state(self, cfg=None):
        cfg = self.cfg if cfg is None else cfg
        st = self.tier.init("aqua_cache", cfg, self.L, self.B, self.H, self.D)
        if self.T0:
            K, V = self.KV(self.T0, 1)
            self.tier.mod("aqua_cache").append(cfg, self.P(), st, K, V)
        return st


def _replace(**ch):
    import dataclasses

    def f(x, c):
        try:
            return dataclasses.replace(x, **{k: v(x) for k, v in ch.items()})
        except (TypeError, ValueError):
            raise Skip("invalid")

    return f


def _cfg_alts():
    from kvq.reference import aqua

    return [
        alt("cfg_other_buffer", _replace(buffer=lambda c: c.buffer + 2)),
        alt("cfg_other_sink", _replace(sink=lambda c: c.sink + 1)),
        alt("cfg_other_max_tokens", _replace(max_tokens=lambda c: c.max_tokens * 2)),
        alt("cfg_other_backbone", _replace(backbone=lambda c: aqua.KeepFP16())),
        alt("kivi_cfg", lambda x, c: small_cfg("kivi", 16)),
    ]


def _P_alts(read: bool = False, single_layer: bool = False):
    """Predictors that do not fit, or hold NaN / 1e30 weights (``read``: a reader may propagate NaN).
    ``single_layer``: the function works on one layer ``l`` (aqua.encode / decode), which cannot know the
    model's layer count: predictors for one more layer, valid for ``l``, may be used (error or result)."""
    from kvq.reference import aqua

    bad = dict(expect=OK_OR_ERROR, oracle=lambda r, c: None) if read else {}
    more = dict(expect=OK_OR_ERROR, oracle=lambda r, c: None) if single_layer else {}

    def nan_pred(x, c):
        fk = list(x.f_key)
        if len(fk) < 2 or fk[1] is None:
            raise Skip("no predictor")
        p = fk[1]
        fk[1] = aqua.Predictor(tuple(np.full_like(m, np.nan) for m in p.mats), p.bias)
        return aqua.AquaPredictors(tuple(fk), x.f_value)

    def big_pred(x, c):
        fk = list(x.f_key)
        if len(fk) < 2 or fk[1] is None:
            raise Skip("no predictor")
        p = fk[1]
        fk[1] = aqua.Predictor(tuple(np.full_like(m, 1e30) for m in p.mats), p.bias)
        return aqua.AquaPredictors(tuple(fk), x.f_value)

    def other_F(x, c):
        F = np.shape(x.f_key[1].mats[0])[0] if x.f_key[1] is not None else 8
        return predictors(1, len(x.f_key), F * 2)

    return [
        alt("other_layers", lambda x, c: predictors(1, len(x.f_key) + 1, np.shape(x.f_key[1].mats[0])[0]), **more),
        alt("nan_weights", nan_pred, **bad),
        alt("huge_weights", big_pred, **bad),
        alt("other_F", other_F),
    ]


def _state_alts():
    def other_method(m):
        def f(x, c):
            L, B, H, D = tuple(x.shape)
            cfg = small_cfg(m, D)
            if cfg is None:
                raise Skip("head dim")
            return c.tier.init(m, cfg, B, H, D)

        return f

    def other_layers(x, c):
        L, B, H, D = tuple(x.shape)
        return c.tier.init("aqua_cache", c.kwargs["cfg"], L + 1, B, H, D)

    return [
        alt("kivi_state", other_method("kivi")),
        alt("oscar_state", other_method("oscar")),
        alt("state_of_other_layers", other_layers),
    ]


def _kv5_alts():
    def grow(axis, by=1):
        def f(x, c):
            a = np_of(x)
            shape = list(a.shape)
            shape[axis] += by
            return like(x, np.zeros(shape, a.dtype))

        return f

    def empty(x, c):
        a = np_of(x)
        return like(x, np.zeros(a.shape[:3] + (0,) + a.shape[4:], a.dtype))

    def over(x, c):
        a = np_of(x)
        return like(x, np.zeros(a.shape[:3] + (c.kwargs["cfg"].max_tokens + 1,) + a.shape[4:], a.dtype))

    def near_6e4(x, c):
        a = np_of(x).astype(F16).copy()
        a[..., 0] = F16(60000)
        a[..., 1 if a.shape[-1] > 1 else 0] = F16(-60000)
        return like(x, a)

    return [
        alt("other_layers", grow(0)),
        alt("other_batch", grow(1)),
        alt("other_heads", grow(2)),
        alt("other_T_than_V", grow(3)),
        alt("other_head_dim", grow(4, 8)),
        alt("over_capacity", over),
        alt("empty", empty, OK_OR_ERROR, oracle=state_unchanged_oracle),
        alt("near_6e4", near_6e4, OK_OR_ERROR, oracle=lambda r, c: None),
    ]


def _bad_P(P) -> bool:
    """Predictors with non-finite or huge weights (their reconstructions may be non-finite)."""
    for p in tuple(getattr(P, "f_key", ())) + tuple(getattr(P, "f_value", ())):
        if p is not None and any(not np.all(np.abs(np.asarray(m)) < 1e20) for m in p.mats):
            return True
    return False


def _append_check(result, kw, tier):
    st = kw["st"]
    if result is None:
        return "append returned None"
    try:
        out = tier.mod("aqua_cache").dequantize(kw["cfg"], kw["P"], st)
    except Exception as e:  # noqa: BLE001
        return f"dequantize after the append raised {type(e).__name__}: {str(e)[:200]}"
    return all_finite(out)


def _odd_head_dim(x, c):
    """An odd head dim: refused where keys are handled before RoPE (which rotates channel pairs)."""
    if not c.kwargs["cfg"].pre_rope:
        raise Skip("an odd head dim is fine without pre-RoPE keys")
    return x + 1


def aqua_cache_specs():
    def append_base(d, tier):
        s = AquaSetup(d, tier)

        def make():
            K, V = s.KV(s.T)
            return dict(cfg=s.cfg, P=s.P(), st=s.state(), K=K, V=V)

        return make

    def read_base(d, tier):
        s = AquaSetup(d, tier, nonempty=True)
        return lambda: dict(cfg=s.cfg, P=s.P(), st=s.state())

    def init_base(d, tier):
        s = AquaSetup(d, tier)
        return lambda: dict(cfg=s.cfg, n_layers=s.L, batch=s.B, kv_heads=s.H, head_dim=s.D)

    kv = lambda n: Arg(n, "data", names=(n, n.lower(), "K and V"), alts=_kv5_alts())  # noqa: E731
    cfg = Arg("cfg", "object", names=CFG_WORDS, alts=_cfg_alts())
    P = Arg("P", "object", names=P_WORDS, alts=_P_alts())
    st = Arg("st", "object", names=STATE_WORDS, alts=_state_alts())
    init = Spec(
        "aqua_cache.init",
        init_base,
        [
            Arg("cfg", "object", names=CFG_WORDS, alts=[alt("kivi_cfg", lambda x, c: small_cfg("kivi", 16))]),
            Arg("n_layers", "int"),
            Arg("batch", "int"),
            Arg("kv_heads", "int"),
            Arg("head_dim", "int", alts=[alt("odd", _odd_head_dim)]),
        ],
        tiers=BOTH,
    )
    init.fn = lambda tier: (lambda **kw: tier.init("aqua_cache", *kw.values()))
    return [
        Spec(
            "aqua_cache.append",
            append_base,
            [cfg, P, st, kv("K"), kv("V")],
            states=("st",),
            check=_append_check,
            tiers=BOTH,
        ),
        Spec(
            "aqua_cache.dequantize",
            read_base,
            [cfg, Arg("P", "object", names=P_WORDS, alts=_P_alts(read=True)), st],
            states=("st",),
            check=lambda r, kw, t: all_finite(r) if not _bad_P(kw["P"]) else None,
            tiers=BOTH,
        ),
        init,
        Spec(
            "aqua_cache.bits_per_value",
            lambda d, t: (lambda s=AquaSetup(d, t): (lambda: dict(cfg=s.cfg, n_layers=s.L, F=s.H * s.D)))(),
            [Arg("cfg", "object", names=CFG_WORDS), Arg("n_layers", "int"), Arg("F", "int")],
            tiers=BOTH,
        ),
        Spec(
            "aqua_cache.state_bytes",
            lambda d, t: (lambda s=AquaSetup(d, t): (lambda: dict(st=s.state())))(),
            [Arg("st", "object", names=STATE_WORDS)],
            tiers=BOTH,
        ),
    ]


# ---------------------------------------------------------------------------------------------------
# aqua: predictors, backbones, encode / decode


def _tokens_base(d, tier):
    B, H, T, D, s = d.int(1, 2), d.choice((1, 2)), d.int(1, 4), d.choice((4, 8)), d.seed()
    return lambda: {"x": tier.arr(values(s, (B, H, T, D), F32))}


def _from_tokens_base(d, tier):
    B, H, T, D, s = d.int(1, 2), d.choice((1, 2)), d.int(1, 4), d.choice((4, 8)), d.seed()
    return lambda: {"x": tier.arr(values(s, (B, T, H * D), F32)), "H": H}


def _fit_base(d, tier, rank=False):
    N, Fi, Fo, s = d.choice((8, 16)), d.choice((2, 4)), d.choice((2, 4)), d.seed()

    def make():
        kw = {
            "X": values(s, (N, Fi), F32).astype(np.float64),
            "Y": values(s + 1, (N, Fo), F32).astype(np.float64),
            "ridge": 1e-3,
        }
        if rank:
            kw["rank"] = 1
        return kw

    return make


def _encode_base(d, tier, decode=False):
    cfg, L, B, H, D = draw_aqua(d)
    l, R, s = d.int(1, L - 1), d.choice((2, 4)), d.seed()  # layer >= 1: the predictors are used
    F = H * D

    def make():
        from kvq.reference import aqua as RA

        P = predictors(s, L, F)
        K, V = values(s + 1, (B, R, F), F32), values(s + 2, (B, R, F), F32)
        prev = (None, None)
        if l:
            prev = (values(s + 3, (B, R, F), F32), values(s + 4, (B, R, F), F32))
        if not decode:
            return dict(
                cfg=cfg,
                P=P,
                l=l,
                K=tier.arr(K),
                V=tier.arr(V),
                K_prev_hat=tier.arr(prev[0]),
                V_prev_hat=tier.arr(prev[1]),
            )
        Kq, Vq, _, _ = RA.encode(cfg, P, l, K, V, *prev)
        return dict(
            cfg=cfg,
            P=P,
            l=l,
            Kq={n: tier.arr(a) for n, a in Kq.items()},
            Vq={n: tier.arr(a) for n, a in Vq.items()},
            F=F,
            K_prev_hat=tier.arr(prev[0]),
            V_prev_hat=tier.arr(prev[1]),
        )

    return make


def _codes_dict_alts():
    def drop_first(x, c):
        return {n: a for i, (n, a) in enumerate(x.items()) if i}

    def wrong_dtype(x, c):
        return {n: like(a, np_of(a).astype(np.int64)) for n, a in x.items()}

    def extra(x, c):
        y = dict(x)
        y["bogus"] = next(iter(x.values()))
        return y

    return [
        alt("missing_code", drop_first),
        alt("int64_codes", wrong_dtype, OK_OR_ERROR, canonical=lambda x, c: x),
        alt("extra_code", extra, OK_OR_ERROR, canonical=lambda x, c: x),
        alt("none", lambda x, c: None),
        alt("list", lambda x, c: list(x.values())),
    ]


def _layer_alts():
    return [
        alt("out_of_range", lambda x, c: len(c.kwargs["P"].f_key)),
        alt("neg", lambda x, c: -1),
        alt("True", lambda x, c: True),
        alt("float", lambda x, c: float(x)),
        alt("str", lambda x, c: str(x)),
    ]


def _tok_other_F(x, c):
    a = np_of(x)
    return like(x, np.zeros(a.shape[:-1] + (a.shape[-1] * 2,), a.dtype))


def aqua_specs():
    return [
        Spec("aqua.to_tokens", _tokens_base, [Arg("x", "data", dict(finite="propagate", layout=True))], tiers=BOTH),
        Spec(
            "aqua.from_tokens",
            _from_tokens_base,
            [
                Arg("x", "data", dict(finite="propagate", layout=True)),
                Arg("H", "int", alts=[alt("not_dividing", lambda x, c: np_of(c.kwargs["x"]).shape[-1] + 1)]),
            ],
            tiers=BOTH,
        ),
        Spec(
            "aqua.fit_ridge",
            _fit_base,
            [
                Arg("X", "data"),
                Arg("Y", "data", alts=[alt("other_N", lambda x, c: x[:-1])]),
                Arg(
                    "ridge",
                    None,
                    alts=[
                        alt("nan", lambda x, c: float("nan")),
                        alt("neg", lambda x, c: -1.0),
                        alt("str", lambda x, c: "0.1"),
                    ],
                ),
            ],
        ),
        Spec(
            "aqua.fit_reduced_rank",
            lambda d, t: _fit_base(d, t, rank=True),
            [
                Arg("X", "data"),
                Arg("Y", "data", alts=[alt("other_N", lambda x, c: x[:-1])]),
                Arg("rank", "int", alts=[alt("too_big", lambda x, c: 100)]),
            ],
        ),
        Spec(
            "aqua.encode",
            _encode_base,
            [
                Arg("cfg", "object", names=CFG_WORDS),
                Arg("P", "object", names=P_WORDS, alts=_P_alts(single_layer=True)),
                Arg("l", "int", dict(lo=0), names=("l", "layer"), alts=_layer_alts()),
                Arg("K", "data", dict(fixed_ndim=False), alts=[alt("other_F", _tok_other_F)]),
                Arg("V", "data", dict(fixed_ndim=False), alts=[alt("other_F", _tok_other_F)]),
                Arg(
                    "K_prev_hat",
                    None,
                    names=("K_prev_hat", "K_prev", "prev"),
                    alts=[
                        alt(
                            "other_F",
                            lambda x, c: _tok_other_F(x, c) if x is not None else (_ for _ in ()).throw(Skip("l=0")),
                        )
                    ],
                ),
            ],
            check=lambda r, kw, t: all_finite(r) if not _bad_P(kw["P"]) else None,
            tiers=BOTH,
        ),
        Spec(
            "aqua.decode",
            lambda d, t: _encode_base(d, t, decode=True),
            [
                Arg("cfg", "object", names=CFG_WORDS),
                Arg("P", "object", names=P_WORDS, alts=_P_alts(read=True, single_layer=True)),
                Arg("l", "int", dict(lo=0), names=("l", "layer"), alts=_layer_alts()),
                Arg("Kq", None, alts=_codes_dict_alts()),
                Arg("F", "int", alts=[alt("too_big", lambda x, c: x * 2)]),
            ],
            check=lambda r, kw, t: all_finite(r) if not _bad_P(kw["P"]) else None,
            tiers=BOTH,
        ),
    ]


def aqua_probe_specs():
    def base(d, tier):
        s = d.seed()
        return lambda: {"y": values(s, (8, 4), F32), "y_hat": values(s + 1, (8, 4), F32)}

    return [
        Spec(
            "aqua_probes.explained_variance",
            base,
            [
                Arg(
                    "y",
                    "data",
                    dict(finite="propagate"),
                    alts=[
                        alt("constant", lambda x, c: np.ones_like(x), OK_OR_ERROR, oracle=lambda r, c: all_finite(r))
                    ],
                ),
                Arg("y_hat", "data", dict(finite="propagate"), alts=[alt("other_shape", lambda x, c: x[:, :-1])]),
            ],
        )
    ]


def all_aqua_specs():
    return aqua_cache_specs() + aqua_specs() + aqua_probe_specs()
