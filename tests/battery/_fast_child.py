"""The Triton tier's cases, run in a child process (the interpreter dies on an out-of-bounds write, issue
36 item 1, and must not take the test session with it).

    python -m tests.battery._fast_child RESULTS IDS     # IDS: a file of case ids "label|arg|mutation"

For every id it appends two lines to RESULTS: ``S <id>`` before the call and ``R <json>`` after it (the
Recorder's counts and failures); the parent (``test_fast_battery.py``) reads them, so that a case that
kills the process is known: started, never finished.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (as tests/conftest.py)


def run_ids(ids, out):
    from ._core import Recorder
    from .engine import TRITON, run_case
    from .specs import by_label
    from .strategies import SeededDraw

    specs = by_label()
    for case_id in ids:
        label, arg, mut = case_id.split("|")
        out.write(f"S {case_id}\n")
        out.flush()
        rec = Recorder("triton", label)
        t0 = time.perf_counter()
        try:
            run_case(rec, specs[label], TRITON, arg, mut, SeededDraw(case_id))
        except Exception as e:  # noqa: BLE001  (a builder failure is reported, not fatal)
            rec.fail(f"{arg}:{mut}", "wrong_result", f"the case could not be built: {type(e).__name__}: {e}"[:400])
        out.write(
            "R "
            + json.dumps(
                {
                    "id": case_id,
                    "counts": dict(rec.counts),
                    "failures": rec.failures,
                    "seconds": round(time.perf_counter() - t0, 3),
                }
            )
            + "\n"
        )
        out.flush()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    results, ids_file = argv
    with open(ids_file) as fh:
        ids = [line.strip() for line in fh if line.strip()]
    warnings.simplefilter("ignore")
    with open(results, "a") as out:
        run_ids(ids, out)


if __name__ == "__main__":
    main()
