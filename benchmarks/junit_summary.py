"""Summarize a pytest JUnit XML file as JSON: passed / failed / skipped / errors, the failures' names,
and the device, commit and date (benchmarks/device.sh calls it after `pytest -m gpu`).

    python3 benchmarks/junit_summary.py $OUT/gpu-tests.xml $OUT/gpu-tests.json --rc $TEST_RC
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path

import common as C

PYTEST_RC = {0: "all passed", 1: "some tests failed", 2: "interrupted", 3: "internal error",
             4: "usage error", 5: "no tests collected", 124: "killed by timeout", 137: "killed (timeout -k)"}


def summarize(xml_path: Path, max_listed: int = 100) -> dict:
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    for s in suites:
        counts["tests"] += int(s.get("tests", 0))
        counts["failed"] += int(s.get("failures", 0))
        counts["errors"] += int(s.get("errors", 0))
        counts["skipped"] += int(s.get("skipped", 0))
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    problems = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            el = case.find(kind)
            if el is not None:
                msg = (el.get("message") or el.text or "").strip().splitlines()
                problems.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                                 "message": (msg[0] if msg else "")[:300]})
    counts["problems"] = problems[:max_listed]
    counts["problems_not_listed"] = max(0, len(problems) - max_listed)
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("xml")
    ap.add_argument("json_out")
    ap.add_argument("--rc", type=int, default=None, help="pytest's exit status")
    a = ap.parse_args()
    res = {"rc": a.rc, "rc_meaning": PYTEST_RC.get(a.rc), "date_utc": C.utc_now(), "commit": C.git_commit()}
    try:
        import torch
        res["device"] = C.device_info("cuda" if torch.cuda.is_available() else "cpu")
    except Exception as e:
        res["device"] = {"error": C.err_str(e)}
    try:
        res.update(summarize(Path(a.xml)))
    except Exception as e:                  # no XML: pytest was killed or crashed before writing it
        res["error"] = f"could not read {a.xml}: {C.err_str(e)}"
    C.write_json(Path(a.json_out).parent, Path(a.json_out).name, res)
    keys = ("passed", "failed", "errors", "skipped")
    print("gpu tests: " + (", ".join(f"{k} {res[k]}" for k in keys) if "passed" in res else res.get("error", ""))
          + f" (pytest rc {a.rc}: {res['rc_meaning']})")


if __name__ == "__main__":
    main()
