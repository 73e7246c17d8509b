"""benchmarks/results_page.py: docs/results.md and README.md's method table come from the committed JSON.

A page generated into a temporary folder from small fixture JSON holds each benchmark's table under its
card, commit, date and protocol; a cell without a measurement is "—"; a JSON of no known benchmark is an
error; and the committed docs/results.md and README.md table equal what the command makes of the committed
JSON, so neither can go stale. benchmarks/results/ holds one folder per card (a run of one commit belongs to
its lab folder), and every results path the README, book, docs and lab notes name is there.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import results_page as RP  # noqa: E402

META = {"device": {"name": "Test GPU"}, "commit": "abc1234" + "0" * 33, "date_utc": "2026-01-02T03:04:05",
        "argv": ["benchmarks/run_all.py", "--out", "/tmp/x"], "mode": "quick"}


def _write(folder: Path, name: str, doc: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(doc))


def _kivi_shape(B, T, sdpa, rows):
    return {"B": B, "T": T, "fp16": {"sdpa_best": {"ms": sdpa}}, "methods": rows}


def _lm_row(method, budget, bits, bits_paper, ppl):
    """A long_lm.json perplexity row (``benchmarks/train_long_lm.py``'s layout)."""
    label = method if method == "FP16" else f"{method} (paper)" if budget is None else f"{method} @ <={budget:g} b/e"
    return {"method": method, "label": label, "budget": budget, "bits_per_element": bits,
            "bits_per_element_paper": bits_paper, "ppl": ppl, "buckets": [{"start": 0, "end": 4096, "ppl": ppl}]}


def _lm_hits(label, accs):
    """A long_lm.json retrieval row: accuracies at (1024, 0.1), (1024, 0.9), (4096, 0.1), (4096, 0.9)."""
    cells = [{"context": n, "depth": d, "accuracy": a, "bits_per_element": 2.0}
             for (n, d), a in zip([(1024, 0.1), (1024, 0.9), (4096, 0.1), (4096, 0.9)], accs)]
    return {"method": label.split(" ")[0], "label": label, "cells": cells}


@pytest.fixture()
def results(tmp_path):
    r = tmp_path / "results"
    _write(r / "h100", "ceilings.json", {"meta": META, "copy_gbps": 3000.4, "matmul_tflops": 800.2})
    _write(r / "h100", "kivi_kitty.json", {"meta": META, "shapes": [
        _kivi_shape(8, 32768, 0.4, {"KIVI-K2V2 [cupy]": {"ms": 0.1, "valid": True, "pct_copy": 66.0},
                                    "Kitty [cupy]": {"ms": 0.2, "valid": False, "pct_copy": 10.0}}),
        _kivi_shape(1, 8192, 0.02, {"KIVI-K2V2 [cupy]": {"error": "boom"}})]})
    _write(r / "h100-abc1234", "ceilings.json", {"meta": META, "copy_gbps": 1.0})        # an older run: not a card
    _write(r / "cpu", "ppl.json", {"meta": dict(META, device="cpu", argv=["ppl", "--windows", "2"]),
                                   "protocol": "Perplexity of a cache. More words.", "seq_len": 64, "rows": [
        {"method": "no cache", "ppl": 2.0, "bits_per_element": 32.0, "bits_per_element_paper": 32.0},
        {"method": "KIVI-K2V2", "ppl": 2.5, "bits_per_element": 2.5, "bits_per_element_paper": 2.25},
        {"method": "OSCAR", "ppl": 2.1, "bits_per_element": 4.4, "bits_per_element_paper": 4.4}]})
    _write(r / "cpu", "long_lm.json", {"script": "benchmarks/train_long_lm.py", "argv": ["--tiny"],
                                       "device_name": "cpu", "commit": "abc1234", "date_utc": "2026-01-02T03:04:05Z",
                                       "args": {"budgets": [2.5]}, "complete": True,
                                       "ppl_by_position": {"context": 4096, "buckets": [[0, 4096]], "rows": [
        _lm_row("FP16", None, 16.0, 16.0, 2.0), _lm_row("KIVI-K2V2", None, 2.3, 2.25, 2.5),
        _lm_row("KIVI-K2V2", 2.5, 2.45, 2.4, 2.4), _lm_row("OSCAR", None, 2.52, 2.52, 2.1)]},
                                       "retrieval": {"contexts": [1024, 4096], "depths": [0.1, 0.9], "trials": 2,
                                                     "rows": [
        _lm_hits("FP16", [1.0, 1.0, 1.0, 1.0]), _lm_hits("KIVI-K2V2 (paper)", [0.0, 0.0, 0.5, 1.0]),
        _lm_hits("KIVI-K2V2 @ <=2.5 b/e", [1.0, 1.0, 1.0, 1.0]), _lm_hits("OSCAR (paper)", [1.0, 0.5, 0.5, 0.5])]}})
    _write(r / "h200", "e2e.json", {"info": {"device": "Test GPU 2", "commit": "def5678", "date": "2026-01-03"},
                                    "rows": [
        {"cache": "StaticCache", "batch": 8, "context": 32768, "ms_per_step": 100.0, "status": "ok", "cache_bytes": 8},
        {"cache": "KIVI-K2V2:triton", "batch": 8, "context": 32768, "ms_per_step": 50.0, "status": "ok"},
        {"cache": "KIVI-K2V2:cupy", "batch": 8, "context": 32768, "ms_per_step": 25.0, "status": "ok"},
        {"cache": "StaticCache", "batch": 1, "context": 32768, "ms_per_step": 30.0, "status": "ok"},
        {"cache": "KIVI-K2V2:cupy", "batch": 1, "context": 32768, "ms_per_step": 60.0, "status": "ok"}]})
    return r


def _rows(table: str, first: str):
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in table.splitlines() if ln.startswith(f"| {first}")]


