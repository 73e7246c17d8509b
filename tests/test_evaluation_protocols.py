"""Issue 40, the parts without a GPU: causal or bidirectional attention metrics according to the model,
methods compared at equal bits per element (``kvq.evaluation.equal_memory_config``), the protocol printed
next to every ``kvq eval`` table, and the amortized flush overhead (``kvq.evaluation.amortized_overhead``)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from kvq import evaluation as E
from kvq.integrations import methods as M
from kvq.reference import metrics, oscar
from kvq.reference import rotations as rot

DIMS = dict(head_dim=128, kv_heads=2, n_layers=6)


def _layer(B=1, H_q=4, H_kv=2, T=64, D=32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H_q, T, D)).astype(np.float32)
    k = (rng.standard_normal((B, H_kv, T, D)) * np.linspace(0.2, 3, D)).astype(np.float32)
    v = rng.standard_normal((B, H_kv, T, D)).astype(np.float32)
    return q, k, v


# ---------------------------------------------------------------------------------------------------
# item 4: causal or bidirectional, following the model


def test_is_causal_follows_the_model_config():
    from transformers import BertConfig, LlamaConfig, LlamaForCausalLM

    from kvq.integrations.models import is_causal, tiny_llama_config
    assert is_causal(LlamaConfig()) is True                              # RoPE decoder
    assert is_causal(tiny_llama_config()) is True
    assert is_causal(BertConfig()) is False                              # MiniLM's family: an encoder
    assert is_causal(BertConfig(is_decoder=True)) is True                # a BERT used as a decoder
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    assert is_causal(tiny) is True

    class Unknown:
        model_type = "mystery"
    with pytest.raises(ValueError, match="pass causal=True"):
        is_causal(Unknown())


def test_error_table_bidirectional_for_an_encoder():
    """causal=False scores the unmasked attention an encoder computes: the KL equals metrics' unmasked KL of
    the same quantized keys, and differs from the causal one (the old, only, behaviour, still the default)."""
    q, k, v = _layer()
    methods = {"naive": oscar.identity_calibration(32)}
    causal = rot.error_table(q, k, v, methods, group_size=16)["naive"]
    assert causal == rot.error_table(q, k, v, methods, group_size=16, causal=True)["naive"]
    bidir = rot.error_table(q, k, v, methods, group_size=16, causal=False)["naive"]
    k_hat = rot.fake_quantize(k, methods["naive"].R_K, 1.0, 16)
    v_hat = rot.fake_quantize(v, methods["naive"].R_V, 1.0, 16)
    assert bidir["attention_kl"] == pytest.approx(metrics.attention_kl(q, k, k_hat, causal=False), rel=1e-12)
    assert bidir["output_mse"] == pytest.approx(metrics.output_mse(q, k, v, k_hat, v_hat, causal=False), rel=1e-12)
    assert bidir["attention_kl"] != pytest.approx(causal["attention_kl"], rel=1e-3)
    for name in ("k_rel_mse", "v_rel_mse", "logit_mse"):                  # no mask in these
        assert bidir[name] == causal[name]
    with pytest.raises(TypeError, match="causal must be True"):
        rot.error_table(q, k, v, methods, group_size=16, causal="no")


def test_target_covariances_bidirectional():
    q, k, v = _layer(seed=1)
    c = rot.target_covariances(q, k, v)
    b = rot.target_covariances(q, k, v, causal=False)
    np.testing.assert_array_equal(c["C_Q"], b["C_Q"])                    # queries do not see the mask
    assert not np.allclose(c["C_S"], b["C_S"])
    with pytest.raises(TypeError, match="causal must be True"):
        rot.target_covariances(q, k, v, causal=1)


# ---------------------------------------------------------------------------------------------------
# item 2: equal memory


@pytest.mark.parametrize("method", [m for m in M.METHODS if m != "FP16"])
@pytest.mark.parametrize("budget", [2.5, 4.5])
@pytest.mark.parametrize("context", [512, 16384])
def test_equal_memory_config_never_exceeds_the_budget(method, budget, context):
    row = E.equal_memory_config(method, budget, context=context, **DIMS)
    if not row["feasible"]:
        assert row["min_bits_per_element"] > budget and "fits" in row["reason"]
        return
    cfg = M.configure(method, head_dim=128, max_tokens=context, kv_heads=2, **row["overrides"])
    bits = M.bits_per_element(method, cfg, context=context, accounting="state", **DIMS)
    assert bits == row["bits_per_element"] <= budget
    assert row["label"] == f"{method} @ <={budget:g} b/e"


def test_equal_memory_config_is_the_closest_below_the_budget():
    """Brute force over the documented search space: no configuration has more bits without exceeding it."""
    context, budget = 4096, 2.5
    row = E.equal_memory_config("KIVI-K2V2*", budget, context=context, **DIMS)
    base = M.configure("KIVI-K2V2*", head_dim=128, max_tokens=context)
    space = E.search_values("kivi", base, context)
    best = 0.0
    for values in itertools.product(*space.values()):
        try:
            cfg = M.configure("KIVI-K2V2*", head_dim=128, max_tokens=context, **dict(zip(space, values)))
        except ValueError:
            continue
        b = M.bits_per_element("KIVI-K2V2*", cfg, context=context, accounting="state", **DIMS)
        if b <= budget:
            best = max(best, b)
    assert row["bits_per_element"] == best
    assert row["overrides"]["sink"] >= 4                                   # a sink method keeps a sink
    assert E.equal_memory_config("KIVI-K2V2", budget, context=context, **DIMS)["overrides"]["sink"] == 0


def test_short_context_gets_a_smaller_window():
    """At 512 tokens the FP16 window is a large share of the cache: the chosen window is smaller than at 16K,
    and smaller than the paper's 128 / 256."""
    short = E.equal_memory_config("KIVI-K2V2", 2.5, context=512, **DIMS)["overrides"]
    long = E.equal_memory_config("KIVI-K2V2", 2.5, context=16384, **DIMS)["overrides"]
    assert short["residual"] < long["residual"] and short["residual"] < 128
    o_short = E.equal_memory_config("OSCAR", 4.5, context=512, **DIMS)["overrides"]
    o_long = E.equal_memory_config("OSCAR", 4.5, context=16384, **DIMS)["overrides"]
    assert o_short["window"] < 256 < o_long["window"]
    # a bigger budget buys a bigger window at the same context
    assert E.equal_memory_config("KIVI-K2V2", 4.5, context=16384, **DIMS)["overrides"]["residual"] > long["residual"]


