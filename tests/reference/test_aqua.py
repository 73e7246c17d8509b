"""AQUA-KV (kvq.reference.aqua, aqua_cache, aqua_probes) on the reference model.

Predictors (ridge with intercept, reduced rank), Algorithm 1 (sequential, on reconstructions; the
quantizer-agnostic ablation on clean inputs), Algorithms 2-3 (decode(encode(x)) bit for bit), the
streaming cache (streaming equals bulk; sinks and buffer exact; bad input leaves the state unchanged),
Algorithm 4 against the plain forward pass, the paper's bits-per-value numbers, and the Fig. 2 probes.
"""

from fractions import Fraction

import numpy as np
import pytest

from kvq.reference import aqua as A
from kvq.reference import aqua_cache as C
from kvq.reference import aqua_probes as PR
from kvq.reference import higgs as Hg
from kvq.reference import model as M

MODEL = M.TinyDecoder(M.ModelConfig(n_layers=4, seed=0))
H, D, L = MODEL.n_kv_heads, MODEL.head_dim, MODEL.n_layers
F = H * D


def higgs(n, d=2):
    return A.Higgs(Hg.HiggsConfig(d, n, group_size=64))


CFGS = {
    "higgs": A.AquaConfig(backbone=higgs(16), first_layer=higgs(256), buffer=16, max_tokens=160),
    "uniform": A.AquaConfig(backbone=A.Uniform(2, 64), first_layer=A.Uniform(4, 64), buffer=16, max_tokens=160),
    "fp16-first-post-rope": A.AquaConfig(backbone=higgs(64), first_layer=A.KeepFP16(), pre_rope=False,
                                         sink=0, buffer=8, max_tokens=160),
}


@pytest.fixture(scope="module")
def data():
    train = M.collect_kv(MODEL, M.sample_tokens(MODEL.cfg, 4, 192, seed=1))
    test = M.collect_kv(MODEL, M.sample_tokens(MODEL.cfg, 2, 192, seed=2))
    preds = {name: A.calibrate(cfg, train) for name, cfg in CFGS.items()}
    return train, test, preds


def stacked(kv, t0=0, t1=None):
    return (np.stack([k[:, :, t0:t1] for k, _ in kv]), np.stack([v[:, :, t0:t1] for _, v in kv]))


# ---------------------------------------------------------------------------------------------------
# predictors


