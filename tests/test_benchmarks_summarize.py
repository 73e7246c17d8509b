"""benchmarks/summarize.py turns a committed results folder into the tables that README.md and the book
show: every shape becomes a row, and each cell is the JSON's number (time, speedup, ratio) as printed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "lab" / "2026-11-22-kivi-kitty-decode" / "results" / "h100-c6508dc"
sys.path.insert(0, str(ROOT / "benchmarks"))

import summarize as S  # noqa: E402


@pytest.fixture(scope="module")
def runs():
    return S.load(RESULTS, "kivi_kitty.json"), S.load(RESULTS, "oscar.json")


def _rows(table: str):
    lines = table.splitlines()
    assert lines[1].startswith("| --- |")
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def test_kivi_kitty_table_cells_are_the_json_numbers(runs):
    kk, _ = runs
    rows = _rows(S.kivi_kitty_table(kk, ("KIVI-K2V2", "Kitty"), ratio_to="KIVI-K2V2"))
    assert len(rows) == len(kk["shapes"])
    for row, s in zip(rows, kk["shapes"]):
        a, k = s["methods"]["KIVI-K2V2 [cupy]"], s["methods"]["Kitty [cupy]"]
        sd = s["fp16"]["sdpa_best"]["ms"]
        assert row[0] == f"{s['B']} x {s['T'] // 1024}K"
        assert row[2:5] == [f"{a['ms']:.3f}", f"{sd / a['ms']:.1f}x", f"{a['pct_copy']:.0f}%"]
        assert row[8] == f"{k['ms'] / a['ms']:.2f}"
    triton = _rows(S.kivi_kitty_table(kk, ("KIVI-K2V2",), backend="triton", ratio_to=None))
    assert triton[0][2] == f"{kk['shapes'][0]['methods']['KIVI-K2V2']['ms']:.3f}"


def test_oscar_table_and_run_line(runs):
    _, o = runs
    rows = _rows(S.oscar_table(o))
    assert len(rows) == len(o["shapes"])
    last = o["shapes"][-1]
    assert rows[-1][3] == f"{last['oscar [cupy]']['ms']:.3f}"
    assert rows[-1][5] == f"{last['oscar [cupy]']['pct_copy']:.1f}%"
    assert "c6508dc" in S.run_line(o) and o["meta"]["device"]["name"] in S.run_line(o)


def test_main_prints_every_table(capsys):
    assert S.main([str(RESULTS)]) == 0
    out = capsys.readouterr().out
    assert "KIVI-K4V4 (ms)" in out and "OSCAR CuPy (ms)" in out and "1282 passed" in out


def test_read_ceiling_table_scales_the_step_to_the_read_only_kernel():
    # a step of 0.5 ms at 40% of copy whose bytes one read-only kernel reads in 0.25 ms: that kernel runs at
    # 80% of copy, and the step takes 50% of its speed; a method without the measurement leaves its cells empty
    kk = {"shapes": [{"B": 1, "T": 32768, "methods": {
        "KIVI-K2V2 [cupy]": {"ms": 0.5, "gbps": 1200.0, "pct_copy": 40.0, "read_ceiling": {"ms": 0.25, "bytes": 600}},
        "Kitty [cupy]": {"ms": 0.6, "gbps": 1000.0, "pct_copy": 33.0}}}]}
    rows = _rows(S.read_ceiling_table(kk, ("KIVI-K2V2", "Kitty")))
    assert rows == [["1 x 32K", "80%", "50%", "", ""]]


def test_read_ceiling_needs_cuda():
    import common as C

    assert C.read_ceiling(1 << 20, "cpu") is None


LATEST = ROOT / "lab" / "2026-11-22-kivi-kitty-decode" / "results" / "h100-7ba6718"


def test_read_ceiling_table_of_a_committed_run():
    kk = S.load(LATEST, "kivi_kitty.json")
    rows = _rows(S.read_ceiling_table(kk, ("KIVI-K2V2",)))
    assert len(rows) == len(kk["shapes"])
    for row, s in zip(rows, kk["shapes"]):
        r = s["methods"]["KIVI-K2V2 [cupy]"]
        rc = r["read_ceiling"]
        assert row[1] == f"{r['pct_copy'] * r['ms'] / rc['ms']:.0f}%"
        assert row[2] == f"{r['pct_read_ceiling']:.0f}%"
    o = S.load(LATEST, "oscar.json")
    assert len(_rows(S.read_ceiling_table(o, ("oscar [cupy]",), key=lambda m: m))) == len(o["shapes"])


def test_amortized_flush_takes_the_cupy_step_when_a_run_has_no_triton_rows():
    import bench_kivi_kitty as BK

    kk = S.load(LATEST, "kivi_kitty.json")
    a = BK.amortized_flush(kk["shapes"], kk["flush"])
    f = kk["flush"]["Kitty"]
    s8 = next(s for s in kk["shapes"] if s["B"] == f["B"] and s["T"] == 8192)
    assert a["Kitty"]["step_row"] == "Kitty [cupy]"
    assert a["Kitty"]["pct_of_step"]["8192"] == 100.0 * f["ms"] / f["G"] / s8["methods"]["Kitty [cupy]"]["ms"]
    # a run with Triton rows keeps the Triton step (the committed c6508dc run's own numbers)
    old = S.load(RESULTS, "kivi_kitty.json")
    assert BK.amortized_flush(old["shapes"], old["flush"])["Kitty"]["pct_of_step"] == \
        old["amortized_flush"]["Kitty"]["pct_of_step"]
    # a flush timed with the CuPy writers takes the CuPy step even where the run has Triton rows
    cupy_flush = {m: dict(f, backend="cupy") for m, f in old["flush"].items()}
    a = BK.amortized_flush(old["shapes"], cupy_flush)["Kitty"]
    s8 = next(s for s in old["shapes"] if s["B"] == cupy_flush["Kitty"]["B"] and s["T"] == 8192)
    assert a["step_row"] == "Kitty [cupy]"
    assert a["pct_of_step"]["8192"] == 100.0 * cupy_flush["Kitty"]["ms"] / cupy_flush["Kitty"]["G"] / s8["methods"]["Kitty [cupy]"]["ms"]


def test_fused_ceilings_table():
    """One row per (method, shape) with all three probes; the ratio is compute only over copies only."""
    fc = {"rows": [{"method": "KIVI-K2V2", "B": 8, "T": 32768, "mode": m, "fused_us": us}
                   for m, us in ((0, 75.0), (1, 66.0), (2, 60.0))]
          + [{"method": "Kitty", "B": 1, "T": 8192, "mode": 0, "fused_us": 10.0}]}      # incomplete: no row
    rows = _rows(S.fused_ceilings_table(fc))
    assert rows == [["8 x 32K", "KIVI-K2V2", "75.0", "66.0", "60.0", "1.10"]]
    run = S.load(ROOT / "lab" / "2026-11-22-kivi-kitty-decode" / "results" / "h100-a5e2ef7", "fused_ceilings.json")
    rows = _rows(S.fused_ceilings_table(run))
    assert len(rows) == len(run["rows"]) // 3 == 7
    assert all(float(r[3]) > float(r[4]) for r in rows)        # that run: compute only > copies only everywhere


def test_run_line_names_a_tree_that_was_not_a_commit():
    # a run on a commit plus uncommitted changes records "hash+label": the label must not be cut off
    res = {"meta": {"device": {"name": "GPU"}, "commit": "fd9acd6+tail-rule", "date_utc": "2026-11-23T04:00:00"},
           "copy_gbps": 3010.2}
    assert "commit `fd9acd6+tail-rule`" in S.run_line(res)
    res["meta"]["commit"] = "fd9acd6" + "0" * 33
    assert "commit `fd9acd6`," in S.run_line(res)


def test_oscar_folded_table_cells_are_the_json_numbers():
    """The R_V-folded table (bench_oscar's rv_folded: rotate_back=False) of the run that has it."""
    o = S.load(ROOT / "benchmarks" / "results" / "h100", "oscar.json")   # the latest H100 run (07f60da)
    rows = _rows(S.oscar_folded_table(o))
    assert len(rows) == len(o["shapes"])
    for row, s in zip(rows, o["shapes"]):
        r, sd = s["oscar [cupy]"], S._sdpa_ms(s)
        f = r["rv_folded"]["ms"]
        assert row[0] == f"{s['B']} x {s['T'] // 1024}K"
        assert row[2:6] == [f"{r['ms']:.3f}", f"{sd / r['ms']:.2f}x", f"{f:.3f}", f"{sd / f:.2f}x"]
