"""Specs of the stateless array functions: quant, packing, attention, hadamard, higgs, kitty's page
functions, oscar's token quantizer and calibration, rotations, metrics, memory, numerics, model.

Each builder draws a valid call (shapes, dtypes, values) and returns ``make()``; ``Arg`` lists say how each
argument may be broken. Tiers: "reference" always; "triton" where ``kvq.fast.MIRRORED`` lists the function.
"""

from __future__ import annotations

import numpy as np

from ._core import OK_OR_ERROR, all_finite
from .engine import Arg, Skip, Spec, alt, like, np_of
from .strategies import STYLES, orthogonal, values

F16, F32 = np.float16, np.float32
BOTH = ("reference", "triton")


def _fresh(tier, **arrays):
    """kwargs with NumPy arrays converted to the tier's arrays (fresh copies)."""
    return {k: (tier.arr(v) if isinstance(v, np.ndarray) else v) for k, v in arrays.items()}


# ---------------------------------------------------------------------------------------------------
# quant


def _quant_shape(d):
    ndim = d.int(1, 3)
    axis = d.int(-ndim, ndim - 1)
    G = d.choice((2, 4, 8))
    shape = [d.int(1, 3) for _ in range(ndim)]
    shape[axis] = G * d.int(1, 3)
    return tuple(shape), axis, G


