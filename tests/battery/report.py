"""Print the battery's figures and its failing calls grouped by cause and function.

python tests/battery/report.py                      # runs the battery (pytest) and reports
python tests/battery/report.py figures.json         # reports a saved run (KVQ_BATTERY_FIGURES=...)
python tests/battery/report.py --markdown ...       # the README's table
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

CAUSES = ("crash", "hang", "state_changed", "jammed", "accepted", "wrong_result", "unclear_error", "unnamed_error")
TITLES = {
    "crash": "process died",
    "hang": "did not return",
    "state_changed": "a rejected call changed the state",
    "jammed": "after a rejected call, a good call went wrong",
    "accepted": "bad input accepted silently",
    "wrong_result": "accepted, but the result is wrong",
    "unclear_error": "unclear error (type or origin)",
    "unnamed_error": "kvq error that does not name the argument",
}


def run_battery(extra) -> str:
    fd, path = tempfile.mkstemp(suffix=".json", prefix="kvq-battery-")
    os.close(fd)
    env = dict(os.environ, KVQ_BATTERY_FIGURES=path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run(
        [sys.executable, "-m", "pytest", "tests/battery", "-q", "--tb=no", "-p", "no:randomly", *extra],
        cwd=root,
        env=env,
        check=False,
    )
    return path


def report(data: dict, markdown: bool = False, limit: int = 8) -> str:
    f = data["figures"]
    out = []
    if markdown:
        out.append(
            "| tier | functions | calls tried | clear errors | correct results | states checked | failing calls |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        for t, c in sorted(f["by_tier"].items()):
            out.append(
                f"| {t} | {f['functions_by_tier'].get(t, 0)} | {c.get('calls', 0)} | {c.get('clear_errors', 0)} | "
                f"{c.get('correct_results', 0)} | {c.get('states_checked', 0)} | {c.get('failures', 0)} |"
            )
        out.append(
            f"| all | {f['functions']} | {f['calls']} | {f['clear_errors']} | {f['correct_results']} | "
            f"{f['states_checked']} | {f['failures']} |"
        )
        return "\n".join(out)
    out.append(
        f"calls tried {f['calls']} on {f['functions']} functions; clear errors {f['clear_errors']}; "
        f"correct results {f['correct_results']}; states checked {f['states_checked']}; "
        f"failing calls {f['failures']}"
    )
    for t, c in sorted(f["by_tier"].items()):
        out.append(f"  {t}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    groups = defaultdict(lambda: defaultdict(list))
    for r in data["failures"]:
        groups[r["cause"]][(r["tier"], r["fn"])].append(r)
    for cause in CAUSES:
        if cause not in groups:
            continue
        n = sum(len(v) for v in groups[cause].values())
        out.append(f"\n== {cause}: {TITLES[cause]} ({n} calls, {len(groups[cause])} functions)")
        for (tier, fn), recs in sorted(groups[cause].items()):
            cases = {}
            for r in recs:
                cases.setdefault(r["case"], r["detail"])
            out.append(f"  {tier} {fn}: {len(recs)} calls")
            for case, detail in list(cases.items())[:limit]:
                out.append(f"      {case}: {detail[:220]}")
            if len(cases) > limit:
                out.append(f"      ... {len(cases) - limit} more cases")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figures", nargs="?", help="a JSON file written with KVQ_BATTERY_FIGURES (default: run now)")
    ap.add_argument("--markdown", action="store_true", help="the README table only")
    ap.add_argument("--limit", type=int, default=8, help="cases listed per function and cause")
    args, extra = ap.parse_known_args(argv)
    path = args.figures or run_battery(extra)
    with open(path) as fh:
        data = json.load(fh)
    print(report(data, args.markdown, args.limit))


if __name__ == "__main__":
    main()
