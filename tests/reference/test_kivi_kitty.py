"""KIVI and Kitty caches (kvq.reference.kivi / kitty / paged) against the papers and the invariants.

Invariants (issue: KIVI and Kitty end to end): streaming equals bulk bit for bit; dequantize then
full attention equals decode_attention (tolerance rule); every dequantized element within half its
group's step; the INT2 step is 5x the INT4 step for the same range (Kitty slides, eqs. 3-6). Plus the
layout of Fig. 1 / Fig. 3 worked by hand, Algorithm 1, and bad input leaving the state unchanged.
"""

from fractions import Fraction

import numpy as np
import pytest

from kvq.reference import attention, kitty, kivi, paged, quant

from .test_attention import assert_tolerance_rule

SMALL = dict(group_size=16, residual=8, max_tokens=256)
CASES = [
    ("KIVI-K2V2", kivi, kivi.KIVIConfig(2, 2, **SMALL)),
    ("KIVI-K4V2*", kivi, kivi.KIVIConfig(4, 2, sink=4, **SMALL)),
    ("KIVI-K2V4*-Gv8", kivi, kivi.KIVIConfig(2, 4, sink=4, v_group_size=8, **SMALL)),
    ("KIVI-K8V8-fp32meta", kivi, kivi.KIVIConfig(8, 8, sink=3, meta_dtype="float32", **SMALL)),
    ("Kitty", kitty, kitty.KittyConfig(0.125, sink=4, **SMALL)),
    ("Kitty-Pro", kitty, kitty.KittyConfig(0.25, sink=4, **SMALL)),
    ("Kitty-random", kitty, kitty.KittyConfig(0.25, selection="random", seed=3, sink=4, **SMALL)),
    ("Kitty-R0", kitty, kitty.KittyConfig(0.25, sink=0, group_size=16, residual=0, max_tokens=256)),
]
IDS = [c[0] for c in CASES]


def kv(B=2, H=2, T=83, D=16, seed=0, outlier=3):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k[..., outlier] = k[..., outlier] * 12 + 5                        # an outlier key channel
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    return k.astype(np.float16), v.astype(np.float16)


def same_state(a, b):
    A, Bs = a.arrays(), b.arrays()
    assert A.keys() == Bs.keys()
    for n in A:
        assert A[n].shape == Bs[n].shape and A[n].dtype == Bs[n].dtype, n
        assert np.array_equal(A[n].view(np.uint8), Bs[n].view(np.uint8)), f"{n} differs"
    assert (a.length, a.k_next, a.v_next) == (b.length, b.k_next, b.v_next)


@pytest.mark.parametrize("name, mod, cfg", CASES, ids=IDS)
@pytest.mark.parametrize("chunks", ["ones", "random"])
def test_streaming_equals_bulk(name, mod, cfg, chunks):
    k, v = kv()
    T = k.shape[2]
    bulk = mod.init(cfg, 2, 2, 16)
    mod.append(cfg, bulk, k, v)
    st = mod.init(cfg, 2, 2, 16)
    rng = np.random.default_rng(1)
    t = 0
    while t < T:
        n = 1 if chunks == "ones" else int(rng.integers(0, 40))
        mod.append(cfg, st, k[:, :, t:t + n], v[:, :, t:t + n])
        t += n
    same_state(bulk, st)


