"""kvq.integrations.transformers: kvq caches inside tiny Llama / Qwen2 / Mistral / Qwen3 models (CPU, no download)."""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

from kvq.integrations import methods as M  # noqa: E402
from kvq.integrations.transformers import (AquaKVCache, FP16Cache, KIVICache, KVQCache, make_cache,  # noqa: E402
                                           model_dims)
from kvq.reference import aqua, aqua_cache, bitdecoding, oscar, paged  # noqa: E402
from kvq.reference.model import apply_rope  # noqa: E402

from .small import MODULES, SMALL  # noqa: E402


def tiny(kind="llama", head_dim=32, dtype=torch.float32, seed=0):
    """A 2-layer model with 4 query heads and 2 KV heads (GQA), random weights."""
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen3": (getattr(transformers, "Qwen3Config", None), getattr(transformers, "Qwen3ForCausalLM", None))}[kind]
    if cls[0] is None:
        pytest.skip(f"transformers has no {kind} model")
    config = cls[0](vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512)
    torch.manual_seed(seed)
    return cls[1](config).to(dtype).eval()


def prompt(T=20, batch=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, T), generator=g)


def record(cache: KVQCache) -> list:
    """Log every (layer, k, v) the model hands to the cache, in order."""
    log, orig = [], cache._update

    def _update(layer_idx, k, v):
        log.append((layer_idx, k.detach().clone(), v.detach().clone()))
        return orig(layer_idx, k, v)

    cache._update = _update
    return log


def teacher_forced(model, cache, ids, P):
    """Last-position logits of a prefill of P tokens, then one decode step per remaining token."""
    out = []
    with torch.no_grad():
        out.append(model(ids[:, :P], past_key_values=cache).logits[:, -1])
        for t in range(P, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1).float()


def compressed_tokens(cache: KVQCache) -> int:
    """Tokens of layer 0 held quantized (not in an FP16 sink / buffer / window / residual)."""
    st, cfg, fam = cache.state(0), cache.store.cfg, M.METHODS[cache.method].family
    if fam in ("kivi", "kitty"):
        c = paged.counts(cfg, st.length)
        return min(c["n_kpages"] * cfg.group_size, c["n_vq"])
    if fam == "oscar":
        return oscar.counts(cfg, st.length)["n_hist"]
    if fam == "bitdecoding":
        return bitdecoding.partition(st.length, cfg.n_r)[0]
    if fam == "aqua":
        return aqua_cache.counts(cfg, st.length)[1] * cfg.buffer
    return 0


def _np(t):
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def oscar_calibration(model, T=48):
    """A real OSCAR calibration per layer: post-RoPE q, k, v of the model on random tokens."""
    dims = model_dims(model)
    qs = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda mod, inp, out, l=l: qs.__setitem__(l, out.detach())) for l, layer in enumerate(model.model.layers)]
    dc = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt(T, batch=2, seed=7), past_key_values=dc)
    for h in hooks:
        h.remove()
    cal = []
    for l, layer in enumerate(dc.layers):
        q = qs[l].float().numpy().reshape(2, T, -1, dims["head_dim"]).transpose(0, 2, 1, 3)
        q = apply_rope(q, np.arange(T), dims["rope_theta"])
        cal.append(oscar.calibrate(q, layer.keys.float().numpy(), layer.values.float().numpy(), group_size=32))
    return cal


def aqua_predictors(model, name, T=64):
    """AquaPredictors fitted (Algorithm 1) on the model's K / V of random tokens, collected by a DynamicCache."""
    dims = model_dims(model)
    cfg = M.configure(name, head_dim=dims["head_dim"], max_tokens=512, kv_heads=dims["kv_heads"],
                      rope_theta=dims["rope_theta"], **SMALL[name])
    dc = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt(T, batch=2, seed=5), past_key_values=dc)
    return aqua.calibrate(cfg, [(layer.keys.float().numpy(), layer.values.float().numpy()) for layer in dc.layers])


def calibration_for(model, name):
    fam = M.METHODS[name].family
    if fam == "oscar":
        return oscar_calibration(model)
    if fam == "aqua":
        return aqua_predictors(model, name)
    return None


# ---------------------------------------------------------------------------------------------------
# FP16 reproduces DynamicCache exactly


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_cache_equals_dynamic_cache(dtype):
    model = tiny(dtype=dtype)
    ids = prompt(30, batch=2)
    ref = teacher_forced(model, DynamicCache(config=model.config), ids, 20)
    cache = FP16Cache(model)
    got = teacher_forced(model, cache, ids, 20)
    assert torch.equal(got, ref)
    assert cache.get_seq_length() == 30 and cache.state(1)[0].dtype == dtype
    a = model.generate(prompt(20), max_new_tokens=32, do_sample=False, past_key_values=DynamicCache(config=model.config))
    b = model.generate(prompt(20), max_new_tokens=32, do_sample=False, past_key_values=make_cache("FP16", model))
    assert a.shape == (1, 52) and torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------
