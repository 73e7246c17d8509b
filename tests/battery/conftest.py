"""The battery's figures: counted by ``_core.Recorder`` in every test, printed at the end of the session,
and written as JSON to the path in ``KVQ_BATTERY_FIGURES`` when that variable is set (never by default:
tests do not write into the repository).

    KVQ_BATTERY_FIGURES=/tmp/figures.json pytest tests/battery -q
    python tests/battery/report.py /tmp/figures.json        # the figures and the failures by cause
"""

from __future__ import annotations

import json
import os
import platform
import re
import time

from . import _core

ENV = "KVQ_BATTERY_FIGURES"


def pytest_collection_modifyitems(config, items):
    """Every battery test carries the ``battery`` marker: ``make test`` deselects it while the battery still
    has failing calls (issue 36); ``make battery`` runs it."""
    import pytest
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.battery)


def figures() -> dict:
    f = _core.FIGURES
    out = {k: int(f.get(k, 0)) for k in ("calls", "clear_errors", "correct_results", "states_checked", "failures")}
    tiers = sorted({k.split(":", 1)[0] for k in f if ":" in k})
    out["by_tier"] = {t: {k.split(":", 1)[1]: int(v) for k, v in f.items() if k.startswith(t + ":")} for t in tiers}
    funcs = {(t, api_name(fn)) for t, fn in _core.FUNCTIONS}
    out["functions"] = len(funcs)
    out["functions_by_tier"] = {t: len({fn for tt, fn in funcs if tt == t}) for t in tiers}
    return out


def api_name(label: str) -> str:
    """The public function behind a Recorder label: "KVStore(Kitty).__init__" -> "KVStore.__init__",
    "kivi.append (streaming equals bulk)" -> "kivi.append"."""
    return re.sub(r"\(.*?\)", "", label).split(" ")[0]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(ENV)
    if not path or not _core.FIGURES.get("calls"):
        return
    data = {
        "figures": figures(),
        "failures": list(_core.FAILURES),
        "exitstatus": int(exitstatus),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
    }
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _core.FIGURES.get("calls"):
        return
    f = figures()
    terminalreporter.write_line(
        f"kvq battery: {f['calls']} calls on {f['functions']} functions, {f['clear_errors']} clear errors, "
        f"{f['correct_results']} correct results, {f['states_checked']} states checked, "
        f"{f['failures']} failing calls"
    )
