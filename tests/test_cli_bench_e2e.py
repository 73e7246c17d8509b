"""Tests of ``kvq bench e2e`` (issue 37): the end-to-end decode-step benchmark from an installed kvq, and
``benchmarks/bench_e2e.py``, now a thin wrapper of ``kvq.commands.bench_e2e``.

On the CPU, offline, in seconds: one tiny run (a 2-layer random Llama, two caches, two steps) whose JSON
is checked for the rows ``benchmarks/e2e_table.py`` reads; bad invocations that end in one line on stderr
and exit status 2 before any model is built (the model builder and the runner are tripwires); the
script's ``--help`` and a bad invocation of it in real subprocesses. Timings are checked for being
positive, never for speed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvq import cli  # noqa: E402
from kvq.commands import bench, bench_e2e  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_e2e.py"


class WorkStarted(AssertionError):
    """Raised by a tripwire: the benchmark began its work before refusing a bad invocation."""


@pytest.fixture
def no_work(monkeypatch):
    """Building the model, timing a cache and reading the card raise WorkStarted; no GPU is visible."""
    import torch

    def trip(name):
        def f(*a, **k):
            raise WorkStarted(f"bench_e2e.{name} was called: the invocation was not refused before the work")
        return f

    for name in ("build_model", "run_one", "max_batch", "device_info", "run"):
        monkeypatch.setattr(bench_e2e, name, trip(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _run(argv, capsys, main=cli.main):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _e2e_table():
    spec = importlib.util.spec_from_file_location("e2e_table", ROOT / "benchmarks" / "e2e_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------ a tiny run

def test_tiny_cpu_run_writes_the_json_e2e_table_reads(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))   # torch may set it itself
    out = tmp_path / "new-dir" / "e2e.json"                                     # the folder is created
    caches = ["DynamicCache", "StaticCache", "KIVI-K2V2:reference", "FP16"]
    rc, stdout, err = _run(["bench", "e2e", "--tiny", "--device", "cpu", "--shapes", "1x64", "2x40", "--caches",
                            *caches, "--steps", "2", "--warmup", "1", "--chunk", "32", "--out", str(out)], capsys)
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert set(doc) == {"info", "rows"}
    info = doc["info"]
    assert info["device"] == "cpu" and {"date", "torch", "commit"} <= set(info)
    assert stdout.splitlines()[0].startswith("# {")                             # the info line, then a line per row
    rows = doc["rows"]
    assert [(r["cache"], r["batch"], r["context"]) for r in rows] == \
        [(c, b, t) for b, t in ((1, 64), (2, 40)) for c in caches]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["steps"] == 2 and 0 < r["ms_min"] <= r["ms_per_step"] <= r["ms_max"]
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["ms_per_step"] * 1e3)
        assert "cache_bytes" not in r and "peak_extra_bytes" not in r           # CUDA allocator figures only
        if r["cache"] in ("KIVI-K2V2:reference", "FP16"):                       # kvq caches: their own bytes
            assert isinstance(r["fused"], bool) and r["kvq_memory_bytes"] > 0 and r["kvq_allocated_bytes"] > 0
        else:
            assert "kvq_memory_bytes" not in r
    assert sum(f"{c}" in line for line in stdout.splitlines() for c in caches) >= len(rows)
    table = _e2e_table().table(doc)                                             # the README table's consumer
    assert "| KIVI-K2V2:reference |" in table and re.search(r"\| FP16 \| [\d.]+ \([\d.]+x\) \|", table), table


def test_default_caches_are_valid_where_they_run():
    for name in bench_e2e.DEFAULT_CACHES:
        bench_e2e.check_cache_name(name, "cuda")
    for name in bench_e2e.DEFAULT_CPU_CACHES:
        bench_e2e.check_cache_name(name, "cpu")
    assert not any(n.endswith((":triton", ":cupy")) for n in bench_e2e.DEFAULT_CPU_CACHES)
    assert bench_e2e.model_bytes(False, "cuda") == pytest.approx(16.06e9, rel=1e-3)   # Llama-3.1-8B in fp16


# ------------------------------------------------------------------------------------- bad invocations

# (argv after `kvq bench e2e`, a fragment of the one-line message)
BAD = [
    (["--shapes", "8x"], "argument --shapes: shape '8x' must be BATCHxCONTEXT"),
    (["--shapes", "8"], "must be BATCHxCONTEXT"),
    (["--shapes", "1x2x3"], "must be BATCHxCONTEXT"),
    (["--shapes", "0x64"], "batch and context must be positive"),
    (["--shapes", "1x-64"], "batch and context must be positive"),
    (["--steps", "0"], "argument --steps: must be a positive integer"),
    (["--steps", "-2"], "argument --steps"),
    (["--steps", "x"], "'x' is not an integer"),
    (["--warmup", "-1"], "argument --warmup: must be a non-negative integer"),
    (["--chunk", "0"], "argument --chunk"),
    (["--max-batch", "0"], "argument --max-batch"),
    (["--margin-gib", "-1"], "argument --margin-gib"),
    (["--margin-gib", "nan"], "argument --margin-gib"),
    (["--caches"], "argument --caches: expected at least one argument"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--tiny", "--caches", "NoSuch"], "--caches 'NoSuch': unknown cache"),
    (["--tiny", "--caches", "KIVI-K2V2:bogus"], "unknown backend 'bogus'"),
    (["--tiny", "--caches", "KIVI-K2V2:"], "unknown backend ''"),
    (["--tiny", "--caches", "quanto-3"], "quanto takes 2, 4 bits"),
    (["--tiny", "--caches", "HQQ-5"], "HQQ takes 1, 2, 3, 4, 8 bits"),
    (["--tiny", "--caches", "quanto-2-x"], "unknown cache"),
    (["--tiny", "--device", "cpu", "--caches", "DynamicCache", "KIVI-K2V2:cupy"], "cupy backend needs a CUDA device"),
    (["--tiny", "--device", "cuda"], "--device cuda: torch sees no CUDA GPU"),
    (["--tiny", "--device", "cuda:1"], "--device cuda:1"),
    (["--tiny", "--device", "tpu"], "--device 'tpu': expected cpu, cuda or cuda:N"),
    (["--tiny", "--max-batch", "1024"], "--max-batch: sizes the batch to a CUDA card's free memory"),
    (["--tiny", "--max-batch-caches", "FP16"], "--max-batch-caches: needs --max-batch"),
    (["--graph", "0"], "argument --graph"),
    (["--tiny", "--device", "cpu", "--graph", "10"], "--graph: times a CUDA-graph replay of the step; needs --device cuda"),
    (["--graphed", "0"], "argument --graphed"),
    (["--tiny", "--device", "cpu", "--graphed", "10"], "--graphed: replays the step from CUDA graphs; needs --device cuda"),
    (["--tiny", "--out", "{file}/r.json"], "is not a directory"),
    (["--tiny", "--out", "{dir}"], "is a directory, not a file"),
    (["--tiny", "--out", ""], "--out is empty"),
]


@pytest.mark.parametrize("argv, fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_invocation_one_line_status_2_before_any_work(argv, fragment, tmp_path, no_work, capsys):
    file = tmp_path / "file.txt"
    file.write_text("x")
    argv = [a.format(file=file, dir=tmp_path) for a in argv]
    for main, args, prog in ((cli.main, ["bench", "e2e", *argv], "kvq bench( e2e)?"),     # argparse: extras
                             (bench_e2e.main, argv, "kvq bench e2e")):                 # named by `kvq bench`
        rc, out, err = _run(args, capsys, main)
        assert rc == 2, (rc, err)
        assert out == "" and "Traceback" not in err
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert re.match(rf"{prog}: error: ", lines[0]) and fragment in lines[0], lines[0]
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]                 # nothing written


def test_triton_on_the_cpu_only_under_the_interpreter(monkeypatch, no_work, capsys):
    pytest.importorskip("triton")
    from kvq.fast.triton import quant

    monkeypatch.setattr(quant, "interpreting", lambda: False)
    rc, out, err = _run(["bench", "e2e", "--tiny", "--device", "cpu", "--caches", "KIVI-K2V2:triton"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "the triton backend needs a CUDA device, or Triton's CPU interpreter" in err
    assert "KIVI-K2V2:reference" in err
    monkeypatch.setattr(quant, "interpreting", lambda: True)
    bench_e2e.check_cache_name("KIVI-K2V2:triton", "cpu")                        # accepted under the interpreter


def test_max_batch_caches_must_be_among_caches(monkeypatch, no_work, capsys):
    """On a (pretended) CUDA device: --max-batch-caches names only caches that are timed."""
    monkeypatch.setattr(bench_e2e, "check_device", lambda *a, **k: None)
    monkeypatch.setattr(bench_e2e, "_device_memory", lambda device: 80 * 2 ** 30)
    rc, out, err = _run(["bench", "e2e", "--device", "cuda", "--caches", "FP16", "--max-batch", "1024",
                         "--max-batch-caches", "FP16", "HQQ-2"], capsys)
    assert rc == 2 and err.strip() == ("kvq bench e2e: error: --max-batch-caches HQQ-2: not among --caches (each "
                                       "is sized from its measured rows)")
    with pytest.raises(WorkStarted):                                            # a good request reaches the run
        cli.main(["bench", "e2e", "--device", "cuda", "--caches", "FP16", "--max-batch", "1024"])


def test_full_model_on_a_small_machine_is_refused(monkeypatch, no_work, capsys):
    monkeypatch.setattr(bench_e2e, "_device_memory", lambda device: 16 * 2 ** 30)
    rc, out, err = _run(["bench", "e2e", "--device", "cpu", "--caches", "DynamicCache"], capsys)
    assert rc == 2 and "more than half of the 16 GiB" in err and "use --tiny" in err
    with pytest.raises(WorkStarted):
        cli.main(["bench", "e2e", "--device", "cpu", "--tiny", "--caches", "DynamicCache"])


def test_help(capsys):
    assert cli.main(["bench", "e2e", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: kvq bench e2e" in out and "--shapes" in out and "--max-batch-caches" in out
    assert bench.main(["--help"]) == 0
    assert "e2e" in capsys.readouterr().out


# ------------------------------------------------------------------------------------- the script

def _script(*argv):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}      # a copy: nothing leaks
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300,
                          env=env, cwd=str(ROOT.parent))


def test_script_help_and_bad_invocation():
    r = _script("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: bench_e2e.py") and "--shapes" in r.stdout and "--out" in r.stdout
    assert "One decode step of a Llama-3.1-8B-shaped model" in r.stdout
    r = _script("--shapes", "8x", "--out", "x.json")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert re.fullmatch(r"bench_e2e\.py: error: argument --shapes: shape '8x' must be BATCHxCONTEXT.*\n", r.stderr)


def test_table_shows_graph_times_and_largest_batches():
    """The JSON's --graph and --max-batch fields become two more tables; a step that was not captured says so."""
    info = {"device": "card", "torch": "t", "transformers": "x", "triton": "y", "commit": "c", "date": "d"}
    ok = lambda c, b, t, ms, **kw: dict(cache=c, batch=b, context=t, ms_per_step=ms, tokens_per_s=b / ms * 1e3,  # noqa: E731
                                        status="ok", **kw)
    rows = [ok("StaticCache", 1, 32768, 30.0, graph_ms_per_step=8.0),
            ok("KIVI-K2V2:cupy", 1, 32768, 40.0, graph_ms_per_step=6.0),
            ok("AQUA-KV:triton", 1, 32768, 60.0, graph_status="failed: RuntimeError: sync"),
            ok("KIVI-K2V2:cupy", 96, 32768, 50.0, max_batch=True),
            dict(cache="StaticCache", batch=3, context=32768, status="oom", max_batch=True)]
    table = _e2e_table().table({"info": info, "rows": rows})
    assert "| KIVI-K2V2:cupy | 40.0 (1.33x) |" in table
    assert "| StaticCache | 8.00 |" in table and "| KIVI-K2V2:cupy | 6.00 (0.75x) |" in table
    assert "| AQUA-KV:triton | no capture |" in table
    assert "| KIVI-K2V2:cupy | 32K | 96 | 50.0 | 1920 |" in table and "| StaticCache | 32K | oom (at 3) | - | - |" in table
    plain = _e2e_table().table({"info": info, "rows": [ok("StaticCache", 1, 32768, 30.0)]})
    assert "GPU time" not in plain and "largest batch" not in plain


