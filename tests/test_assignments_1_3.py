"""Assignments 1-3 (packing, granularity, Kitty pages): every autograder against its reference solution
(full score) and against its untouched starter (every part fails cleanly as "not implemented")."""

import io
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "assignments"
sys.path.insert(0, str(ROOT))
import grading  # noqa: E402

NAMES = ["01_packing", "02_granularity", "03_kitty_pages"]


def parts_of(name):
    return grading.load(ROOT / name / "autograde.py").PARTS


@pytest.mark.parametrize("name", NAMES)
def test_solution_scores_full(name):
    res = grading.grade(parts_of(name), ROOT / "solutions" / f"{name}.py", out=io.StringIO())
    failed = [(p["name"], p["message"]) for p in res["parts"] if p["status"] != "pass"]
    assert res["score"] == res["total"] > 0, failed


@pytest.mark.parametrize("name", NAMES)
def test_starter_scores_zero_cleanly(name):
    res = grading.grade(parts_of(name), ROOT / name / "starter.py", out=io.StringIO())
    assert res["score"] == 0 and res["total"] > 0
    for p in res["parts"]:
        assert (p["status"], p["message"]) == ("fail", "not implemented"), p


@pytest.mark.parametrize("name", NAMES)
def test_autograde_exit_status(name):
    script = ROOT / name / "autograde.py"
    ok = subprocess.run([sys.executable, str(script), "--solution"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "score: 0/" in bad.stdout


@pytest.mark.parametrize("name", NAMES)
def test_starter_does_not_import_solutions(name):
    src = (ROOT / name / "starter.py").read_text()
    assert "solutions" not in src and "kvq" not in src


@pytest.mark.parametrize("name", NAMES)
def test_solution_does_not_call_kvq(name):
    src = (ROOT / "solutions" / f"{name}.py").read_text()
    assert "import kvq" not in src and "from kvq" not in src