# every method generates, and quantizes on the way


@pytest.mark.parametrize("name", [n for n in M.METHODS if n != "FP16"])
def test_generate_every_method(name):
    head_dim = 64 if name == "BitDecoding-2" else 32
    model = tiny(head_dim=head_dim)
    ids = prompt(40 if name == "BitDecoding-2" else 20)
    cache = make_cache(name, model, calibration=calibration_for(model, name), **SMALL[name])
    out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, past_key_values=cache)
    assert out.shape == (1, ids.shape[1] + 32)
    assert torch.equal(out[:, :ids.shape[1]], ids)
    T = ids.shape[1] + 31                              # the last generated token is never fed back
    assert cache.get_seq_length() == T and all(cache.store.length(l) == T for l in range(2))
    assert compressed_tokens(cache) > 0
    assert 0 < cache.bits_per_element() < 16 and 0 < cache.memory_bytes() < 2 * 2 * 2 * head_dim * T * 2


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("name", ["KIVI-K2V2", "Kitty"])
def test_other_architectures(kind, name):
    model = tiny(kind)
    cache = make_cache(name, model, **SMALL[name])
    out = model.generate(prompt(20), max_new_tokens=32, min_new_tokens=32, do_sample=False, past_key_values=cache)
    assert out.shape == (1, 52) and compressed_tokens(cache) > 0


# ---------------------------------------------------------------------------------------------------
# the state inside the HF cache is the kvq state of the same inputs


@pytest.mark.parametrize("name,dtype", [("KIVI-K2V2*", torch.float32), ("Kitty-Pro", torch.bfloat16),
                                        ("OSCAR", torch.float32), ("BitDecoding-4", torch.float16),
                                        ("AQUA-KV", torch.float32), ("AQUA-KV-uniform", torch.bfloat16)])
def test_state_equals_kvq_state(name, dtype):
    model = tiny(dtype=dtype)
    fam = M.METHODS[name].family
    calib = calibration_for(model, name)
    cache = make_cache(name, model, calibration=calib, **SMALL[name])
    log = record(cache)
    teacher_forced(model, cache, prompt(45, batch=2), 21)
    cfg = cache.store.cfg
    assert compressed_tokens(cache) > 0
    if fam == "aqua":
        st = aqua_cache.init(cfg, 2, 2, 2, 32)
        for i in range(0, len(log), 2):                # one forward = layer 0 then layer 1
            (l0, k0, v0), (l1, k1, v1) = log[i], log[i + 1]
            assert (l0, l1) == (0, 1)
            aqua_cache.append(cfg, calib, st, np.stack([_np(k0), _np(k1)]), np.stack([_np(v0), _np(v1)]))
        want = {n: st.arrays() for n in (0, 1)}
    else:
        mod = MODULES[fam]
        states = [mod.init(cfg, 2, 2, 32) for _ in range(2)]
        for l, k, v in log:
            if fam == "oscar":
                mod.append(cfg, calib[l], states[l], _np(k), _np(v))
            else:
                mod.append(cfg, states[l], _np(k), _np(v))
        want = {l: states[l].arrays() for l in (0, 1)}
    for l in (0, 1):
        got = cache.store.state_arrays(l)
        assert got.keys() == want[l].keys()
        for n in got:
            assert np.array_equal(got[n], want[l][n]), (l, n)


# ---------------------------------------------------------------------------------------------------
# compressed logits: close to FP16, and 2-bit further than 4-bit


def _relative_errors(model, name, ids, P):
    ref = teacher_forced(model, DynamicCache(config=model.config), ids, P)
    cache = make_cache(name, model, calibration=calibration_for(model, name), **SMALL[name])
    log = record(cache)
    got = teacher_forced(model, cache, ids, P)
    # the cache's own relative reconstruction error of the K / V it was given (both layers)
    num = den = 0.0
    for l in (0, 1):
        K = torch.cat([k for i, k, _ in log if i == l], 2).float()
        V = torch.cat([v for i, _, v in log if i == l], 2).float()
        Kh, Vh = cache.store.keys_values(l)
        num += float((Kh - K).norm() ** 2 + (Vh - V).norm() ** 2)
        den += float(K.norm() ** 2 + V.norm() ** 2)
    assert compressed_tokens(cache) > 0
    return float((got - ref).norm() / ref.norm()), (num / den) ** 0.5


