"""Per-layer devices (issue 37, item 5): a model spread over several GPUs keeps each layer's state on that
layer's device. On the CPU there is one device, so these tests cover the plumbing (the per-layer list
accepted and validated, a layer's tokens from the wrong device refused with the cache unchanged, both CPU
backends with an explicit list); the GPU test splits a small Llama over cuda:0 / cuda:1."""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvq.integrations import methods as M  # noqa: E402
from kvq.integrations.transformers import hf_layer_devices, make_cache  # noqa: E402

from .small import SMALL  # noqa: E402

B, H, D, L = 1, 2, 64, 3
PER_LAYER = ["KIVI-K2V2", "Kitty", "OSCAR", "BitDecoding-4", "FP16"]


def _store(name, backend="reference", device=None, n_layers=L, **kw):
    cal = "identity" if M.METHODS[name].calibration else None
    return M.KVStore(name, n_layers=n_layers, batch=B, kv_heads=H, head_dim=D, max_tokens=64, backend=backend,
                     device=device, calibration=cal, **{**SMALL[name], **kw})


def _tokens(T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((B, H, T, D), generator=g), torch.randn((B, H, T, D), generator=g)


def _feed(store, steps=((40, 0), (1, 1), (1, 2))):
    for T, seed in steps:
        for l in range(store.n_layers):
            store.append(l, *_tokens(T, 10 * seed + l))


def test_device_forms_are_accepted():
    cpu = torch.device("cpu")
    for device in ("cpu", cpu, ["cpu"] * L, ("cpu", cpu, "cpu")):
        store = _store("KIVI-K2V2", device=device)
        assert store.devices == (cpu,) * L and store.device == cpu
    assert _store("KIVI-K2V2").devices == (cpu,) * L                         # default: the CPU for the reference


@pytest.mark.parametrize("device, err, match", [
    (["cpu"] * (L - 1), ValueError, r"device has 2 entries; pass one device, or one per layer \(3 layers\)"),
    (["cpu"] * (L + 1), ValueError, r"device has 4 entries"),
    (["cpu", None, "cpu"], TypeError, r"device\[1\] must be a torch.device"),
    (["cpu", 1.5, "cpu"], TypeError, r"device\[1\] must be a torch.device"),
    (["cpu", "cpu", "not-a-device"], ValueError, r"device\[2\]='not-a-device' is not a torch device"),
    ("not-a-device", ValueError, r"device='not-a-device' is not a torch device"),
    (True, TypeError, r"device must be None, a torch.device"),
    ({0: "cpu"}, TypeError, r"device must be None, a torch.device"),
])
def test_bad_device_lists_are_refused(device, err, match):
    with pytest.raises(err, match=match):
        _store("KIVI-K2V2", device=device)


def test_fast_backend_names_the_layer_that_is_not_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("checks CUDA device lists (without a GPU the interpreter keeps every layer on the CPU)")
    with pytest.raises(ValueError, match=r"needs a CUDA device, got device\[1\]=cpu"):
        _store("KIVI-K2V2", backend="triton", device=["cuda:0", "cpu", "cuda:0"])


def test_aqua_refuses_layers_on_several_devices_before_any_state():
    _store("AQUA-KV", device=["cpu"] * L)                                   # one distinct device: fine
    with pytest.raises(ValueError, match="AQUA-KV keeps every layer in one cross-layer state"):
        _store("AQUA-KV", device=["cpu", "cuda:1", "cpu"])


@pytest.mark.parametrize("name", PER_LAYER)
def test_explicit_cpu_list_equals_the_default(name):
    """The reference with a per-layer list of CPU devices gives exactly the store without one."""
    a, b = _store(name), _store(name, device=["cpu"] * L)
    _feed(a), _feed(b)
    for l in range(L):
        for x, y in zip(a.keys_values(l), b.keys_values(l)):
            assert x.device.type == "cpu" and torch.equal(x, y)


@pytest.mark.parametrize("name", ["KIVI-K2V2", "OSCAR", "BitDecoding-4"])
def test_triton_interpreter_with_a_per_layer_list(triton_device, name):
    """Triton (interpreter on the CPU) with an explicit list: the same state and decode as without one."""
    from kvq.integrations.attention import decode

    devs = [triton_device] * L
    a, b = _store(name, backend="triton", device=triton_device), _store(name, backend="triton", device=devs)
    _feed(a, ((20, 0), (1, 1))), _feed(b, ((20, 0), (1, 1)))
    q = torch.randn((B, 2 * H, 1, D), generator=torch.Generator().manual_seed(5)).to(a.device)
    for l in range(L):
        for n, arr in a.state_arrays(l).items():
            np.testing.assert_array_equal(arr, b.state_arrays(l)[n])
        for t in b.state(l).arrays().values():
            if isinstance(t, torch.Tensor):
                assert t.device == b.devices[l]
        assert torch.equal(decode(a, l, q), decode(b, l, q))


def _tiny(n_layers=2, head_dim=64):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128,
                                      num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=head_dim, max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_hf_layer_devices_reads_the_device_map():
    model = _tiny(n_layers=4)
    assert hf_layer_devices(model, 4) is None                                  # no device map
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0,
                           "model.layers.2": 1, "model.layers.3.self_attn": "cuda:1", "model.layers.3.mlp": 0,
                           "model.norm": 1, "lm_head": 1}
    assert [str(d) for d in hf_layer_devices(model, 4)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    model.hf_device_map = {"": "cpu"}                                          # everything on one device
    assert hf_layer_devices(model, 4) == ["cpu"] * 4
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "lm_head": 1}
    with pytest.raises(ValueError, match="names no device for decoder layer 1"):
        hf_layer_devices(model, 4)


