"""kvq.integrations.methods: the registry, configure, bits_per_element and KVStore against the reference modules."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from kvq.integrations import methods as M
from kvq.reference import aqua, aqua_cache, kitty, kivi, memory, oscar

B, H, D, L = 2, 2, 64, 3

from .small import MODULES, SMALL  # noqa: E402


def _tokens(T, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal((B, H, T, D)) * 2).astype(dtype)
    v = rng.standard_normal((B, H, T, D)).astype(dtype)
    return k, v


def _random_calibration(seed):
    rng = np.random.default_rng(seed)
    qk, _ = np.linalg.qr(rng.standard_normal((D, D)))
    qv, _ = np.linalg.qr(rng.standard_normal((D, D)))
    return oscar.OSCARCalibration(qk.astype(np.float32), qv.astype(np.float32), 0.96, 0.92)


def _assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and np.array_equal(a[n], b[n]), n


# ---------------------------------------------------------------------------------------------------
# registry and configure


def test_registry_names():
    assert list(M.METHODS) == ["FP16", "KIVI-K2V2", "KIVI-K2V2*", "KIVI-K4V4", "Kitty", "Kitty-Pro", "OSCAR",
                               "AQUA-KV", "AQUA-KV-uniform", "BitDecoding-2", "BitDecoding-4"]
    assert M.configure("KIVI-K2V2*", head_dim=128, max_tokens=256) == \
        kivi.CONFIGS["KIVI-K2V2*"].__class__(**{**kivi.CONFIGS["KIVI-K2V2*"].__dict__, "max_tokens": 256})
    assert M.configure("BitDecoding-2", head_dim=128, max_tokens=512).k_mode == "channel"
    assert M.configure("BitDecoding-2", head_dim=128, max_tokens=512).bits == 2
    assert isinstance(M.configure("AQUA-KV-uniform", head_dim=128, max_tokens=512).backbone, aqua.Uniform)
    assert isinstance(M.configure("AQUA-KV", head_dim=128, max_tokens=512).backbone, aqua.Higgs)


def test_configure_adaptations():
    assert M.configure("OSCAR", head_dim=128, max_tokens=64).group_size == 128
    assert M.configure("OSCAR", head_dim=64, max_tokens=64).group_size == 64
    assert M.configure("OSCAR", head_dim=80, max_tokens=64).group_size == 80
    assert M.configure("BitDecoding-4", head_dim=64, max_tokens=512).v_group == 64
    assert M.configure("BitDecoding-4", head_dim=96, max_tokens=512).v_group == 96
    assert M.configure("AQUA-KV-uniform", head_dim=32, max_tokens=64).backbone.group_size == 32
    assert M.configure("AQUA-KV", head_dim=32, max_tokens=64, kv_heads=2).backbone.cfg.group_size == 64
    assert M.configure("AQUA-KV", head_dim=128, max_tokens=64, kv_heads=8).backbone.cfg.group_size == 1024
    cfg = M.configure("KIVI-K2V2", head_dim=64, max_tokens=300, residual=8)
    assert (cfg.residual, cfg.max_tokens, cfg.group_size) == (8, 300, 128)


def test_configure_errors():
    with pytest.raises(ValueError, match="unknown kvq method 'KIVI'; known methods: FP16, KIVI-K2V2"):
        M.configure("KIVI", head_dim=64, max_tokens=64)
    with pytest.raises(ValueError, match="KIVI-K2V2 has no option 'window'"):
        M.configure("KIVI-K2V2", head_dim=64, max_tokens=64, window=8)
    with pytest.raises(ValueError, match="OSCAR cannot be configured for head_dim=64: .*group_size=48"):
        M.configure("OSCAR", head_dim=64, max_tokens=64, group_size=48)
    with pytest.raises(ValueError, match="BitDecoding-2 cannot serve head_dim=32: .*multiple of 64 at 2 bits"):
        M.configure("BitDecoding-2", head_dim=32, max_tokens=512)
    with pytest.raises(ValueError, match="BitDecoding-4 cannot serve head_dim=48: .*multiple of 32"):
        M.configure("BitDecoding-4", head_dim=48, max_tokens=512)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        M.configure("Kitty", head_dim=0, max_tokens=64)


# ---------------------------------------------------------------------------------------------------
# bits per element


def test_bits_kivi_hand_derived():
    cfg = M.configure("KIVI-K2V2", head_dim=128, max_tokens=4096)
    kw = dict(head_dim=128, kv_heads=8, n_layers=32)
    # paper: 2 bits + (fp16 scale + fp16 min) / 128 per key group of 128 tokens and value group of 128 channels
    assert M.bits_per_element("KIVI-K2V2", cfg, context=32768, **kw) == 2 + 32 / 128 == 2.25
    # state at T = 1000: keys 7 full pages (896 tokens) quantized, 104 in the FP16 Q-buffer;
    # values: the last R = 128 in the FP16 window, 872 quantized
    want = Fraction(104 * 16 + 896 * Fraction(9, 4) + 128 * 16 + 872 * Fraction(9, 4), 2000)
    assert M.bits_per_element("KIVI-K2V2", cfg, context=1000, accounting="state", **kw) == float(want)
    # head_dim 64: value groups are the whole head (64 channels): 2 + 32/64
    cfg64 = M.configure("KIVI-K2V2", head_dim=64, max_tokens=4096)
    assert M.bits_per_element("KIVI-K2V2", cfg64, context=4096, head_dim=64, kv_heads=8, n_layers=2) == \
        (2.25 + 2.5) / 2
    assert M.bits_per_element("FP16", M.configure("FP16", head_dim=64, max_tokens=8), context=5, **kw) == 16.0


@pytest.mark.parametrize("name,fmt", [("KIVI-K2V2", "KIVI-KV2"), ("KIVI-K2V2*", "KIVI-KV2*"), ("KIVI-K4V4", "KIVI-KV4"),
                                      ("Kitty", "Kitty"), ("Kitty-Pro", "Kitty-Pro"), ("OSCAR", "OSCAR")])
@pytest.mark.parametrize("context", [100, 4096, 32768])
def test_bits_paper_equals_memory_formats(name, fmt, context):
    cfg = M.configure(name, head_dim=128, max_tokens=4096)
    got = M.bits_per_element(name, cfg, context=context, head_dim=128, kv_heads=8, n_layers=32)
    assert got == memory.bits_per_element(memory.FORMATS[fmt], context)


def test_bits_other_methods():
    kw = dict(head_dim=128, kv_heads=8, n_layers=28)
    cfg = M.configure("BitDecoding-4", head_dim=128, max_tokens=4096)
    assert M.bits_per_element("BitDecoding-4", cfg, context=1000, **kw) == 4.25
    # state: 7 packed pages of N_r = 128 tokens, 104 tokens in the FP16 residual
    assert M.bits_per_element("BitDecoding-4", cfg, context=1000, accounting="state", **kw) == \
        (104 * 16 + 896 * 4.25) / 1000
    cfg = M.configure("AQUA-KV", head_dim=128, max_tokens=4096, kv_heads=8)
    q = aqua_cache.bits_per_value(cfg, 28, 1024)
    assert abs(float(q) - 2.09) < 0.005                              # AQUA-KV Table 2's 2.09
    assert M.bits_per_element("AQUA-KV", cfg, context=4004, **kw) == float((4 * 16 + 4000 * q) / 4004)
    with pytest.raises(ValueError, match="accounting='x' is unknown"):
        M.bits_per_element("AQUA-KV", cfg, context=4, accounting="x", **kw)


# ---------------------------------------------------------------------------------------------------
# KVStore against the reference modules


@pytest.mark.parametrize("name", ["KIVI-K2V2", "KIVI-K2V2*", "KIVI-K4V4", "Kitty", "Kitty-Pro", "OSCAR",
                                  "BitDecoding-2", "BitDecoding-4"])
def test_store_matches_reference(name):
    spec = M.METHODS[name]
    mod = MODULES[spec.family]
    cal = [_random_calibration(l) for l in range(L)] if spec.family == "oscar" else None
    store = M.KVStore(name, n_layers=L, batch=B, kv_heads=H, head_dim=D, max_tokens=256, calibration=cal,
                      **SMALL[name])
    cfg = store.cfg
    states = [mod.init(cfg, B, H, D) for _ in range(L)]
    chunks = [37, 1, 1, 30, 1, 2]                                   # prefill, then decode steps
    for i, n in enumerate(chunks):
        for l in range(L):
            k, v = _tokens(n, 100 * i + l)
            if i % 2:                                            # torch bf16 input: widened exactly to fp32
                kt, vt = torch.from_numpy(k).bfloat16(), torch.from_numpy(v).bfloat16()
                store.append(l, kt, vt)
                k, v = kt.float().numpy(), vt.float().numpy()
            else:
                store.append(l, k, v)
            if spec.family == "oscar":
                mod.append(cfg, cal[l], states[l], k, v)
            else:
                mod.append(cfg, states[l], k, v)
    for l in range(L):
        _assert_same_state(store.state_arrays(l), states[l].arrays())
        assert store.length(l) == sum(chunks) == states[l].length
        K, V = store.keys_values(l)
        Kr, Vr = (mod.dequantize(cfg, cal[l], states[l]) if cal else mod.dequantize(cfg, states[l]))
        assert K.dtype == torch.float32 and K.shape == (B, H, sum(chunks), D)
        assert np.array_equal(K.numpy(), Kr) and np.array_equal(V.numpy(), Vr)
    assert store.memory_bytes() > 0 and store.allocated_bytes() > 0


def test_store_oscar_identity_and_fp16():
    store = M.KVStore("OSCAR", n_layers=1, batch=B, kv_heads=H, head_dim=D, max_tokens=64, calibration="identity",
                      **SMALL["OSCAR"])
    assert store.calibration[0].rotation == "identity"
    fp = M.KVStore("FP16", n_layers=1, batch=B, kv_heads=H, head_dim=D, max_tokens=64)
    k, v = _tokens(5, 0)
    fp.append(0, k, v)                                            # fp32 numpy -> stored fp16
    K, V = fp.keys_values(0)
    assert np.array_equal(K.numpy(), k.astype(np.float16).astype(np.float32))
    fb = M.KVStore("FP16", n_layers=1, batch=B, kv_heads=H, head_dim=D, max_tokens=64)
    kb = torch.from_numpy(k).bfloat16()
    fb.append(0, kb, kb)
    assert fb.state(0)[0].dtype == torch.bfloat16 and torch.equal(fb.keys_values(0, torch.bfloat16)[0], kb)
    with pytest.raises(ValueError, match="overflows"):
        fp.append(0, k * 1e5, v)


def test_store_empty_and_bad_input():
    store = M.KVStore("KIVI-K2V2", n_layers=2, batch=B, kv_heads=H, head_dim=D, max_tokens=20, **SMALL["KIVI-K2V2"])
    K, V = store.keys_values(1)
    assert K.shape == (B, H, 0, D)
    k, v = _tokens(3, 1)
    with pytest.raises(ValueError, match=r"k has shape \(2, 2, 3, 32\); this cache takes \(B=2, H_kv=2, T_new, D=64\)"):
        store.append(0, k[..., :32], v[..., :32])
    with pytest.raises(IndexError, match="layer=2 is out of range for 2 layers"):
        store.append(2, k, v)
    with pytest.raises(TypeError, match="int32"):
        store.append(0, k.astype(np.int32), v)
    store.append(0, k, v)
    with pytest.raises(ValueError, match="appending 18 tokens to 3 exceeds the capacity max_tokens=20"):
        store.append(0, *_tokens(18, 2))
    assert store.length(0) == 3
    with pytest.raises(ValueError, match="unknown; choose one of"):
        M.KVStore("Kitty", n_layers=1, batch=1, kv_heads=1, head_dim=D, max_tokens=8, backend="numpy")


def test_memoisation_and_invalidation():
    store = M.KVStore("Kitty", n_layers=2, batch=B, kv_heads=H, head_dim=D, max_tokens=128, **SMALL["Kitty"])
    store.append(0, *_tokens(30, 0))
    a = store.keys_values(0)
    n = store.dequantize_calls
    b = store.keys_values(0)
    assert b[0] is a[0] and store.dequantize_calls == n                 # memoised
    store.keys_values(0, torch.float16)
    assert store.dequantize_calls == n                                 # another dtype: from the fp32 memo
    store.append(1, *_tokens(3, 1))                                    # another layer: layer 0 still memoised
    assert store.keys_values(0)[0] is a[0]
    store.append(0, *_tokens(1, 2))
    c = store.keys_values(0)
    assert store.dequantize_calls == n + 1 and c[0].shape[2] == 31      # invalidated by the append
    ref = kitty.dequantize(store.cfg, store.state(0))
    assert np.array_equal(c[0].numpy(), ref[0])
    store.keys_values(1)
    store.clear_memo(0)                                                 # what a family calls on a commit
    d = store.keys_values(0)
    assert d[0] is not c[0] and store.dequantize_calls == n + 3 and np.array_equal(d[0].numpy(), ref[0])
    assert store.keys_values(1)[0] is store.keys_values(1)[0] and store.dequantize_calls == n + 3   # layer 1 kept


def test_memoize_off_keeps_no_copy():
    """``memoize=False`` (the HF caches' store): every read dequantizes afresh, nothing is retained, and
    the values are the memoised store's."""
    kw = dict(n_layers=1, batch=B, kv_heads=H, head_dim=D, max_tokens=128, **SMALL["Kitty"])
    on, off = M.KVStore("Kitty", **kw), M.KVStore("Kitty", memoize=False, **kw)
    for st in (on, off):
        st.append(0, *_tokens(30, 0))
    a, b = off.keys_values(0), off.keys_values(0)
    assert a[0] is not b[0] and off.dequantize_calls == 2 and off._memo[0] == {}
    assert torch.equal(a[0], on.keys_values(0)[0]) and torch.equal(a[1], on.keys_values(0)[1])


def test_hf_cache_store_is_not_memoised():
    from kvq.integrations.transformers import make_cache
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=D, max_position_embeddings=256)
    cache = make_cache("Kitty", cfg, **SMALL["Kitty"])
    k = torch.randn(B, 1, 5, D)
    cache.update(k, k, 0)
    assert cache.store.memoize is False and cache.store._memo[0] == {}