@pytest.mark.parametrize("name", ["KIVI-K2V2", "KIVI-K4V4", "Kitty", "OSCAR", "AQUA-KV", "BitDecoding-4"])
def test_logits_close_to_fp16(name):
    model = tiny()
    logit_err, kv_err = _relative_errors(model, name, prompt(60, batch=2), 24)
    # Bound: a cache whose K / V carry a relative error e perturbs each attention output by at most
    # about e (softmax weights move by ~ e * |q||k| / sqrt(D), small for these weights; values are averaged),
    # and the residual stream and the final norm do not amplify it by more than the 2 layers it passes:
    # relative logit error <= 2 e (+ a floor for the fp32 reorderings). Measured: 0.25 e to 0.8 e.
    assert 0 < logit_err < 2 * kv_err + 1e-3, (logit_err, kv_err)
    # and an absolute bound from the quantizer: the relative RMS error of uniform b-bit min-max quantization
    # of a group is about step / sqrt(12) / rms with step = range / (2^b - 1); a group of 16 Gaussian
    # tokens spans ~3.5 rms, so 2 bits give 3.5 / 3 / sqrt(12) = 0.34 (measured 0.33 for KIVI-K2V2, the
    # FP16 tokens lower it), 4 bits 0.07: allow 0.45 (the 2-bit estimate with a 30% margin)
    assert kv_err < 0.45


def test_two_bits_further_than_four():
    model = tiny()
    ids = prompt(60, batch=2)
    e2, kv2 = _relative_errors(model, "KIVI-K2V2", ids, 24)
    e4, kv4 = _relative_errors(model, "KIVI-K4V4", ids, 24)
    assert kv2 > 3 * kv4 and e2 > e4 > 0


# ---------------------------------------------------------------------------------------------------
# API surface and errors


