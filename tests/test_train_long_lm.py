"""benchmarks/train_long_lm.py: its retrieval data, its options, and its ``--tiny --device cpu`` smoke mode
(train a few steps, evaluate FP16 and KIVI at its paper and equal-memory configurations, write the JSON),
which must finish in well under a minute on the CPU."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_long_lm.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_long_lm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


S = _script()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_lm")
    extra = out / "copy" / "long.json"
    t0 = time.monotonic()
    summary = S.main(["--out", str(out), "--tiny", "--device", "cpu", "--json", str(extra)])
    return out, summary, extra, time.monotonic() - t0


def test_tiny_smoke_run_writes_the_results(smoke):
    out, summary, extra, seconds = smoke
    assert seconds < 60
    on_disk = json.loads((out / "long_lm.json").read_text())
    assert on_disk == json.loads(extra.read_text())
    assert (out / "config.json").exists()                                      # the model was saved
    cfg = on_disk["config"]
    assert cfg["head_dim"] == 128 and cfg["num_key_value_heads"] < cfg["num_attention_heads"]   # GQA
    assert cfg["max_position_embeddings"] == 256
    assert on_disk["data"]["train_split"] == "train" and on_disk["data"]["eval_split"] == "eval"
    assert on_disk["training"]["steps"] == 3
    labels = [r["label"] for r in on_disk["ppl_by_position"]["rows"]]
    assert labels == ["FP16", "KIVI-K2V2 (paper)", "KIVI-K2V2 @ <=2.5 b/e", "KIVI-K2V2 @ <=4.5 b/e"]
    rows = {r["label"]: r for r in on_disk["ppl_by_position"]["rows"]}
    assert "skipped" in rows["KIVI-K2V2 @ <=2.5 b/e"]                          # 2.68 is the least at 256 tokens
    eq = rows["KIVI-K2V2 @ <=4.5 b/e"]
    assert eq["bits_per_element"] <= 4.5 and eq["overrides"]["residual"] < 128
    for r in (rows["FP16"], rows["KIVI-K2V2 (paper)"], eq):
        assert np.isfinite(r["ppl"]) and [b["start"] for b in r["buckets"]] == [0]
    ret = {r["label"]: r for r in on_disk["retrieval"]["rows"]}
    cells = ret["KIVI-K2V2 @ <=4.5 b/e"]["cells"]
    assert sorted({c["context"] for c in cells}) == [128, 256]
    assert {c["depth"] for c in cells} == {0.1, 0.5, 0.9}
    assert all(0 <= c["accuracy"] <= 1 and c["bits_per_element"] <= 4.5 for c in cells)
    # the configuration is chosen again at each context: a shorter context, a window no larger
    w = {c["context"]: c["overrides"]["residual"] for c in cells}
    assert w[128] <= w[256]
    assert "Retrieval" in on_disk["protocol"] and on_disk["accounting"] == "state"


def test_plant_and_query_layout():
    rng = np.random.default_rng(0)
    stream = np.full(400, ord("x"), dtype=np.uint16)
    doc, ans, pos = S.retrieval_case(stream, rng, 200, 0.5, distractors=2)
    text = bytes(doc.astype(np.uint8)).decode()
    key, value = text[pos + 6:pos + 11], text[pos + 14:pos + 20]
    assert text[pos:pos + S.PLANT_LEN] == f"\n@key {key} = {value}\n"
    assert text.endswith(f"\n@get {key} = {value}\n")
    assert bytes(doc[ans].astype(np.uint8)).decode() == value                 # the mask marks the value bytes
    assert text.count("@key") == 3 and len(doc) == 200
    room = 200 - S.QUERY_LEN - S.PLANT_LEN
    assert pos == round(0.5 * room)
    _, _, first = S.retrieval_case(stream, rng, 200, 0.0, distractors=2)
    assert first == 0


def test_training_batch_plants_queries_and_masks():
    args = S.parse_args(["--out", "/tmp/x", "--tiny", "--retrieval-frac", "1", "--pairs", "2"])
    rng = np.random.default_rng(1)
    stream = np.full(5000, ord("y"), dtype=np.uint16)
    ids, ans = S.training_batch(stream, rng, 3, 128, args)
    assert ids.shape == ans.shape == (3, 129)
    for row, m in zip(ids, ans):
        text = bytes(row.astype(np.uint8)).decode()
        assert text.count("@key") == 2 and text.count("@get") == 2 and m.sum() == 2 * S.VALUE_DIGITS
        for k in (text[i + 5:i + 10] for i in range(len(text)) if text.startswith("@get ", i)):
            planted = text.index(f"@key {k} = ")
            assert text[planted + 13:planted + 19] in text[-30:]                # queried with its own value


def test_position_buckets_and_options():
    assert S.position_buckets(16383) == [(0, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 4096),
                                         (4096, 8192), (8192, 16383)]
    assert S.position_buckets(100) == [(0, 100)]
    a = S.parse_args(["--out", "/tmp/x"])
    assert a.context == 16384 and a.eval_contexts[-1] == 16384 and a.budgets == [2.5, 4.5]
    assert "OSCAR" in a.methods and a.minutes == 3.5
    for bad in (["--short-context", "40000"], ["--eval-contexts", "99999"], ["--depths", "1.5"],
                ["--budgets", "0"], ["--pairs", "0"]):
        with pytest.raises(SystemExit):
            S.parse_args(["--out", "/tmp/x", *bad])


def test_load_carries_the_training_record_and_marks_the_json_complete(smoke, tmp_path):
    """--load DIR evaluates the saved model and keeps DIR/long_lm.json's training record (steps, recipe)."""
    out, summary, _, _ = smoke
    again = S.main(["--load", str(out), "--out", str(tmp_path), "--tiny", "--device", "cpu", "--methods", "FP16"])
    assert again["complete"] is True and summary["complete"] is True
    tr = again["training"]
    assert tr["loaded_from"] == str(out.resolve()) and tr["steps"] == summary["training"]["steps"] == 3
    assert tr["recipe"]["context"] == 256 and tr["trained_by"]["argv"] == summary["argv"]
    fp16 = again["ppl_by_position"]["rows"][0]
    assert fp16["label"] == "FP16" and fp16["ppl"] == pytest.approx(summary["ppl_by_position"]["rows"][0]["ppl"])


