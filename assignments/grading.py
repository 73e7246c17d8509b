"""The autograders' shared harness: load a submission, run named parts, print a score per part.

Each assignment folder ``assignments/NN_name/`` has ``README.md``, ``starter.py`` (the functions to
write; they raise NotImplementedError) and ``autograde.py``, which calls :func:`grade`:

    python assignments/01_packing/autograde.py                 # grades starter.py beside it
    python assignments/01_packing/autograde.py --solution      # grades assignments/solutions/01_packing.py
    python assignments/01_packing/autograde.py --file my.py    # grades any file

A part is a function ``part(sub) -> None`` that receives the loaded submission module and raises
(AssertionError with a message, or anything the student's code raises) when it fails. A part that
raises ``NotImplementedError`` scores 0 with "not implemented"; every other exception is caught and
reported in one line, so an untouched starter fails cleanly and never crashes the grader. Exit status:
0 when every part passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import traceback


def load(path) -> object:
    """Import the Python file ``path`` as a fresh module (no package context, no caching)."""
    path = pathlib.Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no submission at {path}")
    spec = importlib.util.spec_from_file_location(f"submission_{abs(hash(str(path)))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def submission_path(folder, argv=None) -> pathlib.Path:
    """The file to grade from the command line: ``--file F``, ``--solution`` or the folder's starter.py."""
    folder = pathlib.Path(folder).resolve()
    ap = argparse.ArgumentParser(description=f"autograder of {folder.name}")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--solution", action="store_true", help="grade the reference solution")
    g.add_argument("--file", help="grade this file")
    a = ap.parse_args(argv)
    if a.file:
        return pathlib.Path(a.file)
    if a.solution:
        return folder.parent / "solutions" / f"{folder.name}.py"
    return folder / "starter.py"


def grade(parts, path, *, out=sys.stdout) -> dict:
    """Run ``parts`` ([(name, points, fn)]) on the submission at ``path``; print one line per part and a
    total; return {"score", "total", "parts": [{name, points, earned, status, message}]}."""
    results = []
    try:
        sub = load(path)
    except Exception as e:                      # a submission that does not even import scores 0
        sub, load_error = None, f"{type(e).__name__}: {e}"
    else:
        load_error = None
    for name, points, fn in parts:
        if sub is None:
            status, msg = "error", f"the submission does not import ({load_error})"
        else:
            try:
                fn(sub)
                status, msg = "pass", ""
            except NotImplementedError:
                status, msg = "fail", "not implemented"
            except AssertionError as e:
                status, msg = "fail", str(e) or "assertion failed"
            except Exception as e:
                tb = traceback.extract_tb(e.__traceback__)[-1]
                status, msg = "error", f"{type(e).__name__}: {e} (at {pathlib.Path(tb.filename).name}:{tb.lineno})"
        earned = points if status == "pass" else 0
        results.append({"name": name, "points": points, "earned": earned, "status": status, "message": msg})
        print(f"[{status:5s}] {name}: {earned}/{points}" + (f"  -- {msg}" if msg else ""), file=out)
    score, total = sum(r["earned"] for r in results), sum(r["points"] for r in results)
    print(f"score: {score}/{total}", file=out)
    return {"score": score, "total": total, "parts": results}


def main(parts, folder, argv=None) -> int:
    """The autograder's entry point: grade and return the exit status (0 only when everything passes)."""
    res = grade(parts, submission_path(folder, argv))
    return 0 if res["score"] == res["total"] else 1