def test_page_has_one_table_per_benchmark_under_its_run_line(results):
    page = RP.page(results)
    assert page.index("## h100") < page.index("## h200") < page.index("## cpu")      # GPU cards first
    assert "h100-abc1234" not in page and "| 1 |" not in page                       # commit folders are not read
    assert "Card `h100` (Test GPU), commit `abc1234`, 2026-01-02; `ceilings.json`." in page
    assert "Run: `benchmarks/run_all.py --out /tmp/x` (quick)." in page
    assert "| 3000 | 800 |" in page                                                  # the ceilings table
    assert "Protocol: Perplexity of a cache." in page and "More words" not in page   # the protocol's first sentence
    (row8,) = _rows(page, "8 x 32K | 0.400")
    assert row8 == ["8 x 32K", "0.400", "0.100", "4.00x", "66%", "—", "—", "—"]      # Kitty failed its check
    (row1,) = _rows(page, "1 x 8K")
    assert row1[2:5] == ["—", "—", "—"]                                              # an error is no number
    assert "| KIVI-K2V2 | 2.250 | 2.500 | 2.5000 | +25.00% |" in page                # ppl.json's table


def test_method_table_from_the_json_and_dashes_where_nothing_was_measured(results):
    table = RP.methods_table(results)
    rows = {r[0]: r for r in _rows(table, "") if r[0] not in ("method", "---")}
    assert list(rows) == ["FP16", "KIVI-K2V2", "OSCAR"]             # long_lm.json's paper rows, in its order
    assert rows["KIVI-K2V2"][1:] == ["2.25 / 2.30", "2.500 (+25.00%)", "0.750", "—", "4.00x / 0.50x (CuPy)", "no"]
    assert rows["OSCAR"][2:4] == ["2.100 (+5.00%)", "0.500"]                         # retrieval at 4096 only
    assert rows["OSCAR"][5:] == ["— / —", "yes (`kvq calibrate oscar`)"]            # no e2e row: no speed
    assert "bits / element at 4K (paper / state)" in table
    assert "`benchmarks/results/cpu/long_lm.json` (cpu, commit `abc1234`, 2026-01-02)" in table
    assert f"](docs/figures/{RP.FIGURE.name})" in table                              # the figure under the table
    assert "`benchmarks/results/h200/e2e.json` (Test GPU 2, commit `def5678`, 2026-01-03)" in table
    assert "Attention KL: no `attention.json` committed." in table


