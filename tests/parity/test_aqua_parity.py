"""kvq.fast.<backend>.aqua / aqua_cache against kvq.reference.aqua / aqua_cache, on the reference model.

What is bit-exact (numerics contract): the fused decode kernel (``aqua.reconstruct``: HIGGS lookup,
scale, inverse Hadamard / uniform unpack + dequantize, plus ``y + bias``) given the same product y; the
sinks, buffers, layer-0 codes and counters of the cache after the same appends (no matrix product
touches them); the fast tier's own streaming (token by token, random chunks) against its bulk append;
the backbone codes of a given residual; layer 0 of ``dequantize``.

What follows rule 7 (the predictors are fp32 matrix products, an order-dependent reduction): the
predictions and the reconstructions of layers >= 1 meet the tolerance rule (``tolerance.check_close``
against a float64 truth; the predictions against the median float32 error over 15 summation orders,
``check_within``); and the residual codes of layers >= 1 are checked by replaying every chunk
layer by layer with the fast tier's own reconstruction of the layer before (so that a legitimate flip
does not cascade into the next layer's inputs): (1) the fast codes are the reference quantizer's codes
of the fast residual, bit for bit; (2) against the codes of the reference's residual, the pre-rounding
values (metadata, scaled values, Hadamard coordinates) differ by at most the bound propagated from the
tolerance rule of the prediction, and every stored difference is a flip across a boundary between them:
one step (one float16 value, one integer code, the runner-up grid point) wherever they are closer than
a step; float32 metadata is stored unrounded and only bounded (``_rounding_flips``, ``_nearest_flips``;
``test_rule7_checker`` shows that they reject anything else). ``decode_attention`` follows the
tolerance rule against float64 attention over the float64 truth of the cache. Bad input raises the
reference's error (type and message) and leaves the state unchanged.

Targets: Triton through the interpreter (CI, CPU) and on the GPU, and the CuPy backend on the GPU
(``pytest -m gpu``).
"""

from __future__ import annotations

import functools
import importlib
import math

import numpy as np
import pytest
import torch

from kvq.fast.caches import aqua as _A
from kvq.reference import aqua as RA
from kvq.reference import aqua_cache as RC
from kvq.reference import attention as RAT
from kvq.reference import higgs as RG
from kvq.reference import model as M
from kvq.reference import numerics as nx
from kvq.reference.hadamard import fwht
from kvq.reference.packing import unpack

from .cases import assert_bits_equal, assert_same_error
from .tolerance import check_close, check_within, step_at

U = 2.0 ** -24                                            # fp32 unit roundoff

MODEL = M.TinyDecoder(M.ModelConfig(n_layers=3, seed=0))   # 3 layers, 2 KV heads of 32: F = 64
H, D, L = MODEL.n_kv_heads, MODEL.head_dim, MODEL.n_layers
F, B = H * D, 2


def _hg(d, n, g, meta="float16"):
    return RA.Higgs(RG.HiggsConfig(d, n, group_size=g, meta_dtype=meta))


# name -> (config, reduced rank of the predictors or None); together every backbone as first layer and
# as residual quantizer, pre- and post-RoPE keys, sinks 0 / 2 / 4, the "w/o V predictor" ablation
CFGS = {
    "higgs": (RA.AquaConfig(backbone=_hg(2, 16, 64), first_layer=_hg(2, 256, 64), buffer=16, max_tokens=400), None),
    "uniform-rank8": (RA.AquaConfig(backbone=RA.Uniform(2, 32), first_layer=RA.Uniform(4, 64, "float32"), buffer=16,
                                    max_tokens=400), 8),
    "fp16-first-post-rope": (RA.AquaConfig(backbone=_hg(2, 64, 32, "float32"), first_layer=RA.KeepFP16(),
                                           pre_rope=False, sink=0, buffer=8, max_tokens=400), None),
    "fp16-residual-no-vpred": (RA.AquaConfig(backbone=RA.KeepFP16(), first_layer=RA.Uniform(8, 32), predict_values=False,
                                             sink=2, buffer=8, max_tokens=400), None),
}
STREAM = {"higgs": "ones", "uniform-rank8": "random", "fp16-first-post-rope": "ones", "fp16-residual-no-vpred": "random"}


def _fa(backend):
    return importlib.import_module(f"kvq.fast.{backend}.aqua")


def _fc(backend):
    return importlib.import_module(f"kvq.fast.{backend}.aqua_cache")


def _t(a, device, dtype=None):
    t = torch.from_numpy(np.ascontiguousarray(a))
    return (t if dtype is None else t.to(dtype)).to(device)


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy()


@functools.lru_cache(maxsize=None)
def _train():
    return M.collect_kv(MODEL, M.sample_tokens(MODEL.cfg, 4, 96, seed=1))


@functools.lru_cache(maxsize=None)
def _setup(name: str, device: str):
    """(cfg, P, K, V, reference state after a bulk append): K, V (L, B, H, T, D) fp32, keys post-RoPE."""
    cfg, rank = CFGS[name]
    P = RA.calibrate(cfg, _train(), rank=rank)
    T = 41 if device == "cpu" else 300
    kv = M.collect_kv(MODEL, M.sample_tokens(MODEL.cfg, B, T, seed=2))
    K, V = np.stack([k for k, _ in kv]), np.stack([v for _, v in kv])
    rs = RC.init(cfg, L, B, H, D)
    RC.append(cfg, P, rs, K, V)
    return cfg, P, K, V, rs


@functools.lru_cache(maxsize=None)
def _fast_bulk(name: str, backend: str, device: str):
    """The fast state after one bulk append of float32 K, V (shared by the tests; never modified)."""
    cfg, P, K, V, _ = _setup(name, device)
    st = _fc(backend).init(cfg, L, B, H, D)
    _fc(backend).append(cfg, P, st, _t(K, device), _t(V, device))
    return st


