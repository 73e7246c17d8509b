"""``kvq calibrate`` on an encoder (issue 40): OSCAR's value target C_S = (SV)^T (SV) / N is computed with
the attention the model computes, decided from the model (``kvq.integrations.models.is_causal``):
bidirectional for a BERT-like encoder such as MiniLM, causal for a causal LM. Small config models, no
downloads; the command runs on the packaged MiniLM."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvq import calibration as cf  # noqa: E402
from kvq.commands.calibrate import calibrate_oscar_model  # noqa: E402
from kvq.integrations.capture import collect_calibration  # noqa: E402
from kvq.reference import oscar  # noqa: E402
from kvq.reference.rotations import target_covariances  # noqa: E402


@pytest.fixture(scope="module")
def bert():
    """A 2-layer BERT encoder from a config (random weights), and two batches of ids."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=64)).eval()
    rng = np.random.default_rng(0)
    return model, [rng.integers(0, 64, (2, 24)) for _ in range(2)]


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaForCausalLM

    from kvq.integrations.models import tiny_llama_config
    torch.manual_seed(0)
    cfg = tiny_llama_config(hidden_size=64, head_dim=32, num_attention_heads=2, num_key_value_heads=1,
                            num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64)
    rng = np.random.default_rng(1)
    return LlamaForCausalLM(cfg).eval(), [rng.integers(0, 256, (2, 24)) for _ in range(2)]


def _direct(model, batches, causal):
    """Each layer's eigenvalues of C_Q and C_S computed on all batches at once, with the given mask."""
    layers = collect_calibration(model, batches, progress=False)
    out = []
    for r in layers:
        cov = target_covariances(r["q"], r["k"], r["v"], scale=r["scaling"], causal=causal)
        out.append(oscar.calibrate(r["q"], r["k"], r["v"], scale=r["scaling"], targets=cov))
    return out


def test_an_encoder_is_calibrated_with_bidirectional_attention(bert):
    model, batches = bert
    default = calibrate_oscar_model(model, batches, progress=False)
    bidir, causal = _direct(model, batches, causal=False), _direct(model, batches, causal=True)
    for c, b, m in zip(default, bidir, causal):
        np.testing.assert_allclose(c.lam_V, b.lam_V, rtol=1e-9, atol=1e-12)    # C_S without a mask
        assert not np.allclose(c.lam_V, m.lam_V, rtol=1e-3)                      # not the causal one
        np.testing.assert_allclose(c.lam_K, b.lam_K, rtol=1e-9, atol=1e-12)    # C_Q has no mask
    forced = calibrate_oscar_model(model, batches, causal=True, progress=False)  # the caller may force it
    for c, m in zip(forced, causal):
        np.testing.assert_allclose(c.lam_V, m.lam_V, rtol=1e-9, atol=1e-12)


def test_a_causal_lm_is_calibrated_with_the_causal_mask(llama):
    model, batches = llama
    default = calibrate_oscar_model(model, batches, progress=False)
    for c, m in zip(default, _direct(model, batches, causal=True)):
        np.testing.assert_allclose(c.lam_V, m.lam_V, rtol=1e-9, atol=1e-12)
    with pytest.raises(TypeError, match="causal must be None"):
        calibrate_oscar_model(model, batches, causal="yes", progress=False)


def test_kvq_calibrate_oscar_on_minilm_records_bidirectional(tmp_path, capsys):
    from kvq.cli import main

    out = tmp_path / "minilm.oscar.safetensors"
    rc = main(["calibrate", "oscar", "--model", "minilm", "--out", str(out), "--tokens", "256", "--seq-len", "128",
               "--device", "cpu", "--quiet", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["causal"] is False and summary["model_shape"]["model_type"] == "bert"
    meta = cf.inspect(out)
    assert meta["config"]["causal"] is False