def test_equal_memory_infeasible_fixed_and_bad_input():
    row = E.equal_memory_config("KIVI-K4V4", 2.5, context=16384, **DIMS)
    assert not row["feasible"] and row["overrides"] is None and row["min_bits_per_element"] > 4
    fixed = E.equal_memory_config("KIVI-K2V2", 4.5, context=16384, fixed={"residual": 64}, **DIMS)
    assert fixed["overrides"]["residual"] == 64                            # held, not searched
    # BitDecoding cannot serve head_dim 32 at all: a reason, not an exception
    bd = E.equal_memory_config("BitDecoding-2", 2.5, context=512, head_dim=32, kv_heads=2, n_layers=2)
    assert not bd["feasible"] and "BitDecoding-2" in bd["reason"]
    for bad in (0, -1.0, float("nan"), True, "2"):
        with pytest.raises(ValueError, match="budget"):
            E.equal_memory_config("KIVI-K2V2", bad, context=512, **DIMS)
    with pytest.raises(ValueError, match="context"):
        E.equal_memory_config("KIVI-K2V2", 2.5, context=0, **DIMS)
    with pytest.raises(ValueError, match="unknown kvq method"):
        E.equal_memory_config("KIVI-K3", 2.5, context=512, **DIMS)


def test_paper_config_row():
    row = E.paper_config("OSCAR", context=2048, **DIMS)
    assert row["label"] == "OSCAR (paper)" and row["budget"] is None and row["overrides"] == {}
    assert row["config"]["sink"] == 64 and row["config"]["window"] == 256
    # 320 FP16 tokens of 2048, the rest at 2 + 32 / 128 bits, in both accountings for OSCAR
    assert row["bits_per_element"] == pytest.approx((320 * 16 + 1728 * 2.25) / 2048)
    assert row["bits_per_element_paper"] == row["bits_per_element"]