def test_cache_api():
    model = tiny()
    cache = KIVICache(model, **SMALL["KIVI-K2V2"])
    # no max_tokens: the capacity starts at 256 and grows up to max_position_embeddings (512), as a dynamic cache
    assert cache.method == "KIVI-K2V2" and cache.max_tokens == 256 and cache.get_max_length() == -1
    assert cache.grow and cache.max_capacity == 512 and cache.layers[0].get_max_cache_shape() == -1
    assert cache.get_seq_length() == 0 and cache.max_batch_size == -1 and cache.memory_bytes() == 0
    assert cache.is_compileable is False and len(cache) == 2
    with torch.no_grad():
        model(prompt(10, batch=3), past_key_values=cache)
    assert cache.max_batch_size == 3 and cache.get_seq_length() == 10
    assert cache.get_mask_sizes(1, 0) == (11, 0)
    assert cache.bits_per_element(accounting="paper") == M.bits_per_element(
        "KIVI-K2V2", cache.config, context=10, head_dim=32, kv_heads=2, n_layers=2)
    with pytest.raises(ValueError, match=r"batch size of a kvq cache is fixed at its first update \(B=3\); got 1"):
        with torch.no_grad():
            model(prompt(1, batch=1), past_key_values=cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.store is None
    assert make_cache("AQUA-KV", model, calibration="identity").config.rope_theta == 10000.0
    assert isinstance(make_cache("AQUA-KV", model.config, calibration="identity"), AquaKVCache)


def test_errors():
    model = tiny()
    with pytest.raises(ValueError, match="unknown kvq method 'KIVI-2'; known methods:"):
        make_cache("KIVI-2", model)
    with pytest.raises(ValueError, match=r"OSCAR needs a calibration: .*Run `kvq calibrate`"):
        make_cache("OSCAR", model)
    with pytest.raises(ValueError, match=r"AQUA-KV needs a calibration: .*Run `kvq calibrate`"):
        make_cache("AQUA-KV", model)
    with pytest.raises(ValueError, match=r"calibration of layer 0 does not fit this model \(head_dim=32"):
        make_cache("OSCAR", model, calibration=[oscar.identity_calibration(64)] * 2)
    with pytest.raises(ValueError, match="OSCAR calibration has 3 layers; the model has 2"):
        make_cache("OSCAR", model, calibration=[oscar.identity_calibration(32)] * 3)
    P3 = aqua.AquaPredictors((None,) * 3, (None,) * 3)
    with pytest.raises(ValueError, match="calibration has predictors for 3 layers; the model has 2"):
        make_cache("AQUA-KV", model, calibration=P3)
    with pytest.raises(ValueError, match="BitDecoding-2 cannot serve head_dim=32: .*multiple of 64"):
        make_cache("BitDecoding-2", model)
    with pytest.raises(ValueError, match="KIVICache serves KIVI-K2V2, KIVI-K2V2\\*, KIVI-K4V4; got 'Kitty'"):
        KIVICache(model, "Kitty")
    with pytest.raises(ValueError, match="Kitty has no option 'window'"):
        make_cache("Kitty", model, window=3)
    with pytest.raises(NotImplementedError, match="do not support beam search"):
        model.generate(prompt(20), max_new_tokens=4, num_beams=2, do_sample=False,
                       past_key_values=make_cache("KIVI-K2V2", model))
    cache = make_cache("Kitty", model)
    with torch.no_grad():
        model(prompt(5), past_key_values=cache)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(ValueError, match=r"appending 20 tokens to 0 exceeds the capacity max_tokens=16"):
        with torch.no_grad():
            model(prompt(20), past_key_values=make_cache("Kitty", model, max_tokens=16, sink=4))
    mistral = tiny("mistral")
    mistral.config.sliding_window = 100
    with pytest.raises(ValueError, match="sliding window of 100 tokens < max_tokens=512"):
        make_cache("Kitty", mistral, max_tokens=512)
    grown = make_cache("Kitty", mistral)          # a growing cache stops at the window: the same attention
    assert grown.max_capacity == 100 and grown.max_tokens == 100


def _bad_updates(k, v):
    """(label, key_states, value_states, error, match) a cache must reject, from good states k, v (B, 2, T, 32)."""
    nan, inf = k.clone(), v.clone()
    nan[0, 1, 2, 3] = float("nan")
    inf[0, 0, 0, 0] = float("inf")
    return [("numpy k", k.numpy(), v, TypeError, "key_states must be a torch.Tensor"),
            ("numpy v", k, v.numpy(), TypeError, "value_states must be a torch.Tensor"),
            ("NaN k", nan, v, ValueError, "NaN"),
            ("inf v", k, inf, ValueError, "NaN or inf|non-finite"),
            ("head dim", k[..., :16], v[..., :16], ValueError, r"key_states have shape \(\d, 2, 3, 16\)"),
            ("heads", k[:, :1], v[:, :1], ValueError, "H_kv=2"),
            ("int dtype", k.int(), v.int(), TypeError, "key_states has dtype torch.int32"),
            ("k / v shapes", k, v[:, :, :1], ValueError, "key_states and value_states must have the same shape"),
            ("k / v dtypes", k.half(), v, ValueError, "one dtype and device"),
            ("overflow", k * 1e6, v, ValueError, "overflow")]


@pytest.mark.parametrize("name", ["FP16", "KIVI-K2V2", "AQUA-KV-uniform"])
def test_rejected_update_changes_nothing(name):
    """A rejected first update creates no store and fixes no batch size; a rejected later update (any
    layer, the batch size included) leaves the store bit-identical; the model's calls then go on."""
    from .test_store_atomicity import snapshot

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=256)
    cal = "identity" if name.startswith("AQUA") else None
    cache, fresh = (make_cache(name, config, calibration=cal, **SMALL[name]) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(3, 2, 3, 32, generator=g) for _ in range(2))
    for label, kb, vb, err, match in _bad_updates(k, v):
        with pytest.raises(err, match=match):
            cache.update(kb, vb, 0)
        assert cache.store is None and cache.max_batch_size == -1 and cache.get_seq_length() == 0, label
        assert not cache.layers[0].is_initialized, label
    with pytest.raises(IndexError, match="layer_idx=True is out of range"):
        cache.update(k, v, True)
    for c in (cache, fresh):                                      # the first accepted update fixes B = 3
        c.update(k, v, 0)
    assert cache.max_batch_size == 3 and cache.layers[0].is_initialized and cache.layers[0].dtype == torch.float32
    for layer in (0, 1):
        for label, kb, vb, err, match in _bad_updates(k, v) + [("batch", k[:1], v[:1], ValueError, "fixed at its "
                                                                "first update \\(B=3\\); got 1")]:
            before = snapshot(cache.store)
            with pytest.raises(err, match=match):
                cache.update(kb, vb, layer)
            assert snapshot(cache.store) == before, (layer, label)
    for c in (cache, fresh):
        K, V = c.update(k, v, 1)
        c.update(k, v, 0)
    assert snapshot(cache.store, memo=False) == snapshot(fresh.store, memo=False)
    assert K.dtype == torch.float32 and torch.equal(K, fresh.store.keys_values(1)[0])


# ---------------------------------------------------------------------------------------------------
# fast tiers inside the model: Triton through the CPU interpreter here, CUDA on the GPU machine