def _chunks(kind, T, seed=1):
    if kind == "ones":
        return [1] * T
    rng = np.random.default_rng(seed)
    out, t = [], 0
    while t < T:
        out.append(min(int(rng.integers(0, 20)), T - t))
        t += out[-1]
    return out


def _same_fast(a, b, what=""):
    """Two fast states hold the same bits (streaming vs bulk, or unchanged after bad input)."""
    fa, fb = a.arrays(), b.arrays()
    assert fa.keys() == fb.keys() and (a.length, tuple(a.shape)) == (b.length, tuple(b.shape)), what
    for n in fa:
        assert fa[n].dtype == fb[n].dtype, (what, n)
        assert_bits_equal(fa[n], _np(fb[n]), f"{what}{n}")


def _ref_state(fs) -> RC.AquaState:
    """The reference's AquaState holding the fast state's arrays (to run the reference on fast codes)."""
    g = {grp: {n: _np(a) for n, a in getattr(fs, grp).items()} for grp in ("first_k", "first_v", "res_k", "res_v")}
    return RC.AquaState(_np(fs.sink_k), _np(fs.sink_v), _np(fs.buf_k), _np(fs.buf_v), **g, length=fs.length,
                        shape=tuple(fs.shape))


def _chunk_codes(st, l: int, c: int, torch_state: bool):
    out = []
    for grp in (("first_k", "first_v") if l == 0 else ("res_k", "res_v")):
        d = {n: (a[:, c] if l == 0 else a[l - 1, :, c]) for n, a in getattr(st, grp).items()}
        out.append(d if torch_state else {n: np.ascontiguousarray(a) for n, a in d.items()})
    return out


def _assert_codes(fast: dict, ref: dict, what: str):
    assert fast.keys() == ref.keys(), (what, sorted(fast), sorted(ref))
    for n in ref:
        assert_bits_equal(fast[n], ref[n], f"{what} {n}")


# ---------------------------------------------------------------------------------------------------
# rule 7: a flip is one step across a boundary between the two pre-rounding values


def _ordinal(x, kind: str) -> np.ndarray:
    """Stored values as integers that count rounding steps (float16: monotone bit patterns, -0 == +0)."""
    if kind == "int":
        return np.asarray(x).astype(np.int64)
    b = np.asarray(x, np.float16).view(np.int16).astype(np.int64)
    return np.where(b < 0, -(b & 0x7FFF), b)


def _rounding_flips(pf, pr, sf, sr, bound, kind: str, what: str) -> int:
    """Pre-rounding values pf (fast), pr (reference) and what they were stored as, sf, sr.

    Asserts |pf - pr| <= bound (elementwise, broadcast) and, where sf != sr: each stored value is the
    contract's rounding of its own pre-rounding value (float16 round-to-nearest-even; integer codes
    rint, ties to even), so every boundary crossed lies between pf and pr, and the two differ by exactly
    one step wherever |pf - pr| is below the step there (the rule-7 flip; more steps only where the bound
    spans several, e.g. float16 subnormals). float32 metadata is stored unrounded: the bound is the whole
    check. Returns the number of stored values that differ."""
    pf, pr = np.asarray(pf, np.float64), np.asarray(pr, np.float64)
    gap = np.abs(pf - pr)
    bound = np.broadcast_to(np.asarray(bound, np.float64), gap.shape)
    assert np.all(gap <= bound), \
        f"{what}: pre-rounding values differ by {gap.max():.3g} > bound {bound[gap > bound].min():.3g}"
    sf, sr = np.broadcast_to(np.asarray(sf), gap.shape), np.broadcast_to(np.asarray(sr), gap.shape)
    neq = sf != sr
    if kind == "float32" or not neq.any():
        return int(neq.sum())
    rnd = (lambda x: x.astype(np.float16)) if kind == "float16" else np.rint                    # noqa: E731
    for p, st, who in ((pf, sf, "fast"), (pr, sr, "reference")):
        got, want = _ordinal(st[neq], kind), _ordinal(rnd(p[neq]), kind)
        assert np.array_equal(got, want), f"{what}: a {who} value is not the rounding of its pre-rounding value"
    steps = np.abs(_ordinal(sf[neq], kind) - _ordinal(sr[neq], kind))
    near = np.minimum(np.abs(sf[neq]), np.abs(sr[neq]))
    step = np.float64(1.0) if kind == "int" else np.spacing(near.astype(np.float16))
    small = gap[neq] < step
    assert np.all(steps[small] == 1), \
        f"{what}: a flip of {steps[small].max()} steps from pre-rounding values closer than one step"
    return int(neq.sum())


def _nearest_flips(vf, vr, jf, jr, grid, bound, what: str) -> int:
    """d-vectors vf (fast), vr (reference) (M, d) fp32 and their nearest grid points jf, jr (M,).

    Asserts |vf - vr|_2 <= bound (M,); where jf != jr: the reference's vector lies within |vf - vr| (plus the
    fp32 rounding of the squared distances) of the bisector of its point and the fast one's (a boundary of
    the nearest-point regions), and the fast point is its runner-up (one step), within 2 |vf - vr|."""
    vf, vr = np.asarray(vf, np.float64), np.asarray(vr, np.float64)
    dv = np.linalg.norm(vf - vr, axis=-1)
    bound = np.broadcast_to(np.asarray(bound, np.float64), dv.shape)
    assert np.all(dv <= bound), f"{what}: pre-rounding vectors differ by {dv.max():.3g} > bound"
    neq = np.asarray(jf) != np.asarray(jr)
    if not neq.any():
        return 0
    g = np.asarray(grid, np.float64)
    d = g.shape[1]
    for i in np.flatnonzero(neq):
        c_r, c_f = g[jr[i]], g[jf[i]]
        dist = np.linalg.norm(vr[i] - g, axis=-1)                           # to every grid point
        sep = np.linalg.norm(c_f - c_r)
        far = max(dist[jr[i]], dist[jf[i]]) + dv[i]
        # fp32 squared distances: each within (2d + 2) u of its value; two decisions (fast, reference)
        slack_h = 2 * (2 * d + 2) * U * far * far / sep
        h = float(np.dot(vr[i] - (c_r + c_f) / 2, (c_f - c_r) / sep))       # signed distance to the bisector
        assert abs(h) <= dv[i] + slack_h, \
            f"{what}: vector {i} lies {abs(h):.3g} from the boundary; the pre-rounding values differ by {dv[i]:.3g}"
        others = np.delete(dist, jr[i])
        assert dist[jf[i]] <= others.min() + 2 * dv[i] + 2 * (2 * d + 2) * U * far, \
            f"{what}: vector {i}: grid point {jf[i]} is not the runner-up of {jr[i]}"
    return int(neq.sum())