def test_attention_errors_at_budgets_rows():
    rng = np.random.default_rng(0)
    layers = [{"q": rng.standard_normal((1, 4, 256, 64)).astype(np.float32),
               "k": rng.standard_normal((1, 2, 256, 64)).astype(np.float32),
               "v": rng.standard_normal((1, 2, 256, 64)).astype(np.float32)} for _ in range(2)]
    out = E.attention_errors_at_budgets(layers, ["FP16", "KIVI-K2V2", "KIVI-K4V4"], [3.0, 4.5], causal=True,
                                        progress=False)
    assert [e["budget"] for e in out] == [3.0, 4.5]
    rows3 = {r["method"]: r for r in out[0]["rows"]}
    assert set(rows3) == {"KIVI-K2V2", "KIVI-K4V4"}                       # FP16 is the reference row only
    assert "skipped" in rows3["KIVI-K4V4"]
    for e in out:
        for r in e["rows"]:
            if "skipped" not in r:
                want = E.equal_memory_config(r["method"], e["budget"], context=256, head_dim=64, kv_heads=2,
                                             n_layers=2)
                assert r["overrides"] == want["overrides"]
                assert r["bits_per_element_state"] == pytest.approx(want["bits_per_element"])
                assert r["bits_per_element_state"] <= e["budget"]
                assert math.isfinite(r["mean"]["attention_kl"])


# ---------------------------------------------------------------------------------------------------
# the protocol next to every table


def test_protocol_is_printed_next_to_every_table(capsys):
    from kvq.commands import eval as ev

    res = {"protocol": "Attention-level errors.", "causal": False, "backend": "reference",
           "shape": {"layers": 6, "batch": 1, "kv_heads": 12, "tokens": 128, "head_dim": 32},
           "geometry": {"n_layers": 6, "kv_heads": 12, "head_dim": 32},
           "text": {"source": "english", "eval_chars": [10, 20], "windows": 1, "seq_len": 128},
           "meta": {"model": "minilm", "model_dtype": "float32", "argv": ["attention"]},
           "rows": [{"method": "KIVI-K2V2", "bits_per_element": 2.25, "bits_per_element_state": 3.5,
                     "mean": dict.fromkeys(("k_rel_mse", "v_rel_mse", "logit_mse", "attention_kl", "output_mse"), .1)}],
           "equal_memory": [{"budget": 2.5, "rows": [
               {"method": "KIVI-K2V2", "bits_per_element": 2.25, "bits_per_element_state": 2.46, "budget": 2.5,
                "overrides": {"residual": 16}, "mean": dict.fromkeys(
                    ("k_rel_mse", "v_rel_mse", "logit_mse", "attention_kl", "output_mse"), .2)},
               {"method": "KIVI-K4V4", "skipped": "no configuration fits", "budget": 2.5}]}]}
    p = ev.table_protocol(res)
    assert list(p) == ["model", "data", "context", "budget", "accounting"]
    assert "minilm" in p["model"] and "bidirectional" in p["model"]
    assert "english" in p["data"] and "10..20" in p["data"]
    assert p["context"].startswith("128 tokens per window")
    assert "<= 2.5 bits per element" in p["budget"] and "paper configuration" in p["budget"]
    assert "state" in p["accounting"] and "paper" in p["accounting"]
    ev._print(res)
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index("protocol of the table below:"):]
    assert table[1].lstrip().startswith("model") and any(line.lstrip().startswith("accounting") for line in table)
    head = next(i for i, line in enumerate(lines) if line.startswith("method"))
    assert lines[head].split()[:2] == ["method", "config"]
    assert lines[head + 2].split()[:3] == ["KIVI-K2V2", "paper", "3.500"]
    assert lines[head + 3].split()[:3] == ["KIVI-K2V2", "<=2.5", "2.460"] and lines[head + 3].endswith("residual=16")
    assert lines[-1].startswith("KIVI-K4V4") and lines[-1].endswith("skipped: no configuration fits")
    # a causal LM's perplexity table names its protocol too
    ppl = {"protocol": "ppl", "windows": 2, "seq_len": 160, "chunk": 80, "rows": [], "text": {"source": "stdlib",
           "split": "eval"}, "meta": {"model": "runs/tiny-lm", "argv": ["ppl", "--set", "KIVI-K2V2:residual=32"]}}
    q = ev.table_protocol(ppl)
    assert "causal" in q["model"] and "stdlib split eval" in q["data"] and "chunks of 80" in q["context"]
    assert "--set KIVI-K2V2:residual=32" in q["budget"]


def test_budget_option_parses_and_rejects_bad_values(capsys):
    from kvq.commands import eval as ev

    args = ev.build_parser().parse_args(["attention"])
    assert args.budget == list(E.DEFAULT_BUDGETS) and not args.paper_only
    assert ev.build_parser().parse_args(["attention", "--budget", "3", "5.5"]).budget == [3.0, 5.5]
    for bad in ("0", "-2", "nan", "x"):
        with pytest.raises(SystemExit) as e:
            ev.build_parser().parse_args(["attention", "--budget", bad])
        assert e.value.code == 2