def test_table_shows_the_graphed_decode_step():
    """--graphed's field becomes its own table: each kvq cache's step x the eager StaticCache step and x its GPU
    time; a step that could not be recorded says so; caches without the field are left out."""
    info = {"device": "card", "torch": "t", "transformers": "x", "triton": "y", "commit": "c", "date": "d"}
    ok = lambda c, b, t, ms, **kw: dict(cache=c, batch=b, context=t, ms_per_step=ms, tokens_per_s=b / ms * 1e3,  # noqa: E731
                                        status="ok", **kw)
    rows = [ok("StaticCache", 1, 32768, 30.0, graph_ms_per_step=20.0),
            ok("KIVI-K2V2:cupy", 1, 32768, 40.0, graphed_ms_per_step=12.0),
            ok("Kitty:cupy", 1, 32768, 40.0, graphed_status="failed: RuntimeError: x"),
            ok("OSCAR:cupy", 1, 32768, 45.0)]
    table = _e2e_table().table({"info": info, "rows": rows})
    assert "| KIVI-K2V2:cupy | 12.0 (0.40x, 0.60x) |" in table
    assert "| Kitty:cupy | no capture |" in table
    graphed = table.split("kvq.integrations.graphs")[1]
    assert "OSCAR" not in graphed and "| StaticCache |" not in graphed
    plain = _e2e_table().table({"info": info, "rows": [ok("StaticCache", 1, 32768, 30.0)]})
    assert "kvq.integrations.graphs" not in plain


