"""Assignments 4 (OSCAR bit reversal, Lemma 1) and 5 (Triton dequantize): every autograder gives the
reference solution full marks and the untouched starter zero (every part "fail": not implemented, no
crash), in process and as a script; and no starter imports the solutions.

The autograder of assignment 5 runs the submission under Triton's interpreter: in process, the test sets
``TRITON_INTERPRET=1`` with monkeypatch (restored afterwards, so no later test sees it); as a script, the
subprocess gets its own environment."""

import importlib.util
import io
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ASSIGNMENTS = ROOT / "assignments"
NAMES = ["04_oscar_bit_reversal", "05_triton_dequantize"]

sys.path.insert(0, str(ASSIGNMENTS))
import grading  # noqa: E402


@pytest.fixture
def interpret(monkeypatch):
    """TRITON_INTERPRET=1 for this test only (the autograders set it when imported; monkeypatch puts
    back the previous value at teardown). Submissions are loaded afresh, so their kernels are decorated
    under it; kvq's own Triton kernels are not imported by the autograders."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _autograder(name):
    path = ASSIGNMENTS / name / "autograde.py"
    spec = importlib.util.spec_from_file_location(f"autograde_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", NAMES)
def test_solution_scores_full_marks(name, interpret):
    parts = _autograder(name).PARTS
    res = grading.grade(parts, ASSIGNMENTS / "solutions" / f"{name}.py", out=io.StringIO())
    assert res["score"] == res["total"] > 0, [p for p in res["parts"] if p["status"] != "pass"]


@pytest.mark.parametrize("name", NAMES)
def test_starter_scores_zero_cleanly(name, interpret):
    parts = _autograder(name).PARTS
    res = grading.grade(parts, ASSIGNMENTS / name / "starter.py", out=io.StringIO())
    assert res["score"] == 0 and res["total"] > 0
    for p in res["parts"]:
        assert (p["status"], p["message"]) == ("fail", "not implemented"), p


@pytest.mark.parametrize("name", NAMES)
def test_autograde_script_exit_status(name):
    script = ASSIGNMENTS / name / "autograde.py"
    env = dict(os.environ, TRITON_INTERPRET="1")
    sol = subprocess.run([sys.executable, str(script), "--solution"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert sol.returncode == 0, sol.stdout + sol.stderr
    assert "score:" in sol.stdout and "Traceback" not in sol.stderr
    st = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert st.returncode == 1, st.stdout + st.stderr
    assert "score: 0/" in st.stdout and "Traceback" not in st.stderr


@pytest.mark.parametrize("name", NAMES)
def test_starter_does_not_import_the_solutions(name):
    lines = [ln.strip() for ln in (ASSIGNMENTS / name / "starter.py").read_text().splitlines()]
    imports = [ln for ln in lines if ln.startswith(("import ", "from "))]
    assert imports, "the starter imports nothing?"
    for ln in imports:
        assert "solutions" not in ln and "kvq" not in ln, ln
    assert not any("solutions" in ln and ("import" in ln or "load" in ln) for ln in lines)
