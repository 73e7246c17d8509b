"""Capacity follows use (issue 37, item 4): a store made with ``grow=True`` reallocates its states as tokens
arrive (doubling, pages copied) and holds exactly what a store preallocated for the whole length holds; the
HF caches grow by default, so a short prompt allocates little and a generation never fails for a length the
model supports. A rejected append leaves a grown store as it was."""

import numpy as np
import pytest
import torch

from kvq.integrations import methods as M

from .small import SMALL

QUANTIZED = [n for n, s in M.METHODS.items() if s.family != "fp16"]
#: appends of a model's life: a prompt, single decode tokens, a long chunk that forces two doublings at once
STEPS = (40, 1, 30, 50, 1, 1, 120, 7)


def _store(name, backend, max_tokens, device=None, **kw):
    cal = "identity" if M.METHODS[name].family in ("oscar", "aqua") else None
    return M.KVStore(name, n_layers=2, batch=1, kv_heads=2, head_dim=64, max_tokens=max_tokens, backend=backend,
                     calibration=cal, device=device, **kw)


def _feed(stores, steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    for T in steps:
        k = rng.standard_normal((1, 2, T, 64)).astype(np.float32)
        v = rng.standard_normal((1, 2, T, 64)).astype(np.float32)
        for layer in range(2):
            for s in stores:
                s.append(layer, k, v)


def _same_contents(a, b):
    for layer in range(2):
        Ka, Va = a.keys_values(layer)
        Kb, Vb = b.keys_values(layer)
        assert torch.equal(Ka, Kb) and torch.equal(Va, Vb), layer


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_growing_store_holds_what_a_preallocated_one_holds(name):
    grown, fixed = _store(name, "reference", 64, grow=True), _store(name, "reference", 1024)
    _feed([grown, fixed])
    # lengths 40, 41, 71 (> 64: doubled to 128), 121, 122, 123, 243 (> 128: max(243, 256)), 250
    assert grown.growths == 2 and grown.max_tokens == 256
    assert grown.length(0) == fixed.length(0) == sum(STEPS) == 250
    assert grown.cfg.max_tokens == grown.max_tokens and grown.state(0).cfg == grown.cfg
    _same_contents(grown, fixed)
    assert grown.allocated_bytes() < fixed.allocated_bytes()


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_growing_triton_store_holds_what_a_preallocated_one_holds(name, triton_device):
    grown = _store(name, "triton", 32, device=triton_device, grow=True)
    fixed = _store(name, "triton", 256, device=triton_device)
    _feed([grown, fixed], steps=(20, 1, 30, 1, 60))
    assert grown.growths >= 2 and grown.state(1).cfg.max_tokens == grown.max_tokens
    _same_contents(grown, fixed)


def test_growth_doubles_and_stops_at_max_capacity():
    s = _store("KIVI-K2V2", "reference", 64, grow=True, max_capacity=200)
    _feed([s], steps=(64,))
    assert s.growths == 0 and s.max_tokens == 64
    _feed([s], steps=(1,))
    assert s.growths == 1 and s.max_tokens == 128           # doubled, not grown to the 65 needed
    _feed([s], steps=(100,))
    assert s.max_tokens == 200                               # capped at max_capacity
    before = s.state_arrays(0)
    with pytest.raises(ValueError, match="exceeds max_capacity=200 of layer 0"):
        _feed([s], steps=(40,))
    after = s.state_arrays(0)
    assert all(np.array_equal(before[n], after[n]) for n in before) and s.length(0) == 165


def test_a_fixed_store_refuses_beyond_its_capacity():
    s = _store("KIVI-K2V2", "reference", 64)
    _feed([s], steps=(64,))
    with pytest.raises(ValueError, match=r"exceeds the capacity max_tokens=64 of layer 0 \(grow=False\)"):
        _feed([s], steps=(1,))
    assert s.length(0) == 64 and s.growths == 0


def test_a_rejected_append_that_would_grow_leaves_the_store_as_it_was():
    s = _store("Kitty", "reference", 64, grow=True)
    _feed([s], steps=(60,))
    cfg, cap, before = s.cfg, s.max_tokens, s.state_arrays(0)
    k = np.random.default_rng(3).standard_normal((1, 2, 10, 64)).astype(np.float32)
    k[0, 1, 7, 5] = np.nan                                   # refused by the method's append, after the growth
    with pytest.raises(ValueError, match="k"):
        s.append(0, k, k.copy())
    after = s.state_arrays(0)
    assert s.cfg is cfg and s.max_tokens == cap and s.growths == 0 and s.state(0).cfg is cfg
    assert before.keys() == after.keys() and all(np.array_equal(before[n], after[n]) for n in before)
    _feed([s], steps=(10,))                                  # and a good append afterwards grows it
    assert s.growths == 1 and s.length(0) == 70


def test_aqua_grows_at_its_commit():
    grown, fixed = _store("AQUA-KV-uniform", "reference", 32, grow=True), _store("AQUA-KV-uniform", "reference", 512)
    _feed([grown, fixed], steps=(40, 1, 100))
    assert grown.growths >= 2
    _same_contents(grown, fixed)


@pytest.mark.parametrize("bad, err, match", [
    (dict(grow=1), TypeError, "grow must be True or False"),
    (dict(grow=True, max_capacity=0), ValueError, "max_capacity must be a positive int"),
    (dict(grow=True, max_capacity=32), ValueError, "max_capacity=32 is below max_tokens=64"),
])
def test_growth_arguments_are_checked(bad, err, match):
    with pytest.raises(err, match=match):
        _store("KIVI-K2V2", "reference", 64, **bad)


# ---------------------------------------------------------------------------------------------------
# the HF caches: grow by default, fixed with max_tokens

transformers = pytest.importorskip("transformers")
from kvq.integrations.transformers import DEFAULT_MAX_TOKENS, make_cache  # noqa: E402

from .test_transformers_caches import prompt, tiny  # noqa: E402


def test_an_hf_cache_grows_past_its_initial_capacity_during_generate():
    model = tiny()                                            # max_position_embeddings 512
    cache = make_cache("KIVI-K2V2", model, **SMALL["KIVI-K2V2"])
    assert cache.grow and cache.get_max_cache_shape() == -1 and cache.allocated_bytes() == 0
    with torch.no_grad():
        model.generate(prompt(DEFAULT_MAX_TOKENS - 6), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                       past_key_values=cache)
    store = cache.store
    assert store.length(0) == DEFAULT_MAX_TOKENS + 13 and store.growths == 1
    assert store.max_tokens == 2 * DEFAULT_MAX_TOKENS and store.max_capacity == 512


def test_a_short_prompt_allocates_in_proportion():
    model = tiny()
    grown = make_cache("KIVI-K2V2", model, **SMALL["KIVI-K2V2"])
    fixed = make_cache("KIVI-K2V2", model, max_tokens=512, **SMALL["KIVI-K2V2"])
    with torch.no_grad():
        model(prompt(30), past_key_values=grown)
        model(prompt(30), past_key_values=fixed)
    assert grown.memory_bytes() == fixed.memory_bytes() > 0
    assert 0 < grown.allocated_bytes() < fixed.allocated_bytes() / 1.5
    assert fixed.get_max_cache_shape() == 512 and not fixed.grow


def test_a_fixed_hf_cache_refuses_beyond_max_tokens():
    model = tiny()
    cache = make_cache("KIVI-K2V2", model, max_tokens=40, **SMALL["KIVI-K2V2"])
    with torch.no_grad():
        model(prompt(36), past_key_values=cache)
        with pytest.raises(ValueError, match="exceeds the capacity max_tokens=40"):
            model(prompt(8), past_key_values=cache)
    assert cache.get_seq_length() == 36


# ---------------------------------------------------------------------------------------------------
# validate=False: no value scan on the fast backends (a model's step never waits on the GPU)


def test_validate_false_skips_the_fast_value_scan(triton_device):
    k = np.random.default_rng(4).standard_normal((1, 2, 5, 64)).astype(np.float32)
    k[0, 0, 2, 3] = np.nan
    checked = _store("KIVI-K2V2", "triton", 64, device=triton_device)
    with pytest.raises(ValueError, match="k contains non-finite values"):
        checked.append(0, k, np.zeros_like(k))
    assert checked.length(0) == 0
    free = _store("KIVI-K2V2", "triton", 64, device=triton_device, validate=False)
    free.append(0, k, np.zeros_like(k))                      # accepted: the token sits in the FP16 buffer
    assert free.length(0) == 5 and bool(torch.isnan(free.keys_values(0)[0]).any())
    from kvq.fast import validation_enabled
    assert validation_enabled()                              # the store turned it off for its call only


def _nan_key(T, seed=5):
    k = np.random.default_rng(seed).standard_normal((1, 2, T, 64)).astype(np.float32)
    k[0, 1, T - 1, 7] = np.nan
    return k


@pytest.mark.parametrize("name", ["FP16", "AQUA-KV"])
def test_validate_false_skips_the_fp16_and_aqua_scans(name, triton_device):
    """FP16's tokens and AQUA-KV's waiting tokens are torch tensors on the store's device, rounded to 16 bits by
    the store itself: validate=True refuses a NaN key with the store unchanged; validate=False rounds it
    without reading it on the host (a scan of a CUDA tensor waits for the GPU), and the NaN is kept."""
    k = _nan_key(24)
    v = np.zeros_like(k)
    checked = _store(name, "triton", 64, device=triton_device, **SMALL[name])
    with pytest.raises(ValueError, match="contains NaN or inf"):
        checked.append(0, k, v)
    assert checked.length(0) == 0
    free = _store(name, "triton", 64, device=triton_device, validate=False, **SMALL[name])
    for layer in range(2):                                   # AQUA-KV: the second layer's append commits both
        free.append(layer, k, v)
    assert free.length(0) == free.length(1) == 24
    assert bool(torch.isnan(free.keys_values(0)[0]).any())


def test_validate_false_skips_aquas_pre_rope_range_check(triton_device):
    """AQUA-KV quantizes keys pre-RoPE: fp16 keys near 6e4 leave fp16's range undone from RoPE. validate=True
    refuses them at the layer's own append (a device read of the keys' largest magnitude; layer 1, whose
    uniform backbone's fp16 minimum overflows); validate=False makes no such read, and the commit compresses
    what the backbone makes of them (no error, nothing finite promised)."""
    big = np.full((1, 2, 24, 64), 6e4, np.float16)
    big[..., ::2] = -6e4
    good = np.random.default_rng(6).standard_normal((1, 2, 24, 64)).astype(np.float16)
    checked = _store("AQUA-KV-uniform", "triton", 64, device=triton_device, **SMALL["AQUA-KV-uniform"])
    checked.append(0, good, good)
    with pytest.raises(ValueError, match="undone from RoPE"):
        checked.append(1, big, good)
    assert checked.length(1) == 0 and checked.pending(0) == 24
    free = _store("AQUA-KV-uniform", "triton", 64, device=triton_device, validate=False,
                  **SMALL["AQUA-KV-uniform"])
    free.append(0, good, good)
    free.append(1, big, good)                                # accepted, and it completes the commit
    assert free.length(0) == free.length(1) == 24 and free.pending(0) == free.pending(1) == 0


def test_validate_is_checked_and_reaches_the_store():
    with pytest.raises(TypeError, match="validate must be True or False"):
        _store("KIVI-K2V2", "reference", 64, validate="no")
    model = tiny()
    with pytest.raises(TypeError, match="validate must be True or False"):
        make_cache("KIVI-K2V2", model, validate=0)
    cache = make_cache("KIVI-K2V2", model, validate=False, **SMALL["KIVI-K2V2"])
    with torch.no_grad():
        model(prompt(10), past_key_values=cache)
    assert cache.store.validate is False


def test_validate_default_scans_only_off_the_gpu():
    """make_cache's default (validate=None): the store scans appended tokens where that costs no GPU
    synchronization (a CPU store: NaN refused, the cache unchanged) and not on a CUDA device; True / False
    override it either way."""
    model = tiny()
    cache = make_cache("KIVI-K2V2", model, **SMALL["KIVI-K2V2"])
    assert cache.validate is None
    with torch.no_grad():
        model(prompt(10), past_key_values=cache)
    assert cache.store.validate is True
    k = torch.randn((1, 2, 1, 32))
    k[0, 1, 0, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cache.update(k, torch.zeros_like(k), 0)
    assert cache.get_seq_length() == 10
    for want in (True, False):
        c = make_cache("KIVI-K2V2", model, validate=want, **SMALL["KIVI-K2V2"])
        with torch.no_grad():
            model(prompt(10), past_key_values=c)
        assert c.store.validate is want


@pytest.mark.gpu
def test_validate_default_is_off_on_cuda():
    """On a CUDA device the default store makes no scan (a decode step never waits on the GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny()
    g = make_cache("KIVI-K2V2", model, **SMALL["KIVI-K2V2"])
    g.update(torch.randn((1, 2, 3, 32), device="cuda"), torch.randn((1, 2, 3, 32), device="cuda"), 0)
    assert g.store.validate is False and g.get_seq_length() == 3


def test_a_growing_cache_of_a_sliding_window_model_stops_at_the_window():
    """Mistral-style models (sliding window 4096 of 32K positions, say): the default cache grows up to the
    window, where kvq's whole-cache attention still equals the window's, and refuses a token beyond it."""
    model = tiny("mistral")
    model.config.sliding_window = 300
    cache = make_cache("KIVI-K2V2", model, **SMALL["KIVI-K2V2"])
    assert cache.max_capacity == 300 and cache.max_tokens == DEFAULT_MAX_TOKENS
    with torch.no_grad():
        model(prompt(290), past_key_values=cache)
        assert cache.store.max_tokens == 300                  # grown, capped at the window
        with pytest.raises(ValueError, match="exceeds max_capacity=300"):
            model(prompt(20), past_key_values=cache)
    assert cache.get_seq_length() == 290
