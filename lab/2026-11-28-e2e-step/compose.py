"""Compose the suite's H200 end-to-end results from the device calls of `results/h200-3f0eeb5/` (one card,
one held machine, commit 3f0eeb5, three calls; see NOTE.md for what each call ran and why).

    python3 lab/2026-11-28-e2e-step/compose.py            # writes benchmarks/results/h200/e2e.json, e2e_graph.json

- ``e2e.json``: the eager rows of ``e2e-8x32k.json`` (8 x 32K) and ``e2e-b1.json`` (1 x 32K, 1 x 128K), and
  the largest-batch rows each run sized first in its process (``e2e-maxbatch.json``'s KIVI-K2V2:cupy,
  ``e2e-maxbatch2.json``'s StaticCache). The two largest-batch rows sized after another one
  (StaticCache in ``e2e-maxbatch.json``, Kitty:cupy in ``e2e-maxbatch2.json``) are left out: bench_e2e held
  the previous row's cache while it measured the free memory (fixed in 25f31e6), so they were sized
  from about 20 GiB instead of about 120.
- ``e2e_graph.json``: ``e2e-graph.json`` as it is (its own eager steps and the CUDA-graph replays).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN = HERE / "results" / "h200-3f0eeb5"
OUT = HERE.parents[1] / "benchmarks" / "results" / "h200"

#: (file, cache) of the largest-batch rows sized first in their process
FIRST_SIZED = {("e2e-maxbatch.json", "KIVI-K2V2:cupy"), ("e2e-maxbatch2.json", "StaticCache")}


def load(name: str) -> dict:
    return json.loads((RUN / name).read_text())


def compose() -> tuple[dict, dict]:
    eager, b1 = load("e2e-8x32k.json"), load("e2e-b1.json")
    rows = [r for r in eager["rows"] + b1["rows"] if not r.get("max_batch")]
    for name in ("e2e-maxbatch.json", "e2e-maxbatch2.json"):
        rows += [r for r in load(name)["rows"] if r.get("max_batch") and (name, r["cache"]) in FIRST_SIZED]
    info = dict(eager["info"], composed_by="lab/2026-11-28-e2e-step/compose.py",
                sources=["e2e-8x32k.json", "e2e-b1.json", "e2e-maxbatch.json", "e2e-maxbatch2.json"])
    for doc in (b1, load("e2e-maxbatch.json"), load("e2e-maxbatch2.json")):
        assert {k: doc["info"][k] for k in ("commit", "device", "torch")} == \
            {k: info[k] for k in ("commit", "device", "torch")}, doc["info"]
    return {"info": info, "rows": rows}, load("e2e-graph.json")


def main() -> int:
    e2e, graph = compose()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "e2e.json").write_text(json.dumps(e2e, indent=1) + "\n")
    (OUT / "e2e_graph.json").write_text(json.dumps(graph, indent=1) + "\n")
    print(f"wrote {OUT / 'e2e.json'} ({len(e2e['rows'])} rows) and {OUT / 'e2e_graph.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