# ---------------------------------------------------------------------------------------------------
# item 5: amortized costs


def test_amortized_overhead_hand_numbers():
    # 32 layers x (0.02 + 0.0056) ms = 0.8192 ms every 128 steps = 0.0064 ms a step; of a 20 ms step: 0.032 %
    a = E.amortized_overhead(quantize_ms=0.02, rank_ms=0.0056, layers=32, period=128, step_ms=20.0)
    assert a["flush_ms"] == pytest.approx(0.8192)
    assert a["per_step_ms"] == pytest.approx(0.0064)
    assert a["fraction"] == pytest.approx(0.00032)
    assert a["percent"] == pytest.approx(0.032)
    # book/kitty.md's H100 numbers: a 0.027 ms flush (one layer's batch-8 flush) over 128 steps is 0.21 us
    b = E.amortized_overhead(quantize_ms=0.027, step_ms=0.1)
    assert b["per_step_ms"] == pytest.approx(0.027 / 128) and b["percent"] == pytest.approx(100 * 0.027 / 12.8)
    # the unit is the caller's: microseconds in, the same fraction out
    c = E.amortized_overhead(quantize_ms=20.0, rank_ms=5.6, layers=32, period=128, step_ms=20000.0)
    assert c["fraction"] == pytest.approx(a["fraction"])


def test_amortized_overhead_bad_input():
    for kw, match in (({"quantize_ms": -1.0, "step_ms": 1.0}, "quantize_ms"),
                      ({"quantize_ms": 1.0, "step_ms": 0.0}, "step_ms"),
                      ({"quantize_ms": 1.0, "step_ms": float("inf")}, "step_ms"),
                      ({"quantize_ms": 1.0, "step_ms": 1.0, "rank_ms": "1"}, "rank_ms"),
                      ({"quantize_ms": 1.0, "step_ms": 1.0, "layers": 0}, "layers"),
                      ({"quantize_ms": 1.0, "step_ms": 1.0, "period": 1.5}, "period")):
        with pytest.raises(ValueError, match=match):
            E.amortized_overhead(**kw)


def test_cli_ppl_budget_rows(tmp_path, capsys):
    """``kvq eval ppl --budget``: the paper rows as before, then each method at the configuration the budget
    allows at the window's length, its state bits within the budget; the printed table shows both."""
    import json

    import torch
    from transformers import LlamaForCausalLM

    from kvq.commands import eval as ev
    from kvq.integrations.models import tiny_llama_config
    torch.manual_seed(1)
    LlamaForCausalLM(tiny_llama_config(num_hidden_layers=2, hidden_size=128, intermediate_size=256)).eval() \
        .save_pretrained(tmp_path)
    argv = ["ppl", "--model", str(tmp_path), "--methods", "FP16", "KIVI-K2V2", "KIVI-K4V4", "--windows", "1",
            "--seq-len", "256", "--chunk", "128", "--device", "cpu", "--quiet", "--budget", "4.5"]
    assert ev.main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in res["rows"]] == ["no cache", "FP16", "KIVI-K2V2", "KIVI-K4V4"]
    (em,) = res["equal_memory"]
    rows = {r["method"]: r for r in em["rows"]}
    assert em["budget"] == 4.5 and set(rows) == {"KIVI-K2V2", "KIVI-K4V4"}
    assert "skipped" in rows["KIVI-K4V4"]                                  # 4-bit codes cannot fit at 256 tokens
    k2 = rows["KIVI-K2V2"]
    want = E.equal_memory_config("KIVI-K2V2", 4.5, context=256, head_dim=128, kv_heads=2, n_layers=2)
    assert k2["overrides"] == want["overrides"] and k2["bits_per_element"] == pytest.approx(want["bits_per_element"])
    assert k2["bits_per_element"] <= 4.5 < res["rows"][2]["bits_per_element"]  # the paper's costs more here
    assert math.isfinite(k2["ppl"])
    assert ev.main(argv) == 0                                                 # the table, with its protocol
    out = capsys.readouterr().out.splitlines()
    assert "protocol of the table below:" in out
    assert any(line.startswith("KIVI-K2V2") and "<=4.5" in line and line.endswith(
        " ".join(f"{k}={v}" for k, v in want["overrides"].items())) for line in out)