def test_same_device_reads_an_unindexed_device_by_its_keyword():
    """``methods.same_device``, the one device comparison of the store and the HF cache (an unindexed "cuda"
    matches any CUDA index) and of the CUDA-graph decode (an unindexed "cuda" is cuda:0)."""
    cuda, cuda0, cuda1, cpu = (torch.device(d) for d in ("cuda", "cuda:0", "cuda:1", "cpu"))
    # "any" (the default): an unindexed device matches every index of its type
    assert M.same_device(cuda, cuda1) and M.same_device(cuda1, cuda) and M.same_device(cuda, cuda0)
    assert M.same_device("cuda", "cuda:1", unindexed="any")
    # "zero": an unindexed device is index 0
    assert M.same_device(cuda, cuda0, unindexed="zero") and M.same_device("cuda:0", "cuda", unindexed="zero")
    assert not M.same_device(cuda, cuda1, unindexed="zero") and not M.same_device(cuda1, cuda, unindexed="zero")
    # either way: two indices compare, and devices of different types never match
    for unindexed in M.UNINDEXED:
        assert M.same_device(cuda1, "cuda:1", unindexed=unindexed) and M.same_device("cpu", cpu, unindexed=unindexed)
        assert not M.same_device(cuda0, cuda1, unindexed=unindexed)
        assert not M.same_device(cpu, cuda, unindexed=unindexed) and not M.same_device(cpu, cuda0, unindexed=unindexed)
    with pytest.raises(ValueError, match=r"unindexed must be one of \('any', 'zero'\), got 'first'"):
        M.same_device(cuda, cuda0, unindexed="first")


def test_cache_refuses_a_layer_on_another_device_and_stays_unchanged():
    """A layer's states arriving on a device other than its state's: ValueError before the cache changes
    (on the CPU: the device map puts layer 1 on cuda:1 and the model hands it CPU tensors)."""
    model = _tiny()
    model.hf_device_map = {"model.layers.0": "cpu", "model.layers.1": "cuda:1"}
    cache = make_cache("KIVI-K2V2", model, backend="reference", **SMALL["KIVI-K2V2"])
    assert [str(d) for d in cache._layer_devices] == ["cpu", "cuda:1"]
    k, v = _tokens(5, 0)
    cache.update(k, v, 0)
    before = {n: a.copy() for n, a in cache.store.state_arrays(1).items()}
    with pytest.raises(ValueError, match=r"key_states of layer 1 are on cpu; this cache keeps layer 1 on cuda:1"):
        cache.update(k, v, 1)
    assert cache.store.length(1) == 0 and cache.store.length(0) == 5
    for n, a in cache.store.state_arrays(1).items():
        np.testing.assert_array_equal(a, before[n])
    with pytest.raises(ValueError, match="AQUA-KV keeps every layer in one cross-layer state"):
        make_cache("AQUA-KV", model, calibration="identity")


def test_cache_device_argument():
    model = _tiny()
    cache = make_cache("Kitty", model, device=["cpu", "cpu"], **SMALL["Kitty"])
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    assert cache.store.devices == (torch.device("cpu"),) * 2
    with pytest.raises(ValueError, match="device has 3 entries"):
        make_cache("Kitty", model, device=["cpu"] * 3)


def _to(x, dev):
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(y, dev) for y in x)
    return x


def _split(model, device_map):
    """``model`` spread as ``from_pretrained(device_map=...)`` spreads it (accelerate's hooks, written out:
    each listed module on its device, its tensor inputs moved there), with ``hf_device_map`` set."""
    for key, dev in device_map.items():
        module = model.get_submodule(key)
        target = torch.device("cuda", dev)
        module.to(target)
        module.register_forward_pre_hook(
            lambda m, args, kwargs, _d=target: (_to(args, _d), {k: _to(v, _d) for k, v in kwargs.items()}),
            with_kwargs=True)
    first = torch.device("cuda", device_map["model.embed_tokens"])
    model.lm_head.register_forward_hook(lambda m, args, out: out.to(first))   # logits back where the ids are
    model.hf_device_map = dict(device_map)
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["KIVI-K2V2", "Kitty", "OSCAR", "BitDecoding-2", "FP16"])
def test_model_split_over_two_gpus(name):
    """A small Llama split over cuda:0 / cuda:1 with a kvq cache generates what the same model on one GPU
    generates, and each layer's state lives on its layer's device."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")

    n = 4
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    kw = dict(calibration="identity" if M.METHODS[name].calibration else None, **SMALL[name])
    kw = {k: v for k, v in kw.items() if v is not None}

    one = _tiny(n_layers=n).half().to("cuda:0")
    cache1 = make_cache(name, one, **kw)
    with torch.no_grad():
        ref = one.generate(ids.to("cuda:0"), past_key_values=cache1, max_new_tokens=16, do_sample=False)

    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    split = _split(_tiny(n_layers=n).half(), device_map)
    cache2 = make_cache(name, split, **kw)
    with torch.no_grad():
        out = split.generate(ids.to("cuda:0"), past_key_values=cache2, max_new_tokens=16, do_sample=False)
    assert torch.equal(out.cpu(), ref.cpu())
    want = [torch.device("cuda", 0)] * 2 + [torch.device("cuda", 1)] * 2
    assert cache2.store.devices == tuple(want)
    for l in range(n):
        st = cache2.store.state(l)
        tensors = st if isinstance(st, tuple) else [t for t in st.arrays().values() if isinstance(t, torch.Tensor)]
        assert tensors and all(t.device == want[l] for t in tensors), l