def test_a_newer_e2e_run_of_other_shapes_does_not_replace_the_speed_column(results):
    """The method table's speed reads the newest e2e run that measured its shapes (8 x 32K, 1 x 32K): a newer
    run of other shapes (a part file) gets its own table on the results page, with its note, and the
    method table's speed and source stay."""
    _write(results / "h200", "e2e_8k.json", {"info": {"device": "Test GPU 2", "commit": "fff0000", "date": "2026-02-01",
                                                       "note": "only the 8K rows"}, "rows": [
        {"cache": "StaticCache", "batch": 1, "context": 8192, "ms_per_step": 10.0, "status": "ok"},
        {"cache": "KIVI-K2V2:cupy", "batch": 1, "context": 8192, "ms_per_step": 5.0, "status": "ok"}]})
    table = RP.methods_table(results)
    rows = {r[0]: r for r in _rows(table, "") if r[0] not in ("method", "---")}
    assert rows["KIVI-K2V2"][5] == "4.00x / 0.50x (CuPy)"
    assert "`benchmarks/results/h200/e2e.json` (Test GPU 2, commit `def5678`, 2026-01-03)" in table
    page = RP.page(results)
    assert "commit `fff0000`, 2026-02-01; `e2e_8k.json`. Note: only the 8K rows." in page
    _write(results / "h200", "e2e_8k.json", {"info": {"device": "Test GPU 2", "commit": "fff0000", "date": "2026-02-01"},
                                               "rows": [dict(r, context=c) for c in (8192, 32768) for r in (
        {"cache": "StaticCache", "batch": 8, "ms_per_step": 80.0, "status": "ok"},
        {"cache": "StaticCache", "batch": 1, "ms_per_step": 20.0, "status": "ok"},
        {"cache": "KIVI-K2V2:cupy", "batch": 8, "ms_per_step": 20.0, "status": "ok"},
        {"cache": "KIVI-K2V2:cupy", "batch": 1, "ms_per_step": 40.0, "status": "ok"})]})
    table = RP.methods_table(results)                                   # a newer run of those shapes does
    rows = {r[0]: r for r in _rows(table, "") if r[0] not in ("method", "---")}
    assert rows["KIVI-K2V2"][5] == "4.00x / 0.50x (CuPy)" and "commit `fff0000`" in table


def test_unknown_json_and_missing_markers_are_errors(results, tmp_path):
    _write(results / "h100", "mystery.json", {"meta": META})
    with pytest.raises(ValueError, match="mystery"):
        RP.page(results)
    with pytest.raises(ValueError, match="results:methods"):
        RP.fill_markers("# a README without the markers\n", "| t |")
    with pytest.raises(ValueError, match="not a folder"):
        RP.page(tmp_path / "nowhere")


def test_main_writes_then_check_passes(results, tmp_path, capsys):
    out, readme = tmp_path / "docs" / "results.md", tmp_path / "README.md"
    readme.write_text(f"# kvq\n\n{RP.BEGIN}\nold table\n{RP.END}\n\nmore text\n")
    figure = tmp_path / "docs" / "figures" / "q.png"
    args = ["--results", str(results), "--out", str(out), "--readme", str(readme), "--figure", str(figure)]
    assert RP.main(args + ["--check"]) == 1                                          # nothing generated yet
    assert "out of date" in capsys.readouterr().err
    assert RP.main(args) == 0
    assert out.read_text() == RP.page(results)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"                          # the figure, drawn
    text = readme.read_text()
    assert "old table" not in text and text.endswith(f"{RP.END}\n\nmore text\n")
    assert RP.methods_table(results) in text
    assert RP.main(args + ["--check"]) == 0
    figure.unlink()
    assert RP.main(args + ["--check"]) == 1 and str(figure) in capsys.readouterr().err   # the figure is missing


