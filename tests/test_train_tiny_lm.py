"""Smoke test of benchmarks/train_tiny_lm.py: a 3-step CPU run, saved, reloaded through load_model.

The reloaded model must be the saved one: its logits equal (bit for bit, same machine) those of a
LlamaForCausalLM built from the saved config with the saved safetensors weights, and match the logits
probe the script wrote into train.json.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvq.integrations.models import ByteTokenizer, attention_geometry, load_model  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_tiny_lm.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_tiny_lm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_lm")
    extra = out / "copy" / "train.json"
    summary = _script().main(["--out", str(out), "--tiny", "--steps", "3", "--seq-len", "64",
                              "--batch", "2", "--device", "cpu", "--json", str(extra)])
    return out, summary, extra


def test_train_json_fields(trained):
    out, summary, extra = trained
    saved = json.loads((out / "train.json").read_text())
    assert json.loads(extra.read_text()) == saved
    for key in ("config", "steps", "tokens_seen", "wall_s", "curve", "final_eval", "final_eval_bits_per_byte",
                "device_name", "torch_version", "commit", "corpus", "probe", "args"):
        assert key in saved, key
    assert saved["steps"] == 3 and saved["tokens_seen"] == 3 * 2 * 64
    assert saved["stop_reason"] == "steps"
    assert [p["step"] for p in saved["curve"]["train"]] == [1, 2, 3]
    assert saved["curve"]["eval"] and all(math.isfinite(p["loss"]) for p in saved["curve"]["eval"])
    fe = saved["final_eval"]
    assert math.isclose(fe["bits_per_byte"], fe["loss"] / math.log(2))
    assert 0 < fe["bits_per_byte"] < 9                 # random init: about log2(257) = 8.0
    assert saved["config"]["kvq_tokenizer"] == "bytes" and saved["config"]["head_dim"] == 128
    assert saved["config"]["num_hidden_layers"] == 2
    assert saved["corpus"]["files"]["eval"] > 0 and saved["commit"]
    assert summary["steps"] == saved["steps"]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_load_model_round_trip(trained):
    out, summary, _ = trained
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tok = load_model(out)
    assert isinstance(tok, ByteTokenizer)
    assert attention_geometry(model) == {"n_layers": 2, "n_heads": 2, "kv_heads": 1, "head_dim": 128,
                                         "rope_theta": 10000.0}
    ids = torch.tensor([tok.encode(summary["probe"]["prompt"])])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 257) and torch.isfinite(logits).all()

    ref = LlamaForCausalLM(LlamaConfig.from_pretrained(out)).eval()        # the saved weights, by hand
    missing, unexpected = ref.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}          # tied to the embeddings
    ref.tie_weights()
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
    assert torch.equal(logits, ref_logits)
    probe = torch.tensor(summary["probe"]["last_logits_head"])
    assert torch.allclose(logits[0, -1, :probe.numel()], probe, rtol=1e-5, atol=1e-5)


def test_bad_options(tmp_path):
    mod = _script()
    with pytest.raises(SystemExit):
        mod.main(["--out", str(tmp_path), "--seq-len", "1"])
    with pytest.raises(SystemExit):
        mod.main(["--out", str(tmp_path), "--steps", "0"])
