"""Attention through kvq (kvq.integrations.attention): a model decoding with a kvq cache runs the method's
decode over the compressed state, never a dequantized copy of the cache; CPU here (reference tier and Triton
through the interpreter), CUDA on the device machine (``-m gpu``)."""

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

from kvq.integrations import attention as A  # noqa: E402
from kvq.integrations import methods as M  # noqa: E402
from kvq.integrations.transformers import make_cache  # noqa: E402

from .small import SMALL  # noqa: E402
from .test_transformers_caches import calibration_for, prompt, record, teacher_forced, tiny  # noqa: E402

QUANTIZED = [n for n in M.METHODS if n != "FP16"]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _spy(monkeypatch):
    """Count the fused decode calls and the dequantizations of whole layers."""
    calls = {"decode": 0}
    orig = A.decode

    def decode(store, layer, q, scale=None):
        calls["decode"] += 1
        return orig(store, layer, q, scale)

    monkeypatch.setattr(A, "decode", decode)
    return calls


def _fused_and_dequantized(model, name, ids, P, calib=None, **kw):
    """Teacher-forced decode logits of the fused path, and at every step those of the dequantize-then-attend
    path on a copy of the same cache (so both attend over the same compressed state). ``calib``: the
    method's calibration (default: fit on ``model``, which must then be on the CPU)."""
    if calib is None and M.METHODS[name].calibration:
        calib = calibration_for(model, name)
    fused = make_cache(name, model, calibration=calib, **SMALL[name], **kw)
    assert model.config._attn_implementation == A.ATTN_IMPLEMENTATION
    got, want = [], []
    with torch.no_grad():
        model(ids[:, :P], past_key_values=fused)
        for t in range(P, ids.shape[1]):
            plain = copy.deepcopy(fused, memo={id(fused.store._mod): fused.store._mod})
            plain.attention = "dequantize"
            want.append(model(ids[:, t:t + 1], past_key_values=plain).logits[:, -1].float())
            got.append(model(ids[:, t:t + 1], past_key_values=fused).logits[:, -1].float())
    return fused, torch.stack(got, 1), torch.stack(want, 1)


@pytest.mark.parametrize("name", QUANTIZED)
def test_decode_runs_on_the_compressed_state(monkeypatch, name):
    """Every decode step of every layer goes through the method's decode; no layer is dequantized; the
    logits equal those of the dequantize-then-attend path within fp32 rounding."""
    model = tiny(head_dim=64)
    calls = _spy(monkeypatch)
    ids = prompt(44, seed=3)
    fused, got, want = _fused_and_dequantized(model, name, ids, 20)
    assert calls["decode"] == 2 * (44 - 20)                       # 2 layers x 24 decode steps
    assert fused.store.dequantize_calls == 0
    assert _rel(got, want) < 1e-5


def test_fp16_cache_equals_dynamic_cache_under_kvq_attention():
    """The FP16 cache reproduces DynamicCache exactly, and DynamicCache itself is unchanged by the switch."""
    model = tiny(dtype=torch.float16)
    ids = prompt(30)
    gen = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    want = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    want_logits = teacher_forced(model, DynamicCache(config=model.config), ids, 20)
    cache = make_cache("FP16", model)
    assert model.config._attn_implementation == A.ATTN_IMPLEMENTATION
    assert torch.equal(model.generate(ids, past_key_values=cache, **gen), want)
    assert torch.equal(teacher_forced(model, DynamicCache(config=model.config), ids, 20), want_logits)
    assert torch.equal(teacher_forced(model, make_cache("FP16", model), ids, 20), want_logits)


@pytest.mark.parametrize("name", ["KIVI-K2V2", "OSCAR", "AQUA-KV", "BitDecoding-4"])
def test_chunked_prefill_attends_to_the_prefix(name):
    """A second prefill chunk attends to the cached prefix dequantized once (as the state holds it after the
    chunk's append, which the decode steps read too) and to itself in FP16, causally: the logits of a
    DynamicCache holding that dequantized prefix."""
    model = tiny()
    ids = prompt(60, seed=4)
    calib = calibration_for(model, name) if M.METHODS[name].calibration else None
    cache = make_cache(name, model, calibration=calib, **SMALL[name])
    dc = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :30], past_key_values=cache)
        before = [cache.store.keys_values(l, torch.float32) for l in range(2)]
        got = model(ids[:, 30:], past_key_values=cache).logits
        for l in range(2):                   # AQUA-KV reads before the commit of the chunk (Algorithm 4)
            KV = before[l] if M.METHODS[name].family == "aqua" else cache.store.keys_values(l, torch.float32)
            dc.update(*(x[:, :, :30] for x in KV), l)
        want = model(ids[:, 30:], past_key_values=dc).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert cache.get_seq_length() == 60


