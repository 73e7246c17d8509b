"""kvq.evaluation and `kvq eval`: perplexity with the compressed cache maintained, attention-level errors
from captured activations, and the command line around them (CPU, tiny models built from a config)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvq import evaluation as E
from kvq.commands import eval as cmd
from kvq.integrations.capture import capture_qkv

FP16_EPS = 2.0 ** -11          # fp16 unit roundoff


@pytest.fixture(scope="module")
def tiny():
    """A random tiny Llama (GQA 4:2, head_dim 64) in float32, and 2 windows of 256 token ids."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 256))
    return model, ids


def test_no_cache_row_is_the_models_own_loss(tiny):
    """The 'no cache' row's NLL is transformers' own causal-LM loss over the same windows (an independent
    computation: model(..., labels=ids).loss averages the same S - 1 predictions per window)."""
    model, ids = tiny
    res = E.perplexity(model, ids, [], chunk=64, progress=False)
    row = res["rows"][0]
    with torch.no_grad():
        ref = float(model(input_ids=torch.as_tensor(ids), labels=torch.as_tensor(ids)).loss)
    assert row["method"] == "no cache" and res["tokens_scored"] == 2 * 255
    assert row["nll"] == pytest.approx(ref, rel=1e-5)
    assert row["ppl"] == pytest.approx(math.exp(ref), rel=1e-5)
    assert "auto-regressively" in res["protocol"]


def test_fp16_cache_changes_only_rounding_and_2_bits_hurt_more_than_4(tiny):
    """FP16 differs from no cache by fp16 rounding of K / V only: the NLL moves by far less than one
    unit roundoff times the NLL; KIVI-K2V2 moves it more than KIVI-K4V4."""
    model, ids = tiny
    res = E.perplexity(model, ids, ["FP16", "KIVI-K4V4", "KIVI-K2V2"], chunk=64, progress=False,
                       overrides={m: {"residual": 32} for m in ("KIVI-K4V4", "KIVI-K2V2")})
    nll = {r["method"]: r["nll"] for r in res["rows"]}
    assert abs(nll["FP16"] - nll["no cache"]) < FP16_EPS * nll["no cache"]
    d4, d2 = abs(nll["KIVI-K4V4"] - nll["no cache"]), abs(nll["KIVI-K2V2"] - nll["no cache"])
    assert d2 > d4 > abs(nll["FP16"] - nll["no cache"])
    bits = {r["method"]: r["bits_per_element_paper"] for r in res["rows"]}
    assert bits["FP16"] == 16.0 and bits["KIVI-K2V2"] < bits["KIVI-K4V4"] < 16


def test_chunk_size_does_not_matter_for_fp16(tiny):
    """With the FP16 cache a chunk attends to exactly the tokens it would see token by token."""
    model, ids = tiny
    a = E.perplexity(model, ids[:1, :64], ["FP16"], chunk=1, progress=False, no_cache_row=False)["rows"][0]
    b = E.perplexity(model, ids[:1, :64], ["FP16"], chunk=64, progress=False, no_cache_row=False)["rows"][0]
    assert a["nll"] == pytest.approx(b["nll"], rel=1e-5)


def test_perplexity_errors(tiny):
    model, ids = tiny
    with pytest.raises(ValueError, match="windows must be"):
        E.perplexity(model, ids[0], ["FP16"], progress=False)
    with pytest.raises(ValueError, match="chunk must be"):
        E.perplexity(model, ids, ["FP16"], chunk=0, progress=False)
    with pytest.raises(ValueError, match="needs a calibration"):
        E.perplexity(model, ids, ["OSCAR"], progress=False)
    with pytest.raises(ValueError, match="unknown"):
        E.perplexity(model, ids, ["KIVI-K3V3"], progress=False)


def test_windows_from_ids():
    w = E.windows_from_ids(np.arange(10), 4)
    assert w.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert E.windows_from_ids(np.arange(10), 4, max_windows=1).shape == (1, 4)
    with pytest.raises(ValueError, match="fewer than one window"):
        E.windows_from_ids(np.arange(3), 4)


def test_attention_errors_order_and_skips(tiny):
    model, ids = tiny
    layers = capture_qkv(model, torch.as_tensor(ids[:, :256]))       # BitDecoding-2: one N_r = 256 page
    res = E.attention_errors(layers, ["FP16", "KIVI-K4V4", "KIVI-K2V2", "BitDecoding-2"], causal=True,
                             progress=False, overrides={"KIVI-K4V4": {"residual": 32}, "KIVI-K2V2": {"residual": 32}})
    rows = {r["method"]: r for r in res["rows"]}
    assert res["shape"] == {"layers": 2, "batch": 2, "kv_heads": 2, "tokens": 256, "head_dim": 64}
    fp = rows["FP16"]["mean"]
    assert fp["k_rel_mse"] < FP16_EPS ** 2 and fp["v_rel_mse"] < FP16_EPS ** 2    # fp16 rounding only
    for key in ("k_rel_mse", "v_rel_mse", "logit_mse", "attention_kl", "output_mse"):
        assert rows["KIVI-K2V2"]["mean"][key] > rows["KIVI-K4V4"]["mean"][key] > fp[key]
        assert len(rows["KIVI-K2V2"]["layers"]) == 2
    assert rows["BitDecoding-2"]["mean"]["attention_kl"] > fp["attention_kl"]      # D = 64 serves 2 bits


