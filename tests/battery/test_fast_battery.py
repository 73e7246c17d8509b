"""Bad input to the Triton tier (``kvq.fast.triton``, every function of ``kvq.fast.MIRRORED`` that has a
Triton version) under the interpreter, on CPU tensors: the same rules as the reference battery.

The calls run in a child process (``_fast_child.py``) so that a kernel that writes out of bounds (the
interpreter aborts with ``free(): invalid next size``) is reported as a ``crash`` of that case instead of
ending the session; the child is restarted after the case. A case that makes no progress for
``HANG_S`` seconds is a ``hang``. Each case draws its valid call from a generator seeded by its id, so a
failure reproduces with ``python -m tests.battery._fast_child``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ._core import Recorder
from .engine import TRITON
from .specs import all_specs, by_label

HANG_S = 120
ROOT = Path(__file__).resolve().parents[2]

GROUPS = [(s.label, a, tuple(muts)) for s in all_specs() if "triton" in s.tiers for a, muts in s.groups(TRITON)]
CASES = [pytest.param(label, a, muts, id=f"{label}-{a}") for label, a, muts in GROUPS]

_RESULTS: dict = {}


def _case_ids(groups):
    return [f"{label}|{a}|{m}" for label, a, muts in groups for m in muts]


def _run_child(ids) -> dict:
    """Run ``ids`` in child processes (restarting after a crash); {id: outcome}."""
    out = {}
    pending = list(ids)
    with tempfile.TemporaryDirectory(prefix="kvq-battery-") as tmp:
        while pending:
            res, idf, errf = (Path(tmp) / n for n in ("results.txt", "ids.txt", "stderr.txt"))
            idf.write_text("\n".join(pending))
            res.write_text("")
            env = dict(os.environ, TRITON_INTERPRET="1")
            with open(errf, "w") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.battery._fast_child", str(res), str(idf)],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
                last, size = time.monotonic(), 0
                while proc.poll() is None:
                    time.sleep(0.2)
                    s = res.stat().st_size
                    if s != size:
                        last, size = time.monotonic(), s
                    elif time.monotonic() - last > HANG_S:
                        proc.kill()
                        proc.wait()
                        break
            started, finished = None, set()
            for line in res.read_text().splitlines():
                if line.startswith("S "):
                    started = line[2:]
                elif line.startswith("R "):
                    rec = json.loads(line[2:])
                    out[rec["id"]] = rec
                    finished.add(rec["id"])
            if started is not None and started not in finished:
                tail = " | ".join(errf.read_text().strip().splitlines()[-3:])[-300:]
                cause = "hang" if proc.returncode in (-9,) and time.monotonic() - last > HANG_S else "crash"
                label, arg, mut = started.split("|")
                out[started] = {
                    "id": started,
                    "counts": {"calls": 1, "failures": 1},
                    "failures": [
                        {
                            "tier": "triton",
                            "fn": label,
                            "case": f"{arg}:{mut}",
                            "cause": cause,
                            "detail": (
                                f"the process died (exit {proc.returncode}): {tail}"
                                if cause == "crash"
                                else f"no progress for {HANG_S} s"
                            ),
                        }
                    ],
                }
                finished.add(started)
            elif started is None and proc.returncode not in (0, None):
                raise RuntimeError(f"the Triton battery child failed to start: {errf.read_text()[-2000:]}")
            pending = [i for i in pending if i not in finished]
    return out


@pytest.fixture(scope="session")
def fast_results(request):
    """Outcomes of every selected Triton case, computed once per session in child processes."""
    wanted = []
    for item in request.session.items:
        cs = getattr(item, "callspec", None)
        if cs is not None and item.originalname == "test_fast_bad_input":
            wanted.append((cs.params["label"], cs.params["arg"], cs.params["muts"]))
    ids = [i for i in _case_ids(wanted) if i not in _RESULTS]
    if ids:
        _RESULTS.update(_run_child(ids))
    return _RESULTS


@pytest.mark.parametrize("label,arg,muts", CASES)
def test_fast_bad_input(label, arg, muts, fast_results):
    assert label in by_label()
    rec = Recorder("triton", label)
    for m in muts:
        outcome = fast_results.get(f"{label}|{arg}|{m}")
        assert outcome is not None, f"no outcome for {label} {arg} {m}"
        rec.add_external(outcome)
    rec.assert_clean()