def test_state_after_generate_equals_direct_appends():
    """The fused path only appends: the state after generate is the state of appending the same tokens."""
    model = tiny()
    cache = make_cache("Kitty", model, **SMALL["Kitty"])
    log = record(cache)
    model.generate(prompt(20), max_new_tokens=24, min_new_tokens=24, do_sample=False, past_key_values=cache)
    ref = M.KVStore("Kitty", n_layers=2, batch=1, kv_heads=2, head_dim=32, max_tokens=cache.max_tokens,
                    **SMALL["Kitty"])
    for l, k, v in log:
        ref.append(l, k, v)
    for l in (0, 1):
        got, want = cache.store.state_arrays(l), ref.state_arrays(l)
        assert got.keys() == want.keys() and all(np.array_equal(got[n], want[n]) for n in got)


def test_left_padding_is_refused_and_leaves_the_cache_empty():
    model = tiny()
    cache = make_cache("KIVI-K2V2", model, **SMALL["KIVI-K2V2"])
    ids = prompt(12, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert cache.store is None and cache.get_seq_length() == 0
    out = model.generate(ids, past_key_values=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (2, 16)


def test_batch_with_equal_lengths_matches_single_sequences():
    model = tiny()
    ids = prompt(24, batch=2, seed=9)
    both = teacher_forced(model, make_cache("KIVI-K4V4", model, **SMALL["KIVI-K4V4"]), ids, 12)
    for b in range(2):
        one = teacher_forced(model, make_cache("KIVI-K4V4", model, **SMALL["KIVI-K4V4"]), ids[b:b + 1], 12)
        assert _rel(both[b:b + 1], one) < 1e-5


def test_attention_option_is_checked():
    model = tiny()
    with pytest.raises(ValueError, match="attention="):
        make_cache("KIVI-K2V2", model, attention="flash")


def test_triton_backend_decodes_in_model(triton_device, monkeypatch):
    """The Triton tier's fused decode inside the model (interpreter here, CUDA on the device)."""
    model = tiny(dtype=torch.float16).to(triton_device)
    calls = _spy(monkeypatch)
    ids = prompt(36, seed=5).to(triton_device)
    fused, got, want = _fused_and_dequantized(model, "KIVI-K2V2", ids, 20, backend="triton")
    assert calls["decode"] == 2 * 16 and fused.store.dequantize_calls == 0
    assert _rel(got, want) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cupy"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", QUANTIZED)
def test_fused_decode_in_model_gpu(monkeypatch, backend, dtype, name):
    """Every method, both backends, fp16 and bf16 models with GQA: fused logits = dequantized-path logits
    within the model dtype's rounding."""
    calib = calibration_for(tiny(head_dim=64), name) if M.METHODS[name].calibration else None   # same weights
    model = tiny(dtype=dtype, head_dim=64).cuda()
    calls = _spy(monkeypatch)
    ids = prompt(60, batch=2, seed=6).cuda()
    fused, got, want = _fused_and_dequantized(model, name, ids, 36, calib=calib, backend=backend)
    assert calls["decode"] == 2 * 24 and fused.store.dequantize_calls == 0
    assert _rel(got, want) < (2e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cupy"])
@pytest.mark.parametrize("name", list(M.METHODS))
def test_decode_steps_make_no_torch_synchronization_gpu(backend, name):
    """make_cache's default on CUDA (validate=None: no value scans) with a fixed capacity: decode steps, page
    flushes and AQUA-KV's commits among them, make no synchronizing torch call (set_sync_debug_mode("error")
    raises at one; CuPy's own calls are not seen by torch, and its launches do not synchronize)."""
    calib = calibration_for(tiny(head_dim=64), name) if M.METHODS[name].calibration else None
    model = tiny(dtype=torch.float16, head_dim=64).cuda()
    cache = make_cache(name, model, calibration=calib, backend=backend, max_tokens=128, **SMALL[name])
    ids = prompt(40, batch=2, seed=3).cuda()
    with torch.no_grad():
        model(ids, past_key_values=cache)
        nxt = prompt(1, batch=2, seed=4).cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(40, 64):                          # past a chunk / page / residual group of SMALL's
                pos = torch.full((1,), t, device="cuda", dtype=torch.long)
                model(input_ids=nxt, past_key_values=cache, cache_position=pos, position_ids=pos.expand(2, 1))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert cache.get_seq_length() == 64 and cache.store.validate is False


def test_the_new_cache_argument_and_the_old_one_give_the_same_generation():
    """transformers is renaming ``past_key_values`` to ``cache``: kvq caches work under either name, and
    ``cache_argument`` names the one this transformers takes (the old one where ``forward`` lacks ``cache``)."""
    import inspect
    import warnings

    from kvq.integrations.transformers import cache_argument
    model = tiny()
    arg = cache_argument(model)
    has_new = "cache" in inspect.signature(type(model).forward).parameters
    assert arg == ("cache" if has_new else "past_key_values")
    outs = []
    for name in {arg, "past_key_values"}:
        cache = make_cache("KIVI-K2V2", model, **SMALL["KIVI-K2V2"])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            outs.append(model.generate(prompt(20), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                       **{name: cache}))
        assert cache.get_seq_length() == 31
        if name == arg:
            assert not [x for x in w if "past_key_values" in str(x.message)]
    assert all(torch.equal(outs[0], o) for o in outs)


def test_warns_once_only_when_a_model_attends_another_way():
    """attention="auto": a cache bound to a model whose attention is not kvq's (the user set it back to SDPA
    after make_cache) warns once that the model gets a dequantized copy; a cache from a bare config that no
    model has bound (update called directly) and a model attending through kvq do not warn."""
    import warnings
    model = tiny()
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    assert getattr(cfg, "_attn_implementation", None) is None
    k = torch.randn(1, 2, 3, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bare = make_cache("KIVI-K2V2", cfg, max_tokens=64)
        K, _ = bare.update(k, k, 0)                                  # standalone: the dequantized cache, silently
        assert K.shape == (1, 2, 3, 32) and not bare.fused
        cache = make_cache("KIVI-K2V2", model, max_tokens=64)        # make_cache sets kvq attention
        assert cache.fused
    model.set_attn_implementation("sdpa")
    with pytest.warns(UserWarning, match="attends with 'sdpa'"):
        assert not cache.fused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cache.fused                                       # once per cache


def test_attn_implementation_reads_what_the_config_says():
    """``attn_implementation`` (the fast read behind ``KVQCache.fused``) equals ``config._attn_implementation``
    before any model binds the config, after ``set_attn_implementation`` to kvq and back to SDPA, and for an
    object that keeps no ``__dict__`` entry (the attribute, or None)."""
    from types import SimpleNamespace

    from kvq.integrations.transformers import attn_implementation
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    assert attn_implementation(cfg) == getattr(cfg, "_attn_implementation", None)
    model = tiny()
    make_cache("KIVI-K2V2", model, max_tokens=64)
    assert attn_implementation(model.config) == model.config._attn_implementation == A.ATTN_IMPLEMENTATION
    model.set_attn_implementation("sdpa")
    assert attn_implementation(model.config) == model.config._attn_implementation == "sdpa"
    assert attn_implementation(SimpleNamespace(_attn_implementation="eager")) == "eager"
    assert attn_implementation(object()) is None


def test_fused_update_tags_a_view_of_the_keys():
    """With kvq attention, ``update`` returns the new keys as a tagged view (the caller's tensor carries no
    tag, the data is the caller's) and the new values as they are; the tag names the cache, the layer and
    the tokens cached before."""
    model = tiny(head_dim=64)
    cache = make_cache("KIVI-K2V2", model, max_tokens=64)
    k, v = torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)
    kk, vv = cache.update(k, v, 0)
    assert kk is not k and not hasattr(k, "_kvq") and kk.data_ptr() == k.data_ptr() and torch.equal(kk, k)
    assert kk._kvq == (cache, 0, 0)
    assert vv is v and not hasattr(v, "_kvq")
    k2 = torch.randn(1, 2, 1, 64)
    kk2, _ = cache.update(k2, k2.clone(), 0)
    assert kk2._kvq == (cache, 0, 5)
