"""Bad invocations of every ``kvq`` command (issue 36, item 8): each ends with ONE line on stderr and a
non-zero exit status, before any work, never with a Python traceback.

The table below runs in-process through ``kvq.cli.main`` with every entry point of real work replaced
by a tripwire (model loading, the benchmarks, figure drawing, the demo's computation, the evaluations),
so a check that came too late fails the test instead of running for minutes. A few invocations run as
real subprocesses (``python -m kvq``) to prove the exit status and the absence of a traceback end to end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np
import pytest

from kvq import cli
from kvq import commands as C

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvq import calibration as cf  # noqa: E402
from kvq.reference import aqua, oscar  # noqa: E402


class WorkStarted(AssertionError):
    """Raised by a tripwire: a command began its work before refusing a bad invocation."""


@pytest.fixture
def no_work(monkeypatch):
    """Every entry point of real work raises WorkStarted; no GPU is visible (whatever the machine)."""
    import torch

    from kvq import demo, evaluation
    from kvq.commands import bench, calibrate, figures
    from kvq.integrations import models

    def trip(name):
        def f(*a, **k):
            raise WorkStarted(f"{name} was called: the invocation was not refused before the work")
        return f

    for mod, name in ((models, "load_model"), (models, "load_minilm"), (bench, "bench_quant"),
                      (bench, "bench_decode"), (figures, "write_figures"), (figures, "minilm_activations"),
                      (demo, "run_reference"), (demo, "synthetic_kv"), (evaluation, "perplexity"),
                      (evaluation, "attention_errors"), (calibrate, "calibrate_oscar_model"),
                      (calibrate, "calibrate_aqua_model")):
        monkeypatch.setattr(mod, name, trip(f"{mod.__name__}.{name}"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def paths(tmp_path):
    """Files the table refers to: a model directory (config.json only), a FIFO, a regular file, calibration
    files of both kinds, a directory."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 256, "num_hidden_layers": 2}')
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    file = tmp_path / "file.txt"
    file.write_text("hello\n")
    shape = {"n_layers": 2, "kv_heads": 2, "head_dim": 16, "rope_theta": 10000.0}
    osc = tmp_path / "o.safetensors"
    cf.save_oscar(osc, [oscar.identity_calibration(16)] * 2, model_shape=shape)
    rng = np.random.default_rng(0)

    def pred(F_in):
        return aqua.Predictor((rng.standard_normal((F_in, 32)).astype(np.float32),),
                              rng.standard_normal(32).astype(np.float32))

    P = aqua.AquaPredictors((None, pred(32)), (None, pred(64)))
    aq = tmp_path / "a.safetensors"
    cf.save_aqua(aq, P, aqua.AquaConfig(), model_shape=shape)                     # HIGGS backbone
    return {"model": str(model), "empty": str(empty), "fifo": str(fifo), "file": str(file), "oscar": str(osc),
            "aqua": str(aq), "dir": str(tmp_path), "missing": str(tmp_path / "missing")}