def _check_flips(bb, rf, rr, bound_r, cf, cr, what) -> int:
    """Rule 7 for one backbone: the fast codes cf of residual rf against the codes cr of the reference's
    residual rr, |rf - rr| <= bound_r; metadata first, then the codes given the fast tier's metadata."""
    if isinstance(bb, RA.KeepFP16):
        return _rounding_flips(rf, rr, cf["x"], cr["x"], bound_r, "float16", what)
    if isinstance(bb, RA.Uniform):
        G, qm, meta = bb.group_size, nx.qmax(bb.bits), nx.dtype_name(bb.meta_dtype)
        gf, gr = (r.reshape(r.shape[:-1] + (-1, G)) for r in (rf, rr))
        mn_f, mn_r = (nx.canonical_zero(x.min(-1)) for x in (gf, gr))
        d_f, d_r = (nx.sub(x.max(-1), m) for x, m in ((gf, mn_f), (gr, mn_r)))
        s32_f, s32_r = (nx.canonical_zero(nx.div(x, qm)) for x in (d_f, d_r))
        bound_s = (2 * bound_r + np.spacing(np.maximum(d_f, d_r))) / qm + np.spacing(np.maximum(s32_f, s32_r))
        assert np.array_equal(nx.to_meta(s32_f, meta), cf["scale"]) and np.array_equal(nx.to_meta(mn_f, meta), cf["mn"])
        n = _rounding_flips(s32_f, s32_r, cf["scale"], cr["scale"], bound_s, meta, f"{what} scale")
        n += _rounding_flips(mn_f, mn_r, cf["mn"], cr["mn"], bound_r, meta, f"{what} min")
        s, m = cf["scale"].astype(np.float32)[..., None], cf["mn"].astype(np.float32)[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            uf, ur = (np.where(s == 0, np.float32(0), nx.clamp(nx.div(nx.sub(x, m), s), 0, qm)) for x in (gf, gr))
            bound_u = (bound_r + np.spacing(np.maximum(np.abs(gf - m), np.abs(gr - m)).max(-1, keepdims=True))) / s \
                + np.spacing(np.float32(qm))
        code_f = unpack(cf["codes"], bb.bits, axis=-1).reshape(gf.shape)
        assert np.array_equal(np.where(s == 0, 0, nx.rint(uf)), code_f), f"{what}: recomputed codes differ"
        return n + _rounding_flips(uf, ur, code_f, nx.rint(ur), np.where(s == 0, 0.0, bound_u), "int", f"{what} codes")
    cfg = bb.cfg                                                            # HIGGS
    g, d = cfg.group_size, cfg.d
    pad = lambda r: np.concatenate([r, np.zeros(r.shape[:-1] + (cfg.n_groups(F) * g - F,), np.float32)],   # noqa: E731
                                   -1).reshape(r.shape[:-1] + (cfg.n_groups(F), g))
    gf, gr = pad(rf), pad(rr)
    rms_f, rms_r = (np.sqrt(nx.div(RG.group_sum_of_squares(x), np.float32(g))) for x in (gf, gr))
    bound_rms = bound_r + (math.log2(g) + 3) * U * np.maximum(rms_f, rms_r)
    assert np.array_equal(nx.to_meta(rms_f, cfg.meta_dtype), cf["scale"]), f"{what}: recomputed scales differ"
    n = _rounding_flips(rms_f, rms_r, cf["scale"], cr["scale"], bound_rms, nx.dtype_name(cfg.meta_dtype),
                        f"{what} scale")
    s = cf["scale"].astype(np.float32)[..., None]
    yf, yr = fwht(gf), fwht(gr)
    with np.errstate(divide="ignore", invalid="ignore"):
        zf, zr = (np.where(s == 0, np.float32(0), nx.div(y, s)) for y in (yf, yr))
        # |H dr|_i <= |dr|_2; each fwht's rounding <= log2(g) u |r|_2 + u |y_i| (x FS); each division 1/2 ulp
        norm = lambda x: np.linalg.norm(x.astype(np.float64), axis=-1, keepdims=True)   # noqa: E731
        bound_y = math.sqrt(min(F, g)) * bound_r + math.log2(g) * U * (norm(gf) + norm(gr)) \
            + U * (np.abs(yf) + np.abs(yr))
        bound_z = np.where(s == 0, 0.0, bound_y / s + np.spacing(np.maximum(np.abs(zf), np.abs(zr))))
    vf, vr = (z.reshape(-1, d) for z in (zf, zr))
    bound_v = np.sqrt(d) * bound_z.reshape(-1, d).max(-1)
    jf = cf["idx"].reshape(-1).astype(np.int64)
    assert np.array_equal(jf, RG.nearest(vf, cfg.codebook())), f"{what}: fast indices are not the nearest points"
    return n + _nearest_flips(vf, vr, jf, RG.nearest(vr, cfg.codebook()), cfg.codebook(), bound_v, f"{what} idx")


def _pred64(pref, parts):
    y = np.concatenate([np.asarray(p, np.float64) for p in parts], -1)
    for m in pref.mats:
        y = y @ m.astype(np.float64)
    return y + pref.bias.astype(np.float64)


def _ref32_errors(pref, x, truth, n_orders=15, seed=0) -> list:
    """Max-abs errors of the float32 prediction ``pref(x)`` summed in ``n_orders`` random orders: every
    contraction (the input features, then each factor's inner dim) permuted, the same products."""
    rng = np.random.default_rng(seed)
    errs = []
    for _ in range(n_orders):
        y = nx.as_f32(x)
        for m in pref.mats:
            p = rng.permutation(m.shape[0])
            y = np.matmul(y[..., p], m[p])
        errs.append(float(np.max(np.abs(nx.add(y, pref.bias).astype(np.float64) - truth))))
    return errs


def _check_layer_codes(bb, x, pref, pdev, parts, codes_f, what) -> int:
    """One of K / V of one layer >= 1 and chunk: prediction (tolerance rule), then the codes (rule 7)."""
    codes_np = {n: _np(a) for n, a in codes_f.items()}
    if pref is None:                                                    # no product: bit-exact
        _assert_codes(codes_f, bb.encode(x), what)
        return 0
    pf = _np(_A.predict(pdev, parts) + pdev.bias)                       # what the fast flush computed
    parts_np = [_np(p) for p in parts]
    x_in = np.concatenate(parts_np, -1)
    pr = pref(x_in)
    truth = _pred64(pref, parts_np)
    # rule 7 against the median float32 error over 15 summation orders: the stored order alone is a
    # lucky yardstick with this machine's BLAS (scipy-openblas 0.3.31, AVX-512), e.g. chunk 0 layer 2 V
    # of the uniform rank-8 case: 2.5e-7 in stored order, 5.1e-7 to 6.6e-7 (median 5.8e-7) in random ones,
    # the fast prediction 7.8e-7
    ref_err = float(np.median(_ref32_errors(pref, x_in, truth)))
    check_within(pf, truth, ref_err, torch.float32, f"{what} prediction")
    # |pf - pr| <= |pf - truth| + |pr - truth|: the rule's bound on the first, the reference's own error
    bound_p = 2 * ref_err + float(np.abs(pr - truth).max()) + step_at(float(np.abs(truth).max()), torch.float32)
    rf, rr = nx.sub(x, pf), nx.sub(x, pr)
    bound_r = bound_p + float(np.spacing(np.maximum(np.abs(rf), np.abs(rr)).max()))
    cf = bb.encode(rf)
    _assert_codes(codes_f, cf, f"{what} (the reference quantizer of the fast residual)")
    return _check_flips(bb, rf, rr, bound_r, codes_np, bb.encode(rr), what)


def _replay(target, cfg, P, K, V, fs) -> int:
    """Every chunk, layer by layer, with the fast tier's reconstruction of the layer before (``aqua.decode``
    on the same shapes as the flush: the same bits): layer 0 codes bit-exact, layers >= 1 by
    ``_check_layer_codes``. Returns the number of stored values that differ from the reference's."""
    FA = _fa(target[0])
    S, R = cfg.sink, cfg.buffer
    w = _A.weights(P, fs.device)
    flips = 0
    for c in range(RC.counts(cfg, fs.length)[1]):
        sl = slice(S + c * R, S + (c + 1) * R)
        kp = vp = None
        for l in range(L):
            k = K[l][:, :, sl].astype(np.float16).astype(np.float32)
            if cfg.pre_rope:
                k = M.apply_rope(k, np.arange(sl.start, sl.stop), cfg.rope_theta, inverse=True)
            xk, xv = RA.to_tokens(k), RA.to_tokens(V[l][:, :, sl].astype(np.float16).astype(np.float32))
            Kq, Vq = _chunk_codes(fs, l, c, True)
            kh, vh = FA.decode(cfg, P, l, Kq, Vq, F, kp, vp)
            if l == 0:
                _assert_codes(Kq, cfg.first_layer.encode(xk), f"chunk {c} layer 0 K")
                _assert_codes(Vq, cfg.first_layer.encode(xv), f"chunk {c} layer 0 V")
            else:
                fk = P.f_key[l] if cfg.predict_keys else None
                fv = P.f_value[l] if cfg.predict_values else None
                flips += _check_layer_codes(cfg.backbone, xk, fk, fk and w[0][l], [kp], Kq, f"chunk {c} layer {l} K")
                flips += _check_layer_codes(cfg.backbone, xv, fv, fv and w[1][l], [vp, kh], Vq, f"chunk {c} layer {l} V")
            kp, vp = kh, vh
    return flips


# ---------------------------------------------------------------------------------------------------
# the fused decode kernel


RECON = [("higgs d2 n16 g64 F96", _hg(2, 16, 64), 96), ("higgs d2 n256 g32 fp32", _hg(2, 256, 32, "float32"), 64),
         ("higgs d4 n256 g64", _hg(4, 256, 64), 64), ("higgs n300 uint16", None, 64),
         ("uniform 2 g32", RA.Uniform(2, 32), 64), ("uniform 4 g16 fp32", RA.Uniform(4, 16, "float32"), 48),
         ("uniform 8 g64", RA.Uniform(8, 64), 64)]


@pytest.mark.parametrize("case", RECON, ids=[r[0] for r in RECON])
def test_reconstruct_bit_exact(fast_target, case):
    """aqua.reconstruct == the reference's decode, and decode + (y + bias), bit for bit: padding (F = 96 in
    groups of 64), grids of 16 / 256 / 300 points (uint8 / uint16 indices), d = 4, fp16 / fp32 metadata,
    2 / 4 / 8-bit uniform codes, zero vectors (zero scales)."""
    backend, device = fast_target
    _, bb, Fc = case
    if bb is None:                                                      # an explicit grid of 300 points
        grid = np.random.default_rng(3).standard_normal((300, 2)).astype(np.float32)
        bb = RA.Higgs(RG.HiggsConfig(2, 300, group_size=32, grid=grid))
    rng = np.random.default_rng(Fc)
    x = (rng.standard_normal((3, 5, Fc)) * 2).astype(np.float32)
    x[1, 2] = 0.0                                                       # a zero token vector
    codes = bb.encode(x)
    ct = {n: _t(a, device) for n, a in codes.items()}
    y = rng.standard_normal((3, 5, Fc)).astype(np.float32)
    b = rng.standard_normal(Fc).astype(np.float32)
    rec = _fa(backend).reconstruct
    assert_bits_equal(rec(bb, ct, Fc), bb.decode(codes, Fc), "Q^-1")
    assert_bits_equal(rec(bb, ct, Fc, _t(y, device), _t(b, device)), nx.add(bb.decode(codes, Fc), nx.add(y, b)),
                      "Q^-1 + (y + bias)")
    assert tuple(rec(bb, {n: a[:, :0] for n, a in ct.items()}, Fc).shape) == (3, 0, Fc)
    first = next(iter(ct))
    with pytest.raises(ValueError, match="come together"):
        rec(bb, ct, Fc, _t(y, device))
    with pytest.raises(ValueError, match="shape"):
        rec(bb, dict(ct, **{first: ct[first][:, :, :-1]}), Fc)
    with pytest.raises(ValueError, match="float32 tensor"):
        rec(bb, ct, Fc, _t(y, device).double(), _t(b, device))
    with pytest.raises(TypeError):
        rec(RA.KeepFP16(), {"x": _t(x, device).half()}, Fc)


def test_encode_decode_per_layer(fast_target):
    """aqua.encode's reconstructions are aqua.decode of its codes (the same values), layer by layer, and
    layer 0's codes and reconstructions are the reference's bit for bit."""
    backend, device = fast_target
    FA = _fa(backend)
    cfg, P, K, V, _ = _setup("higgs", device)
    toks = RA.calibration_tokens(cfg, [(k[:, :, :20], v[:, :, :20]) for k, v in zip(K, V)])
    kh = vh = None
    for l, (k, v) in enumerate(toks):
        Kq, Vq, K_hat, V_hat = FA.encode(cfg, P, l, _t(k, device), _t(v, device), kh, vh)
        K2, V2 = FA.decode(cfg, P, l, Kq, Vq, F, kh, vh)
        assert torch.equal(K2, K_hat) and torch.equal(V2, V_hat), l
        if l == 0:
            rq = RA.encode(cfg, P, 0, k, v)
            _assert_codes(Kq, rq[0], "layer 0 K")
            _assert_codes(Vq, rq[1], "layer 0 V")
            assert_bits_equal(K_hat, rq[2], "layer 0 K_hat")
        kh, vh = K_hat, V_hat
    with pytest.raises(ValueError, match="K_prev_hat"):
        FA.encode(cfg, P, 1, _t(toks[1][0], device), _t(toks[1][1], device))
    assert torch.equal(FA.to_tokens(_t(K[0], device)), _t(RA.to_tokens(K[0]), device))
    assert torch.equal(FA.from_tokens(_t(RA.to_tokens(V[1]), device), H), _t(V[1], device))


# ---------------------------------------------------------------------------------------------------
# the cache state


@pytest.mark.parametrize("name", list(CFGS))
def test_state_parity(fast_target, name):
    """Streaming (token by token or random chunks; float16 or float32 input) == bulk on the fast tier, bit
    for bit; sinks, buffers, layer-0 codes, counters == the reference bit for bit; residual codes by the
    rule-7 replay."""
    backend, device = fast_target
    FC = _fc(backend)
    cfg, P, K, V, rs = _setup(name, device)
    bulk = _fast_bulk(name, backend, device)
    st = FC.init(cfg, L, B, H, D)
    dt = torch.float16 if name in ("uniform-rank8", "fp16-first-post-rope") else torch.float32
    Kt, Vt = _t(K, device, dt), _t(V, device, dt)
    t = 0
    for n in _chunks(STREAM[name], K.shape[3]):
        FC.append(cfg, P, st, Kt[:, :, :, t:t + n], Vt[:, :, :, t:t + n])
        t += n
    _same_fast(st, bulk, "streamed vs bulk: ")
    fa, ra = bulk.arrays(), rs.arrays()
    assert fa.keys() == ra.keys() and (bulk.length, tuple(bulk.shape)) == (rs.length, tuple(rs.shape))
    for n in ra:
        assert tuple(fa[n].shape) == ra[n].shape and _np(fa[n]).dtype == ra[n].dtype, n
        if not n.startswith("res_"):
            assert_bits_equal(fa[n], ra[n], n)
    assert RC.counts(cfg, bulk.length)[1] >= 2                         # at least two chunks were encoded
    _replay(fast_target, cfg, P, K, V, bulk)
    assert FC.state_bytes(bulk) == RC.state_bytes(rs)


def _truth(cfg, P, rst) -> list:
    """[(K_l, V_l)] float64 (B, H, T, D) of a reference state: Algorithm 3 chunk by chunk in exact arithmetic
    on the stored codes and the fp32 predictor weights, RoPE with the fp32 tables (the float64 truth)."""
    n_sink, n, n_buf = RC.counts(cfg, rst.length)
    S, R = cfg.sink, cfg.buffer
    parts = [[[rst.sink_k[l][:, :, :n_sink]], [rst.sink_v[l][:, :, :n_sink]]] for l in range(L)]
    for c in range(n):
        kp = vp = None
        for l in range(L):
            Kq, Vq = _chunk_codes(rst, l, c, False)
            bb = cfg.first_layer if l == 0 else cfg.backbone
            kh, vh = (bb.decode(q, F).astype(np.float64) for q in (Kq, Vq))
            if l and cfg.predict_keys:
                kh = kh + _pred64(P.f_key[l], [kp])
            if l and cfg.predict_values:
                vh = vh + _pred64(P.f_value[l], [vp, kh])
            k = RA.from_tokens(kh, H)
            if cfg.pre_rope:
                cos, sin = (t.astype(np.float64) for t in M.rope_tables(S + c * R + np.arange(R), D, cfg.rope_theta))
                k = k * cos + np.concatenate([-k[..., D // 2:], k[..., :D // 2]], -1) * sin
            parts[l][0].append(k)
            parts[l][1].append(RA.from_tokens(vh, H))
            kp, vp = kh, vh
    for l in range(L):
        parts[l][0].append(rst.buf_k[l][:, :, :n_buf])
        parts[l][1].append(rst.buf_v[l][:, :, :n_buf])
    return [tuple(np.concatenate([np.asarray(a, np.float64) for a in p], 2) for p in pl) for pl in parts]


@pytest.mark.parametrize("name", list(CFGS))
def test_dequantize(fast_target, name):
    """dequantize: sink, buffer and layer 0 bit-exact with the reference's dequantize of the same state;
    layers >= 1 within the tolerance rule against the float64 truth; decode_layer is its history."""
    backend, device = fast_target
    FC = _fc(backend)
    cfg, P, K, V, _ = _setup(name, device)
    fs = _fast_bulk(name, backend, device)
    rst = _ref_state(fs)
    ref, truth = RC.dequantize(cfg, P, rst), _truth(cfg, P, rst)
    got = FC.dequantize(cfg, P, fs)
    n_sink, n, _ = RC.counts(cfg, fs.length)
    hist = slice(n_sink, n_sink + n * cfg.buffer)
    hat = None
    for l in range(L):
        hat = FC.decode_layer(cfg, P, fs, l, hat)
        for i, what in ((0, "K"), (1, "V")):
            g, r = got[l][i], ref[l][i]
            assert g.dtype == torch.float32 and tuple(g.shape) == r.shape == (B, H, K.shape[3], D)
            if l == 0:
                assert_bits_equal(g, r, f"layer 0 {what}")
            else:
                keep = np.r_[0:n_sink, hist.stop:r.shape[2]]
                assert_bits_equal(g[:, :, keep], r[:, :, keep], f"layer {l} {what} sink / buffer")
                check_close(g[:, :, hist], truth[l][i][:, :, hist], r[:, :, hist], torch.float32, f"layer {l} {what}")
        assert_bits_equal(_fa(backend).from_tokens(hat[1], H), _np(got[l][1][:, :, hist]), f"layer {l} decode_layer V")


ATTN = [("higgs", torch.float32, 4, 1, 2), ("higgs", torch.float16, 1, 2, 0), ("uniform-rank8", torch.bfloat16, 2, 1, 1),
        ("fp16-first-post-rope", torch.float32, 2, 3, 2), ("fp16-residual-no-vpred", torch.float16, 4, 1, 1)]


@pytest.mark.parametrize("a", ATTN, ids=[f"{a[0]}-{str(a[1])[6:]}-gqa{a[2]}-tq{a[3]}-l{a[4]}" for a in ATTN])
def test_decode_attention(fast_target, a):
    """decode_attention of layer l (hat from the decode_layer chain, or decoded inside) against float64
    attention over the float64 truth of the cache, with the reference's fp32 attention over its
    dequantize as the float32 reference (tolerance rule)."""
    backend, device = fast_target
    FC = _fc(backend)
    name, dtype, ratio, T_q, l = a
    cfg, P, K, V, _ = _setup(name, device)
    fs = _fast_bulk(name, backend, device)
    rst = _ref_state(fs)
    rng = np.random.default_rng(ratio * 10 + l)
    q = torch.from_numpy(rng.standard_normal((B, H * ratio, T_q, D)).astype(np.float32)).to(dtype).to(device)
    hat = None
    for j in range(l + 1):
        hat = FC.decode_layer(cfg, P, fs, j, hat)
    out, lse = FC.decode_attention(cfg, P, fs, l, q, hat)
    assert out.dtype == dtype and tuple(out.shape) == tuple(q.shape) and lse.dtype == torch.float32
    out2, lse2 = FC.decode_attention(cfg, P, fs, l, q)                   # hat decoded inside: the same bits
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    q32 = q.float().cpu().numpy()
    K64, V64 = _truth(cfg, P, rst)[l]
    K32, V32 = RC.dequantize(cfg, P, rst)[l]
    o64, l64 = RAT.decode_attention(q32.astype(np.float64), [(K64, V64)])
    o32, l32 = RAT.decode_attention(q32, [(K32, V32)])
    check_close(out, o64, o32, dtype, "out")
    check_close(lse, l64, l32, torch.float32, "lse")
    out3, _ = FC.decode_attention(cfg, P, fs, l, q, hat, scale=0.3)
    check_close(out3, RAT.decode_attention(q32.astype(np.float64), [(K64, V64)], scale=0.3)[0],
                RAT.decode_attention(q32, [(K32, V32)], scale=0.3)[0], dtype, "out (scale=0.3)")


# ---------------------------------------------------------------------------------------------------
# bad input, module objects, the checker


def test_bad_input(fast_target):
    backend, device = fast_target
    FC = _fc(backend)
    cfg, P, K, V, _ = _setup("higgs", device)
    rs, fs = RC.init(cfg, L, B, H, D), FC.init(cfg, L, B, H, D)
    RC.append(cfg, P, rs, K[:, :, :, :30], V[:, :, :, :30])
    FC.append(cfg, P, fs, _t(K[:, :, :, :30], device), _t(V[:, :, :, :30], device))
    before, rbefore = fs.copy(), rs.copy()
    T = lambda x: _t(x, device)                                                    # noqa: E731
    k1, v1 = K[:, :, :, 30:33], V[:, :, :, 30:33]
    nan, inf, big = k1.copy(), v1.copy(), k1.copy()
    nan[1, 0, 1, 2, 3] = np.nan
    inf[2, 1, 0, 0, 0] = -np.inf
    big[0, 1, 1, 0, 5] = 7e4                                                       # overflows the FP16 buffers
    bad = [(k1.astype(np.float64), v1), (k1.astype(np.int32), v1), (k1[:, :1], v1[:, :1]),
           (k1[..., :D // 2], v1[..., :D // 2]), (k1[0], v1[0]), (k1[:2], v1[:2]), (k1, V[:, :, :, 30:34]),
           (nan, v1), (k1, inf), (big, v1),
           (np.zeros((L, B, H, cfg.max_tokens, D), np.float16),) * 2]
    for kb, vb in bad:
        assert_same_error(lambda: RC.append(cfg, P, rs, kb, vb), lambda: FC.append(cfg, P, fs, T(kb), T(vb)))
        _same_fast(fs, before, "after bad input: ")
    P2 = RA.AquaPredictors((None,) * 2, (None,) * 2)
    assert_same_error(lambda: RC.append(cfg, P2, rs, k1, v1), lambda: FC.append(cfg, P2, fs, T(k1), T(v1)))
    for args in ((cfg, 0, B, H, D), (cfg, L, B, H, 0), (RA.AquaConfig(buffer=4), L, B, H, 31)):
        assert_same_error(lambda: RC.init(*args), lambda: FC.init(*args))
    with pytest.raises(TypeError, match="torch.Tensor"):
        FC.append(cfg, P, fs, k1, v1)                                              # NumPy: the reference's input
    with pytest.raises(TypeError, match="backbones"):
        FC.init(RA.AquaConfig(backbone=type("Odd", (), {"encode": 0, "decode": 0, "bits_per_value": 0})()), L, B, H, D)
    FC.append(cfg, P, fs, T(k1[:, :, :, :0]), T(v1[:, :, :, :0]))                 # an empty append changes nothing
    _same_fast(fs, before, "after an empty append: ")
    # a failure inside a chunk's encoding (a residual beyond float16) leaves both states unchanged
    c4 = CFGS["fp16-residual-no-vpred"][0]
    zero = RA.Predictor((np.zeros((F, F), np.float32),), np.full(F, -3e4, np.float32))
    Pbig = RA.AquaPredictors((None, zero, None), (None, None, None))
    kk = np.ones((L, B, H, c4.sink + c4.buffer, D), np.float32)
    kk[1] = 5e4                                                                    # fits float16; 5e4 + 3e4 does not
    r4, f4 = RC.init(c4, L, B, H, D), FC.init(c4, L, B, H, D)
    f4_before = f4.copy()
    assert_same_error(lambda: RC.append(c4, Pbig, r4, kk, kk), lambda: FC.append(c4, Pbig, f4, T(kk), T(kk)))
    _same_fast(f4, f4_before, "after a failed chunk: ")
    assert r4.length == 0
    # decode_attention and decode_layer
    q = torch.zeros((B, 2 * H, 1, D), dtype=torch.float32, device=device)
    for qb in (q[:, :H + 1], q[..., :D // 2], q[0], q[:1], q.double()):
        with pytest.raises((ValueError, TypeError)):
            FC.decode_attention(cfg, P, fs, 1, qb)
    with pytest.raises(ValueError, match="outside"):
        FC.decode_attention(cfg, P, fs, L, q)
    with pytest.raises(ValueError, match="hat must be"):
        FC.decode_attention(cfg, P, fs, 1, q, (q, q))
    with pytest.raises(ValueError, match="prev must be"):
        FC.decode_layer(cfg, P, fs, 2, (q, q))
    with pytest.raises(ValueError, match="empty"):
        FC.decode_attention(cfg, P, FC.init(cfg, L, B, H, D), 0, q)
    _same_fast(fs, before, "after reads: ")
    assert all(np.array_equal(a, b) for a, b in zip(rs.arrays().values(), rbefore.arrays().values()))


def test_module_objects(fast_target):
    """Data names are the reference's objects; bits_per_value is its Fraction; init's tensors have the
    reference's shapes and dtypes; decode_layer of an empty history is empty."""
    backend, device = fast_target
    FA, FC = _fa(backend), _fc(backend)
    for name in ("Uniform", "Higgs", "KeepFP16", "AquaConfig", "Predictor", "AquaPredictors"):
        assert getattr(FA, name) is getattr(RA, name)
    for name, (cfg, _) in CFGS.items():
        assert FC.bits_per_value(cfg, 28, 1024) == RC.bits_per_value(cfg, 28, 1024)
        fs, rs = FC.init(cfg, L, B, H, D), RC.init(cfg, L, B, H, D)
        fa, ra = fs.arrays(), rs.arrays()
        assert fa.keys() == ra.keys()
        for n in ra:
            assert tuple(fa[n].shape) == ra[n].shape and _np(fa[n]).dtype == ra[n].dtype and fa[n].device.type == device
        assert FC.state_bytes(fs) == RC.state_bytes(rs)
    cfg, P = CFGS["higgs"][0], _setup("higgs", device)[1]
    k, v = FC.decode_layer(cfg, P, FC.init(cfg, L, B, H, D), 1)
    assert tuple(k.shape) == tuple(v.shape) == (B, 0, F)


def test_rule7_checker():
    """The flip checks of this file accept what rule 7 allows (one step across a boundary between two
    pre-rounding values within the bound; several only where the bound spans several steps) and reject
    everything else (so a wrong fast code cannot pass the replay)."""
    e = 2.0 ** -20
    assert _rounding_flips([0.5 + e], [0.5 - e], [1], [0], 4 * e, "int", "ok") == 1
    assert _rounding_flips([2.5 - e], [2.5 + e], [2], [3], 4 * e, "int", "ok") == 1
    for pf, pr, sf, sr, bound in (([0.5 + e], [0.5 - e], [2], [0], 4 * e),        # two steps
                                  ([0.3], [0.3 + e], [1], [0], 4 * e),            # no boundary in between
                                  ([1.5 + e], [1.5 - e], [2], [0], 4 * e),        # not one step
                                  ([0.5 + e], [0.5 - e], [1], [0], e)):           # values further apart than the bound
        with pytest.raises(AssertionError):
            _rounding_flips(pf, pr, sf, sr, bound, "int", "bad")
    a = np.float16(1.0)
    b = np.nextafter(a, np.float16(2))
    mid = (np.float32(a) + np.float32(b)) / 2
    pf, pr = np.nextafter(mid, np.float32(2)), np.nextafter(mid, np.float32(0))
    assert _rounding_flips([pf], [pr], [pf.astype(np.float16)], [pr.astype(np.float16)], 1e-6, "float16", "ok") == 1
    with pytest.raises(AssertionError):
        _rounding_flips([pf], [pr], [np.float16(1.5)], [pr.astype(np.float16)], 1e-6, "float16", "bad")
    sub = np.float32(2.0 ** -24 * 5.5)                                           # float16 subnormals, step 2^-24
    lo, hi = sub - np.float32(2.0 ** -23), sub + np.float32(2.0 ** -23)             # 4 steps apart: several flips ok
    assert _rounding_flips([hi], [lo], [hi.astype(np.float16)], [lo.astype(np.float16)], 1e-6, "float16", "ok") == 1
    grid = np.array([[0, 0], [1, 0], [0.5, 3]], np.float32)
    vr, vf = np.array([[0.5 - e, 0.2]], np.float32), np.array([[0.5 + e, 0.2]], np.float32)
    assert _nearest_flips(vf, vr, np.array([1]), np.array([0]), grid, [4 * e], "ok") == 1
    with pytest.raises(AssertionError):                                          # far from the boundary
        _nearest_flips(np.array([[0.1, 0.2]], np.float32), np.array([[0.1, 0.2]], np.float32), np.array([1]),
                       np.array([0]), grid, [4 * e], "bad")
    with pytest.raises(AssertionError):                                          # a far point, not the runner-up
        _nearest_flips(vf, vr, np.array([2]), np.array([0]), grid, [4 * e], "bad")
    with pytest.raises(AssertionError):                                          # further apart than the bound
        _nearest_flips(vf, vr, np.array([1]), np.array([0]), grid, [e], "bad")


# ----------------------------------------------------------------------------- RoPE over the history


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("D", [2, 8, 128])
def test_fast_rope_is_the_reference_apply_rope_bit_for_bit(dev, inverse, D):
    """``aqua_cache.rope`` (three passes: the halves' products, then in-place sums) equals
    ``model.apply_rope`` (concatenated rotate_half) bit for bit, signed zeros, huge and tiny values included,
    on a transposed view as ``segments`` passes it."""
    from kvq.fast.caches import aqua_cache as FA

    rng = np.random.default_rng(D + 7 * inverse)
    B, H, T, theta, t0 = 2, 3, 37, 500000.0, 11
    x = (rng.standard_normal((B, T, H, D)) * np.exp2(rng.integers(-20, 20, size=(B, T, H, D)))).astype(np.float32)
    x[0, :3] = 0.0
    x[1, :3] = -0.0
    x[0, 3, 0, :] = np.float32(3.0e38)
    xt = np.ascontiguousarray(x.transpose(0, 2, 1, 3))                     # (B, H, T, D)
    want = M.apply_rope(xt, np.arange(t0, t0 + T), theta, inverse=inverse)
    cos, sin = M.rope_tables(np.arange(t0, t0 + T), D, theta)
    xv = torch.from_numpy(x).to(dev).transpose(1, 2)                        # a view, not contiguous
    got = FA.rope(xv, torch.from_numpy(cos).to(dev), torch.from_numpy(sin).to(dev), inverse)
    assert_bits_equal(got, want, f"rope inverse={inverse} D={D} on {dev}")
    assert_bits_equal(xv, xt, "rope leaves its input as it was")


def test_rope_tables_cover_the_capacity_at_first_use(monkeypatch):
    """The device RoPE tables are made for the cache's capacity at their first use: later chunks and decode
    steps within it slice them, and never copy a new table to the device (a synchronizing copy) mid-
    generation. Slices equal the reference's tables of those positions."""
    from kvq.fast.caches import aqua_cache as FA

    made = []
    real = FA.rope_tables
    monkeypatch.setattr(FA, "rope_tables", lambda pos, D, theta: made.append(len(pos)) or real(pos, D, theta))
    monkeypatch.setattr(FA, "_ROPE", {})
    theta, D, cap = 12345.0, 8, 10000
    cos, sin = FA._rope_tables(theta, D, 4, 16, "cpu", cap)
    assert made == [12288]                                      # capacity rounded up to _ROPE_ROUND
    for t0 in (20, 4096, 9000):
        c, s = FA._rope_tables(theta, D, t0, 16, "cpu", cap)
        want = M.rope_tables(np.arange(t0, t0 + 16), D, theta)
        assert np.array_equal(c.numpy(), want[0]) and np.array_equal(s.numpy(), want[1])
    assert made == [12288]
    FA._rope_tables(theta, D, 12288, 16, "cpu", cap)            # past it (a grown cache): made once more
    assert made == [12288, 16384]
    FA._rope_tables(theta, D, 4, 16, "cpu", 20000)              # a larger cache: its capacity at its first use
    assert made == [12288, 16384, 20480]