def test_a_row_lets_go_of_its_cache_before_it_frees_memory(monkeypatch):
    """run_one's last collection (before it returns the device's memory) finds the row's cache unreachable:
    nothing of the row (its step's closure included) holds it, so the next row, and --max-batch's sizing
    from the free memory, see that memory free."""
    import gc
    import types
    import weakref

    made, dead = [], []
    real_make = bench_e2e.make

    def make(*a, **k):
        cache = real_make(*a, **k)
        made.append(weakref.ref(cache))
        return cache

    def collect():
        gc.collect()
        dead.append(bool(made) and made[-1]() is None)

    monkeypatch.setattr(bench_e2e, "make", make)
    monkeypatch.setattr(bench_e2e, "gc", types.SimpleNamespace(collect=collect))
    model = bench_e2e.build_model(True, "cpu", 128)
    args = types.SimpleNamespace(device="cpu", warmup=1, steps=1, chunk=32, graph=None)
    row = bench_e2e.run_one(model, "DynamicCache", 1, 32, args)
    assert row["status"] == "ok" and len(made) == 1
    assert dead[-1], "the row's cache was still reachable when run_one freed the device's memory"


def test_fill_commits_aqua_kv_as_a_prefill_does():
    """The benchmark's fill tells a kvq cache each layer was attended, as the model's kvq attention does in a
    prefill: AQUA-KV commits every chunk, so none of the filled tokens waits in fp16 (it all waited until the
    first step, and the fill, not the cache, bounded AQUA-KV's largest batch); the other caches are as
    before."""
    model = bench_e2e.build_model(True, "cpu", 128)
    aqua = bench_e2e.make("AQUA-KV:reference", model, 1, 48, 4)
    bench_e2e.fill(aqua, model, 1, 48, 16)
    store = aqua.store
    assert store.length(0) == 48 and all(store.pending(l) == 0 for l in range(store.n_layers))
    kivi = bench_e2e.make("KIVI-K2V2:reference", model, 1, 48, 4)
    bench_e2e.fill(kivi, model, 1, 48, 16)
    assert kivi.get_seq_length() == 48


