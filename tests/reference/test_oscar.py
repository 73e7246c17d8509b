"""OSCAR reference (kvq.reference.oscar / rotations): calibration, quantizer, cache, folding, tables.

Against the paper: C_Q / C_S as defined in section 3 (GQA-averaged, optionally per KV head), R = U H P_br
(eq. 3), App. A.5's clip-then-quantize, the S0 / INT2 / W layout of section 4 and Algorithm 1, the
R_V fold of section 4, Table 10's columns. Invariants: streaming equals bulk bit for bit; the pages
hold exactly the direct encoding of the rotated tokens; decode attention equals dequantize-then-attend
(tolerance rule); bad input leaves the state unchanged. Small synthetic layers with planted structure
(decaying query spectrum, outlier key channels).
"""

import numpy as np
import pytest

from kvq.reference import attention, oscar, quant
from kvq.reference import rotations as rot
from kvq.reference.packing import unpack

from .test_attention import assert_tolerance_rule


def layer(B=1, H_q=4, H_kv=2, T=96, D=32, seed=0):
    """q (B, H_q, T, D), k, v (B, H_kv, T, D) fp32 with planted structure."""
    rng = np.random.default_rng(seed)
    O_Q, O_K, O_V = (rot.random_orthogonal(D, rng) for _ in range(3))
    j = np.arange(D)
    q = (rng.standard_normal((B, H_q, T, D)) * (2.0 / (1 + j) ** 0.7)) @ O_Q      # decaying spectrum
    k = (rng.standard_normal((B, H_kv, T, D)) * (1.5 / (1 + j / 4) ** 0.5)) @ O_K
    k = k + 0.5 * q[:, ::H_q // H_kv]
    out = rng.choice(D, 3, replace=False)
    k[..., out] = k[..., out] * 6.0 + np.array([4.0, -3.0, 2.5])                    # outlier channels
    v = (rng.standard_normal((B, H_kv, T, D)) / (1 + j / 4) ** 0.7) @ O_V
    v[..., rng.choice(D, 2, replace=False)] *= 5.0
    return [a.astype(np.float32) for a in (q, k, v)]


CFG = oscar.OSCARConfig(sink=5, window=12, group_size=16, page_size=8, max_tokens=128)
Q, K, V = layer(B=2, T=83)
CAL = oscar.calibrate(Q, K, V, group_size=16)
CAL_HEAD = oscar.calibrate(Q, K, V, group_size=16, per_head=True)


def same_state(a, b):
    A, Bs = a.arrays(), b.arrays()
    assert A.keys() == Bs.keys()
    for n in A:
        assert A[n].shape == Bs[n].shape and A[n].dtype == Bs[n].dtype, n
        assert np.array_equal(A[n].view(np.uint8), Bs[n].view(np.uint8)), f"{n} differs"
    assert (a.length, a.next_page) == (b.length, b.next_page)


# ---------------------------------------------------------------------------------------------------
# calibration


def test_targets_match_their_definitions():
    q, k, v = (a.astype(np.float64) for a in layer(B=2, T=20, D=8, seed=1))
    cov = rot.target_covariances(q, k, v, per_head=True)
    N = 2 * 20
    for j in range(2):                                           # KV head j serves query heads 2j, 2j+1
        want_q = sum(q[b, h].T @ q[b, h] for b in range(2) for h in (2 * j, 2 * j + 1)) / (2 * N)
        np.testing.assert_allclose(cov["C_Q"][j], want_q, rtol=1e-12)
        C_S = 0
        for b in range(2):
            for h in (2 * j, 2 * j + 1):
                s = q[b, h] @ k[b, j].T / np.sqrt(8) + np.triu(np.full((20, 20), -np.inf), 1)
                S = np.exp(s - s.max(1, keepdims=True))
                S /= S.sum(1, keepdims=True)                     # row softmax with causal mask
                C_S = C_S + v[b, j].T @ S.T @ S @ v[b, j]
        np.testing.assert_allclose(cov["C_S"][j], C_S / (2 * N), rtol=1e-10)
        np.testing.assert_allclose(cov["C_K"][j], sum(k[b, j].T @ k[b, j] for b in range(2)) / N, rtol=1e-12)
    shared = rot.target_covariances(q, k, v)                     # production metric: also over KV heads
    for n in cov:
        np.testing.assert_allclose(shared[n], cov[n].mean(0), rtol=1e-12)


def test_calibration_builds_eq3():
    cov = rot.target_covariances(Q, K, V)
    lam, U = rot.eig_desc(cov["C_Q"])
    assert np.all(np.diff(lam) <= 0)
    np.testing.assert_allclose(U @ np.diag(lam) @ U.T, cov["C_Q"], atol=1e-10 * lam[0])
    want = U @ rot.hadamard64(32) @ rot.pbr_matrix(32)
    np.testing.assert_allclose(CAL.R_K, want, atol=1e-6)
    assert CAL.R_K.dtype == np.float32 and (CAL.clip_k, CAL.clip_v) == (0.96, 0.92)
    assert CAL_HEAD.R_K.shape == (2, 32, 32) and not np.allclose(CAL_HEAD.R_K[0], CAL_HEAD.R_K[1])
    t = oscar.calibrate(Q, K, V, target="tensor")
    np.testing.assert_allclose(t.lam_K, rot.eig_desc(cov["C_K"])[0])
    for kind in rot.ROTATIONS:                                  # every ablation is orthogonal
        R = oscar.calibrate(Q, K, V, rotation=kind).R_K.astype(np.float64)
        np.testing.assert_allclose(R.T @ R, np.eye(32), atol=1e-5)
    np.testing.assert_array_equal(oscar.calibrate(Q, K, V, rotation="identity").R_V, np.eye(32))


def test_clip_fit_minimizes_its_stated_objective():
    """calibrate_clip returns the grid ratio with the smallest mean e M e^T, and for keys with
    M = R^T C_Q R that objective is the mean squared logit error over the calibration queries (eq. 1)."""
    R = CAL.R_K
    x = rot.rotate(K, R).astype(np.float16)
    C = rot.target_covariances(Q, K, V)["C_Q"]
    M = R.T.astype(np.float64) @ C @ R
    best, obj = oscar.calibrate_clip(x, M, 16)
    assert obj.shape == (len(oscar.CLIP_GRID),) and best == oscar.CLIP_GRID[int(np.argmin(obj))]
    c = oscar.CLIP_GRID[3]
    codes, s, m = rot.quantize_tokens(x, c, 16)
    e = quant.dequantize(codes, s, m, 16, -1, np.float32).astype(np.float64) - x
    k_err = (e @ R.T.astype(np.float64)).reshape(-1, 32)         # every key's error, original frame
    q_all = Q.astype(np.float64).reshape(-1, 32)                 # every query of every head
    logit = np.sum((q_all @ k_err.T) ** 2) / len(q_all) / (2 * 83)
    np.testing.assert_allclose(obj[3], logit, rtol=1e-5)
    fit = oscar.calibrate(Q, K, V, group_size=16, clip="fit")
    assert fit.clip_k in oscar.CLIP_GRID and fit.clip_v in oscar.CLIP_GRID


def test_calibration_bad_input():
    with pytest.raises(ValueError, match="power of two"):
        oscar.calibrate(*layer(D=24, T=8))
    with pytest.raises(ValueError, match="orthogonal"):
        oscar.OSCARCalibration(np.ones((4, 4), np.float32), np.eye(4, dtype=np.float32))
    with pytest.raises(TypeError, match="float32"):
        oscar.OSCARCalibration(np.eye(4), np.eye(4))
    with pytest.raises(ValueError, match=r"clip_k"):
        oscar.OSCARCalibration(np.eye(4, dtype=np.float32), np.eye(4, dtype=np.float32), clip_k=0.0)
    with pytest.raises(ValueError, match="unknown"):
        oscar.calibrate(Q, K, V, rotation="best")
    q, k, v = layer(T=8)
    k[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        oscar.calibrate(q, k, v)


# ---------------------------------------------------------------------------------------------------
# the cache


@pytest.mark.parametrize("cal", [CAL, CAL_HEAD], ids=["per-layer", "per-head"])
@pytest.mark.parametrize("chunks", ["ones", "random"])
def test_streaming_equals_bulk(cal, chunks):
    bulk = oscar.append(CFG, cal, oscar.init(CFG, 2, 2, 32), K, V)
    st = oscar.init(CFG, 2, 2, 32)
    rng = np.random.default_rng(1)
    t = 0
    while t < 83:
        n = 1 if chunks == "ones" else int(rng.integers(0, 30))
        oscar.append(CFG, cal, st, K[:, :, t:t + n], V[:, :, t:t + n])
        t += n
    same_state(bulk, st)


@pytest.mark.parametrize("T", [3, 5, 17, 18, 83])
def test_layout_and_pages_hold_the_direct_encoding(T):
    """Sink || INT2 history || recent (section 4): FP16 tokens are fp16(x R) exactly; history pages hold
    exactly App. A.5's codes and metadata of those fp16 tokens (the quantizer is bit-exact)."""
    st = oscar.append(CFG, CAL, oscar.init(CFG, 2, 2, 32), K[:, :, :T], V[:, :, :T])
    c = oscar.counts(CFG, T)
    assert c["n_sink"] + c["n_hist"] + c["n_win"] == T and c["n_win"] == min(max(T - 5, 0), 12)
    Kr, Vr = oscar.dequantize(CFG, CAL, st, rotated=True)
    for x, xr, R, clip, codes, sc, mn in ((K, Kr, CAL.R_K, 0.96, st.k_codes, st.k_scale, st.k_mn),
                                          (V, Vr, CAL.R_V, 0.92, st.v_codes, st.v_scale, st.v_mn)):
        x16 = rot.rotate(x[:, :, :T], R).astype(np.float16)
        fp = np.r_[0:c["n_sink"], 5 + c["n_hist"]:T]
        assert np.array_equal(xr[:, :, fp], x16[:, :, fp].astype(np.float32))
        h = slice(5, 5 + c["n_hist"])
        if not c["n_hist"]:
            continue
        want_c, want_s, want_m = rot.quantize_tokens(x16[:, :, h], clip, 16)
        for b in range(2):
            for i in range(c["n_hist"]):
                pid, slot = st.table[b, i // 8], i % 8
                assert np.array_equal(unpack(codes[pid, :, slot], 2, -1), want_c[b, :, i])
                assert np.array_equal(sc[pid, :, slot], want_s[b, :, i])
                assert np.array_equal(mn[pid, :, slot], want_m[b, :, i])
        got = quant.dequantize(want_c, want_s, want_m, 16, -1, np.float32)
        assert np.array_equal(xr[:, :, h], got)
    assert st.next_page == 2 * c["n_pages"]


def test_paper_configuration():
    cfg = oscar.CONFIGS["OSCAR"]
    assert (cfg.sink, cfg.window, cfg.group_size, cfg.bits) == (64, 256, 128, 2)
    assert [oscar.CONFIGS[n].group_size for n in ("OSCAR-G64", "OSCAR-G32")] == [64, 32]
    c = oscar.counts(cfg, 1000)
    assert (c["n_sink"], c["n_hist"], c["n_win"]) == (64, 680, 256)


@pytest.mark.parametrize("cal", [CAL, CAL_HEAD], ids=["per-layer", "per-head"])
def test_decode_attention_equals_dequantize_then_attention(cal):
    st = oscar.append(CFG, cal, oscar.init(CFG, 2, 2, 32), K, V)
    q = np.random.default_rng(3).standard_normal((2, 4, 2, 32)).astype(np.float32)
    out, lse = oscar.decode_attention(CFG, cal, st, q)
    truth, lse64 = oscar.decode_attention(CFG, cal, st, q.astype(np.float64))   # rotations exact in f64
    Kh, Vh = oscar.dequantize(CFG, cal, st)                                    # original frame, fp32
    other = attention.attention(q, Kh[:, :, ::-1], Vh[:, :, ::-1])             # fp32, another order
    assert_tolerance_rule(out, other, truth)
    np.testing.assert_allclose(lse, lse64, rtol=1e-5)
    np.testing.assert_allclose(truth, attention.attention(q.astype(np.float64), Kh.astype(np.float64),
                                                          Vh.astype(np.float64)), atol=1e-5)
    # rotate_back=False: the output stays in R_V's frame, o_rot = o R_V
    o_rot, _ = oscar.decode_attention(CFG, cal, st, q.astype(np.float64), rotate_back=False)
    RV = np.asarray(cal.R_V, np.float64)
    RVq = RV if RV.ndim == 2 else RV[np.arange(4) // 2]
    np.testing.assert_allclose(o_rot, truth @ RVq, atol=1e-6)


def test_identity_rotation_no_clip_is_plain_per_token_int2():
    cal = oscar.identity_calibration(32)
    cfg = oscar.OSCARConfig(sink=0, window=0, group_size=16, page_size=8, max_tokens=128)
    Kh, Vh = oscar.dequantize(cfg, cal, oscar.append(cfg, cal, oscar.init(cfg, 2, 2, 32), K, V))
    for x, xh in ((K, Kh), (V, Vh)):
        c, s, m = quant.quantize(x.astype(np.float16), 2, 16, axis=-1)
        assert np.array_equal(xh, quant.dequantize(c, s, m, 16, -1, np.float32))


def test_cache_error_shrinks_with_fp16_windows():
    errs = []
    for S0, W in ((0, 0), (5, 12), (5, 40)):
        cfg = oscar.OSCARConfig(sink=S0, window=W, group_size=16, page_size=8, max_tokens=128)
        Kh, _ = oscar.dequantize(cfg, CAL, oscar.append(cfg, CAL, oscar.init(cfg, 2, 2, 32), K, V))
        errs.append(float(np.mean((Kh - K) ** 2)))
    assert errs[0] > errs[1] > errs[2] > 0


def test_bad_input_leaves_state_unchanged():
    st = oscar.append(CFG, CAL, oscar.init(CFG, 2, 2, 32), K[:, :, :20], V[:, :, :20])
    before = st.copy()
    k, v = K[:, :, :4], V[:, :, :4]
    nan = k.copy()
    nan[1, 1, 2, 3] = np.nan
    big = k.copy()
    big[0, 0, 0, :] = 6e4
    bad = [((k[:, :1], v[:, :1]), ValueError, "H_kv=2"), ((k[..., :16], v[..., :16]), ValueError, "D=32"),
           ((k.astype(np.float64), v.astype(np.float64)), TypeError, "float64"),
           ((k, v[:, :, :3]), ValueError, "same shape"),
           ((np.zeros((2, 2, 200, 32), np.float32),) * 2, ValueError, "capacity"),
           ((nan, v), ValueError, "NaN"), ((big, v), ValueError, "overflows float16")]
    for (kk, vv), err, match in bad:
        with pytest.raises(err, match=match):
            oscar.append(CFG, CAL, st, kk, vv)
        same_state(st, before)
    wrong = oscar.identity_calibration(16)
    with pytest.raises(ValueError, match="rotations have shape"):
        oscar.append(CFG, wrong, st, k, v)
    same_state(st, before)
    with pytest.raises(TypeError, match="OSCARCalibration"):
        oscar.append(CFG, {"R_K": 1}, st, k, v)
    with pytest.raises(ValueError, match="H_q"):
        oscar.decode_attention(CFG, CAL, st, np.zeros((2, 3, 1, 32), np.float32))
    with pytest.raises(ValueError, match="empty"):
        oscar.decode_attention(CFG, CAL, oscar.init(CFG, 2, 2, 32), np.zeros((2, 4, 1, 32), np.float32))
    with pytest.raises(ValueError, match="group_size"):
        oscar.init(CFG, 1, 1, 24)
    with pytest.raises(ValueError, match="bits"):
        oscar.OSCARConfig(bits=3)


# ---------------------------------------------------------------------------------------------------
# folding R_V into W_V and W_O (section 4)


def _layer_forward(x, W_Q, W_K, W_V, W_O, H_q, H_kv, D):
    T = x.shape[0]
    split = lambda y, H: y.reshape(T, H, D).transpose(1, 0, 2)[None]      # noqa: E731 -> (1, H, T, D)
    o = attention.attention(split(x @ W_Q, H_q), split(x @ W_K, H_kv), split(x @ W_V, H_kv), causal=True)
    return o[0].transpose(1, 0, 2).reshape(T, H_q * D) @ W_O


@pytest.mark.parametrize("per_head", [False, True])
def test_folding_rv_leaves_the_layer_output_unchanged(per_head):
    rng = np.random.default_rng(4)
    H_q, H_kv, D, d_model, T = 4, 2, 16, 48, 10
    W_Q, W_K, W_V = (rng.standard_normal((d_model, H * D)) / 7 for H in (H_q, H_kv, H_kv))
    W_O = rng.standard_normal((H_q * D, d_model)) / 8
    x = rng.standard_normal((T, d_model))
    R = np.stack([rot.random_orthogonal(D, rng) for _ in range(H_kv)]) if per_head else rot.random_orthogonal(D, rng)
    W_V2, W_O2 = oscar.fold_value_rotation(W_V, W_O, R, H_q)
    y = _layer_forward(x, W_Q, W_K, W_V, W_O, H_q, H_kv, D)
    np.testing.assert_allclose(_layer_forward(x, W_Q, W_K, W_V2, W_O2, H_q, H_kv, D), y, rtol=1e-11, atol=1e-12)
    v, v2 = ((x @ W).reshape(T, H_kv, D) for W in (W_V, W_V2))
    Rh = np.broadcast_to(R, (H_kv, D, D))
    np.testing.assert_allclose(v2, np.einsum("thd,hde->the", v, Rh), atol=1e-12)     # values come out rotated
    with pytest.raises(ValueError, match="W_V"):
        oscar.fold_value_rotation(W_V[:, :5], W_O, R, H_q)


def test_folded_calibration_stores_the_same_cache():
    """Values rotated upstream (x W_V R_V, here rotate(v, R_V)) into a cache given calib.folded() give
    the same bytes as raw values into the unfolded cache; the output leaves in the rotated frame."""
    v_rot = rot.rotate(V, CAL.R_V)
    a = oscar.append(CFG, CAL, oscar.init(CFG, 2, 2, 32), K, V)
    b = oscar.append(CFG, CAL.folded(), oscar.init(CFG, 2, 2, 32), K, v_rot)
    same_state(a, b)
    q = np.random.default_rng(5).standard_normal((2, 4, 1, 32))
    o_a, _ = oscar.decode_attention(CFG, CAL, a, q, rotate_back=False)
    o_b, _ = oscar.decode_attention(CFG, CAL.folded(), b, q)
    np.testing.assert_allclose(o_a, o_b, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# Table 10 and Figs. 2 / 8


def test_rotation_table_columns():
    q, k, v = layer(T=128, D=64, seed=6)
    C = rot.target_covariances(q, k, v)["C_Q"]
    lam, U = rot.eig_desc(C)
    R = {n: rot.compose(n, U) for n in ("identity", "hadamard", "eigen", "eigen_hadamard", "oscar")}
    t = rot.rotation_table(q, k, R, 32)
    np.testing.assert_allclose(t["eigen"]["importance"], lam[0] / lam.mean(), rtol=1e-9)   # diag = Lambda
    for n in ("eigen_hadamard", "oscar"):                                                  # Lemma 1
        np.testing.assert_allclose(t[n]["importance"], 1.0, rtol=1e-12)
    assert t["identity"]["importance"] > 1.5 and t["hadamard"]["importance"] > 1.0 + 1e-6
    # P_br permutes channels: the same values, so the same max |K~|; Hadamard spreads the outliers
    np.testing.assert_allclose(t["oscar"]["max_abs"], t["eigen_hadamard"]["max_abs"], rtol=1e-12)
    assert t["hadamard"]["max_abs"] < t["identity"]["max_abs"] / 2
    assert t["hadamard"]["group_range"] < t["identity"]["group_range"]
    assert t["hadamard"]["tr_E"] < t["identity"]["tr_E"]
    x = k.astype(np.float64)
    g = x.reshape(1, 2, 128, 2, 32)
    np.testing.assert_allclose(t["identity"]["group_range"], (g.max(-1) - g.min(-1)).mean())


def test_error_table_orders_naive_last():
    q, k, v = layer(T=96, seed=7)
    methods = {"naive INT2": oscar.identity_calibration(32),
               "Hadamard": oscar.calibrate(q, k, v, rotation="hadamard", clip=(1.0, 1.0)),
               "OSCAR": oscar.calibrate(q, k, v, group_size=16)}
    t = rot.error_table(q, k, v, methods, group_size=16)
    assert list(t["OSCAR"]) == ["k_rel_mse", "v_rel_mse", "logit_mse", "attention_kl", "sv_mse", "output_mse"]
    for m in t["OSCAR"]:
        assert t["naive INT2"][m] > max(t["Hadamard"][m], t["OSCAR"][m]) > 0, m
    assert t["OSCAR"]["sv_mse"] < t["Hadamard"]["sv_mse"]


# ---------------------------------------------------------------------------------------------------
# issue 36: bad arguments raise a clear error naming them (or give the correct result)


def test_oscar_offline_arguments_are_checked():
    with pytest.raises(TypeError, match="head_dim"):
        oscar.identity_calibration(True)
    with pytest.raises(ValueError, match="head_dim"):
        oscar.identity_calibration(-4)
    with pytest.raises(TypeError, match="rotation must be a str"):
        oscar.OSCARCalibration(np.eye(4, dtype=np.float32), np.eye(4, dtype=np.float32), rotation=5)
    with pytest.raises(TypeError, match=r"clip must be a pair"):
        oscar.calibrate(Q, K, V, clip=0.9)
    with pytest.raises(ValueError, match=r"clip must be a pair"):
        oscar.calibrate(Q, K, V, clip=(0.9, 0.9, 0.9))
    with pytest.raises(ValueError, match=r"clip\[0\]"):
        oscar.calibrate(Q, K, V, clip=(0.0, 0.9))
    with pytest.raises(ValueError, match=r"k R overflows float16"):    # the clip fit sees fp16(k R_K)
        oscar.calibrate(Q, K * np.float32(1e6), V, clip="fit", group_size=16)
    x = rot.rotate(K[:, :, :4], CAL.R_K).astype(np.float16)
    M = np.eye(32)
    with pytest.raises(ValueError, match="x_rot"):
        oscar.calibrate_clip(x[0], M, 16)
    with pytest.raises(ValueError, match="M has shape"):
        oscar.calibrate_clip(x, np.eye(33), 16)
    with pytest.raises(ValueError, match="M contains non-finite"):
        oscar.calibrate_clip(x, M * np.nan, 16)
    with pytest.raises(ValueError, match="ratios is empty"):
        oscar.calibrate_clip(x, M, 16, ratios=())
    with pytest.raises(TypeError, match="ratios must be a sequence"):
        oscar.calibrate_clip(x, M, 16, ratios="0.9")
    with pytest.raises(ValueError, match=r"ratios\[0\]"):
        oscar.calibrate_clip(x, M, 16, ratios=(1.5,))
    for bad_clip, err in ((True, TypeError), ("0.9", TypeError), (None, TypeError), (0.0, ValueError)):
        with pytest.raises(err, match="clip"):
            oscar.quantize_tokens(x, bad_clip, 16)
        with pytest.raises(err, match="clip"):
            rot.fake_quantize(K, CAL.R_K, bad_clip, 16)
    assert all(np.array_equal(a, b) for a, b in zip(oscar.quantize_tokens(x, np.float64(0.9), 16),
                                                    oscar.quantize_tokens(x, 0.9, 16)))


def test_fold_value_rotation_names_the_argument():
    rng = np.random.default_rng(0)
    W_V, W_O, R = rng.standard_normal((16, 8)), rng.standard_normal((16, 16)), rot.random_orthogonal(4, rng)
    for kw, word in ((dict(W_V=W_V.astype(np.complex64)), "W_V"), (dict(W_O=np.full(W_O.shape, "a")), "W_O"),
                     (dict(R_V=np.eye(5)), "R_V"), (dict(R_V=np.stack([R] * 5)), "R_V"),
                     (dict(n_heads=True), "n_heads"), (dict(n_heads=0), "n_heads"), (dict(n_heads=4.0), "n_heads"),
                     (dict(n_heads=3), "n_heads"), (dict(W_O=W_O[:8]), "W_O")):
        args = dict(W_V=W_V, W_O=W_O, R_V=R, n_heads=4) | kw
        with pytest.raises((TypeError, ValueError), match=word):
            oscar.fold_value_rotation(**args)
    a = oscar.fold_value_rotation(W_V, W_O, R, 4)                  # integer weights convert exactly
    b = oscar.fold_value_rotation(np.rint(W_V).astype(np.int32), W_O, R, np.int64(4))
    np.testing.assert_array_equal(b[0], oscar.fold_value_rotation(np.rint(W_V), W_O, R, 4)[0])
    assert a[0].shape == b[0].shape


def test_oscar_counts_and_decode_arguments():
    for T in (True, -1, 1.0, float("nan"), None, "3"):
        with pytest.raises((TypeError, ValueError), match="T"):
            oscar.counts(CFG, T)
    with pytest.raises(TypeError, match="cfg"):
        oscar.counts("OSCAR", 3)
    assert oscar.counts(CFG, np.int64(40)) == oscar.counts(CFG, 40)
    st = oscar.append(CFG, CAL, oscar.init(CFG, 2, 2, 32), K, V)
    for bad in (np.int32, np.bool_, np.complex64):
        with pytest.raises(TypeError, match="q has dtype"):
            oscar.decode_attention(CFG, CAL, st, np.zeros((2, 4, 1, 32), bad))


def test_rotations_arguments_are_checked():
    assert rot.bit_reverse(1, 3) == 4 and rot.bit_reverse(np.int64(6), 3) == 3
    for k, n_bits, word in ((True, 3, "k"), (-1, 3, "k"), (8, 3, "k"), (1.0, 3, "k"), (1, True, "n_bits"),
                            (1, -1, "n_bits"), (1, None, "n_bits")):
        with pytest.raises((TypeError, ValueError), match=word):
            rot.bit_reverse(k, n_bits)
    with pytest.raises(TypeError, match="C must be a real array"):
        rot.eig_desc(np.eye(4, dtype=np.complex64))
    with pytest.raises(TypeError, match="C must be a real array"):
        rot.eig_desc(np.full((4, 4), "a"))
    for d in (True, -1, 4.0, None):
        with pytest.raises((TypeError, ValueError), match="d"):
            rot.random_orthogonal(d, np.random.default_rng(0))
    for rng in ("seed", None, 0):
        with pytest.raises(TypeError, match="rng"):
            rot.random_orthogonal(4, rng)
    U = rot.random_orthogonal(4, np.random.default_rng(0))
    with pytest.raises(TypeError, match="rng"):
        rot.compose("oscar", U, rng="seed")
    with pytest.raises(ValueError, match="U contains non-finite"):
        rot.compose("oscar", U * np.nan)
    with pytest.raises(ValueError, match="U must be square"):
        rot.compose("oscar", U[:, :-1])
    with pytest.raises(ValueError, match="unknown"):
        rot.compose(["oscar"], U)
    x = np.zeros((1, 2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="x is a scalar"):
        rot.rotate(np.float32(1.0), np.eye(4, dtype=np.float32))
    with pytest.raises(ValueError, match="R has shape"):               # 3 heads for x's 2
        rot.rotate(x, np.stack([np.eye(4, dtype=np.float32)] * 3)[:, None])
    with pytest.raises(ValueError, match="C"):
        rot.frozen_surrogate(np.eye(4), np.eye(5), np.eye(4))
    with pytest.raises(ValueError, match="R has shape"):
        rot.fake_quantize(x, np.eye(5, dtype=np.float32), 0.9, 4)
    with pytest.raises(ValueError, match="x is a scalar"):
        rot.fake_quantize(np.float32(1.0), np.eye(4, dtype=np.float32), 0.9, 4)
