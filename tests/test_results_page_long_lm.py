"""The long-context model's results on the results page (issue 40): a card file
``benchmarks/results/<card>/long_lm.json`` (``benchmarks/train_long_lm.py``'s output) is a known benchmark
of ``results_page`` and renders its protocol, a table of perplexity by position bucket per row (FP16, each
method's paper configuration and its equal-memory configurations, with their bits per element) and a table
of retrieval accuracy by needle depth per context length.

The JSON is made here, at test time, by ``train_long_lm.py --tiny --device cpu --no-save`` (a few training
steps, about 10 s on a CPU): every number the test checks is read back from that JSON, none is typed in."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import results_page as RP  # noqa: E402

from kvq import evaluation as E  # noqa: E402


def _script():
    spec = importlib.util.spec_from_file_location("train_long_lm", ROOT / "benchmarks" / "train_long_lm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def long_lm(tmp_path_factory):
    """(results folder with the card file h200/long_lm.json, its JSON) from a CPU smoke run of the script."""
    out = tmp_path_factory.mktemp("long_lm_run")
    _script().main(["--out", str(out), "--tiny", "--device", "cpu", "--no-save"])
    results = tmp_path_factory.mktemp("results")
    (results / "h200").mkdir()
    shutil.copy(out / "long_lm.json", results / "h200" / "long_lm.json")
    return results, json.loads((out / "long_lm.json").read_text())


def _table_rows(md: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in md.splitlines()
            if ln.startswith("| ") and not ln.startswith("| ---")]


def test_long_lm_is_a_known_benchmark_of_a_card(long_lm):
    results, _ = long_lm
    assert RP.benchmark_of(results / "h200" / "long_lm.json") == "long_lm"
    assert RP.benchmark_of(Path("long_lm_eval.json")) == "long_lm"                 # a run written in parts
    assert [c.name for c in RP.card_dirs(results)] == ["h200"]
    assert list(RP.load_card(results / "h200")) == ["long_lm"]


def test_page_renders_protocol_and_both_tables_from_the_json(long_lm):
    results, doc = long_lm
    page = RP.page(results)
    assert "### Long-context LM: perplexity by position and retrieval" in page
    assert f"commit `{RP._short(doc['commit'])}`" in page and "`long_lm.json`" in page
    assert "Run: `benchmarks/train_long_lm.py --out" in page                          # how it was run
    # the protocol: model, data and split, context, budgets, accounting, all from the JSON
    cfg = doc["config"]
    assert (f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} KV heads of {cfg['head_dim']}"
            in page)
    assert f"{cfg['max_position_embeddings']} positions" in page
    assert "'train' split" in page and "'eval' split" in page
    assert "at most 2.5, 4.5 bits per element" in page and "accounting: 'state'" in page

    rows = _table_rows(page)
    pp = doc["ppl_by_position"]
    head = next(r for r in rows if r[:2] == ["row", "bits / element (state / paper)"])
    assert len(head) == 3 + len(pp["buckets"])
    for r in pp["rows"]:                                                               # one row per JSON row
        (got,) = [x for x in rows if x[0] == r["label"] and len(x) == len(head)]
        if "ppl" in r:
            assert got[1] == f"{r['bits_per_element']:.2f} / {r['bits_per_element_paper']:.2f}"
            assert got[2:] == [f"{r['ppl']:.4f}"] + [f"{b['ppl']:.4f}" for b in r["buckets"]]
        else:                                                                          # skipped: no number
            assert set(got[1:]) <= {"—", "— / —"} and r["skipped"] in page

    rt = doc["retrieval"]
    for n in rt["contexts"]:
        assert f"Context {n} tokens:" in page
        block = page.split(f"Context {n} tokens:")[1].split("\n\n")[1]
        table = _table_rows(block)
        assert table[0] == ["row", f"bits / element at {n}"] + [f"depth {d:g}" for d in rt["depths"]] + ["mean"]
        for r in rt["rows"]:
            (got,) = [x for x in table if x[0] == r["label"]]
            cells = [c for c in r.get("cells", []) if c.get("context") == n and "accuracy" in c]
            if cells:
                assert got[1] == f"{cells[0]['bits_per_element']:.2f}"
                assert got[2:-1] == [f"{c['accuracy']:.2f}" for c in cells]
            else:
                assert set(got[1:]) == {"—"}


def test_report_refuses_what_is_not_a_long_lm_json():
    with pytest.raises(ValueError, match="long_lm.json"):
        E.long_lm_report({"rows": []})
    with pytest.raises(ValueError, match="long_lm.json"):
        E.long_lm_ppl_table([])


def test_a_partial_run_says_so(long_lm):
    _, doc = long_lm
    assert doc["complete"] is True and "partial" not in E.long_lm_protocol(doc)
    assert "stopped before every row was evaluated" in E.long_lm_protocol({**doc, "complete": False})


def test_paper_rows_and_quality_points_come_from_the_json(long_lm):
    """The README's method table and figure read each row of the JSON: the paper rows (bits, perplexity,
    mean retrieval at the perplexity context) and one point per evaluated non-FP16 row."""
    results, doc = long_lm
    pp, rt = doc["ppl_by_position"], doc["retrieval"]
    paper = E.long_lm_paper_rows(doc)
    want = [r for r in pp["rows"] if r["budget"] is None and "ppl" in r]
    assert list(paper) == [r["method"] for r in want]
    for r in want:
        cells = [c["accuracy"] for x in rt["rows"] if x["label"] == r["label"] for c in x["cells"]
                 if c["context"] == pp["context"] and "accuracy" in c]
        got = paper[r["method"]]
        assert (got["bits"], got["bits_paper"], got["ppl"]) == (r["bits_per_element"], r["bits_per_element_paper"],
                                                                r["ppl"])
        assert got["retrieval"] == (pytest.approx(sum(cells) / len(cells)) if cells else None)
    points, fp16 = E.long_lm_quality_points(doc)
    measured = [r for r in pp["rows"] if r["method"] != "FP16" and "ppl" in r]
    assert [(p["method"], p["bits"], p["value"]) for p in points] == [
        (r["method"], r["bits_per_element"], r["ppl"]) for r in measured]
    assert [p["config"] for p in points] == ["paper" if r["budget"] is None else f"<={r['budget']:g}" for r in measured]
    assert fp16 == next(r["ppl"] for r in pp["rows"] if r["method"] == "FP16")
    with pytest.raises(ValueError, match="long_lm.json"):
        E.long_lm_paper_rows({"rows": []})


def test_method_table_and_figure_from_a_long_lm_run(long_lm, tmp_path):
    results, doc = long_lm
    table = RP.methods_table(results)
    lines = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| ---")]
    assert [ln.split("|")[1].strip() for ln in lines[1:]] == list(E.long_lm_paper_rows(doc))
    png = RP.quality_figure(results, tmp_path / "f.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty" / "h200").mkdir(parents=True)                 # a card with no long_lm.json
    with pytest.raises(ValueError, match="no long_lm.json"):
        RP.quality_figure(tmp_path / "empty", tmp_path / "g.png")