def test_attention_errors_bad_input(tiny):
    model, ids = tiny
    with pytest.raises(ValueError, match="layers is empty"):
        E.attention_errors([], ["FP16"], progress=False)
    layers = capture_qkv(model, torch.as_tensor(ids[:, :32]))
    layers[1] = dict(layers[1], k=layers[1]["k"][:, :, :16])
    with pytest.raises(ValueError, match="layer 1"):
        E.attention_errors(layers, ["FP16"], progress=False)


# ---------------------------------------------------------------------------------------------------
# the command line


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny):
    """The tiny byte-level LM saved as kvq's trainer saves it (so load_model returns a ByteTokenizer)."""
    from kvq.integrations.models import tiny_llama_config
    torch.manual_seed(1)
    m = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=2, hidden_size=128, intermediate_size=256)).eval()
    d = tmp_path_factory.mktemp("tiny-lm")
    m.save_pretrained(d)
    return str(d)


def test_cli_help(capsys):
    from kvq.cli import main
    for argv in (["eval", "--help"], ["eval", "ppl", "--help"], ["eval", "attention", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    assert "perplexity" in capsys.readouterr().out


def test_cli_ppl_json_and_missing_calibration(saved, capsys):
    rc = cmd.main(["ppl", "--model", saved, "--methods", "FP16", "KIVI-K2V2", "--windows", "1", "--seq-len", "160",
                   "--chunk", "80", "--device", "cpu", "--json", "--quiet"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in res["rows"]] == ["no cache", "FP16", "KIVI-K2V2"]
    assert res["text"] == {"source": "stdlib", "split": "eval"} and res["seq_len"] == 160
    assert res["meta"]["model"] == saved and "protocol" in res
    rc = cmd.main(["ppl", "--model", saved, "--methods", "OSCAR", "--windows", "1", "--seq-len", "160",
                   "--device", "cpu", "--quiet"])
    assert rc == 1 and "OSCAR need calibration files" in capsys.readouterr().err


def test_cli_ppl_calibrates_here(saved, capsys, tmp_path):
    out = tmp_path / "ppl.json"
    rc = cmd.main(["ppl", "--model", saved, "--methods", "OSCAR", "AQUA-KV-uniform", "--windows", "1", "--seq-len",
                   "160", "--chunk", "80", "--calibrate", "--calib-tokens", "512", "--calib-seq-len", "256",
                   "--device", "cpu", "--quiet", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["calibrations"]["OSCAR"]["calibrated_here"]["split"] == "train"      # disjoint from "eval"
    assert all(np.isfinite(r["ppl"]) for r in res["rows"])


def test_cli_attention_on_minilm(capsys):
    """The packaged MiniLM (real weights, offline) on real English text."""
    rc = cmd.main(["attention", "--methods", "FP16", "KIVI-K4V4", "BitDecoding-2", "--windows", "1", "--seq-len",
                   "128", "--device", "cpu", "--json", "--quiet"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["geometry"]["head_dim"] == 32 and res["causal"] is False
    rows = {r["method"]: r for r in res["rows"]}
    assert "skipped" in rows["BitDecoding-2"]
    assert rows["KIVI-K4V4"]["mean"]["attention_kl"] > rows["FP16"]["mean"]["attention_kl"]


def test_cli_set_configures_a_method(saved, capsys):
    """--set METHOD:KEY=VALUE reaches the method's cache: a longer KIVI residual keeps more tokens in
    FP16, so its state bits rise; a malformed item is a clear error."""
    assert cmd.parse_sets(["KIVI-K2V2:residual=32", "KIVI-K2V2:sink=4"]) == {"KIVI-K2V2": {"residual": 32, "sink": 4}}
    with pytest.raises(ValueError, match="METHOD:KEY=VALUE"):
        cmd.parse_sets(["KIVI-K2V2residual=32"])
    bits = []
    for r in ("32", "128"):
        assert cmd.main(["ppl", "--model", saved, "--methods", "KIVI-K2V2", "--windows", "1", "--seq-len", "160",
                         "--chunk", "80", "--device", "cpu", "--json", "--quiet",
                         "--set", f"KIVI-K2V2:residual={r}"]) == 0
        bits.append(json.loads(capsys.readouterr().out)["rows"][-1]["bits_per_element"])
    assert bits[0] < bits[1]


def test_perplexity_at_budgets_runs_each_method_at_its_equal_memory_config(tiny):
    """perplexity_at_budgets: per budget, each method at equal_memory_config's choice for the windows' length
    and the model's shape; its row is the perplexity run's with that configuration (same NLL as running it
    directly), with budget, label and overrides added, and the chosen configuration's bits at most the budget."""
    model, ids = tiny
    ids = ids[:1, :128]
    out = E.perplexity_at_budgets(model, ids, ["FP16", "KIVI-K2V2"], budgets=[4.5], chunk=64, progress=False)
    assert [b["budget"] for b in out] == [4.5] and [r["method"] for r in out[0]["rows"]] == ["KIVI-K2V2"]
    row = out[0]["rows"][0]
    want = E.equal_memory_config("KIVI-K2V2", 4.5, context=128, head_dim=64, kv_heads=2, n_layers=2)
    assert row["overrides"] == want["overrides"] and row["label"] == want["label"] and row["budget"] == 4.5
    direct = E.perplexity(model, ids, ["KIVI-K2V2"], chunk=64, progress=False, no_cache_row=False,
                          overrides={"KIVI-K2V2": want["overrides"]})["rows"][0]
    assert row["nll"] == direct["nll"] and want["bits_per_element"] <= 4.5