def test_committed_results_page_and_readme_table_are_current():
    """docs/results.md and README.md's method table equal what `make results` makes of the committed JSON."""
    assert (ROOT / "docs" / "results.md").read_text() == RP.page(RP.RESULTS)
    readme = (ROOT / "README.md").read_text()
    assert RP.fill_markers(readme, RP.methods_table(RP.RESULTS)) == readme
    assert RP.FIGURE.is_file()                                       # the figure the table shows is committed


#: A results folder or file named by its path from the repository root (not a placeholder like ``<card>``).
RESULT_PATH = re.compile(r"(?<![\w./:-])((?:benchmarks/results|lab/[\w.-]+/results)/[\w.-]+)")
#: A relative path in a lab note: ```../x`` `` or ``[text](../x)``.
RELATIVE_PATH = re.compile(r"`(\.\./[^`\s*]+)`|\]\((\.\./[^)\s#*]+)")


def missing_paths(text: str, page: Path) -> list[str]:
    """The results paths (from the repository root) and ``../`` paths (from ``page``'s folder) that ``text``
    names and that do not exist."""
    named = [(ROOT / m.rstrip("."), m.rstrip(".")) for m in RESULT_PATH.findall(text)]
    named += [(page.parent / (a or b), a or b) for a, b in RELATIVE_PATH.findall(text)]
    return [name for path, name in named if not path.exists()]


def test_benchmarks_results_holds_one_folder_per_card():
    """The latest run per card in benchmarks/results/<card>/; a commit's run lives in its lab folder."""
    cards = {p.name for p in RP.card_dirs(RP.RESULTS)}
    entries = {p.name for p in RP.RESULTS.iterdir()}
    assert cards >= {"cpu", "h100", "h200"}
    stray = entries - cards
    assert not stray, f"{sorted(stray)}: move each run to lab/<date>-<question>/results/ (see lab/README.md)"


def test_missing_paths_finds_what_is_not_there(tmp_path):
    page = ROOT / "lab" / "README.md"
    text = ("`benchmarks/results/h100/` and benchmarks/results/h100. `benchmarks/results/<card>/` "
            "`git show 564c384:benchmarks/results/gone/x` [HISTORY](../README.md)")
    assert missing_paths(text, page) == []                                   # placeholders and git revisions pass
    text = "`benchmarks/results/h100-0000000/` `lab/x-y/results/h100/` `../no-such-folder/` [a](../nope.md#b)"
    assert missing_paths(text, page) == ["benchmarks/results/h100-0000000", "lab/x-y/results/h100",
                                         "../no-such-folder/", "../nope.md"]


def test_results_paths_named_in_the_docs_exist():
    """Every results folder or file the README, the book, docs/, benchmarks/ and lab/ pages name is there
    (moving a run to the lab moves its readers' paths with it)."""
    pages = [ROOT / "README.md", *ROOT.glob("book/*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.md"),
             *(p for p in ROOT.glob("lab/**/*.md") if not any(s.startswith(".") for s in p.relative_to(ROOT).parts))]
    missing = [f"{p.relative_to(ROOT)}: {name}" for p in pages for name in missing_paths(p.read_text(), p)]
    assert not missing, "\n".join(missing)


def test_run_line_of_merged_runs_names_every_part():
    """A long_lm.json merged from several --load runs (train_long_lm.py --merge) shows each part's command."""
    doc = {"script": "benchmarks/train_long_lm.py", "argv": ["--merge", "<part 0>", "<part 1>"],
           "commit": "abc1234", "date_utc": "2026-11-28T22:00:00Z", "device_name": "NVIDIA H200",
           "parts": [{"argv": ["--load", "m", "--methods", "FP16"]}, {"argv": ["--load", "m", "--methods", "Kitty"]}]}
    cmd = RP.run_info(doc)["command"]
    assert cmd == ("benchmarks/train_long_lm.py --load m --methods FP16 ; "
                   "benchmarks/train_long_lm.py --load m --methods Kitty (merged: 2 runs)")