def test_ridge_recovers_a_linear_map_and_matches_the_closed_form():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((500, 6)).astype(np.float32) + 3
    W, b = rng.standard_normal((6, 4)), rng.standard_normal(4)
    Y = (X @ W + b).astype(np.float32)
    p = A.fit_ridge(X, Y, ridge=1e-10)
    assert p.mats[0].dtype == p.bias.dtype == np.float32
    np.testing.assert_allclose(p.mats[0], W, atol=1e-4)
    np.testing.assert_allclose(p.bias, b, atol=1e-3)
    # ridge 0.1: the minimizer of |Xc W - Yc|^2 + lam |W|^2, lam = 0.1 * mean diag(Xc^T Xc), by lstsq
    Yn = Y + rng.standard_normal(Y.shape).astype(np.float32)
    p = A.fit_ridge(X, Yn, ridge=0.1)
    Xc, Yc = X - X.mean(0), Yn - Yn.mean(0)
    lam = 0.1 * (Xc.astype(np.float64) ** 2).sum(0).mean()
    W_ls = np.linalg.lstsq(np.vstack([Xc, np.sqrt(lam) * np.eye(6)]), np.vstack([Yc, np.zeros((6, 4))]), rcond=None)[0]
    np.testing.assert_allclose(p.mats[0], W_ls, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(p.bias, Yn.mean(0) - X.mean(0) @ W_ls, rtol=1e-4, atol=1e-4)


def test_reduced_rank():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((400, 12)).astype(np.float32)
    Y = (X @ rng.standard_normal((12, 10))).astype(np.float32)
    p2 = A.fit_reduced_rank(X, Y, rank=2)
    assert [m.shape for m in p2.mats] == [(12, 2), (2, 10)]
    assert np.linalg.matrix_rank(p2(X) - p2.bias, tol=1e-3) == 2
    full, ridge = A.fit_reduced_rank(X, Y, rank=10), A.fit_ridge(X, Y)
    np.testing.assert_allclose(full(X), ridge(X), atol=1e-3)
    ev = [PR.explained_variance(Y, A.fit_reduced_rank(X, Y, rank=r)(X)) for r in (1, 3, 6, 10)]
    assert ev == sorted(ev) and ev[-1] > 0.999
    with pytest.raises(ValueError, match="rank"):
        A.fit_reduced_rank(X, Y, rank=11)


def test_explained_variance_ignores_bias():
    y = np.random.default_rng(2).standard_normal((100, 3))
    assert PR.explained_variance(y, y + 5) == pytest.approx(1.0)
    assert PR.explained_variance(y, np.broadcast_to(y.mean(0), y.shape)) == pytest.approx(0.0)


# ---------------------------------------------------------------------------------------------------
# calibration (Algorithm 1), encode / decode (Algorithms 2-3)


@pytest.mark.parametrize("name", list(CFGS))
def test_decode_of_encode_is_the_reconstruction(name, data):
    cfg, P = CFGS[name], data[2][name]
    toks = A.calibration_tokens(cfg, data[1])
    Kh = Vh = None
    for l, (K, V) in enumerate(toks):
        Kq, Vq, K_hat, V_hat = A.encode(cfg, P, l, K, V, Kh, Vh)
        K2, V2 = A.decode(cfg, P, l, Kq, Vq, F, Kh, Vh)
        assert np.array_equal(K2, K_hat) and np.array_equal(V2, V_hat)
        rel = ((K_hat - K) ** 2).sum() / ((K - K.mean(0)) ** 2).sum()
        assert rel < (0.02 if l == 0 and name != "fp16-first-post-rope" else 0.15), (l, rel)
        Kh, Vh = K_hat, V_hat


@pytest.mark.parametrize("name", ["higgs", "uniform"])
def test_predictors_reduce_residual_variance_and_error(name, data):
    """On held-out data: the residual each layer quantizes has less variance than the vector itself,
    and the AQUA-KV reconstruction error is below that of the same backbone without predictors."""
    cfg, P = CFGS[name], data[2][name]
    before, after = PR.residual_variance(cfg, P, data[1])
    assert np.all(after[:, 1:] < 0.7 * before[:, 1:]), after / before
    plain = A.AquaConfig(backbone=cfg.backbone, first_layer=cfg.first_layer, predict_keys=False,
                         predict_values=False, buffer=16)
    err = {}
    for tag, c in (("aqua", cfg), ("plain", plain)):
        Kh = Vh = None
        err[tag] = []
        for l, (K, V) in enumerate(A.calibration_tokens(cfg, data[1])):
            _, _, Kh, Vh = A.encode(c, P, l, K, V, Kh, Vh)
            err[tag].append((((Kh - K) ** 2).sum(), ((Vh - V) ** 2).sum()))
    e_aqua, e_plain = np.array(err["aqua"]), np.array(err["plain"])
    np.testing.assert_array_equal(e_aqua[0], e_plain[0])            # layer 0: same first-layer quantizer
    assert np.all(e_aqua[1:] < 0.75 * e_plain[1:]), e_aqua / e_plain


def test_calibration_is_deterministic_and_follows_algorithm_1(data):
    cfg, train = CFGS["higgs"], data[0]
    P1, P2 = data[2]["higgs"], A.calibrate(cfg, train)
    for a, b in zip(P1.f_key[1:] + P1.f_value[1:], P2.f_key[1:] + P2.f_value[1:]):
        assert all(np.array_equal(x, y) for x, y in zip(a.mats + (a.bias,), b.mats + (b.bias,)))
    toks = A.calibration_tokens(cfg, train)
    _, _, K0_hat, V0_hat = A.encode(cfg, P1, 0, *toks[0])
    fk = A.fit_ridge(K0_hat, toks[1][0])                         # line 13: trained on layer 0's reconstruction
    np.testing.assert_array_equal(P1.f_key[1].mats[0], fk.mats[0])
    K1_pred = fk(K0_hat)
    K1_rec = K1_pred + cfg.backbone.decode(cfg.backbone.encode(toks[1][0] - K1_pred), F)
    fv = A.fit_ridge(np.concatenate([V0_hat, K1_rec], -1), toks[1][1])   # line 17
    np.testing.assert_array_equal(P1.f_value[1].mats[0], fv.mats[0])


def test_quantizer_agnostic_ablation_trains_on_clean_inputs(data):
    cfg, train = CFGS["higgs"], data[0]
    P = A.calibrate(cfg, train, quantizer_agnostic=True)
    toks = A.calibration_tokens(cfg, train)
    np.testing.assert_array_equal(P.f_key[2].mats[0], A.fit_ridge(toks[1][0], toks[2][0]).mats[0])
    Xv = np.concatenate([toks[1][1], toks[2][0]], -1)
    np.testing.assert_array_equal(P.f_value[2].mats[0], A.fit_ridge(Xv, toks[2][1]).mats[0])
    assert not np.array_equal(P.f_key[2].mats[0], data[2]["higgs"].f_key[2].mats[0])
    Pr = A.calibrate(cfg, train, rank=8)
    assert Pr.f_key[1].mats[0].shape == (F, 8) and Pr.n_params < P.n_params


def test_pre_rope_keys_are_more_predictable(data):
    """§3.3: linear predictors do better on pre-RoPE keys (a linear map is not rotation-equivariant)."""
    ev = {}
    for pre in (True, False):
        cfg = A.AquaConfig(pre_rope=pre, sink=0)
        tr, te = A.calibration_tokens(cfg, data[0]), A.calibration_tokens(cfg, data[1])
        ev[pre] = np.mean([PR.explained_variance(te[l][0], A.fit_ridge(tr[l - 1][0], tr[l][0])(te[l - 1][0]))
                           for l in range(1, L)])
    assert ev[True] > ev[False] + 0.1, ev


def test_probes_fig2(data):
    res = PR.probe_explained_variance(A.AquaConfig(), data[0], data[1], depth=2)
    assert set(res["K"]) == {"L-1", "L-1..2", "T-1", "T-1..2", "V"}
    assert set(res["V"]) == {"L-1", "L-1..2", "T-1", "T-1..2", "K"}
    for role in "KV":
        r = res[role]
        assert r["L-1"] > 0.4 and r["L-1..2"] >= r["L-1"] - 0.01        # previous layers predict
        assert r["T-1"] < r["L-1"] - 0.3                                 # previous tokens hardly do (§3.1)
        assert r["V" if role == "K" else "K"] > 0.4                      # the other role does
    with pytest.raises(ValueError, match="depth"):
        PR.probe_explained_variance(A.AquaConfig(), data[0], data[1], depth=L)


# ---------------------------------------------------------------------------------------------------
# the streaming cache


def same_state(a, b):
    A_, B_ = a.arrays(), b.arrays()
    assert A_.keys() == B_.keys() and a.length == b.length
    for n in A_:
        assert A_[n].dtype == B_[n].dtype and np.array_equal(A_[n].view(np.uint8), B_[n].view(np.uint8)), n


@pytest.mark.parametrize("name", list(CFGS))
def test_streaming_equals_bulk(name, data):
    cfg, P = CFGS[name], data[2][name]
    K, V = stacked(data[1], 0, 61)
    bulk = C.init(cfg, L, 2, H, D)
    C.append(cfg, P, bulk, K, V)
    rng = np.random.default_rng(0)
    for chunks in ("ones", "random"):
        st, t = C.init(cfg, L, 2, H, D), 0
        while t < 61:
            n = 1 if chunks == "ones" else int(rng.integers(0, 20))
            C.append(cfg, P, st, K[:, :, :, t:t + n], V[:, :, :, t:t + n])
            t += n
        same_state(bulk, st)


@pytest.mark.parametrize("name", list(CFGS))
def test_dequantize_layout(name, data):
    cfg, P = CFGS[name], data[2][name]
    T = 61
    K, V = stacked(data[1], 0, T)
    st = C.init(cfg, L, 2, H, D)
    C.append(cfg, P, st, K, V)
    out = C.dequantize(cfg, P, st)
    S, R = cfg.sink, cfg.buffer
    n_q = (T - S) // R * R
    for l, (k, v) in enumerate(out):
        assert k.shape == v.shape == (2, H, T, D) and k.dtype == np.float32
        for x, x_hat in ((K[l], k), (V[l], v)):
            exact = np.r_[0:S, S + n_q:T]                                  # sink and buffer: FP16 copies
            np.testing.assert_array_equal(x_hat[:, :, exact], x[:, :, exact].astype(np.float16))
            q = x[:, :, S:S + n_q]
            rel = ((x_hat[:, :, S:S + n_q] - q) ** 2).sum() / (q ** 2).sum()
            assert rel < 0.15, (l, rel)
    # the chunks decode to what Algorithm 2 reconstructs for the same chunk of tokens
    pos = S + np.arange(R)
    Kh = Vh = None
    for l in range(L):
        k = K[l][:, :, S:S + R].astype(np.float16).astype(np.float32)
        if cfg.pre_rope:
            k = M.apply_rope(k, pos, cfg.rope_theta, inverse=True)
        _, _, Kh, Vh = A.encode(cfg, P, l, A.to_tokens(k), A.to_tokens(V[l][:, :, S:S + R].astype(np.float16)), Kh, Vh)
        np.testing.assert_array_equal(A.from_tokens(Vh, H), out[l][1][:, :, S:S + R])


def test_bad_input_leaves_the_state_unchanged(data):
    cfg, P = CFGS["higgs"], data[2]["higgs"]
    K, V = stacked(data[1], 0, 30)
    st = C.init(cfg, L, 2, H, D)
    C.append(cfg, P, st, K, V)
    ref = st.copy()
    nan = K.copy()
    nan[1, 0, 0, 0, 0] = np.nan
    big = np.full((L, 2, H, 200, D), 1, np.float16)
    cases = [((nan, V), ValueError, "non-finite"), ((K.astype(np.float64), V), TypeError, "float64"),
             ((K[:, :1], V[:, :1]), ValueError, "shape"), ((K, V[:, :, :, :3]), ValueError, "same shape"),
             ((big, big), ValueError, "capacity"), ((K * np.float32(1e5), V), ValueError, "overflows")]
    for (k, v), err, msg in cases:
        with pytest.raises(err, match=msg):
            C.append(cfg, P, st, k, v)
        same_state(st, ref)
    with pytest.raises(ValueError, match="predictors"):
        C.append(cfg, A.AquaPredictors((None,) * 2, (None,) * 2), st, K, V)
    with pytest.raises(ValueError, match="rope_theta"):
        A.AquaConfig(rope_theta=None)


def test_algorithm_4_forward(data):
    """Inference through the cache: exact FP16 attention while everything sits in the sink and buffer;
    after compression, the logits stay closer to the uncompressed model's with predictors than without."""
    cfg, P = CFGS["higgs"], data[2]["higgs"]
    tok = M.sample_tokens(MODEL.cfg, 1, 64, seed=9)
    ref, _ = M.forward(MODEL, tok)
    st = C.init(cfg, L, 1, H, D)
    lg = C.forward(MODEL, cfg, P, st, tok[:, :12])                       # 12 < sink + buffer: no chunk yet
    np.testing.assert_allclose(lg, ref[:, :12], atol=2e-2)
    plain = A.AquaConfig(backbone=cfg.backbone, first_layer=cfg.first_layer, predict_keys=False,
                         predict_values=False, buffer=16, max_tokens=160)
    errs = {}
    for tag, c in (("aqua", cfg), ("plain", plain)):
        st = C.init(c, L, 1, H, D)
        C.forward(MODEL, c, P, st, tok[:, :40])
        out = np.concatenate([C.forward(MODEL, c, P, st, tok[:, t:t + 1]) for t in range(40, 64)], 1)
        assert st.length == 64
        errs[tag] = float(((out - ref[:, 40:]) ** 2).mean())
    assert errs["aqua"] < errs["plain"], errs


def test_bits_per_value_paper_numbers():
    """Table 1: Quant-2b-gs64 2.50; Table 2: AQUA-KV (HIGGS 2-bit, first layer 4-bit) on Llama 3.2 3B
    (28 layers, 8 KV heads x 128 = 1024 values per token) 2.09."""
    assert A.Uniform(2, 64).bits_per_value(1024) == Fraction(5, 2)
    cfg = A.AquaConfig()                                                  # paper defaults
    b = C.bits_per_value(cfg, 28, 1024)
    assert b == (Fraction(4) + 27 * Fraction(2)) / 28 + Fraction(16, 1024) and round(float(b), 2) == 2.09
    assert C.bits_per_value(A.AquaConfig(first_layer=A.KeepFP16()), 2, 1024) == (16 + 2 + Fraction(16, 1024)) / 2


@pytest.mark.parametrize("name", ["uniform", "higgs"])
def test_bits_per_value_counts_the_stored_codes(name):
    """Uniform codes are packed and HIGGS d=2 n=256 indices fill a byte: the state's code arrays hold
    exactly bits_per_value bits per quantized value (first layer and residuals)."""
    cfg = CFGS[name]
    st = C.init(cfg, L, 2, H, D)
    per_chunk = lambda codes, lead: sum(a[lead].nbytes for a in codes.values()) * 8   # noqa: E731
    values = 2 * cfg.buffer * F                                           # one chunk, B = 2
    assert Fraction(per_chunk(st.first_k, (slice(None), 0)), values) == cfg.first_layer.bits_per_value(F)
    if name == "uniform":
        assert Fraction(per_chunk(st.res_k, (0, slice(None), 0)), values) == cfg.backbone.bits_per_value(F)
    assert C.state_bytes(st) > 0


# ---------------------------------------------------------------------------------------------------
# bad input (issue 36): a clear error naming the argument, before anything is read or written


def _small(F=16, seed=0, fill=None):
    """A two-layer uniform config and random predictors for token vectors of F values (``fill``: every
    weight of f_key[1] set to that value)."""
    rng = np.random.default_rng(seed)
    cfg = A.AquaConfig(backbone=A.Uniform(2, 8), first_layer=A.Uniform(4, 8), buffer=4, max_tokens=32)
    wk = (rng.standard_normal((F, F)) * 0.1).astype(np.float32)
    if fill is not None:
        wk[:] = fill
    P = A.AquaPredictors((None, A.Predictor((wk,), np.zeros(F, np.float32))),
                         (None, A.Predictor(((rng.standard_normal((2 * F, F)) * 0.1).astype(np.float32),),
                                            np.zeros(F, np.float32))))
    K, V = (rng.standard_normal((1, 4, F)).astype(np.float32) for _ in range(2))
    return cfg, P, K, V


@pytest.mark.parametrize("fill,msg", [(np.nan, "NaN or inf"), (np.inf, "NaN or inf"),
                                      (1e30, r"\|w\| = 1e\+30 > .*MAX_PREDICTOR_ABS")])
def test_corrupted_predictors_are_refused_naming_them(fill, msg):
    """NaN / inf / 1e30 weights (a corrupted calibration) are refused by encode, decode (any layer, even one
    that does not read them) and the cache, naming the predictor; the cache is left unchanged."""
    cfg, P, K, V = _small()
    _, bad, _, _ = _small(fill=fill)
    Kq, Vq, Kh, Vh = A.encode(cfg, P, 0, K, V)
    where = r"P\.f_key\[1\]\.mats\[0\] holds " + msg
    with pytest.raises(ValueError, match=where):
        A.encode(cfg, bad, 0, K, V)
    with pytest.raises(ValueError, match=where):
        A.encode(cfg, bad, 1, K, V, Kh, Vh)
    with pytest.raises(ValueError, match=where):
        A.decode(cfg, bad, 0, Kq, Vq, K.shape[-1])
    st = C.init(cfg, 2, 1, 2, 8)
    C.append(cfg, P, st, np.zeros((2, 1, 2, 3, 8), np.float16), np.zeros((2, 1, 2, 3, 8), np.float16))
    ref = st.copy()
    with pytest.raises(ValueError, match=where):
        C.append(cfg, bad, st, np.zeros((2, 1, 2, 1, 8), np.float16), np.zeros((2, 1, 2, 1, 8), np.float16))
    with pytest.raises(ValueError, match=where):
        C.dequantize(cfg, bad, st)
    same_state(st, ref)


def test_encode_decode_check_layer_config_and_shapes():
    cfg, P, K, V = _small()
    Kq, Vq, Kh, Vh = A.encode(cfg, P, 0, K, V)
    for l, err in ((True, TypeError), (1.0, TypeError), (None, TypeError), (-1, ValueError), (2, ValueError)):
        with pytest.raises(err, match=r"\bl\b"):
            A.encode(cfg, P, l, K, V, Kh, Vh)
        with pytest.raises(err, match=r"\bl\b"):
            A.decode(cfg, P, l, Kq, Vq, 16, Kh, Vh)
    with pytest.raises(TypeError, match="cfg must be a AquaConfig"):
        A.encode("cfg", P, 0, K, V)
    with pytest.raises(TypeError, match="P must be AquaPredictors"):
        A.decode(cfg, {}, 0, Kq, Vq, 16)
    with pytest.raises(ValueError, match="K and V must have the same shape"):
        A.encode(cfg, P, 0, K, V[..., :8])
    with pytest.raises(ValueError, match="K_prev_hat must have shape"):
        A.encode(cfg, P, 1, K, V, Kh[..., :8], Vh)
    with pytest.raises(ValueError, match="K contains non-finite"):
        A.encode(cfg, P, 0, np.where(K > 1, np.nan, K).astype(np.float32), V)
    with pytest.raises(ValueError, match="F=32"):
        A.decode(cfg, P, 0, Kq, Vq, 32)
    with pytest.raises(TypeError, match=r"F must be an int"):
        A.decode(cfg, P, 0, Kq, Vq, True)
    with pytest.raises(ValueError, match=r"Kq must hold exactly the arrays \['codes', 'mn', 'scale'\]"):
        A.decode(cfg, P, 0, {"scale": Kq["scale"], "mn": Kq["mn"]}, Vq, 16)
    with pytest.raises(TypeError, match=r"Kq\['codes'\] has dtype int64"):
        A.decode(cfg, P, 0, dict(Kq, codes=Kq["codes"].astype(np.int64)), Vq, 16)
    with pytest.raises(TypeError, match="Vq must be a dict"):
        A.decode(cfg, P, 0, Kq, list(Vq.values()), 16)


def test_a_residual_the_backbone_cannot_hold_names_its_layer_and_predictor():
    """A prediction that pushes the residual past float16 (finite, bounded weights): the backbone's error,
    with what was quantized (the same message in the fast tiers)."""
    F = 16
    cfg = A.AquaConfig(backbone=A.KeepFP16(), first_layer=A.KeepFP16(), predict_values=False, buffer=4, max_tokens=32)
    P = A.AquaPredictors((None, A.Predictor((np.zeros((F, F), np.float32),), np.full(F, -3e4, np.float32))),
                         (None, None))
    K = np.full((1, 4, F), 5e4, np.float32)
    with pytest.raises(ValueError, match=r"K of layer 1 minus its prediction by P\.f_key\[1\] cannot be quantized "
                                         r"by the FP16 backbone: x overflows float16"):
        A.encode(cfg, P, 1, K, K, K, K)


def test_fits_and_layout_helpers_refuse_bad_input():
    rng = np.random.default_rng(3)
    X, Y = rng.standard_normal((20, 3)), rng.standard_normal((20, 2))
    Xn = X.copy()
    Xn[0, 0] = np.nan
    cases = [(lambda: A.fit_ridge(Xn, Y), ValueError, "X contains non-finite"),
             (lambda: A.fit_ridge(X, Y.astype(np.complex64)), TypeError, "Y must be a real matrix"),
             (lambda: A.fit_ridge(X, Y, ridge=-1.0), ValueError, "ridge"),
             (lambda: A.fit_ridge(X, Y, ridge="0.1"), TypeError, "ridge"),
             (lambda: A.fit_ridge(np.ones((20, 3)), Y), ValueError, "X gives a singular system"),
             (lambda: A.fit_reduced_rank(X, Y[:-1], 1), ValueError, "X .* and Y"),
             (lambda: A.to_tokens(np.zeros((2, 3, 4))), ValueError, "x must have 4 dimensions"),
             (lambda: A.from_tokens(np.zeros((1, 2, 8)), 3), ValueError, "H=3 does not divide"),
             (lambda: A.from_tokens(np.zeros((1, 2, 8)), True), TypeError, "H must be an int"),
             (lambda: C.bits_per_value(A.AquaConfig(), 0, 1024), ValueError, "n_layers"),
             (lambda: C.bits_per_value(A.AquaConfig(), 2, 1024.0), TypeError, "F must be an int"),
             (lambda: C.state_bytes(None), TypeError, "st must be an AquaState"),
             (lambda: A.Higgs("bogus"), TypeError, "cfg must be a kvq.reference.higgs.HiggsConfig")]
    for fn, err, msg in cases:
        with pytest.raises(err, match=msg):
            fn()
    assert A.from_tokens(A.to_tokens(np.arange(48.0).reshape(1, 2, 3, 8)).tolist(), 2).shape == (1, 2, 3, 8)


def test_explained_variance_of_a_constant_target_is_refused():
    """1 - Var(y - y_hat) / Var(y) is 0 / 0 for a constant y: a ValueError, never a non-finite number."""
    y = np.random.default_rng(4).standard_normal((50, 3))
    with pytest.raises(ValueError, match="y is constant in every channel"):
        PR.explained_variance(np.full((50, 3), 0.1), y)
    with pytest.raises(ValueError, match="y is constant"):
        PR.explained_variance(y[:1], y[:1])                                   # one row
    with pytest.raises(ValueError, match="y and y_hat must have one shape"):
        PR.explained_variance(y, y[:, :2])
    with pytest.raises(TypeError, match="y_hat must be a real matrix"):
        PR.explained_variance(y, y.astype(np.complex128))
    with pytest.raises(TypeError, match="y_hat"):
        PR.explained_variance(y, None)
    assert PR.explained_variance(y[:, 0], y[:, 0] * 0.5) == pytest.approx(0.75)   # (N,): one channel
    nan = y.copy()
    nan[3, 1] = np.nan
    assert np.isnan(PR.explained_variance(nan, y))                                # NaN propagates
