"""The end-to-end decode-step table from a ``bench_e2e.py`` JSON (what the README and the results notes show).

    python3 benchmarks/e2e_table.py benchmarks/results/h200-bf244c7-e2e/e2e.json

One row per cache, one column per (batch x context): ms per step (eager wall time around ``model(...)``,
Python included), and in brackets the step relative to the FP16 StaticCache of the same shape (or "oom").
Then the cache bytes at rest and the peak extra bytes during a step at the largest shape each cache ran.
"""

from __future__ import annotations

import json
import sys


def table(doc: dict) -> str:
    rows = doc["rows"]
    shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows if not r.get("max_batch")))
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    at = {(r["cache"], r["batch"], r["context"]): r for r in rows if not r.get("max_batch")}
    info = doc["info"]
    out = [f"{info.get('device')} (torch {info.get('torch')}, transformers {info.get('transformers')}, "
           f"Triton {info.get('triton')}), commit `{info.get('commit')}`, {info.get('date')}; ms per decode step "
           f"(eager), x StaticCache in brackets", ""]
    out.append("| cache | " + " | ".join(f"{b} x {t // 1024}K" for b, t in shapes) + " | KV at rest / step extra (GiB) |")
    out.append("| --- | " + " | ".join("---" for _ in shapes) + " | --- |")
    for c in caches:
        cells, last = [], None
        for b, t in shapes:
            r = at.get((c, b, t))
            base = at.get(("StaticCache", b, t))
            if r is None:
                cells.append("-")
            elif r["status"] != "ok":
                cells.append(r["status"])
            else:
                rel = (f" ({r['ms_per_step'] / base['ms_per_step']:.2f}x)"
                       if base and base["status"] == "ok" and c != "StaticCache" else "")
                cells.append(f"{r['ms_per_step']:.1f}{rel}")
                if "cache_bytes" in r and (last is None or b * t > last["batch"] * last["context"]):
                    last = r
        mem = (f"{last['cache_bytes'] / 2 ** 30:.2f} / {last.get('peak_extra_bytes', 0) / 2 ** 30:.2f} "
               f"({last['batch']} x {last['context'] // 1024}K)" if last else "-")
        out.append(f"| {c} | " + " | ".join(cells) + f" | {mem} |")
    return "\n".join(out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        print(table(json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