def _run(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:                                     # argparse exits; cli returns the rest
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


M = ["--model", "{model}"]
O = ["--out", "{dir}/out.safetensors"]

# (argv, a fragment the one-line message must contain)
BAD = [
    # the dispatcher
    (["nosuch"], "unknown command 'nosuch'"),
    (["--bogus"], "unknown command '--bogus'"),
    # kvq demo
    (["demo", "--outliers", "-1"], "argument --outliers: must be an integer in [0, 128]"),
    (["demo", "--outliers", "129"], "argument --outliers"),
    (["demo", "--tokens", "0"], "argument --tokens"),
    (["demo", "--tokens", "100"], "--tokens must be a positive multiple of 128"),
    (["demo", "--tokens", "1e3"], "'1e3' is not an integer"),
    (["demo", "--tokens", "1048576"], "argument --tokens: must be an integer in [1, 65536]"),
    (["demo", "--seed", "-1"], "argument --seed: must be a non-negative integer"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    # kvq eval
    (["eval"], "the following arguments are required"),
    (["eval", "ppl"], "the following arguments are required: --model"),
    (["eval", "ppl", *M, "--methods", "NoSuch"], "unknown kvq method 'NoSuch'"),
    (["eval", "ppl", *M, "--methods", "KIVI-K2V2", "--set", "KIVI-K2V2:bogus=1"], "KIVI-K2V2 has no option 'bogus'"),
    (["eval", "ppl", *M, "--set", "KIVI-K2V2residual=1"], "expected METHOD:KEY=VALUE"),
    (["eval", "ppl", *M, "--set", "NoSuch:sink=1"], "unknown kvq method 'NoSuch'"),
    (["eval", "ppl", *M, "--methods", "FP16", "--set", "KIVI-K2V2:residual=64"], "KIVI-K2V2 is not among --methods"),
    (["eval", "ppl", *M, "--out", "{file}/result.json"], "is not a directory"),
    (["eval", "ppl", *M, "--out", "{dir}"], "is a directory, not a file"),
    (["eval", "ppl", *M, "--out", "{fifo}"], "is not a regular file"),
    (["eval", "ppl", *M, "--methods", "OSCAR", "--calib-oscar", "{fifo}"],
     "--calib-oscar {fifo}: is a named pipe (FIFO), not a regular file"),
    (["eval", "ppl", *M, "--calib-oscar", "{dir}"], "is a directory, not a regular file"),
    (["eval", "ppl", *M, "--calib-oscar", "{missing}"], "no such calibration file"),
    (["eval", "ppl", *M, "--calib-oscar", "{aqua}"], "holds a 'aqua' calibration, not 'oscar'"),
    (["eval", "ppl", *M, "--calib-aqua-uniform", "{aqua}"], "calibrated with the 'higgs' backbone, not 'uniform'"),
    (["eval", "ppl", *M, "--calib-aqua", "{file}"], "truncated, not a safetensors file|not a valid safetensors"),
    (["eval", "ppl", *M, "--windows", "0"], "argument --windows: must be a positive integer"),
    (["eval", "ppl", *M, "--batch-size", "-2"], "argument --batch-size"),
    (["eval", "ppl", *M, "--chunk", "0"], "argument --chunk"),
    (["eval", "ppl", *M, "--seq-len", "1"], "argument --seq-len: must be an integer in [2,"),
    (["eval", "ppl", *M, "--seq-len", "512"], "--seq-len 512 exceeds the model's 256 positions"),
    (["eval", "ppl", *M, "--calib-tokens", "0"], "argument --calib-tokens"),
    (["eval", "ppl", *M, "--calib-seq-len", "1"], "argument --calib-seq-len"),
    (["eval", "ppl", *M, "--seq-len", "128", "--calibrate", "--calib-tokens", "10", "--calib-seq-len", "64"],
     "--calib-tokens 10 is less than one sequence"),
    (["eval", "ppl", *M, "--backend", "bogus"], "argument --backend: invalid choice"),
    (["eval", "ppl", *M, "--device", "cuda"], "--device cuda: torch sees no CUDA GPU"),
    (["eval", "ppl", *M, "--device", "tpu"], "--device 'tpu': expected cpu, cuda or cuda:N"),
    (["eval", "ppl", *M, "--dtype", "float13"], "--dtype 'float13'"),
    (["eval", "ppl", *M, "--dtype", "int8"], "--dtype 'int8'"),
    (["eval", "ppl", *M, "--source", "{missing}"], "no such file"),
    (["eval", "ppl", "--model", "{missing}"], "no such model directory"),
    (["eval", "ppl", "--model", "{file}"], "is a file; expected a model directory"),
    (["eval", "ppl", "--model", "{empty}"], "has no config.json"),
    (["eval", "attention", "--seq-len", "1024"], "--seq-len 1024 exceeds the model's 512 positions"),
    (["eval", "attention", "--windows", "-1"], "argument --windows"),
    (["eval", "attention", "--model", "./no/such/dir"], "no such model directory"),
    # kvq calibrate
    (["calibrate"], "the following arguments are required"),
    (["calibrate", "oscar", *M], "the following arguments are required: --out"),
    (["calibrate", "oscar", *M, *O, "--device", "cuda"], "--device cuda: torch sees no CUDA GPU"),
    (["calibrate", "aqua", *M, *O, "--device", "cuda:0"], "--device cuda:0: torch sees no CUDA GPU"),
    (["calibrate", "oscar", *M, *O, "--tokens", "0"], "argument --tokens: must be a positive integer"),
    (["calibrate", "oscar", *M, *O, "--seq-len", "0"], "argument --seq-len"),
    (["calibrate", "oscar", *M, *O, "--batch-size", "0"], "argument --batch-size"),
    (["calibrate", "oscar", *M, *O, "--tokens", "100"], "--tokens 100 is less than one sequence of --seq-len 512"),
    (["calibrate", "oscar", *M, *O, "--clip-k", "0"], "argument --clip-k: must be a ratio in (0, 1]"),
    (["calibrate", "oscar", *M, *O, "--clip-k", "1.5"], "argument --clip-k"),
    (["calibrate", "oscar", *M, *O, "--clip-v", "nan"], "argument --clip-v: 'nan' is not a finite number"),
    (["calibrate", "oscar", *M, *O, "--group-size", "0"], "argument --group-size"),
    (["calibrate", "oscar", *M, *O, "--seed", "-1"], "argument --seed"),
    (["calibrate", "oscar", *M, *O, "--rotation", "bogus"], "argument --rotation: invalid choice"),
    (["calibrate", "oscar", *M, *O, "--target", "bogus"], "argument --target: invalid choice"),
    (["calibrate", "aqua", *M, *O, "--rank", "0"], "argument --rank: must be a positive integer"),
    (["calibrate", "aqua", *M, *O, "--ridge", "-1"], "argument --ridge: must be a non-negative number"),
    (["calibrate", "aqua", *M, *O, "--ridge", "inf"], "argument --ridge: 'inf' is not a finite number"),
    (["calibrate", "aqua", *M, *O, "--backbone", "bogus"], "argument --backbone: invalid choice"),
    (["calibrate", "oscar", *M, *O, "--source", "{missing}"], "no such file"),
    (["calibrate", "oscar", *M, *O, "--source", "{dir}"], "is not a regular file"),
    (["calibrate", "oscar", *M, *O, "--dtype", "bogus"], "--dtype 'bogus'"),
    (["calibrate", "oscar", *M, "--out", "{dir}"], "is a directory, not a file"),
    (["calibrate", "oscar", *M, "--out", "{fifo}"], "is not a regular file"),
    (["calibrate", "oscar", *M, "--out", "{file}/x.safetensors"], "is not a directory"),
    (["calibrate", "oscar", "--model", "{missing}", *O], "no such model directory"),
    # kvq bench
    (["bench"], "the following arguments are required"),
    (["bench", "quant", "--group-size", "0"], "argument --group-size: must be a positive integer"),
    (["bench", "quant", "--group-size", "-4"], "argument --group-size"),
    (["bench", "quant", "--group-size", "x"], "'x' is not an integer"),
    (["bench", "quant", "--shape", "1,1,128,128", "--group-size", "96"], "--group-size 96 must divide"),
    (["bench", "quant", "--repeats", "0"], "argument --repeats"),
    (["bench", "quant", "--warmup", "-1"], "argument --warmup"),
    (["bench", "quant", "--bits", "3"], "argument --bits: invalid choice"),
    (["bench", "quant", "--bits", "1"], "argument --bits: invalid choice"),
    (["bench", "quant", "--shape", "1,2,3"], "4 positive integers"),
    (["bench", "quant", "--shape", "0,1,128,128"], "4 positive integers"),
    (["bench", "quant", "--shape", "65536,1024,1048576,128"], "more than a quarter of the"),
    (["bench", "quant", "--device", "cuda"], "--device cuda"),
    (["bench", "quant", "--device", "tpu"], "argument --device: invalid choice"),
    (["bench", "quant", "--backend", "triton"], "--backend triton needs --device cuda"),
    (["bench", "quant", "--out", "{file}/r.json"], "is not a directory"),
    (["bench", "decode", "--methods", "AQUA-KV"], "cannot time 'AQUA-KV'"),
    (["bench", "decode", "--methods", "NoSuch"], "cannot time 'NoSuch'"),
    (["bench", "decode", "--shape", "1,3,2,256,64"], "must be a multiple of H_kv"),
    (["bench", "decode", "--repeats", "-1"], "argument --repeats"),
    # kvq figures
    (["figures", "--dpi", "5"], "argument --dpi: must be an integer in [10, 1200]"),
    (["figures", "--minilm-tokens", "4"], "argument --minilm-tokens"),
    (["figures", "--minilm-tokens", "600"], "argument --minilm-tokens"),
    (["figures", "--minilm-chars", "0"], "argument --minilm-chars"),
    (["figures", "--layer", "-1"], "argument --layer"),
    (["figures", "--head", "x"], "argument --head"),
    (["figures", "--out", "{file}"], "exists and is not a directory"),
    (["figures", "--only", ","], "--only names no figure"),
    (["figures", "--only", "nosuch"], "unknown figure 'nosuch'"),
    (["figures", "--source", "bogus"], "argument --source: invalid choice"),
]


def _fill(argv, paths):
    return [a.format(**paths) for a in argv]


def _id(case):
    return " ".join(case[0])


@pytest.mark.parametrize("argv, fragment", BAD, ids=[_id(c) for c in BAD])
def test_bad_invocation_one_line_nonzero_before_any_work(argv, fragment, paths, no_work, capsys):
    rc, out, err = _run(_fill(argv, paths), capsys)
    assert isinstance(rc, int) and rc != 0, (rc, err)
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error" in lines[0]
    import re
    assert re.search(fragment.format(**paths) if "|" in fragment else re.escape(fragment.format(**paths)),
                     lines[0]), lines[0]
    assert out == ""                                            # nothing was computed or printed


def test_every_numeric_option_is_range_checked():
    """Each command's parser gives every int / float option a checking type (positive, non-negative, in
    a range, a ratio), so a bad number is refused as it is parsed."""
    from kvq import demo
    from kvq.commands import bench, calibrate, figures
    from kvq.commands import eval as ev

    unchecked = []

    def walk(p, where):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, f"{where} {name}")
            elif a.type in (int, float):
                if not a.choices:
                    unchecked.append(f"{where} {a.option_strings}")
    parsers = {"demo": demo.build_parser(), "eval": ev.build_parser(), "calibrate": calibrate.build_parser(),
               "bench": bench.build_parser(), "figures": figures.build_parser()}
    for where, p in parsers.items():
        assert isinstance(p, C.Parser), where
        walk(p, where)
    assert not unchecked, unchecked


def test_set_is_refused_not_skipped_when_it_breaks_the_method():
    """A --set value that makes the method's configuration invalid for the model is an error naming the
    item; a method that cannot serve the model anyway is left to be reported as skipped."""
    from kvq.commands import eval as ev

    geo = {"head_dim": 32, "kv_heads": 2}
    with pytest.raises(ValueError, match=r"--set KIVI-K2V2:residual=-5: "):
        ev._check_set_values({"KIVI-K2V2": {"residual": -5}}, {}, geo, 128)
    with pytest.raises(ValueError, match=r"--set Kitty:residual='abc'"):
        ev._check_set_values({"Kitty": {"residual": "abc"}}, {}, geo, 128)
    ev._check_set_values({"KIVI-K2V2": {"residual": 32}}, {}, geo, 128)
    ev._check_set_values({"BitDecoding-2": {"v_group": 32}}, {}, geo, 128)      # cannot serve head_dim 32: skip


def test_set_that_breaks_a_method_fails_the_evaluation(tmp_path, capsys, monkeypatch):
    """End to end on a tiny model: the run exits non-zero with the --set named (it used to exit 0 with the
    method marked skipped)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))   # torch sets it on model loading
    import torch
    from transformers import LlamaForCausalLM

    from kvq.commands import eval as ev
    from kvq.integrations.models import tiny_llama_config

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1, hidden_size=64, head_dim=32, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=128)).save_pretrained(tmp_path / "m")
    capsys.readouterr()
    rc = ev.main(["ppl", "--model", str(tmp_path / "m"), "--methods", "KIVI-K2V2", "--windows", "1", "--seq-len",
                  "64", "--device", "cpu", "--quiet", "--set", "KIVI-K2V2:residual=-5"])
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]                          # after transformers' weight-loading bar
    assert rc != 0 and last.startswith("kvq eval ppl: error: --set KIVI-K2V2:residual=-5: "), err
    assert "Traceback" not in out + err and out == ""


def test_cli_reports_command_errors_and_keeps_tracebacks_for_bugs(monkeypatch, capsys):
    from kvq import demo

    def bad(argv):
        raise C.CommandError("--x must be 3", "kvq demo")

    monkeypatch.setattr(demo, "main", bad)
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err == "kvq demo: error: --x must be 3\n"

    def bug(argv):
        raise KeyError("a genuine bug")

    monkeypatch.setattr(demo, "main", bug)
    with pytest.raises(KeyError, match="a genuine bug"):
        cli.main(["demo"])


def test_usage_errors_turns_kvq_errors_into_command_errors_only():
    with pytest.raises(C.CommandError, match="boom") as e:
        with C.usage_errors("kvq x"):
            raise cf.CalibrationFileError("boom\n on two lines")
    assert e.value.prog == "kvq x" and str(e.value) == "boom on two lines"
    with pytest.raises(C.CommandError, match="Permission denied"):
        with C.usage_errors("kvq x"):
            raise PermissionError(13, "Permission denied")
    with pytest.raises(RuntimeError):                             # not a usage error: left alone
        with C.usage_errors("kvq x"):
            raise RuntimeError("work failed")


@pytest.mark.parametrize("parse, good, bad", [
    (C.positive_int, [("1", 1), ("42", 42)], ["0", "-1", "1.5", "x", ""]),
    (C.non_negative_int, [("0", 0), ("7", 7)], ["-1", "nan"]),
    (C.positive_float, [("0.5", 0.5), ("1e3", 1000.0)], ["0", "-1", "nan", "inf", "x"]),
    (C.non_negative_float, [("0", 0.0), ("2.5", 2.5)], ["-0.1", "-inf", "nan"]),
    (C.ratio, [("1", 1.0), ("0.25", 0.25)], ["0", "1.01", "-0.5", "nan"]),
    (C.int_in(8, 512), [("8", 8), ("512", 512)], ["7", "513", "8.0"]),
])
def test_argparse_types(parse, good, bad):
    for text, want in good:
        assert parse(text) == want
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_check_out_file_and_dir(tmp_path, monkeypatch):
    C.check_out_file(str(tmp_path / "new" / "deeper" / "r.json"))          # creatable directories are fine
    (tmp_path / "r.json").write_text("{}")
    C.check_out_file(str(tmp_path / "r.json"))                              # an existing file is replaced
    C.check_out_dir(str(tmp_path / "figs"))
    with pytest.raises(C.CommandError, match="is a directory, not a file"):
        C.check_out_file(str(tmp_path))
    with pytest.raises(C.CommandError, match="exists and is not a directory"):
        C.check_out_dir(str(tmp_path / "r.json"))
    with pytest.raises(C.CommandError, match="--out is empty"):
        C.check_out_file("")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if os.fspath(p) == str(tmp_path) else real(p, mode))
    with pytest.raises(C.CommandError, match=f"the directory {tmp_path} is not writable"):
        C.check_out_file(str(tmp_path / "x.json"))                          # a read-only directory (even as root)
    with pytest.raises(C.CommandError, match="is not writable"):
        C.check_out_dir(str(tmp_path / "figs"))


# ---------------------------------------------------------------------------------------------------
# end to end: real processes


@pytest.mark.parametrize("argv, fragment", [
    (["demo", "--outliers", "-1"], "argument --outliers"),
    (["bench", "quant", "--group-size", "0"], "argument --group-size"),
    (["eval", "ppl", "--model", "{model}", "--methods", "KIVI-K2V2", "--set", "KIVI-K2V2:bogus=1"],
     "KIVI-K2V2 has no option 'bogus'"),
    (["eval", "ppl", "--model", "{model}", "--out", "{file}/r.json"], "is not a directory"),
    (["calibrate", "oscar", "--model", "{model}", "--out", "{dir}/o.safetensors", "--device", "cuda:99"],
     "--device cuda:99"),
])
def test_subprocess_exit_status_and_no_traceback(argv, fragment, paths):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "kvq", *_fill(argv, paths)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stdout + r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment.format(**paths) in lines[0], r.stderr


def test_eval_loads_aqua_files_against_the_models_rope_theta(paths):
    """``kvq eval`` checks an AQUA-KV file's RoPE base against the model's (keys predicted before RoPE)."""
    from kvq.commands import eval as ev

    args = argparse.Namespace(calib_oscar=None, calib_aqua=paths["aqua"], calib_aqua_uniform=None)
    geo = {"n_layers": 2, "kv_heads": 2, "head_dim": 16, "rope_theta": 5e5}
    with pytest.raises(cf.CalibrationFileError, match="rope_theta is 10000.0 in the file, expected 500000.0"):
        ev._load_calibrations(args, ["AQUA-KV"], geo)
    cal, ovr, src = ev._load_calibrations(args, ["AQUA-KV"], {**geo, "rope_theta": 10000.0})
    assert ovr["AQUA-KV"]["rope_theta"] == 10000.0 and src["AQUA-KV"]["file"] == paths["aqua"]