def test_a_failing_row_is_recorded_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """A cache whose step raises (not out of memory) gets ``status: "failed: <error> [at file:line]"``; the
    rows after it still run while the device takes work."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    real_fill = bench_e2e.fill

    def fill(cache, *a, **k):
        if type(cache).__name__ == "DynamicCache":
            raise RuntimeError("boom in the peer's kernel")
        return real_fill(cache, *a, **k)

    monkeypatch.setattr(bench_e2e, "fill", fill)
    out = tmp_path / "e2e.json"
    rc, stdout, err = _run(["bench", "e2e", "--tiny", "--device", "cpu", "--shapes", "1x40", "--caches", "DynamicCache",
                            "FP16", "--steps", "1", "--warmup", "0", "--chunk", "32", "--out", str(out)], capsys)
    assert rc == 0, err
    doc = json.loads(out.read_text())
    failed, ok = doc["rows"]
    assert re.fullmatch(r"failed: RuntimeError: boom in the peer's kernel \[at test_cli_bench_e2e\.py:\d+\]",
                        failed["status"]), failed
    assert ok["cache"] == "FP16" and ok["status"] == "ok" and "stopped" not in doc["info"]
    assert "failed: RuntimeError" in stdout


def test_a_row_that_loses_the_device_stops_the_run(tmp_path, capsys, monkeypatch):
    """A failure that takes the device with it (an illegal memory access leaves the CUDA context unusable):
    the run records where in ``info["stopped"]``, runs no further row and ends with status 1."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    real_fill, alive = bench_e2e.fill, [True]

    def fill(cache, *a, **k):
        if type(cache).__name__ == "DynamicCache":
            alive[0] = False
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_fill(cache, *a, **k)

    monkeypatch.setattr(bench_e2e, "fill", fill)
    monkeypatch.setattr(bench_e2e, "device_alive", lambda device: alive[0])
    out = tmp_path / "e2e.json"
    rc, stdout, err = _run(["bench", "e2e", "--tiny", "--device", "cpu", "--shapes", "1x40", "2x40", "--caches",
                            "FP16", "DynamicCache", "--steps", "1", "--warmup", "0", "--chunk", "32", "--out", str(out)],
                           capsys)
    assert rc == 1
    doc = json.loads(out.read_text())
    assert [(r["cache"], r["batch"], r["status"][:6]) for r in doc["rows"]] == [("FP16", 1, "ok"), ("DynamicCache", 1, "failed")]
    assert doc["info"]["stopped"].startswith("the CUDA context was lost at DynamicCache 1 x 40 (failed: RuntimeError")
    assert "the rows after it were not run" in stdout


