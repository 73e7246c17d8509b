"""What the `kvq` command line prints: `kvq eval` ends with an aligned table (one row per method, one column
per metric), never a Python dict; and every subcommand survives a closed stdout (`kvq ... | head`): no
traceback, exit status 141 (128 + SIGPIPE)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from kvq import cli
from kvq.commands import eval as ev

PPL = {
    "protocol": "Perplexity with the compressed KV cache maintained while the text is consumed. " * 3,
    "windows": 1, "seq_len": 160, "chunk": 80, "tokens_scored": 159, "backend": "auto",
    "rows": [{"method": "no cache", "ppl": 95.1234, "nll": 4.555, "bits_per_element": 32.0,
              "bits_per_element_paper": 32.0, "seconds": 0.4},
             {"method": "KIVI-K2V2", "ppl": 101.2, "nll": 4.6171, "bits_per_element": 3.125,
              "bits_per_element_paper": 2.25, "seconds": 12.34}],
    "meta": {"kvq": "0.1.0", "commit": "abc1234", "date_utc": "2026-01-01T00:00:00Z", "device": "cpu",
             "model": "runs/tiny lm", "model_dtype": "float32", "argv": ["ppl", "--model", "runs/tiny lm"]},
}
ATTENTION = {
    "protocol": "Attention-level errors (OSCAR, section 5).",
    "shape": {"layers": 6, "batch": 1, "kv_heads": 12, "tokens": 16, "head_dim": 32}, "causal": False,
    "backend": "reference",
    "rows": [{"method": "FP16", "bits_per_element": 16.0,
              "mean": {"k_rel_mse": 1e-8, "v_rel_mse": 2e-8, "logit_mse": 9.146e-08, "attention_kl": 2.102e-08,
                       "output_mse": 3.923e-09}},
             {"method": "KIVI-K2V2", "bits_per_element": 2.25,
              "mean": {"k_rel_mse": 0.0812, "v_rel_mse": 0.1203, "logit_mse": 0.5, "attention_kl": 0.0123,
                       "output_mse": 0.0042}},
             {"method": "BitDecoding-2", "skipped": "head_dim 32: the layout needs a multiple of 64"}],
    "meta": {"kvq": "0.1.0", "argv": ["attention", "--windows", "1"]},
}


def printed(res, capsys) -> list[str]:
    ev._print(res)
    return capsys.readouterr().out.splitlines()


def table_of(lines) -> tuple[list[str], list[list[str]], list[str]]:
    """(header cells, row cells, the raw table lines) of the table that ends the output: the block whose
    second line is a rule of dashes; cells are split on runs of two or more spaces."""
    rule = max(i for i, line in enumerate(lines) if line and set(line) <= {"-", " "})
    block = lines[rule - 1:]
    split = [re.split(r" {2,}", line.strip()) for line in block]
    return split[0], split[2:], block


def test_ppl_ends_with_a_table_not_a_dict(capsys):
    lines = printed(PPL, capsys)
    assert not any(line.lstrip().startswith("{") for line in lines)          # no dict repr anywhere
    header, rows, block = table_of(lines)
    assert lines[-1] == block[-1]                                            # the table is the last thing
    assert header == ["method", "bits/elem", "bits/elem (paper)", "nll (nats/token)", "ppl", "seconds"]
    assert rows == [["no cache", "32.000", "32.000", "4.5550", "95.1234", "0.4"],
                    ["KIVI-K2V2", "3.125", "2.250", "4.6171", "101.2000", "12.3"]]
    # aligned: every numeric column ends at the same character in every line of the table
    spans = [[m.span() for m in re.finditer(r"\S+(?: \S+)*", line)] for line in [block[0], *block[2:]]]
    assert all(len(sp) == len(header) for sp in spans)
    for j, name in enumerate(header):
        edges = {sp[j][0] if j == 0 else sp[j][1] for sp in spans}         # names left, numbers right
        assert len(edges) == 1, (name, edges)
    # the metadata as `field  value` lines, the command line re-quoted
    assert "argv         kvq eval ppl --model 'runs/tiny lm'" in lines      # names padded to model_dtype's
    assert "commit       abc1234" in lines
    assert max(len(line) for line in lines[:lines.index("")]) <= 100         # the protocol, wrapped


def test_attention_table_has_a_row_per_method_and_a_note_for_skipped(capsys):
    lines = printed(ATTENTION, capsys)
    header, rows, block = table_of(lines)
    assert lines[-1] == block[-1]
    assert header == ["method", "bits/elem", "K relMSE", "V relMSE", "logit MSE", "attn KL (nats)", "out MSE",
                      "note"]
    assert [r[0] for r in rows] == ["FP16", "KIVI-K2V2", "BitDecoding-2"]
    assert rows[1] == ["KIVI-K2V2", "2.250", "0.0812", "0.1203", "0.5", "0.0123", "0.0042"]
    assert rows[2] == ["BitDecoding-2", "-", "-", "-", "-", "-", "-",
                       "skipped: head_dim 32: the layout needs a multiple of 64"]
    assert "6 layers, 1 windows x 16 tokens, 12 KV heads of 32, causal=False; means over layers" in lines


def test_format_table_alignment_and_bad_rows():
    out = ev.format_table(["name", "x"], [["a", "1.5"], ["long name", "10.25"]])
    assert out == ["name           x",
                   "---------  -----",
                   "a            1.5",
                   "long name  10.25"]
    with pytest.raises(ValueError, match="row 1 has 1 cells; the header has 2"):
        ev.format_table(["name", "x"], [["a", "1"], ["b"]])
    with pytest.raises(ValueError, match="align must give"):
        ev.format_table(["name", "x"], [["a", "1"]], align="<^")


def test_json_output_is_unchanged(capsys, tmp_path):
    """--json prints exactly ``json.dumps(result, indent=1)`` and --out writes it: the table is for people."""
    import json

    from kvq.commands import emit

    out = tmp_path / "r.json"
    emit(ATTENTION, out=str(out), as_json=True, printer=ev._print)
    assert capsys.readouterr().out == json.dumps(ATTENTION, indent=1) + "\n"
    assert json.loads(out.read_text()) == ATTENTION


# ---------------------------------------------------------------------------------------------------
# a closed stdout


class _ClosedPipe(io.TextIOBase):
    """A stdout whose reader has gone: every write raises BrokenPipeError (as a pipe does)."""

    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass


def test_closed_stdout_in_process(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert cli.main(["--help"]) == cli.CLOSED_PIPE_STATUS == 141
    assert cli.main(["figures", "--list"]) == 141
    assert capsys.readouterr().err == ""


def _run_into_closed_pipe(argv, timeout=120, unbuffered=True):
    """Run ``python -m kvq ARGV`` with stdout a pipe whose reading end is already closed (what ``| head``
    leaves once head has exited); returns the CompletedProcess (stderr captured as text). Unbuffered, the
    first print meets the closed pipe; buffered, the flush at the end does."""
    r, w = os.pipe()
    os.close(r)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", **({"PYTHONUNBUFFERED": "1"} if unbuffered else {}))
    try:
        return subprocess.run([sys.executable, "-m", "kvq", *argv], stdout=w, stderr=subprocess.PIPE, text=True,
                              timeout=timeout, env=env)
    finally:
        os.close(w)


@pytest.mark.parametrize("unbuffered", [True, False], ids=["unbuffered", "buffered"])
@pytest.mark.parametrize("argv", [["--help"], ["figures", "--list"]], ids=["help", "figures-list"])
def test_closed_pipe_cheap_commands(argv, unbuffered):
    res = _run_into_closed_pipe(argv, unbuffered=unbuffered)
    assert "Traceback" not in res.stderr and "BrokenPipeError" not in res.stderr, res.stderr
    assert res.returncode == 141, res.stderr


def test_eval_into_a_closed_pipe():
    """`kvq eval attention ... | head`: the cheapest real evaluation (the packaged MiniLM, one window of 16
    tokens, FP16 only) ends quietly when nobody reads its table."""
    res = _run_into_closed_pipe(["eval", "attention", "--methods", "FP16", "--windows", "1", "--seq-len", "16",
                                 "--device", "cpu", "--quiet"], timeout=300)
    assert "Traceback" not in res.stderr and "BrokenPipeError" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == 141, res.stderr[-3000:]


def test_head_reads_the_first_line():
    """The shell case itself: `kvq figures --list | head -1` prints the first line and exits 0."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    res = subprocess.run(f"'{sys.executable}' -m kvq figures --list | head -1", shell=True, capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.stdout == "synthetic:\n" and "Traceback" not in res.stderr, res.stderr