@pytest.mark.parametrize("name, mod, cfg", CASES, ids=IDS)
def test_decode_attention_equals_dequantize_then_attention(name, mod, cfg):
    k, v = kv(T=77, seed=2)
    st = mod.init(cfg, 2, 2, 16)
    mod.append(cfg, st, k, v)
    q = np.random.default_rng(3).standard_normal((2, 8, 2, 16)).astype(np.float32)
    out, lse = mod.decode_attention(cfg, st, q)
    K, V = mod.dequantize(cfg, st)
    truth = attention.attention(q.astype(np.float64), K.astype(np.float64), V.astype(np.float64))
    other = attention.attention(q, K[:, :, ::-1], V[:, :, ::-1])      # fp32, keys in another order
    assert_tolerance_rule(out, other, truth)
    # and the log-sum-exp is that of the scores over every token
    s = np.einsum("bhqd,bhtd->bhqt", q.astype(np.float64), np.repeat(K, 4, axis=1).astype(np.float64)) / 4.0
    m = s.max(-1)
    np.testing.assert_allclose(lse, m + np.log(np.exp(s - m[..., None]).sum(-1)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name, mod, cfg", CASES, ids=IDS)
def test_buffers_exact_and_quantized_within_half_step(name, mod, cfg):
    k, v = kv(T=90, seed=4)
    st = mod.init(cfg, 2, 2, 16)
    mod.append(cfg, st, k, v)
    K, V = mod.dequantize(cfg, st)
    c = paged.counts(cfg, 90)
    S, G = cfg.sink, cfg.group_size
    kq = slice(S, S + c["n_kpages"] * G)
    vq = slice(S, S + c["n_vq"])
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    # FP16 tokens come back exactly
    exact_k = np.ones(90, bool)
    exact_k[kq] = False
    exact_v = np.ones(90, bool)
    exact_v[vq] = False
    assert np.array_equal(K[:, :, exact_k], k32[:, :, exact_k])
    assert np.array_equal(V[:, :, exact_v], v32[:, :, exact_v])
    # quantized keys: |err| <= step/2 per (page, channel), up to the rounding of the stored metadata
    for b in range(2):
        for j in range(c["n_kpages"]):
            pid = st.k_table[b, j]
            step = st.k_pool["scale"][pid].astype(np.float64)                # (H, D)
            mn = st.k_pool["mn"][pid].astype(np.float64)
            x = k32[b, :, S + j * G:S + (j + 1) * G].astype(np.float64)       # (H, G, D)
            hi = mn + step * (15 if name.startswith("Kitty") else 2 ** cfg.k_bits - 1)
            inside = (x >= mn[:, None]) & (x <= hi[:, None])
            err = np.abs(K[b, :, S + j * G:S + (j + 1) * G] - x)
            tol = step[:, None] / 2 + 1e-6 * (np.abs(x) + 1)
            assert np.all(err[inside] <= np.broadcast_to(tol, err.shape)[inside])
    # quantized values: per token, the step of its group
    Vq, vx = V[:, :, vq].astype(np.float64), v32[:, :, vq].astype(np.float64)
    Gv = cfg.v_group(16)
    r = vx.reshape(vx.shape[:-1] + (16 // Gv, Gv))
    step = (r.max(-1) - r.min(-1)) / (2 ** cfg.v_bits - 1)                    # exact range / qmax
    err = np.abs(Vq - vx).reshape(r.shape)
    assert np.all(err <= step[..., None] / 2 * (1 + 1e-3) + 1e-3 * step[..., None] + 1e-6)


def test_layout_worked_by_hand():
    """Fig. 1 bookkeeping for S = 32, G = 128, R = 128 at T = 1000 (Kitty defaults)."""
    c = paged.counts(kitty.CONFIGS["Kitty"], 1000)
    # 968 post-sink tokens: 7 key pages (896) + 72 in the key Q-buffer; values: 128 in the window,
    # 840 evicted = 6 pages (768) + 72 in the value Q-buffer
    assert (c["n_sink"], c["n_kpages"], c["n_kbuf"]) == (32, 7, 72)
    assert (c["n_win"], c["n_vq"], c["n_vbuf"], c["n_vpages"]) == (128, 768, 72, 6)
    c = paged.counts(kivi.CONFIGS["KIVI-K2V2"], 1000)                       # no sink, no value Q-buffer
    assert (c["n_kpages"], c["n_kbuf"], c["n_win"], c["n_vq"], c["n_vpages"]) == (7, 104, 128, 872, 7)
    assert paged.segment_bounds(kivi.CONFIGS["KIVI-K2V2"], 1000) == [(0, 872), (872, 896), (896, 1000)]


def test_paper_configurations():
    C = kivi.CONFIGS
    assert [(C[n].k_bits, C[n].v_bits, C[n].sink) for n in C] == [(2, 2, 0), (4, 4, 0), (2, 2, 32), (2, 4, 32), (4, 2, 32)]
    assert kitty.CONFIGS["Kitty"].d_boost(128) == 16 and kitty.CONFIGS["Kitty-Pro"].d_boost(128) == 32
    assert (kitty.CONFIGS["Kitty"].sink, kitty.CONFIGS["Kitty"].residual, kitty.CONFIGS["Kitty"].group_size) == (32, 128, 128)


def test_int2_step_is_five_int4_steps():
    """Slides eqs. 3-6: for the same range r, INT2 step r/3 = 5 x INT4 step r/15 (exactly, in rationals;
    exactly in fp32 when r/15 is a power of two; otherwise up to one rounding of each quotient)."""
    for r in (Fraction(7, 3), Fraction(1), Fraction(65504)):
        assert (r / 3) / (r / 15) == 5
    rng = np.random.default_rng(5)
    for e in range(-10, 10):
        x = np.array([[0.0, 15.0 * 2.0 ** e]], np.float32).repeat(4, axis=0).T   # (2, 4): range 15 * 2^e
        _, s2, _ = quant.quantize(x, 2, 2, axis=0, meta_dtype=np.float32)
        _, s4, _ = quant.quantize(x, 4, 2, axis=0, meta_dtype=np.float32)
        assert np.all(s2 == 5 * s4)
    x = rng.standard_normal((128, 64)).astype(np.float32)
    _, s2, _ = quant.quantize(x, 2, 128, axis=0, meta_dtype=np.float32)
    _, s4, _ = quant.quantize(x, 4, 128, axis=0, meta_dtype=np.float32)
    np.testing.assert_allclose(s2, 5 * s4.astype(np.float64), rtol=2 ** -22)


def test_kitty_page_is_the_dense_sparse_decomposition():
    rng = np.random.default_rng(6)
    page = rng.standard_normal((3, 16, 8)).astype(np.float32)          # (H, G, D)
    page[:, :, 5] *= 20
    scores = kitty.channel_scores(page)
    np.testing.assert_allclose(scores, np.abs(page).mean(axis=1), rtol=1e-6)
    boost = kitty.select_boost(scores, 2)
    assert boost[:, 5].all() and np.all(boost.sum(-1) == 2)
    enc = kitty.encode_page(page, boost)
    assert enc["low"].shape == (3, 8, 4) and enc["high"].shape == (3, 2, 4) and enc["idx"].dtype == np.uint8
    for h in range(3):
        chans = np.flatnonzero(boost[h])
        # 0-based rows in channel order; unboosted channels hold the sentinel D_boost = 2
        assert enc["idx"][h].tolist() == [chans.tolist().index(c) if c in chans else 2 for c in range(8)]
    # Algorithm 1 gives exactly per-channel INT4 for boosted channels and INT2 for the others
    got = kitty.dequantize_page(enc, 16)
    for bits, sel in ((4, boost), (2, ~boost)):
        c, s, m = quant.quantize(page, bits, 16, axis=1)
        want = quant.dequantize(c, s, m, 16, axis=1, out_dtype=np.float32)
        assert np.array_equal(got[np.broadcast_to(sel[:, None, :], got.shape)],
                              want[np.broadcast_to(sel[:, None, :], want.shape)])


def test_kitty_without_boost_stores_kivi_key_pages():
    cfg_k = kitty.KittyConfig(0.0, sink=0, residual=8, group_size=16, max_tokens=64)
    cfg_v = kivi.KIVIConfig(2, 2, sink=0, residual=8, group_size=16, max_tokens=64)
    k, v = kv(T=48)
    a = kitty.append(cfg_k, kitty.init(cfg_k, 2, 2, 16), k, v)
    b = kivi.append(cfg_v, kivi.init(cfg_v, 2, 2, 16), k, v)
    assert np.array_equal(a.k_pool["low"], b.k_pool["codes"])
    assert np.all(a.k_pool["idx"] == 0) and a.k_pool["high"].shape[2] == 0      # sentinel D_boost = 0
    assert np.array_equal(a.k_pool["scale"].view(np.uint16), b.k_pool["scale"].view(np.uint16))


def test_random_selection_is_seeded_and_differs_from_magnitude():
    k, v = kv(T=64)
    cfg_r = kitty.KittyConfig(0.25, selection="random", seed=1, sink=0, residual=0, group_size=16, max_tokens=64)
    a = kitty.append(cfg_r, kitty.init(cfg_r, 2, 2, 16), k, v)
    b = kitty.append(cfg_r, kitty.init(cfg_r, 2, 2, 16), k, v)
    same_state(a, b)
    cfg_m = kitty.KittyConfig(0.25, sink=0, residual=0, group_size=16, max_tokens=64)
    m = kitty.append(cfg_m, kitty.init(cfg_m, 2, 2, 16), k, v)
    assert np.all((m.k_pool["idx"][: m.k_next, :, 3] < 4))          # the outlier channel is always boosted
    assert not np.array_equal(a.k_pool["idx"], m.k_pool["idx"])


def test_boost_reduces_key_error():
    k, v = kv(T=128, seed=7)
    errs = []
    for rate in (0.0, 0.125, 0.25, 1.0):
        cfg = kitty.KittyConfig(rate, sink=0, residual=0, group_size=16, max_tokens=128)
        K, _ = kitty.dequantize(cfg, kitty.append(cfg, kitty.init(cfg, 2, 2, 16), k, v))
        errs.append(float(np.mean((K - k.astype(np.float32)) ** 2)))
    assert errs[0] > errs[1] > errs[2] > errs[3]


def test_channel_sensitivity_finds_the_outlier_channel():
    k, _ = kv(B=1, T=32, seed=8)
    q = np.random.default_rng(9).standard_normal((1, 4, 32, 16)).astype(np.float32)
    mse = kitty.channel_sensitivity(q, k)
    assert mse.shape == (4, 16) and np.all(mse >= 0)
    assert np.all(mse.argmax(axis=1) == 3)
    # a channel that is constant over the tokens quantizes exactly: zero sensitivity
    k2 = k.copy()
    k2[..., 7] = 0.5
    assert np.all(kitty.channel_sensitivity(q, k2)[:, 7] == 0)


@pytest.mark.parametrize("name, mod, cfg", CASES[:1] + CASES[4:5], ids=["kivi", "kitty"])
def test_bad_input_leaves_state_unchanged(name, mod, cfg):
    k, v = kv(T=20)
    st = mod.init(cfg, 2, 2, 16)
    mod.append(cfg, st, k, v)
    before = st.copy()
    bad = [
        ((k[:, :1], v[:, :1]), ValueError, "H_kv=2"),
        ((k[..., :8], v[..., :8]), ValueError, "D=16"),
        ((k.astype(np.float64), v.astype(np.float64)), TypeError, "float64"),
        ((k, v[:, :, :5]), ValueError, "same shape"),
        ((np.zeros((2, 2, 300, 16), np.float16),) * 2, ValueError, "capacity"),
    ]
    nan = k.copy()
    nan[1, 1, 3, 2] = np.nan
    bad.append(((nan, v), ValueError, "NaN"))
    big = k.astype(np.float32)
    big[0, 0, 0, 0] = 1e6
    bad.append(((big, v), ValueError, "overflows float16"))
    for (kk, vv), err, match in bad:
        with pytest.raises(err, match=match):
            mod.append(cfg, st, kk, vv)
        same_state(st, before)
    with pytest.raises(ValueError, match="H_q"):
        mod.decode_attention(cfg, st, np.zeros((2, 3, 1, 16), np.float32))
    with pytest.raises(ValueError, match="empty"):
        mod.decode_attention(cfg, mod.init(cfg, 2, 2, 16), np.zeros((2, 4, 1, 16), np.float32))


def test_bad_configs():
    with pytest.raises(ValueError, match="bits=3"):
        kivi.KIVIConfig(3, 2)
    with pytest.raises(ValueError, match="group_size"):
        kivi.KIVIConfig(2, 2, group_size=6)
    with pytest.raises(ValueError, match="boost_rate"):
        kitty.KittyConfig(1.5)
    with pytest.raises(ValueError, match="selection"):
        kitty.KittyConfig(0.1, selection="best")
    with pytest.raises(ValueError, match="v_group_size"):
        kivi.init(kivi.KIVIConfig(2, 2, v_group_size=5), 1, 1, 16)
    with pytest.raises(ValueError, match="batch"):
        kivi.init(kivi.CONFIGS["KIVI-K2V2"], 0, 1, 16)


def test_paged_counts_check_their_arguments():
    """issue 36: counts / segment_bounds / max_pages take a KIVIConfig or KittyConfig and an int T >= 0."""
    cfg = kivi.KIVIConfig(group_size=8, residual=4, max_tokens=64)
    for T in (True, -1, 1.0, float("nan"), None, "3"):
        for fn in (paged.counts, paged.segment_bounds):
            with pytest.raises((TypeError, ValueError), match="T"):
                fn(cfg, T)
    for bad in ("KIVI", 3, {}, None):
        for call in (lambda c: paged.counts(c, 3), lambda c: paged.segment_bounds(c, 3), paged.max_pages):
            with pytest.raises(TypeError, match="cfg must be a KIVIConfig or a KittyConfig"):
                call(bad)
    assert paged.segment_bounds(cfg, np.int64(30)) == paged.segment_bounds(cfg, 30)
    c = paged.counts(kitty.KittyConfig(group_size=8, residual=4, max_tokens=64), 30)     # a KittyConfig too
    assert c["n_sink"] + c["post"] == 30


def test_bad_arguments_name_the_argument():
    """Issue 36: config fields, select_boost's arguments and Kitty pages are refused naming the argument."""
    for bad in (True, 2.0, "2", 3, None):
        with pytest.raises(ValueError, match="k_bits="):
            kivi.KIVIConfig(k_bits=bad)
        with pytest.raises(ValueError, match="v_bits="):
            kivi.KIVIConfig(v_bits=bad)
        with pytest.raises(ValueError, match="v_bits="):
            kitty.KittyConfig(v_bits=bad)
    scores = np.abs(np.random.default_rng(0).standard_normal((2, 8))).astype(np.float32)
    for bad in (np.nan, np.inf):
        s = scores.copy()
        s[0, 3] = bad                                  # NaN would sort as the largest score
        with pytest.raises(ValueError, match="scores contains non-finite"):
            kitty.select_boost(s, 2)
    with pytest.raises(TypeError, match="scores"):
        kitty.select_boost(scores.astype(np.complex64), 2)
    with pytest.raises(TypeError, match="scores"):
        kitty.select_boost(None, 2)
    for d_boost, err in ((True, TypeError), (2.0, TypeError), (None, TypeError), (-1, ValueError), (9, ValueError)):
        with pytest.raises(err, match="d_boost"):
            kitty.select_boost(scores, d_boost)
    with pytest.raises(TypeError, match="rng"):
        kitty.select_boost(scores, 2, "random", rng="seed")
    with pytest.raises(ValueError, match="kpage"):
        kitty.channel_scores(np.float32(1))
    kpage = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    boost = np.zeros(16, bool)
    boost[:2] = True
    nan = kpage.copy()
    nan[0, 0] = np.nan
    with pytest.raises(ValueError, match="kpage contains non-finite"):
        kitty.encode_page(nan, boost)
    with pytest.raises(TypeError, match="boost"):
        kitty.encode_page(kpage, None)
    page = kitty.encode_page(kpage, boost)
    with pytest.raises(ValueError, match=r"page lacks \['low'\]"):
        kitty.dequantize_page({n: a for n, a in page.items() if n != "low"}, 8)
    with pytest.raises(TypeError, match="page must be a dict"):
        kitty.dequantize_page(list(page.values()), 8)
    np.testing.assert_array_equal(kitty.dequantize_page(page, 8).shape, kpage.shape)