def quantize_base(d, tier, pack_bits=False):
    shape, axis, G = _quant_shape(d)
    bits = d.choice((2, 4, 8) if pack_bits else (2, 3, 4, 8))
    if pack_bits:
        G = G if G % (8 // bits) == 0 else 8 // bits * G
        shape = list(shape)
        shape[axis] = G * d.int(1, 2)
        shape = tuple(shape)
    dtype = d.choice((F16, F32))
    seed, style = d.seed(), d.choice(STYLES)
    meta = d.choice(("float16", "float32"))

    def make():
        return _fresh(tier, x=values(seed, shape, dtype, style), bits=bits, group_size=G, axis=axis, meta_dtype=meta)

    return make


def _check_codes(result, kw, tier):
    codes = np_of(result[0])
    if codes.dtype != np.uint8:
        return f"codes have dtype {codes.dtype}"
    bits = kw.get("bits")
    if (
        isinstance(bits, (int, np.integer))
        and not isinstance(bits, bool)
        and codes.size
        and codes.max() >= 2 ** int(bits)
    ):
        return f"code {codes.max()} out of range for {bits} bits"
    return all_finite(result[1:])


def dequantize_base(d, tier):
    shape, axis, G = _quant_shape(d)
    bits, dtype, seed, style = d.choice((2, 4, 8)), d.choice((F16, F32)), d.seed(), d.choice(STYLES)
    out = d.choice(("float16", "float32", "bfloat16"))
    from kvq.reference import quant

    codes, scale, mn = quant.quantize(values(seed, shape, dtype, style), bits, G, axis)

    def make():
        return _fresh(
            tier, codes=codes.copy(), scale=scale.copy(), mn=mn.copy(), group_size=G, axis=axis, out_dtype=out
        )

    return make


def quantile_base(d, tier, name="a"):
    shape, axis, _ = _quant_shape(d)
    seed, style, rho = d.seed(), d.choice(STYLES), d.choice((0.5, 0.9, 0.96, 1.0))

    def make():
        return _fresh(
            tier,
            **{name: values(seed, shape, F32, style)},
            **({"rho": rho} if name == "a" else {"ratio": rho}),
            axis=axis,
        )

    return make


def _quantile_truth(kw):
    """The documented linear rule in fp32 (three rounded operations), a row holding NaN giving NaN."""
    a = np.moveaxis(np.asarray(np_of(kw["a"]), np.float32), kw["axis"], -1)
    n, rho = a.shape[-1], float(kw["rho"])
    s = np.sort(a, axis=-1)
    h = (n - 1) * rho
    lo = int(np.floor(h))
    hi = min(lo + 1, n - 1)
    frac = np.float32(h - lo)
    with np.errstate(invalid="ignore", over="ignore"):
        tau = (s[..., lo] + frac * (s[..., hi] - s[..., lo])).astype(np.float32)
    return np.where(np.isnan(a).any(axis=-1), np.float32(np.nan), tau)


def _group_not_dividing(x, c):
    n = np_of(c.kwargs["x"]).shape[c.kwargs["axis"]]
    return n + 1


def _empty_x(x, c):
    a = np_of(x)
    return like(x, np.zeros((0,) + a.shape[1:], a.dtype))


QUANT = [
    Spec(
        "quant.quantize",
        quantize_base,
        [
            Arg("x", "data", dict(fixed_ndim=False), alts=[alt("empty", _empty_x)]),
            Arg("bits", "int", dict(bad=(1, 5, 16, 0))),
            Arg("group_size", "int", dict(none_ok=True), alts=[alt("not_dividing", _group_not_dividing)]),
            Arg("axis", "axis"),
            Arg("meta_dtype", "dtype", names=("meta_dtype", "dtype")),
        ],
        check=_check_codes,
        tiers=BOTH,
    ),
    Spec(
        "quant.dequantize",
        dequantize_base,
        [
            Arg("codes", "codes", dict(bits_arg=None)),
            Arg("scale", "meta"),
            Arg("mn", "meta", names=("mn", "min")),
            Arg("group_size", "int", dict(none_ok=True), alts=[alt("wrong", lambda x, c: x * 2 if x else 3)]),
            Arg("axis", "axis"),
            Arg("out_dtype", "dtype", dict(allowed=("float16", "bfloat16", "float32")), names=("out_dtype", "dtype")),
        ],
        check=lambda r, kw, t: (
            all_finite(r)
            if not any(
                np.isnan(np_of(kw[m]).astype(np.float64)).any()
                for m in ("scale", "mn")
                if kw.get(m) is not None and not isinstance(kw.get(m), str)
            )
            else None
        ),
        tiers=BOTH,
    ),
    Spec(
        "quant.quantile",
        quantile_base,
        [Arg("a", "data", dict(finite="propagate", fixed_ndim=False)), Arg("rho", "ratio"), Arg("axis", "axis")],
        truth=_quantile_truth,
        tiers=BOTH,
    ),
    Spec(
        "quant.percentile_clip",
        lambda d, t: quantile_base(d, t, "x"),
        [Arg("x", "data", dict(fixed_ndim=False)), Arg("ratio", "ratio"), Arg("axis", "axis")],
        tiers=BOTH,
    ),
]


# ---------------------------------------------------------------------------------------------------
# packing


def pack_base(d, tier):
    bits = d.choice((2, 4, 8))
    per = 8 // bits
    ndim = d.int(1, 3)
    axis = d.int(-ndim, ndim - 1)
    shape = [d.int(1, 3) for _ in range(ndim)]
    shape[axis] = per * d.int(1, 3)
    seed = d.seed()

    def make():
        codes = np.random.default_rng(seed).integers(0, 2**bits, size=shape).astype(np.uint8)
        return _fresh(tier, codes=codes, bits=bits, axis=axis)

    return make


def unpack_base(d, tier):
    bits = d.choice((2, 4, 8))
    ndim = d.int(1, 3)
    axis = d.int(-ndim, ndim - 1)
    shape = [d.int(1, 3) for _ in range(ndim)]
    seed = d.seed()

    def make():
        packed = np.random.default_rng(seed).integers(0, 256, size=shape).astype(np.uint8)
        return _fresh(tier, packed=packed, bits=bits, axis=axis)

    return make


def _pack_axis_not_multiple(x, c):
    a = np_of(x)
    bits = c.kwargs["bits"]
    if bits == 8:
        raise Skip("every length packs at 8 bits")
    ax = c.kwargs["axis"]
    shape = list(a.shape)
    shape[ax] += 1
    return like(x, np.zeros(shape, np.uint8))


def quantize_pack_base(d, tier):
    return quantize_base(d, tier, pack_bits=True)


def unpack_dequantize_base(d, tier):
    mk = quantize_pack_base(d, tier)
    kw0 = mk()
    from kvq.reference import packing

    x = np_of(kw0["x"])
    packed, scale, mn = packing.quantize_pack(x, kw0["bits"], kw0["group_size"], kw0["axis"], kw0["meta_dtype"])
    out = d.choice(("float16", "float32", "bfloat16"))

    def make():
        return _fresh(
            tier,
            packed=packed.copy(),
            scale=scale.copy(),
            mn=mn.copy(),
            bits=kw0["bits"],
            group_size=kw0["group_size"],
            axis=kw0["axis"],
            out_dtype=out,
        )

    return make


PACKING = [
    Spec(
        "packing.pack",
        pack_base,
        [
            Arg("codes", "codes", alts=[alt("axis_not_multiple", _pack_axis_not_multiple)]),
            Arg("bits", "int", dict(bad=(1, 3, 16))),
            Arg("axis", "axis"),
        ],
        tiers=BOTH,
    ),
    Spec(
        "packing.unpack",
        unpack_base,
        [Arg("packed", "codes", dict(bits_arg=None)), Arg("bits", "int", dict(bad=(1, 3, 16))), Arg("axis", "axis")],
        tiers=BOTH,
    ),
    Spec(
        "packing.quantize_pack",
        quantize_pack_base,
        [
            Arg("x", "data", dict(fixed_ndim=False)),
            Arg("bits", "int", dict(bad=(1, 3, 16))),
            Arg("group_size", "int", dict(none_ok=True), alts=[alt("not_dividing", _group_not_dividing)]),
            Arg("axis", "axis"),
            Arg("meta_dtype", "dtype", names=("meta_dtype", "dtype")),
        ],
        check=lambda r, kw, t: all_finite(r[1:]) if np_of(r[0]).dtype == np.uint8 else "packed is not uint8",
        tiers=BOTH,
    ),
    Spec(
        "packing.unpack_dequantize",
        unpack_dequantize_base,
        [
            Arg("packed", "codes", dict(bits_arg=None)),
            Arg("scale", "meta"),
            Arg("mn", "meta", names=("mn", "min")),
            Arg("bits", "int", dict(bad=(1, 3, 16))),
            Arg("group_size", "int", dict(none_ok=True)),
            Arg("axis", "axis"),
            Arg("out_dtype", "dtype", dict(allowed=("float16", "bfloat16", "float32")), names=("out_dtype", "dtype")),
        ],
        tiers=BOTH,
    ),
]


# ---------------------------------------------------------------------------------------------------
# attention


def qkv_base(d, tier, with_mask=False, Tq=None):
    B, H_kv, g, D = d.int(1, 2), d.choice((1, 2)), d.choice((1, 2)), d.choice((16, 32))
    Tq = d.int(1, 3) if Tq is None else Tq
    Tk = d.int(1, 6)
    dtype = d.choice((F16, F32))
    s = d.seed()

    def make():
        kw = dict(
            q=values(s, (B, H_kv * g, Tq, D), dtype),
            k=values(s + 1, (B, H_kv, Tk, D), dtype),
            v=values(s + 2, (B, H_kv, Tk, D), dtype),
        )
        return _fresh(tier, **kw)

    return make


def _other_last(x, c):
    a = np_of(x)
    return like(x, np.zeros(a.shape[:-1] + (a.shape[-1] + 8,), a.dtype))


def _other_batch(x, c):
    a = np_of(x)
    return like(x, np.zeros((a.shape[0] + 1,) + a.shape[1:], a.dtype))


def _heads_not_dividing(x, c):
    a = np_of(x)
    hq = np_of(c.kwargs["q"]).shape[1]
    h = hq + 1 if hq > 1 else 3
    return like(x, np.zeros((a.shape[0], h) + a.shape[2:], a.dtype))


def _empty_tokens(x, c):
    a = np_of(x)
    return like(x, np.zeros(a.shape[:2] + (0,) + a.shape[3:], a.dtype))


def _kv_alts():
    return [
        alt("other_head_dim", _other_last),
        alt("other_batch", _other_batch),
        alt("heads_not_dividing", _heads_not_dividing),
    ]


def attention_base(d, tier):
    mk = qkv_base(d, tier)
    causal, use_mask = d.choice((False, True)), d.choice((False, True))

    def make():
        kw = mk()
        kw["causal"] = causal
        B, Tk = kw["k"].shape[0], kw["k"].shape[2]
        kw["key_padding_mask"] = np.ones((B, Tk), bool) if use_mask else None
        kw["scale"] = None
        return kw

    return make


def _mask_wrong_shape(x, c):
    k = np_of(c.kwargs["k"])
    return np.ones((k.shape[0], k.shape[2] + 1), bool)


ATTN = [
    Spec(
        "attention.attention",
        attention_base,
        [
            Arg("q", "data"),
            Arg(
                "k",
                "data",
                alts=_kv_alts() + [alt("empty", _empty_tokens, OK_OR_ERROR, oracle=lambda r, c: all_finite(r))],
            ),
            Arg("v", "data", alts=[alt("other_head_dim", _other_last)]),
            Arg("scale", "scale"),
            Arg(
                "key_padding_mask",
                None,
                names=("key_padding_mask", "mask"),
                alts=[
                    alt("wrong_shape", _mask_wrong_shape),
                    alt("strings", lambda x, c: "all"),
                    alt(
                        "all_masked",
                        lambda x, c: np.zeros(_mask_wrong_shape(x, c).shape, bool)[:, :-1],
                        OK_OR_ERROR,
                        oracle=lambda r, c: all_finite(r),
                    ),
                ],
            ),
        ],
    ),
    Spec(
        "attention.partial_attention",
        lambda d, t: _with_scale(qkv_base(d, t)),
        [
            Arg("q", "data"),
            Arg("k", "data", alts=_kv_alts()),
            Arg("v", "data", alts=[alt("other_head_dim", _other_last)]),
            Arg("scale", "scale"),
        ],
        tiers=BOTH,
    ),
]


def _with_scale(mk):
    def make():
        kw = mk()
        kw["scale"] = None
        return kw

    return make


def merge_base(d, tier):
    mk = qkv_base(d, tier)
    n = d.int(1, 3)

    def make():
        from kvq.reference.attention import partial_attention

        kw = mk()
        parts = []
        for i in range(n):
            q, k, v = (np_of(kw[x]).astype(F32) for x in ("q", "k", "v"))
            o, lse = partial_attention(q, k * (i + 1), v)
            parts.append((tier.arr(o.astype(F32)), tier.arr(lse.astype(F32))))
        return {"partials": parts}

    return make


def _partial_nan_lse(x, c):
    o, lse = x[0]
    return [(o, _set_nan(lse))] + list(x[1:])


def _nonfinite(r):
    return None if all_finite(r) is not None else "NaN input gave an all-finite result (silently wrong)"


def _partials_numpy(x, c):
    if c.tier.ref:
        raise Skip("reference tier")
    return [(np_of(a), np_of(b)) for a, b in x]


def _set_nan(a):
    b = np_of(a).copy()
    b.flat[0] = np.nan
    return like(a, b)


def decode_base(d, tier):
    mk = qkv_base(d, tier)
    n = d.int(1, 3)

    def make():
        kw = mk()
        segs = [(kw["k"], kw["v"])] + [
            (like(kw["k"], np_of(kw["k"]) * (i + 2)), like(kw["v"], np_of(kw["v"]))) for i in range(n - 1)
        ]
        return {"q": kw["q"], "segments": segs, "scale": None}

    return make


def _seg_mismatch(x, c):
    k, v = x[0]
    return [(k, _other_last(v, c))] + list(x[1:])


def _seg_nan(x, c):
    k, v = x[0]
    return [(_set_nan(k), v)] + list(x[1:])


def _seg_triple(x, c):
    k, v = x[0]
    return [(k, v, v)] + list(x[1:])


def _seg_empty_extra(x, c):
    k, v = x[0]
    return list(x) + [(_empty_tokens(k, c), _empty_tokens(v, c))]


ATTN += [
    Spec(
        "attention.merge",
        merge_base,
        [
            Arg(
                "partials",
                None,
                names=("partials", "partial", "o", "lse"),
                alts=[
                    alt("empty", lambda x, c: []),
                    alt("none", lambda x, c: None),
                    alt("triple", lambda x, c: [(x[0][0], x[0][1], x[0][1])] + list(x[1:])),
                    alt(
                        "lse_wrong_shape",
                        lambda x, c: [(x[0][0], like(x[0][1], np_of(x[0][1])[..., None]))] + list(x[1:]),
                    ),
                    alt("o_mismatch", lambda x, c: list(x) + [(like(x[0][0], np_of(x[0][0])[..., :1]), x[0][1])]),
                    alt("lse_nan", _partial_nan_lse, OK_OR_ERROR, oracle=lambda r, c: _nonfinite(r)),
                    alt("numpy_array", _partials_numpy, OK_OR_ERROR, canonical=lambda x, c: x),
                ],
            )
        ],
        tiers=BOTH,
    ),
    Spec(
        "attention.decode_attention",
        decode_base,
        [
            Arg("q", "data", alts=[alt("other_head_dim", _other_last), alt("other_batch", _other_batch)]),
            Arg(
                "segments",
                None,
                names=("segments", "segment", "k", "v"),
                alts=[
                    alt("empty", lambda x, c: []),
                    alt("none", lambda x, c: None),
                    alt("kv_mismatch", _seg_mismatch),
                    alt("nan", _seg_nan),
                    alt("triple", _seg_triple),
                    alt("empty_segment", _seg_empty_extra, OK_OR_ERROR, canonical=lambda x, c: x),
                    alt("strings", lambda x, c: ["kv"]),
                ],
            ),
            Arg("scale", "scale"),
        ],
        tiers=BOTH,
    ),
]


# ---------------------------------------------------------------------------------------------------
# hadamard, higgs


def fwht_base(d, tier):
    n = d.choice((1, 2, 4, 8, 16))
    ndim = d.int(1, 3)
    shape = [d.int(1, 3) for _ in range(ndim)]
    axis = d.int(-ndim, ndim - 1)
    shape[axis] = n
    s, dtype = d.seed(), d.choice((F16, F32))

    def make():
        return _fresh(tier, x=values(s, shape, dtype), axis=axis)

    return make


def _axis_len3(x, c):
    a = np_of(x)
    shape = list(a.shape)
    shape[c.kwargs["axis"]] = 3
    return like(x, np.ones(shape, a.dtype))


def _gss_truth(kw):
    x = np_of(kw["xg"]).astype(np.float64)
    return (x * x).sum(-1).astype(np.float32)


def gss_base(d, tier):
    g = d.choice((1, 2, 4, 8, 16))
    shape = (d.int(1, 3), g)
    s = d.seed()

    def make():
        return _fresh(tier, xg=values(s, shape, F32))

    return make


def nearest_base(d, tier):
    dd, n = d.choice(((2, 16), (2, 64), (4, 256)))
    s = d.seed()

    def make():
        from kvq.reference.higgs import load_grid

        return _fresh(tier, v=values(s, (3, dd), F32), grid=np.array(load_grid(dd, n)))

    return make


def higgs_cfg(d):
    from kvq.reference.higgs import HiggsConfig

    dd, n = d.choice(((2, 16), (2, 64), (4, 256)))
    return HiggsConfig(d=dd, n=n, group_size=d.choice((8, 16, 32)), meta_dtype=d.choice(("float16", "float32")))


def higgs_quant_base(d, tier):
    cfg = higgs_cfg(d)
    F, lead, s = d.choice((8, 12, 32, 40)), d.int(1, 3), d.seed()
    dtype = d.choice((F16, F32))

    def make():
        return _fresh(tier, cfg=cfg, x=values(s, (lead, F), dtype))

    return make


def higgs_dequant_base(d, tier):
    cfg = higgs_cfg(d)
    F, lead, s = d.choice((8, 12, 32, 40)), d.int(1, 3), d.seed()
    from kvq.reference import higgs

    idx, scale = higgs.quantize(cfg, values(s, (lead, F), F32))
    out = d.choice((F16, F32))

    def make():
        return _fresh(tier, cfg=cfg, idx=idx.copy(), scale=scale.copy(), F=F, out_dtype=out)

    return make


def _idx_out_of_range(x, c):
    a = np_of(x).copy()
    a.flat[0] = c.kwargs["cfg"].n if c.kwargs["cfg"].n < np.iinfo(a.dtype).max else np.iinfo(a.dtype).max
    if a.flat[0] < c.kwargs["cfg"].n:
        raise Skip("dtype full")
    return like(x, a)


def _other_cfg_objects():
    from kvq.reference import kivi, oscar

    return [alt("kivi_cfg", lambda x, c: kivi.KIVIConfig()), alt("oscar_cfg", lambda x, c: oscar.OSCARConfig())]


HIGGS = [
    Spec(
        "hadamard.hadamard_matrix",
        lambda d, t: (lambda dd=d.choice((1, 2, 4, 8, 64)): (lambda: {"d": dd}))(),
        [Arg("d", "int", dict(bad=(3, 6, 100)), names=("d", "dimension"))],
        tiers=BOTH,
    ),
    Spec(
        "hadamard.fwht_scale",
        lambda d, t: (lambda dd=d.choice((1, 2, 4, 8, 64)): (lambda: {"d": dd}))(),
        [Arg("d", "int", dict(bad=(3, 6, 100)), names=("d", "dimension"))],
        tiers=BOTH,
    ),
    Spec(
        "hadamard.fwht",
        fwht_base,
        [
            Arg(
                "x",
                "data",
                dict(finite="propagate", fixed_ndim=False),
                names=("x", "axis", "dimension"),
                alts=[alt("axis_len_3", _axis_len3)],
            ),
            Arg("axis", "axis"),
        ],
        tiers=BOTH,
    ),
    Spec(
        "higgs.load_grid",
        lambda d, t: (lambda p=d.choice(((2, 16), (2, 64), (2, 256), (4, 256))): (lambda: {"d": p[0], "n": p[1]}))(),
        [Arg("d", "int", dict(bad=(3,))), Arg("n", "int", dict(bad=(17, 1024)))],
        tiers=BOTH,
    ),
    Spec(
        "higgs.index_dtype",
        lambda d, t: (lambda n=d.choice((2, 16, 256, 257, 70000)): (lambda: {"n": n}))(),
        [Arg("n", "int", dict(bad=(2**40,)))],
        tiers=BOTH,
    ),
    Spec(
        "higgs.group_sum_of_squares",
        gss_base,
        [
            Arg(
                "xg",
                "data",
                dict(finite="propagate", fixed_ndim=False),
                alts=[
                    alt(
                        "len_3",
                        lambda x, c: like(x, np.ones((2, 3), F32)),
                        OK_OR_ERROR,
                        canonical=lambda x, c: like(x, np.ones((2, 3), F32)),
                    )
                ],
            )
        ],
        truth=_gss_truth,
        tiers=BOTH,
    ),
    Spec(
        "higgs.nearest",
        nearest_base,
        [
            Arg(
                "v",
                "data",
                dict(fixed_ndim=False),
                alts=[
                    alt("f16", lambda x, c: like(x, np_of(x).astype(F16)), OK_OR_ERROR, canonical=lambda x, c: x),
                    alt("other_dim", _other_last),
                ],
            ),
            Arg(
                "grid",
                None,
                alts=[
                    alt(
                        "f64", lambda x, c: like(x, np_of(x).astype(np.float64)), OK_OR_ERROR, canonical=lambda x, c: x
                    ),
                    alt("wrong_dim", _other_last),
                    alt("none", lambda x, c: None),
                    alt("empty", lambda x, c: like(x, np_of(x)[:0])),
                ],
            ),
        ],
        tiers=BOTH,
    ),
    Spec(
        "higgs.quantize",
        higgs_quant_base,
        [
            Arg("cfg", "object", names=("cfg", "config", "HiggsConfig"), alts=_other_cfg_objects()),
            Arg("x", "data", dict(fixed_ndim=False), alts=[alt("empty", lambda x, c: like(x, np_of(x)[:, :0]))]),
        ],
        tiers=BOTH,
    ),
    Spec(
        "higgs.dequantize",
        higgs_dequant_base,
        [
            Arg("cfg", "object", names=("cfg", "config"), alts=_other_cfg_objects()),
            Arg("idx", "codes", dict(bits_arg=None), alts=[alt("out_of_range", _idx_out_of_range)]),
            Arg("scale", "meta"),
            Arg("F", "int", alts=[alt("too_big", lambda x, c: x + 64)]),
            Arg("out_dtype", "dtype", dict(allowed=("float16", "bfloat16", "float32")), names=("out_dtype", "dtype")),
        ],
        tiers=BOTH,
    ),
    Spec(
        "higgs.bits_per_value",
        lambda d, t: (lambda c=higgs_cfg(d): (lambda: {"cfg": c, "F": 64}))(),
        [Arg("cfg", "object", names=("cfg", "config")), Arg("F", "int")],
        tiers=BOTH,
    ),
    Spec(
        "higgs.HiggsConfig",
        lambda d, t: (lambda: dict(d=2, n=16, group_size=64, meta_dtype="float16", grid=None)),
        [
            Arg("d", "int", dict(bad=(3,))),
            Arg("n", "int", dict(bad=(17,))),
            Arg("group_size", "int", dict(bad=(3, 48))),
            Arg("meta_dtype", "dtype", names=("meta_dtype", "dtype")),
            Arg(
                "grid",
                None,
                alts=[
                    alt("nan", lambda x, c: np.full((16, 2), np.nan, F32)),
                    alt("wrong_shape", lambda x, c: np.ones((16, 3), F32)),
                    alt("f64", lambda x, c: np.ones((16, 2))),
                    alt("str", lambda x, c: "grid"),
                ],
            ),
        ],
    ),
]


# ---------------------------------------------------------------------------------------------------
# kitty's page functions, oscar's token quantizer


def kpage_base(d, tier):
    lead = d.choice(((), (2,), (1, 2)))
    G, D = d.choice((4, 8)), d.choice((8, 16))
    s = d.seed()

    def make():
        return _fresh(tier, kpage=values(s, lead + (G, D), F32))

    return make


def _rng_bad(value):
    def f(x, c):
        if c.kwargs.get("selection") != "random":
            raise Skip("rng is used only by selection='random'")
        return value

    return f


def select_boost_base(d, tier):
    lead, D = d.choice(((), (2,))), d.choice((8, 16))
    k, sel, s = d.int(0, 3), d.choice(("magnitude", "random")), d.seed()

    def make():
        return _fresh(
            tier,
            scores=np.abs(values(s, lead + (D,), F32)),
            d_boost=k,
            selection=sel,
            rng=np.random.default_rng(s) if sel == "random" else None,
        )

    return make


def encode_page_base(d, tier):
    mk = kpage_base(d, tier)
    k = d.int(0, 3)

    def make():
        kw = mk()
        shape = np_of(kw["kpage"]).shape
        boost = np.zeros(shape[:-2] + (shape[-1],), bool)
        boost[..., :k] = True
        kw["boost"] = tier.arr(boost)
        kw["meta_dtype"] = "float16"
        return kw

    return make


def _boost_unequal(x, c):
    b = np.ascontiguousarray(np_of(x)).copy()
    rows = b.reshape(-1, b.shape[-1])                       # one row of channel flags per page (a view)
    if rows.shape[0] < 2:
        raise Skip("one page")
    k = int(rows[1].sum())
    n = k + 1 if k + 1 <= rows.shape[1] else k - 1          # page 0 boosts a count unlike the others'
    rows[0] = False
    rows[0, :n] = True
    return like(x, b)


def dequantize_page_base(d, tier):
    mk = encode_page_base(d, tier)
    kw0 = mk()
    from kvq.reference import kitty

    page = kitty.encode_page(np_of(kw0["kpage"]), np_of(kw0["boost"]))
    G = np_of(kw0["kpage"]).shape[-2]

    def make():
        return {"page": {n: tier.arr(a.copy()) for n, a in page.items()}, "group_size": G}

    return make


def _page_drop(key):
    def f(x, c):
        return {n: a for n, a in x.items() if n != key}

    return f


def _page_idx_out(x, c):
    y = dict(x)
    a = np_of(x["idx"]).copy()
    a.flat[0] = 200
    y["idx"] = like(x["idx"], a)
    return y


def channel_sensitivity_base(d, tier):
    B, H, T, D = 1, d.choice((1, 2)), d.choice((4, 8)), d.choice((8, 16))
    s = d.seed()

    def make():
        return _fresh(
            tier,
            q=values(s, (B, H, T, D), F32),
            k=values(s + 1, (B, H, T, D), F32),
            bits=2,
            group_size=None,
            causal=True,
            scale=None,
        )

    return make


def quantize_tokens_base(d, tier):
    lead = d.choice(((2,), (1, 2, 3)))
    G = d.choice((4, 8))
    D = G * d.int(1, 2)
    s, clip, bits = d.seed(), d.choice((0.9, 1.0)), d.choice((2, 4))

    def make():
        return _fresh(tier, x_rot=values(s, lead + (D,), F16), clip=clip, group_size=G, bits=bits, meta_dtype="float16")

    return make


def _not_dividing_last(x, c):
    return np_of(c.kwargs["x_rot"]).shape[-1] + 1


PAGES = [
    Spec(
        "kitty.channel_scores",
        kpage_base,
        [Arg("kpage", "data", dict(finite="propagate", fixed_ndim=False))],
        tiers=BOTH,
    ),
    Spec(
        "kitty.select_boost",
        select_boost_base,
        [
            Arg("scores", "data", dict(fixed_ndim=False)),
            Arg(
                "d_boost",
                "int",
                dict(lo=0),
                alts=[alt("above_D", lambda x, c: np_of(c.kwargs["scores"]).shape[-1] + 1)],
            ),
            Arg("selection", "choice"),
            Arg(
                "rng",
                None,
                alts=[alt("str", _rng_bad("seed")), alt("int", _rng_bad(5), OK_OR_ERROR, oracle=lambda r, c: None)],
            ),
        ],
        tiers=BOTH,
    ),
    Spec(
        "kitty.encode_page",
        encode_page_base,
        [
            Arg("kpage", "data", dict(fixed_ndim=False)),
            Arg(
                "boost",
                None,
                alts=[
                    alt(
                        "wrong_shape",
                        lambda x, c: like(x, np.zeros(np_of(x).shape[:-1] + (np_of(x).shape[-1] + 1,), bool)),
                    ),
                    alt("unequal", _boost_unequal),
                    alt("none", lambda x, c: None),
                    alt("int", lambda x, c: like(x, np_of(x).astype(np.int64)), OK_OR_ERROR, canonical=lambda x, c: x),
                    alt("float", lambda x, c: like(x, np_of(x).astype(F32)), OK_OR_ERROR, canonical=lambda x, c: x),
                ],
            ),
            Arg("meta_dtype", "dtype", names=("meta_dtype", "dtype")),
        ],
        tiers=BOTH,
    ),
    Spec(
        "kitty.dequantize_page",
        dequantize_page_base,
        [
            Arg(
                "page",
                None,
                alts=[
                    alt("missing_low", _page_drop("low")),
                    alt("missing_idx", _page_drop("idx")),
                    alt("idx_out_of_range", _page_idx_out, OK_OR_ERROR, oracle=lambda r, c: all_finite(r)),
                    alt("none", lambda x, c: None),
                    alt("list", lambda x, c: list(x.values())),
                ],
            ),
            Arg("group_size", "int", dict(none_ok=True), alts=[alt("wrong", lambda x, c: x * 2)]),
        ],
        tiers=BOTH,
    ),
    Spec(
        "kitty.channel_sensitivity",
        channel_sensitivity_base,
        [
            Arg("q", "data"),
            Arg("k", "data", alts=[alt("other_head_dim", _other_last)]),
            Arg("bits", "int", dict(bad=(1, 5))),
            Arg("group_size", "int", dict(none_ok=True)),
            Arg("scale", "scale"),
        ],
        tiers=BOTH,
    ),
    Spec(
        "oscar.quantize_tokens",
        quantize_tokens_base,
        [
            Arg("x_rot", "data", dict(fixed_ndim=False), names=("x_rot", "x")),
            Arg("clip", "ratio"),
            Arg(
                "group_size",
                "int",
                dict(none_ok=True),
                alts=[alt("not_dividing", lambda x, c: _not_dividing_last(x, c))],
            ),
            Arg("bits", "int", dict(bad=(1, 5))),
            Arg("meta_dtype", "dtype", names=("meta_dtype", "dtype")),
        ],
        tiers=BOTH,
    ),
    Spec(
        "rotations.quantize_tokens",
        quantize_tokens_base,
        [
            Arg("x_rot", "data", dict(fixed_ndim=False), names=("x_rot", "x")),
            Arg("clip", "ratio"),
            Arg("group_size", "int", dict(none_ok=True)),
            Arg("bits", "int", dict(bad=(1, 5))),
        ],
    ),
]


# ---------------------------------------------------------------------------------------------------
# oscar calibration, rotations


def calib_qkv_base(d, tier):
    N, D, H = d.choice((8, 16)), d.choice((8, 16)), d.choice((1, 2))
    s = d.seed()

    def make():
        return dict(
            q=values(s, (1, 2 * H, N, D), F32), k=values(s + 1, (1, H, N, D), F32), v=values(s + 2, (1, H, N, D), F32)
        )

    return make


def calibrate_base(d, tier):
    mk = calib_qkv_base(d, tier)
    rotation = d.choice(("oscar", "eigen", "hadamard", "identity", "random"))
    per_head, clip = d.choice((False, True)), "fit"  # "fit" uses group_size and bits

    def make():
        kw = mk()
        D = kw["k"].shape[-1]
        kw.update(rotation=rotation, target="attention", per_head=per_head, clip=clip, group_size=D, bits=2)
        return kw

    return make


def calibrate_clip_base(d, tier):
    H, T, D, s = d.choice((1, 2)), d.choice((4, 8)), d.choice((8, 16)), d.seed()

    def make():
        M = np.eye(D, dtype=np.float64)
        return dict(x_rot=values(s, (1, H, T, D), F16), M=M, group_size=D, bits=2)

    return make


def fold_base(d, tier):
    H_kv, g, D, dm, s = d.choice((1, 2)), d.choice((1, 2)), d.choice((4, 8)), d.choice((8, 16)), d.seed()

    def make():
        rng = np.random.default_rng(s)
        return dict(
            W_V=rng.standard_normal((dm, H_kv * D)),
            W_O=rng.standard_normal((H_kv * g * D, dm)),
            R_V=orthogonal(s, D),
            n_heads=H_kv * g,
        )

    return make


def _calib_obj_base(d, tier):
    D, s, per = d.choice((4, 8, 16)), d.seed(), d.choice((False, True))

    def make():
        lead = (2,) if per else ()
        return dict(
            R_K=orthogonal(s, D, lead),
            R_V=orthogonal(s + 1, D, lead),
            clip_k=0.96,
            clip_v=0.92,
            lam_K=None,
            lam_V=None,
            rotation="oscar",
        )

    return make


def _non_orth(x, c):
    a = np.array(x, copy=True)
    a[..., 0, 0] += 0.5
    return a


OSCAR_OFFLINE = [
    Spec(
        "oscar.OSCARCalibration",
        _calib_obj_base,
        [
            Arg(
                "R_K",
                None,
                alts=[
                    alt("non_orthogonal", _non_orth),
                    alt("f64", lambda x, c: x.astype(np.float64)),
                    alt("nan", lambda x, c: np.full_like(x, np.nan)),
                    alt("1d", lambda x, c: x[..., 0, :]),
                    alt("non_square", lambda x, c: x[..., :-1]),
                    alt("none", lambda x, c: None),
                ],
            ),
            Arg("R_V", None, alts=[alt("other_dim", lambda x, c: np.eye(x.shape[-1] * 2, dtype=F32))]),
            Arg("clip_k", "ratio"),
            Arg("clip_v", "ratio"),
            Arg("rotation", None, alts=[alt("int", lambda x, c: 5)]),
        ],
    ),
    Spec(
        "oscar.identity_calibration",
        lambda d, t: (lambda D=d.choice((4, 16, 64)): (lambda: dict(head_dim=D)))(),
        [Arg("head_dim", "int", dict(huge_ok=False))],
        tiers=BOTH,
    ),
    Spec(
        "oscar.calibrate",
        calibrate_base,
        [
            Arg("q", "data"),
            Arg("k", "data", alts=[alt("other_head_dim", _other_last)]),
            Arg("v", "data"),
            Arg("rotation", "choice"),
            Arg("target", "choice"),
            Arg(
                "clip",
                None,
                alts=[
                    alt("out_of_range", lambda x, c: (0.0, 1.5)),
                    alt("bogus", lambda x, c: "bogus"),
                    alt("nan", lambda x, c: (float("nan"), 0.9)),
                    alt("scalar", lambda x, c: 0.9),
                    alt("triple", lambda x, c: (0.9, 0.9, 0.9)),
                ],
            ),
            Arg(
                "group_size",
                "int",
                dict(none_ok=True),
                alts=[alt("not_dividing", lambda x, c: np.shape(c.kwargs["k"])[-1] + 1)],
            ),
            Arg("bits", "int", dict(bad=(1, 5))),
        ],
    ),
    Spec(
        "oscar.calibrate_clip",
        calibrate_clip_base,
        [
            Arg("x_rot", "data", names=("x_rot", "x")),
            Arg(
                "M",
                None,
                alts=[
                    alt("wrong_shape", lambda x, c: np.eye(x.shape[0] + 1)),
                    alt("nan", lambda x, c: x * np.nan),
                    alt("none", lambda x, c: None),
                ],
            ),
            Arg("group_size", "int", dict(none_ok=True)),
            Arg("bits", "int", dict(bad=(1, 5))),
            Arg(
                "ratios",
                None,
                alts=[
                    alt("empty", lambda x, c: ()),
                    alt("above_1", lambda x, c: (1.5,)),
                    alt("nan", lambda x, c: (float("nan"),)),
                    alt("str", lambda x, c: "0.9"),
                ],
            ),
        ],
    ),
    Spec(
        "oscar.fold_value_rotation",
        fold_base,
        [
            Arg("W_V", "data", dict(finite="propagate")),
            Arg("W_O", "data", dict(finite="propagate")),
            Arg(
                "R_V",
                None,
                alts=[
                    alt("wrong_dim", lambda x, c: np.eye(x.shape[-1] + 1, dtype=F32)),
                    alt("per_head_wrong", lambda x, c: np.stack([x] * 5)),
                ],
            ),
            Arg("n_heads", "int", alts=[alt("not_multiple", lambda x, c: x + 1)]),
        ],
    ),
]


def _rot_d_base(choices):
    return lambda d, t: (lambda D=d.choice(choices): (lambda: {"d": D}))()


def _C_base(d, tier):
    D, s = d.choice((4, 8)), d.seed()

    def make():
        a = np.random.default_rng(s).standard_normal((16, D))
        return {"C": a.T @ a}

    return make


def _rotate_base(d, tier):
    D, s, per = d.choice((4, 8)), d.seed(), d.choice((False, True))

    def make():
        return {"x": values(s, (1, 2, 3, D), F32), "R": orthogonal(s, D, (2,))[:, None] if per else orthogonal(s, D)}

    return make


def _compose_base(d, tier):
    D, kind, s = (
        d.choice((4, 8, 64)),
        d.choice(("oscar", "eigen", "hadamard", "identity", "random", "eigen_pbr")),
        d.seed(),
    )

    def make():
        return {"kind": kind, "U": orthogonal(s, D), "d": None, "rng": np.random.default_rng(s)}

    return make


def _frozen_base(d, tier):
    D, s = d.choice((4, 8)), d.seed()

    def make():
        a = np.random.default_rng(s).standard_normal((16, D))
        return {"R": orthogonal(s, D), "C": a.T @ a, "E": np.eye(D) * 0.1}

    return make


def _fake_quant_base(d, tier):
    D, s = d.choice((4, 8)), d.seed()

    def make():
        return {"x": values(s, (1, 1, 4, D), F32), "R": orthogonal(s, D), "clip": 0.95, "group_size": D, "bits": 2}

    return make


def _target_cov_base(d, tier):
    mk = calib_qkv_base(d, tier)

    def make():
        kw = mk()
        kw.update(per_head=False, scale=None)
        return kw

    return make


ROTATIONS = [
    Spec(
        "rotations.bit_reverse",
        lambda d, t: (lambda k=d.int(0, 7): (lambda: {"k": k, "n_bits": 3}))(),
        [Arg("k", "int", dict(lo=0), alts=[alt("too_big", lambda x, c: 8)]), Arg("n_bits", "int", dict(lo=0))],
    ),
    Spec("rotations.bit_reversal", _rot_d_base((1, 2, 8, 64)), [Arg("d", "int", dict(bad=(3, 12)))]),
    Spec("rotations.pbr_matrix", _rot_d_base((2, 8, 64)), [Arg("d", "int", dict(bad=(3, 12)))]),
    Spec("rotations.hadamard64", _rot_d_base((64, 128)), [Arg("d", "int", dict(bad=(3, 96)))]),
    Spec(
        "rotations.eig_desc",
        _C_base,
        [
            Arg(
                "C",
                "data",
                dict(fixed_ndim=False),
                alts=[
                    alt("non_square", lambda x, c: x[:, :-1]),
                    alt(
                        "nonsymmetric",
                        lambda x, c: x + np.triu(np.ones_like(x)),
                        OK_OR_ERROR,
                        oracle=lambda r, c: all_finite(r),
                    ),
                ],
            )
        ],
    ),
    Spec(
        "rotations.random_orthogonal",
        lambda d, t: (lambda D=d.choice((2, 8)), s=d.seed(): (lambda: {"d": D, "rng": np.random.default_rng(s)}))(),
        [
            Arg("d", "int", dict(lo=0)),
            Arg("rng", None, alts=[alt("str", lambda x, c: "seed"), alt("none", lambda x, c: None)]),
        ],
    ),
    Spec(
        "rotations.compose",
        _compose_base,
        [
            Arg("kind", "choice"),
            Arg("U", None, alts=[alt("non_square", lambda x, c: x[:, :-1]), alt("nan", lambda x, c: x * np.nan)]),
            Arg("rng", None, alts=[alt("str", lambda x, c: "seed")]),
        ],
    ),
    Spec(
        "rotations.rotate",
        _rotate_base,
        [
            Arg("x", "data", dict(finite="propagate", fixed_ndim=False)),
            Arg(
                "R",
                None,
                alts=[
                    alt("wrong_dim", lambda x, c: np.eye(x.shape[-1] + 1, dtype=F32)),
                    alt("per_head_wrong", lambda x, c: np.stack([np.eye(x.shape[-1], dtype=F32)] * 3)[:, None]),
                    alt("none", lambda x, c: None),
                ],
            ),
        ],
    ),
    Spec(
        "rotations.frozen_surrogate",
        _frozen_base,
        [
            Arg("R", None, alts=[alt("wrong_dim", lambda x, c: np.eye(x.shape[-1] + 1))]),
            Arg("C", None, alts=[alt("wrong_dim", lambda x, c: np.eye(x.shape[-1] + 1))]),
            Arg(
                "E",
                None,
                alts=[
                    alt(
                        "nan",
                        lambda x, c: x * np.nan,
                        OK_OR_ERROR,
                        oracle=lambda r, c: None if not np.isfinite(r) else "NaN E gave a finite value",
                    )
                ],
            ),
        ],
    ),
    Spec(
        "rotations.target_covariances",
        _target_cov_base,
        [
            Arg("q", "data"),
            Arg("k", "data", alts=[alt("other_head_dim", _other_last)]),
            Arg("v", "data"),
            Arg("scale", "scale"),
        ],
    ),
    Spec(
        "rotations.fake_quantize",
        _fake_quant_base,
        [
            Arg("x", "data", dict(fixed_ndim=False)),
            Arg("R", None, alts=[alt("wrong_dim", lambda x, c: np.eye(x.shape[-1] + 1, dtype=F32))]),
            Arg("clip", "ratio"),
            Arg("group_size", "int", dict(none_ok=True), alts=[alt("not_dividing", lambda x, c: x + 1)]),
            Arg("bits", "int", dict(bad=(1, 5))),
        ],
    ),
]


# ---------------------------------------------------------------------------------------------------
# metrics


def _metric_base(which):
    def base(d, tier):
        B, H, T, D, s = 1, d.choice((1, 2)), d.choice((2, 5)), d.choice((4, 8)), d.seed()

        def make():
            q, k, v = (values(s + i, (B, H, T, D), F32) for i in range(3))
            k_hat, v_hat = k + F32(0.01), v - F32(0.01)
            kw = {
                "relative_mse": dict(x=k, x_hat=k_hat),
                "logit_mse": dict(q=q, k=k, k_hat=k_hat, scale=None),
                "attention_scores": dict(q=q, k=k, causal=False, scale=None),
                "attention_kl": dict(q=q, k=k, k_hat=k_hat, causal=False, scale=None),
                "output_mse": dict(q=q, k=k, v=v, k_hat=k_hat, v_hat=v_hat, causal=False, scale=None),
            }[which]
            return kw

        return make

    return base


METRICS = [
    Spec(
        "metrics.relative_mse",
        _metric_base("relative_mse"),
        [
            Arg(
                "x",
                "data",
                dict(finite="propagate", fixed_ndim=False),
                alts=[alt("zeros", lambda x, c: np.zeros_like(x), OK_OR_ERROR, oracle=lambda r, c: all_finite(r))],
            ),
            Arg("x_hat", "data", dict(finite="propagate", fixed_ndim=False), alts=[alt("other_shape", _other_last)]),
        ],
    ),
    Spec(
        "metrics.logit_mse",
        _metric_base("logit_mse"),
        [
            Arg("q", "data", dict(finite="propagate")),
            Arg("k", "data", dict(finite="propagate")),
            Arg("k_hat", "data", dict(finite="propagate"), alts=[alt("other_shape", _other_last)]),
            Arg("scale", "scale"),
        ],
    ),
    Spec(
        "metrics.attention_scores",
        _metric_base("attention_scores"),
        [
            Arg("q", "data", dict(finite="propagate")),
            Arg("k", "data", dict(finite="propagate"), alts=[alt("other_head_dim", _other_last)]),
            Arg("scale", "scale"),
        ],
    ),
    Spec(
        "metrics.attention_kl",
        _metric_base("attention_kl"),
        [
            Arg("q", "data", dict(finite="propagate")),
            Arg("k", "data", dict(finite="propagate")),
            Arg("k_hat", "data", dict(finite="propagate"), alts=[alt("other_shape", _other_last)]),
        ],
    ),
    Spec(
        "metrics.output_mse",
        _metric_base("output_mse"),
        [
            Arg("q", "data", dict(finite="propagate")),
            Arg("v", "data", dict(finite="propagate")),
            Arg("v_hat", "data", dict(finite="propagate"), alts=[alt("other_shape", _other_last)]),
        ],
    ),
]


# ---------------------------------------------------------------------------------------------------
# memory accounting


def _fmt_base(d, tier):
    from kvq.reference import memory

    name = d.choice(sorted(memory.FORMATS))

    def make():
        return {"fmt": memory.FORMATS[name]}

    return make


def _with(mk, **extra):
    def make():
        kw = mk()
        kw.update(extra)
        return kw

    return make


def _cache_format_base(d, tier):
    return lambda: dict(
        name="x",
        k_bits=2,
        v_bits=2,
        group_size=32,
        meta_bits=16,
        n_meta=2,
        sink=0,
        recent=0,
        k_boost_rate=0.0,
        boost_bits=4,
        residual_k=0,
        residual_v=0,
        index_bits=0,
        fp_bits=16,
    )


MEMORY = [
    Spec(
        "memory.CacheFormat",
        _cache_format_base,
        [
            Arg("k_bits", "int", dict(bad=(0,))),
            Arg("group_size", "int"),
            Arg("meta_bits", "int", dict(lo=0)),
            Arg("sink", "int", dict(lo=0)),
            Arg("k_boost_rate", "ratio", dict(lo_open=False)),
            Arg("residual_k", "int", dict(lo=0)),
        ],
    ),
    Spec(
        "memory.quantized_bits",
        lambda d, t: _with(_fmt_base(d, t), accounting="paper"),
        [Arg("fmt", "object", names=("fmt", "format", "CacheFormat")), Arg("accounting", "choice")],
    ),
    Spec(
        "memory.bits_per_element",
        lambda d, t: _with(_fmt_base(d, t), context=d.choice((1, 100, 4096)), accounting="paper"),
        [Arg("fmt", "object", names=("fmt", "format")), Arg("context", "int"), Arg("accounting", "choice")],
    ),
    Spec(
        "memory.cache_bytes",
        lambda d, t: _with(
            _fmt_base(d, t), layers=2, kv_heads=2, head_dim=64, tokens=d.choice((1, 100)), batch=1, accounting="full"
        ),
        [
            Arg("fmt", "object", names=("fmt", "format")),
            Arg("layers", "int"),
            Arg("kv_heads", "int"),
            Arg("head_dim", "int"),
            Arg("tokens", "int", dict(lo=0)),
            Arg("batch", "int", dict(lo=0)),
            Arg("accounting", "choice"),
        ],
    ),
    Spec(
        "memory.max_batch",
        lambda d, t: _with(
            _fmt_base(d, t), budget_bytes=10**9, layers=2, kv_heads=2, head_dim=64, tokens=128, accounting="full"
        ),
        [
            Arg(
                "budget_bytes",
                None,
                alts=[
                    alt("neg", lambda x, c: -1),
                    alt("nan", lambda x, c: float("nan")),
                    alt("str", lambda x, c: "1e9"),
                    alt("True", lambda x, c: True),
                    alt("none", lambda x, c: None),
                ],
            ),
            Arg("layers", "int"),
            Arg("tokens", "int"),
            Arg("accounting", "choice"),
        ],
    ),
]


# ---------------------------------------------------------------------------------------------------
# numerics helpers (public names of kvq.reference.numerics)


NUMERICS = [
    Spec(
        "numerics.check_bits",
        lambda d, t: (lambda b=d.choice((2, 3, 4, 8)): (lambda: {"bits": b}))(),
        [Arg("bits", "int", dict(bad=(1, 5, 16)))],
    ),
    Spec(
        "numerics.qmax",
        lambda d, t: (lambda b=d.choice((2, 3, 4, 8)): (lambda: {"bits": b}))(),
        [Arg("bits", "int", dict(bad=(1, 5, 16)))],
    ),
    Spec(
        "numerics.normalize_axis",
        lambda d, t: (lambda: {"axis": -1, "ndim": 3}),
        [Arg("axis", "axis"), Arg("ndim", "int", dict(lo=0))],
    ),
    Spec(
        "numerics.as_f32",
        lambda d, t: (lambda s=d.seed(): (lambda: {"x": values(s, (3, 4), F16), "name": "x"}))(),
        [Arg("x", "data", dict(finite="propagate", fixed_ndim=False, scalar_ok=True))],
    ),
    Spec(
        "numerics.to_meta",
        lambda d, t: (
            lambda s=d.seed(): (lambda: {"x": np.abs(values(s, (4,), F32)), "meta_dtype": "float16", "name": "scale"})
        )(),
        [
            Arg("x", "data", dict(finite="propagate", fixed_ndim=False, scalar_ok=True), names=("x", "scale")),
            Arg("meta_dtype", "dtype", names=("meta_dtype", "dtype")),
        ],
    ),
    Spec(
        "numerics.to_out",
        lambda d, t: (lambda s=d.seed(): (lambda: {"x": values(s, (4,), F32), "out_dtype": "float16"}))(),
        [
            Arg("x", "data", dict(finite="propagate", fixed_ndim=False, scalar_ok=True)),
            Arg("out_dtype", "dtype", dict(allowed=("float16", "bfloat16", "float32")), names=("out_dtype", "dtype")),
        ],
    ),
]


# ---------------------------------------------------------------------------------------------------
# the tiny NumPy model


def _model_cfg_base(d, tier):
    return lambda: dict(
        n_layers=2,
        d_model=32,
        n_heads=2,
        n_kv_heads=1,
        head_dim=16,
        d_ff=32,
        vocab_size=16,
        rope_theta=10000.0,
        eps=1e-5,
        spectrum=0.5,
        seed=0,
    )


def _tiny_model():
    from kvq.reference.model import ModelConfig, TinyDecoder

    return TinyDecoder(
        ModelConfig(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=32, vocab_size=16)
    )


def _rope_base(d, tier):
    D, T, s = d.choice((4, 16)), d.int(1, 5), d.seed()

    def make():
        return {"x": values(s, (1, 2, T, D), F32), "positions": np.arange(T), "theta": 10000.0, "inverse": False}

    return make


def _tokens_base(d, tier):
    T, s = d.int(1, 6), d.seed()

    def make():
        return {"model": _tiny_model(), "tokens": np.random.default_rng(s).integers(0, 16, (1, T))}

    return make


def _tokens_alts():
    return [
        alt("out_of_vocab", lambda x, c: np.full_like(x, 10**6)),
        alt("negative", lambda x, c: -np.ones_like(x)),
        alt("float", lambda x, c: x.astype(F32)),
        alt("1d", lambda x, c: x[0]),
        alt("empty", lambda x, c: x[:, :0], OK_OR_ERROR, oracle=lambda r, c: None),
        alt("none", lambda x, c: None),
    ]


MODEL = [
    Spec(
        "model.ModelConfig",
        _model_cfg_base,
        [
            Arg("n_layers", "int"),
            Arg("d_model", "int"),
            Arg("n_heads", "int"),
            Arg("n_kv_heads", "int", alts=[alt("not_dividing", lambda x, c: 3)]),
            Arg("head_dim", "int", dict(bad=(3,))),
            Arg("vocab_size", "int"),
            Arg(
                "rope_theta",
                None,
                names=("rope_theta", "theta"),
                alts=[
                    alt("nan", lambda x, c: float("nan")),
                    alt("neg", lambda x, c: -1.0),
                    alt("zero", lambda x, c: 0.0),
                    alt("str", lambda x, c: "1e4"),
                ],
            ),
            Arg("eps", None, alts=[alt("neg", lambda x, c: -1.0), alt("nan", lambda x, c: float("nan"))]),
        ],
    ),
    Spec(
        "model.rope_tables",
        lambda d, t: (
            lambda T=d.int(1, 4), D=d.choice((4, 16)): (
                lambda: {"positions": np.arange(T), "head_dim": D, "theta": 10000.0}
            )
        )(),
        [
            Arg(
                "positions",
                None,
                alts=[
                    alt("float", lambda x, c: x + 0.5, OK_OR_ERROR, oracle=lambda r, c: all_finite(r)),
                    alt("none", lambda x, c: None),
                    alt("2d", lambda x, c: x[None, None]),
                ],
            ),
            Arg("head_dim", "int", dict(bad=(3,))),
            Arg(
                "theta",
                None,
                alts=[
                    alt("nan", lambda x, c: float("nan")),
                    alt("neg", lambda x, c: -1.0),
                    alt("zero", lambda x, c: 0.0),
                    alt("str", lambda x, c: "1e4"),
                ],
            ),
        ],
    ),
    Spec(
        "model.apply_rope",
        _rope_base,
        [
            Arg(
                "x", "data", dict(finite="propagate", fixed_ndim=False), alts=[alt("odd_dim", lambda x, c: x[..., :-1])]
            ),
            Arg(
                "positions",
                None,
                alts=[alt("wrong_len", lambda x, c: np.arange(len(x) + 1)), alt("none", lambda x, c: None)],
            ),
            Arg("theta", None, alts=[alt("nan", lambda x, c: float("nan")), alt("neg", lambda x, c: -1.0)]),
        ],
    ),
    Spec(
        "model.rms_norm",
        lambda d, t: (lambda s=d.seed(): (lambda: {"x": values(s, (2, 8), F32), "w": np.ones(8, F32), "eps": 1e-5}))(),
        [
            Arg("x", "data", dict(finite="propagate", fixed_ndim=False)),
            Arg("w", None, alts=[alt("wrong_len", lambda x, c: np.ones(len(x) + 1, F32))]),
            Arg("eps", None, alts=[alt("neg", lambda x, c: -1.0), alt("nan", lambda x, c: float("nan"))]),
        ],
    ),
    Spec(
        "model.sample_tokens",
        lambda d, t: (lambda: dict(cfg=_tiny_model().cfg, batch=1, T=4, seed=0, branching=4)),
        [
            Arg("cfg", "object", names=("cfg", "config")),
            Arg("batch", "int", dict(lo=0)),
            Arg("T", "int", dict(lo=0)),
            Arg("branching", "int"),
        ],
    ),
    Spec(
        "model.collect_kv",
        _tokens_base,
        [Arg("model", "object"), Arg("tokens", None, names=("tokens", "token"), alts=_tokens_alts())],
    ),
    Spec(
        "model.forward",
        lambda d, t: _with(_tokens_base(d, t), past=None),
        [
            Arg("tokens", None, names=("tokens", "token"), alts=_tokens_alts()),
            Arg(
                "past",
                None,
                alts=[
                    alt("wrong_layers", lambda x, c: [(np.zeros((1, 1, 2, 16), F32),) * 2]),
                    alt("str", lambda x, c: "past"),
                ],
            ),
        ],
    ),
]


ARRAY_SPECS = QUANT + PACKING + ATTN + HIGGS + PAGES + OSCAR_OFFLINE + ROTATIONS + METRICS + MEMORY + NUMERICS + MODEL