@pytest.mark.parametrize("name", ["KIVI-K2V2", "Kitty", "BitDecoding-4"])
def test_triton_backend_in_model(triton_device, name):
    model = tiny(dtype=torch.float16).to(triton_device)
    cache = make_cache(name, model, backend="triton", **SMALL[name])
    log = record(cache)
    out = model.generate(prompt(20).to(triton_device), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                         past_key_values=cache)
    assert out.shape == (1, 52) and compressed_tokens(cache) > 0 and cache.store.backend == "triton"
    ref = M.KVStore(name, n_layers=2, batch=1, kv_heads=2, head_dim=32, max_tokens=cache.store.max_tokens,
                    backend="reference", **SMALL[name])            # the capacity the cache has now (it grows)
    for l, k, v in log:
        ref.append(l, k.cpu(), v.cpu())
    for l in (0, 1):
        got, want = cache.store.state_arrays(l), ref.state_arrays(l)
        assert got.keys() == want.keys() and all(np.array_equal(got[n], want[n]) for n in got)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cupy"])
@pytest.mark.parametrize("name", ["KIVI-K2V2", "Kitty", "OSCAR", "BitDecoding-4"])
def test_fast_backend_in_model(backend, name):
    model = tiny(dtype=torch.float16).cuda()
    calib = "identity" if name == "OSCAR" else None              # identity rotation: bit-exact in every tier
    cache = make_cache(name, model, backend=backend, calibration=calib, **SMALL[name])
    assert cache.backend == backend
    log = record(cache)
    out = model.generate(prompt(20).cuda(), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                         past_key_values=cache)
    assert out.shape == (1, 52) and compressed_tokens(cache) > 0 and cache.store.backend == backend
    ref = M.KVStore(name, n_layers=2, batch=1, kv_heads=2, head_dim=32, max_tokens=cache.store.max_tokens,
                    backend="reference", calibration=calib, **SMALL[name])   # the cache's capacity now (it grows)
    for l, k, v in log:
        ref.append(l, k.cpu(), v.cpu())
    for l in (0, 1):
        got, want = cache.store.state_arrays(l), ref.state_arrays(l)
        assert got.keys() == want.keys()
        for n in got:
            assert np.array_equal(got[n], want[n]), (l, n)


# ---------------------------------------------------------------------------------------------------
# calibration files from `kvq calibrate`


def test_calibration_files_are_accepted_by_path(tmp_path):
    """OSCAR and AQUA-KV caches take a `kvq calibrate` file by path: the same logits as the in-memory
    calibration; a file for another shape, or of the other backbone, fails with a clear error."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvq import calibration as CF
    from kvq.commands.calibrate import calibrate_aqua_model, calibrate_oscar_model
    from kvq.integrations.methods import configure
    from kvq.integrations.transformers import make_cache, model_dims

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    batches = [np.random.default_rng(0).integers(0, 64, size=(2, 48))]
    dims = model_dims(model)
    shape = {k: dims[k] for k in ("n_layers", "kv_heads", "head_dim")} | {"rope_theta": dims["rope_theta"]}
    osc = calibrate_oscar_model(model, batches, progress=False)
    CF.save_oscar(tmp_path / "o.safetensors", osc, model_shape=shape)
    acfg = configure("AQUA-KV", head_dim=32, kv_heads=1, max_tokens=4096, rope_theta=dims["rope_theta"], sink=4,
                     buffer=16)
    P, acfg = calibrate_aqua_model(model, batches, cfg=acfg, progress=False)
    CF.save_aqua(tmp_path / "a.safetensors", P, acfg, model_shape=shape)
    ids = torch.as_tensor(np.random.default_rng(1).integers(0, 64, size=(1, 40)))
    for method, obj, path, kw in (("OSCAR", osc, tmp_path / "o.safetensors", dict(sink=4, window=8, page_size=16)),
                                  ("AQUA-KV", P, tmp_path / "a.safetensors", dict(sink=4, buffer=16))):
        with torch.no_grad():
            a = model(ids, past_key_values=make_cache(method, model, calibration=obj, **kw)).logits
            b = model(ids, past_key_values=make_cache(method, model, calibration=str(path), **kw)).logits
        assert torch.equal(a, b), method
    with pytest.raises(ValueError, match="backbone"):
        make_cache("AQUA-KV-uniform", model, calibration=tmp_path / "a.safetensors")
    other = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
    with pytest.raises(ValueError, match="head_dim"):
        make_cache("OSCAR", other, calibration=tmp_path / "o.safetensors")
    with pytest.raises(ValueError, match="takes no calibration file"):
        make_cache("KIVI-K2V2", model, calibration=tmp_path / "o.safetensors")