def test_device_alive_on_the_cpu():
    assert bench_e2e.device_alive("cpu") is True


# ----------------------------------------------------------------------------- quanto's unpack limit


@pytest.mark.parametrize("tokens", [32768, 32768 + 14, 8192, 131072, 3])
def test_quanto_batch_limit_is_the_largest_batch_within_2_31_codes(tokens):
    lim = bench_e2e.quanto_batch_limit(tokens, 8, 128)
    assert lim * tokens * 8 * 128 <= 2 ** 31 < (lim + 1) * tokens * 8 * 128


def test_quanto_batch_limit_at_32k():
    # the lab note's figures: 64 at a 32K prefill (exactly 2^31 codes), 63 once steps add tokens
    assert bench_e2e.quanto_batch_limit(32768, 8, 128) == 64
    assert bench_e2e.quanto_batch_limit(32769, 8, 128) == 63


def _max_batch_args(**kw):
    import argparse
    return argparse.Namespace(**{"warmup": 2, "steps": 4, "graph": None, "graphed": None, "margin_gib": 3.0, **kw})


def _fake_model():
    from types import SimpleNamespace
    return SimpleNamespace(config=SimpleNamespace(num_key_value_heads=8, head_dim=128, hidden_size=4096,
                                                  num_attention_heads=32))


@pytest.fixture
def fake_gpu(monkeypatch):
    """max_batch without a GPU: 100 GiB free, and run_one records the batch it was asked for."""
    import torch
    asked = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * 2 ** 30, 140 * 2 ** 30))

    def run_one(model, name, batch, context, args):
        asked.append(batch)
        return {"cache": name, "batch": batch, "context": context, "status": "ok"}
    monkeypatch.setattr(bench_e2e, "run_one", run_one)
    return asked


def test_max_batch_caps_quanto_at_the_unpack_limit(fake_gpu):
    args = _max_batch_args()
    row = bench_e2e.max_batch(_fake_model(), "quanto-2", 32768, 2 ** 30, args)   # 1 GiB / sequence: 97 fit
    want = bench_e2e.quanto_batch_limit(32768 + bench_e2e.step_tokens(args), 8, 128)
    assert want == 63 and fake_gpu == [want]
    assert row["batch"] == want and row["max_batch"] and "2^31 codes" in row["capped"]


def test_max_batch_leaves_other_caches_and_small_quanto_batches_alone(fake_gpu):
    args = _max_batch_args()
    row = bench_e2e.max_batch(_fake_model(), "KIVI-K2V2:cupy", 32768, 2 ** 30, args)
    assert fake_gpu == [97] and "capped" not in row                   # (100 - 3) GiB / 1 GiB per sequence
    row = bench_e2e.max_batch(_fake_model(), "quanto-4", 32768, 2 ** 31, args)    # 2 GiB / sequence: 48 fit
    assert fake_gpu[-1] == 48 and "capped" not in row


def test_max_batch_refuses_a_context_past_quanto_s_limit_at_batch_1(fake_gpu):
    row = bench_e2e.max_batch(_fake_model(), "quanto-2", 2 ** 21, 2 ** 30, _max_batch_args())
    assert fake_gpu == [] and row["status"].startswith("failed:") and row["batch"] == 0


def test_e2e_table_marks_a_capped_largest_batch():
    rows = [{"cache": "quanto-2", "batch": 63, "context": 32768, "status": "ok", "ms_per_step": 900.0,
             "tokens_per_s": 70.0, "max_batch": True, "capped": "at most 63: ..."},
            {"cache": "KIVI-K2V2:cupy", "batch": 175, "context": 32768, "status": "ok", "ms_per_step": 58.4,
             "tokens_per_s": 2997.0, "max_batch": True}]
    table = _e2e_table().max_batch_table(rows)
    assert "| quanto-2 | 32K | 63 (capped) |" in table and "| KIVI-K2V2:cupy | 32K | 175 |" in table
