"""``kvq.integrations.capture``: post-RoPE Q, K, V of real transformers models (tiny, built from configs).

Captured K / V equal what a ``DynamicCache`` stores; captured Q is post-RoPE (attention recomputed from
the captured q, k, v with GQA reproduces the layer's attention output, and q equals RoPE applied to the
q projection); BERT's K equals ``module.key(x)``; the model's attention implementation is restored after
a capture, also after an exception.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvq.integrations.capture import (CAPTURE_IMPLEMENTATIONS, capture_implementation, capture_qkv,  # noqa: E402
                                      collect_calibration)
from kvq.reference.model import apply_rope  # noqa: E402

SMALL = dict(vocab_size=97, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128)


def _decoder(family: str, attn: str = "sdpa"):
    torch.manual_seed(0)
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                          "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]
    cfg = cfg_cls(**SMALL, attn_implementation=attn)
    return model_cls(cfg).eval()


def _ids(B=2, T=12, seed=0):
    return torch.as_tensor(np.random.default_rng(seed).integers(0, 97, (B, T)))


@pytest.fixture(scope="module")
def llama():
    return _decoder("llama")


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_kv_equal_the_dynamic_cache(family, attn):
    model = _decoder(family, attn)
    ids = _ids()
    recs = capture_qkv(model, ids)
    assert model.config._attn_implementation == attn
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    assert isinstance(cache, transformers.DynamicCache) and len(recs) == 3
    for l, r in enumerate(recs):
        assert r["layer"] == l and r["scaling"] == pytest.approx(32 ** -0.5)
        assert r["q"].shape == (2, 4, 12, 32) and r["k"].shape == r["v"].shape == (2, 2, 12, 32)
        assert r["q"].dtype == r["k"].dtype == r["v"].dtype == np.float32
        assert np.array_equal(r["k"], cache.layers[l].keys.numpy())
        assert np.array_equal(r["v"], cache.layers[l].values.numpy())


def test_q_is_post_rope_and_reproduces_the_attention_output(llama):
    ids = _ids(B=2, T=10, seed=1)
    attn0 = llama.model.layers[0].self_attn
    seen = {}
    h1 = attn0.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o_in", a[0].detach().clone()))
    h2 = attn0.register_forward_pre_hook(
        lambda m, a, kw: seen.__setitem__("x", (a[0] if a else kw["hidden_states"]).detach().clone()),
        with_kwargs=True)
    try:
        with torch.no_grad():
            llama(ids, use_cache=False)
    finally:
        h1.remove()
        h2.remove()
    r = capture_qkv(llama, ids, layers=[0])[0]
    q, k, v = (torch.from_numpy(r[n]).double() for n in ("q", "k", "v"))
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)       # GQA: 4 query heads on 2 KV heads
    T = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * r["scaling"]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = (s.softmax(-1) @ v).transpose(1, 2).reshape(2, T, 4 * 32)              # (B, T, H_q * D)
    np.testing.assert_allclose(out.numpy(), seen["o_in"].double().numpy(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():                                                        # q = RoPE(q_proj(x))
        q_pre = attn0.q_proj(seen["x"]).view(2, T, 4, 32).transpose(1, 2).numpy()
    np.testing.assert_allclose(r["q"], apply_rope(q_pre, np.arange(T), 10000.0), rtol=1e-5, atol=1e-5)
    assert not np.allclose(r["q"][:, :, 1:], q_pre[:, :, 1:], atol=1e-3)          # RoPE did rotate it


def test_capture_leaves_the_model_output_unchanged(llama):
    ids = _ids()
    with torch.no_grad():
        ref = llama(ids, use_cache=False).logits
        with capture_implementation(llama):
            assert llama.config._attn_implementation == CAPTURE_IMPLEMENTATIONS["sdpa"]
            got = llama(ids, use_cache=False).logits
    assert torch.equal(ref, got) and llama.config._attn_implementation == "sdpa"


def test_padding_mask_and_layer_subset(llama):
    ids = _ids(B=2, T=8)
    full = capture_qkv(llama, ids)
    ones = capture_qkv(llama, ids, attention_mask=torch.ones_like(ids))
    assert all(np.array_equal(a[n], b[n]) for a, b in zip(full, ones) for n in ("q", "k", "v"))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                                           # left padding of the second sequence
    padded = capture_qkv(llama, ids, attention_mask=mask)
    assert np.array_equal(padded[0]["k"][0], full[0]["k"][0])       # unpadded row: same keys
    assert not np.allclose(padded[2]["k"][1, :, 3:], full[2]["k"][1, :, 3:])  # the mask reached attention
    sub = capture_qkv(llama, ids, layers=[2, 0], keep=("k",))
    assert [r["layer"] for r in sub] == [0, 2] and set(sub[0]) == {"k", "layer", "scaling"}
    assert np.array_equal(sub[1]["k"], full[2]["k"])
    with pytest.raises(ValueError, match="attention_mask has shape"):
        capture_qkv(llama, ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(TypeError, match="integer token ids"):
        capture_qkv(llama, ids.float())
    with pytest.raises(ValueError, match="keep"):
        capture_qkv(llama, ids, keep=("x",))


def test_implementation_restored_after_an_exception(llama, monkeypatch):
    mlp = llama.model.layers[1].mlp

    def boom(*a, **k):
        raise RuntimeError("boom in layer 1")

    monkeypatch.setattr(mlp, "forward", boom)
    with pytest.raises(RuntimeError, match="boom in layer 1"):
        capture_qkv(llama, _ids())
    assert llama.config._attn_implementation == "sdpa"
    recs = capture_qkv(llama, _ids(), layers=[0])            # stops after layer 0: never reaches the broken MLP
    assert len(recs) == 1 and recs[0]["layer"] == 0
    monkeypatch.undo()
    with torch.no_grad():
        llama(_ids(), use_cache=False)                      # an ordinary forward still works, nothing recorded


def test_bert_keys_equal_module_key():
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ids = _ids(B=2, T=9)
    sa = model.encoder.layer[1].attention.self
    seen = {}
    h = sa.register_forward_pre_hook(
        lambda m, a, kw: seen.__setitem__("x", (a[0] if a else kw["hidden_states"]).detach().clone()),
        with_kwargs=True)
    try:
        recs = capture_qkv(model, ids)
    finally:
        h.remove()
    assert len(recs) == 2 and model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        for name, proj in (("k", sa.key), ("v", sa.value), ("q", sa.query)):
            want = proj(seen["x"]).view(2, 9, 4, 16).transpose(1, 2).numpy()
            assert np.array_equal(recs[1][name], want), name


def test_collect_calibration_concatenates_batches(llama):
    batches = [_ids(B=2, T=8, seed=s).numpy() for s in range(3)]
    layers = collect_calibration(llama, batches, progress=False)
    assert len(layers) == 3 and layers[1]["q"].shape == (6, 4, 8, 32) and layers[1]["k"].shape == (6, 2, 8, 32)
    second = capture_qkv(llama, batches[1])
    assert np.array_equal(layers[2]["v"][2:4], second[2]["v"])
    one_d = collect_calibration(llama, [batches[0][0]], progress=False, keep=("k",))
    assert one_d[0]["k"].shape == (1, 2, 8, 32) and "q" not in one_d[0]
    with pytest.raises(ValueError, match="share one sequence length"):
        collect_calibration(llama, [batches[0], _ids(B=1, T=5)], progress=False)
    with pytest.raises(ValueError, match="token_batches is empty"):
        collect_calibration(llama, [], progress=False)
