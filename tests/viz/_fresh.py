"""Run a snippet in a fresh interpreter (without MPLBACKEND): the viz modules' import hygiene checks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_fresh(code: str) -> None:
    """Run ``code`` (dedented) in a new Python process; it must exit 0 and print exactly "ok"."""
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