def test_a_stopped_run_keeps_the_rows_it_finished(smoke, tmp_path, monkeypatch):
    """The JSON is rewritten after each row (complete: false): a run stopped during its second row leaves
    the first row on disk."""
    out = smoke[0]
    real, calls = S.cached_nll, []

    def stop_at_second_row(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt                      # a time limit, say: not caught per row
        return real(*a, **k)

    monkeypatch.setattr(S, "cached_nll", stop_at_second_row)
    with pytest.raises(KeyboardInterrupt):
        S.main(["--load", str(out), "--out", str(tmp_path), "--tiny", "--device", "cpu", "--budgets"])
    doc = json.loads((tmp_path / "long_lm.json").read_text())
    assert doc["complete"] is False
    assert [r["label"] for r in doc["ppl_by_position"]["rows"]] == ["FP16"]
    assert [r["label"] for r in doc["retrieval"]["rows"]] == ["FP16"]


def test_merge_joins_the_methods_of_load_runs_of_one_model(smoke, tmp_path):
    """--merge: --load runs of one saved model that split the methods give one long_lm.json whose rows are
    those of a single run over all the methods; runs that differ in model or protocol are refused."""
    out = smoke[0]
    common = ["--load", str(out), "--tiny", "--device", "cpu", "--budgets"]
    whole = S.main(common + ["--out", str(tmp_path / "w"), "--methods", "FP16", "KIVI-K2V2"])
    a = S.main(common + ["--out", str(tmp_path / "a"), "--methods", "FP16", "--json", str(tmp_path / "a.json")])
    b = S.main(common + ["--out", str(tmp_path / "b"), "--methods", "KIVI-K2V2", "--json", str(tmp_path / "b.json")])
    merged = S.merge_main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                           "--json", str(tmp_path / "m" / "long_lm.json")])
    assert json.loads((tmp_path / "m" / "long_lm.json").read_text()) == merged
    assert merged["args"]["methods"] == ["FP16", "KIVI-K2V2"]
    assert [p["methods"] for p in merged["parts"]] == [["FP16"], ["KIVI-K2V2"]]
    for table in ("ppl_by_position", "retrieval"):
        assert [r["label"] for r in merged[table]["rows"]] == [r["label"] for r in whole[table]["rows"]]
    assert [r["ppl"] for r in merged["ppl_by_position"]["rows"]] == pytest.approx(
        [r["ppl"] for r in whole["ppl_by_position"]["rows"]])
    with pytest.raises(ValueError, match="again"):                    # a method in two parts
        S.merge_runs([a, a])
    with pytest.raises(ValueError, match="--trials"):                 # another protocol
        S.merge_runs([a, {**b, "args": {**b["args"], "trials": 2}}])
    with pytest.raises(ValueError, match="'training'"):               # another model
        S.merge_runs([a, {**b, "training": {**b["training"], "steps": 99}}])
    with pytest.raises(ValueError, match="not complete"):
        S.merge_runs([a, {**b, "complete": False}])
    with pytest.raises(ValueError, match="at least two"):
        S.merge_runs([a])