# ---------------------------------------------------------------------------------------------------
# AQUA-KV: cross-layer commits, waiting tokens, incremental chunk decode


def _aqua_predictors(cfg, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((B, H, 60, D)).astype(np.float32)
    kv = [(base + 0.3 * rng.standard_normal(base.shape).astype(np.float32),
           0.5 * base + rng.standard_normal(base.shape).astype(np.float32)) for _ in range(L)]
    return aqua.calibrate(cfg, kv)


@pytest.mark.parametrize("name", ["AQUA-KV", "AQUA-KV-uniform"])
def test_aqua_pending_and_commit(name):
    cfg0 = M.configure(name, head_dim=D, max_tokens=128, kv_heads=H, **SMALL[name])
    P = _aqua_predictors(cfg0)
    store = M.KVStore(name, n_layers=L, batch=B, kv_heads=H, head_dim=D, max_tokens=128, calibration=P,
                      **SMALL[name])
    assert store.cfg == cfg0
    st = aqua_cache.init(store.cfg, L, B, H, D)
    for step, n in enumerate([25, 1, 1, 12, 1]):
        toks = [_tokens(n, 10 * step + l) for l in range(L)]
        for l in range(L - 1):
            committed = store.keys_values(l)
            store.append(l, *toks[l])
            assert store.pending(l) == n and store.state(l).length == st.length   # waiting, nothing committed
            K, V = store.keys_values(l)
            assert store.length(l) == st.length + n
            assert torch.equal(K[:, :, :st.length], committed[0])
            assert np.array_equal(K[:, :, st.length:].numpy(), toks[l][0].astype(np.float16).astype(np.float32))
            assert np.array_equal(V[:, :, st.length:].numpy(), toks[l][1].astype(np.float16).astype(np.float32))
        # the last layer: update reads before the commit (Algorithm 4), then all layers are appended at once
        K, V = store.update(L - 1, *toks[L - 1])
        assert np.array_equal(K[:, :, st.length:].numpy(), toks[L - 1][0].astype(np.float16).astype(np.float32))
        aqua_cache.append(store.cfg, P, st, np.stack([t[0] for t in toks]), np.stack([t[1] for t in toks]))
        assert all(store.pending(l) == 0 for l in range(L))
        _assert_same_state(store.state_arrays(0), st.arrays())
        ref = aqua_cache.dequantize(store.cfg, P, st)
        for l in range(L):
            K, V = store.keys_values(l)
            assert np.array_equal(K.numpy(), ref[l][0]) and np.array_equal(V.numpy(), ref[l][1])
    assert st.length == 40 and aqua_cache.counts(store.cfg, 40)[1] == 2          # two chunks compressed
    assert len(store._chunks) == 2                                                   # each decoded once


def test_aqua_errors_and_identity():
    cfg = M.configure("AQUA-KV", head_dim=D, max_tokens=64, kv_heads=H, **SMALL["AQUA-KV"])
    P = _aqua_predictors(cfg)
    with pytest.raises(ValueError, match=r"AQUA-KV needs a calibration: .*`kvq calibrate`"):
        M.KVStore("AQUA-KV", n_layers=L, batch=B, kv_heads=H, head_dim=D, max_tokens=64)
    with pytest.raises(ValueError, match="calibration has predictors for 3 layers; the model has 4"):
        M.KVStore("AQUA-KV", n_layers=4, batch=B, kv_heads=H, head_dim=D, max_tokens=64, calibration=P)
    with pytest.raises(ValueError, match=r"f_key\[1\] maps 128 -> 128 values; this model needs 64 -> 64"):
        M.KVStore("AQUA-KV", n_layers=L, batch=B, kv_heads=H, head_dim=32, max_tokens=64, calibration=P)
    store = M.KVStore("AQUA-KV", n_layers=L, batch=B, kv_heads=H, head_dim=D, max_tokens=64, calibration="identity",
                      **SMALL["AQUA-KV"])
    assert not store.cfg.predict_keys and not store.cfg.predict_values
    with pytest.raises(ValueError, match="NaN or inf"):
        store.append(0, np.full((B, H, 1, D), np.nan, np.float32), np.zeros((B, H, 1, D), np.float32))
    assert store.length(0) == 0


def test_oscar_calibration_errors():
    kw = dict(n_layers=L, batch=B, kv_heads=H, head_dim=D, max_tokens=64)
    with pytest.raises(ValueError, match=r"OSCAR needs a calibration: a list of one .*OSCARCalibration per layer. "
                                         r"Run `kvq calibrate`"):
        M.KVStore("OSCAR", **kw)
    with pytest.raises(ValueError, match="OSCAR calibration has 2 layers; the model has 3"):
        M.KVStore("OSCAR", calibration=[_random_calibration(0)] * 2, **kw)
    with pytest.raises(ValueError, match=r"calibration of layer 0 does not fit this model \(head_dim=64"):
        M.KVStore("OSCAR", calibration=[oscar.identity_calibration(32)] * 3, **kw)
    with pytest.raises(ValueError, match="KIVI-K2V2 takes no calibration"):
        M.KVStore("KIVI-K2V2", calibration="identity", **kw)


# ---------------------------------------------------------------------------------------------------
# fast tiers: Triton through the CPU interpreter here; both backends on CUDA on the GPU machine


@pytest.mark.parametrize("name", ["KIVI-K2V2", "Kitty", "OSCAR", "BitDecoding-2", "AQUA-KV-uniform"])
def test_triton_store_equals_reference(triton_device, name):
    fam = M.METHODS[name].family
    cal = "identity" if fam in ("oscar", "aqua") else None
    kw = dict(n_layers=2, batch=1, kv_heads=H, head_dim=D, max_tokens=128, calibration=cal, **SMALL[name])
    ref = M.KVStore(name, backend="reference", **kw)
    fast = M.KVStore(name, backend="triton", device=triton_device, **kw)
    rng = np.random.default_rng(0)
    for n in (37, 1, 30):
        for l in range(2):
            k, v = (rng.standard_normal((1, H, n, D)).astype(np.float16) for _ in range(2))
            ref.append(l, k, v)
            fast.append(l, torch.from_numpy(k).to(triton_device), torch.from_numpy(v).to(triton_device))
    for l in range(2):
        _assert_same_state(fast.state_arrays(l), ref.state_arrays(l))
        assert torch.equal(fast.keys_values(l)[0].cpu(), ref.keys_values(l)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cupy"])
@pytest.mark.parametrize("name", ["KIVI-K2V2", "KIVI-K4V4", "Kitty", "Kitty-Pro", "OSCAR", "BitDecoding-2",
                                  "BitDecoding-4", "AQUA-KV-uniform"])
def test_fast_backend_state_equals_reference(backend, name):
    fam = M.METHODS[name].family
    cal = "identity" if fam == "oscar" else None                  # identity rotation: bit-exact in every tier
    if fam == "aqua":
        cal = _aqua_predictors(M.configure(name, head_dim=D, max_tokens=128, kv_heads=H, **SMALL[name]))
    kw = dict(n_layers=L, batch=B, kv_heads=H, head_dim=D, max_tokens=128, calibration=cal, **SMALL[name])
    ref = M.KVStore(name, backend="reference", **kw)
    fast = M.KVStore(name, backend=backend, device="cuda", **kw)
    for i, n in enumerate([37, 1, 30, 1]):
        for l in range(L):
            k, v = _tokens(n, 10 * i + l, np.float16)
            ref.append(l, k, v)
            fast.append(l, torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda())
    for l in range(L):
        a, b = fast.state_arrays(l), ref.state_arrays(l)
        if fam == "aqua":                 # residual codes of layers >= 1 follow contract rule 7 (fp32 products)
            a = {n: x for n, x in a.items() if not n.startswith("res_")}
            b = {n: x for n, x in b.items() if not n.startswith("res_")}
        _assert_same_state(a, b)
        Kf, Vf = fast.keys_values(l)
        Kr, Vr = ref.keys_values(l)
        assert Kf.is_cuda
        if fam == "aqua":
            assert torch.allclose(Kf.cpu(), Kr, rtol=1e-3, atol=1e-3)
        else:
            assert torch.equal(Kf.cpu(), Kr) and torch.equal(Vf.cpu(), Vr)
