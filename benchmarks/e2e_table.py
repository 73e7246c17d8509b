"""The end-to-end decode-step table from a ``bench_e2e.py`` JSON (what the README and the results notes show).

    python3 benchmarks/e2e_table.py benchmarks/results/h200/e2e.json

One row per cache, one column per (batch x context): ms per step (eager wall time around ``model(...)``,
Python included), and in brackets the step relative to the FP16 StaticCache of the same shape (or "oom").
Then the cache bytes at rest and the peak extra bytes during a step at the largest shape each cache ran. Where
the JSON has them, a table of the GPU time per step (``--graph``), one of the step through kvq's CUDA-graph
decode (``--graphed``) and one of the largest batches (``--max-batch``).
"""

from __future__ import annotations

import json
import sys


def status_word(r: dict) -> str:
    """A row's status for a table cell: ``oom``, ``failed`` or ``unavailable`` (the JSON keeps the reason)."""
    return r["status"].split(":")[0]


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
                cells.append(status_word(r))
            else:
                rel = (f" ({r['ms_per_step'] / base['ms_per_step']:.2f}x)"
                       if base and base["status"] == "ok" and c != "StaticCache" else "")
                cells.append(f"{r['ms_per_step']:.1f}{rel}")
                if "cache_bytes" in r and (last is None or b * t > last["batch"] * last["context"]):
                    last = r
        mem = (f"{last['cache_bytes'] / 2 ** 30:.2f} / {last.get('peak_extra_bytes', 0) / 2 ** 30:.2f} "
               f"({last['batch']} x {last['context'] // 1024}K)" if last else "-")
        out.append(f"| {c} | " + " | ".join(cells) + f" | {mem} |")
    graph = graph_table(rows, shapes, caches)
    if graph:
        out += ["", graph]
    graphed = graphed_table(rows, shapes, caches)
    if graphed:
        out += ["", graphed]
    largest = max_batch_table(rows)
    if largest:
        out += ["", largest]
    return "\n".join(out)


def _grid(title: str, rows: list, shapes: list, caches: list, cell, keep=None) -> str:
    """A table of one cell per (cache, shape) under ``title``: "-" where the cache has no row at the shape,
    the status where the row did not run, else ``cell(row, StaticCache's row of the shape or None)``;
    ``keep(cache)`` False leaves a cache out (None: every cache)."""
    at = {(r["cache"], r["batch"], r["context"]): r for r in rows if not r.get("max_batch")}
    out = [title, "", "| cache | " + " | ".join(f"{b} x {t // 1024}K" for b, t in shapes) + " |",
           "| --- | " + " | ".join("---" for _ in shapes) + " |"]
    for c in caches:
        if keep is not None and not keep(c):
            continue
        cells = []
        for b, t in shapes:
            r, base = at.get((c, b, t)), at.get(("StaticCache", b, t))
            cells.append("-" if r is None else status_word(r) if r["status"] != "ok" else cell(r, base))
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def graphed_table(rows: list, shapes: list, caches: list) -> str:
    """ms per step through ``kvq.integrations.graphs`` (``--graphed``: the model's step replayed from CUDA
    graphs, each layer's kvq work eager between them; wall time, Python included), x the eager StaticCache
    step and x StaticCache's GPU time (``--graph``) in brackets; "" when no row has it."""
    has = lambda r: "graphed_ms_per_step" in r or "graphed_status" in r          # noqa: E731
    if not any(has(r) for r in rows):
        return ""

    def cell(r, base):
        if "graphed_ms_per_step" not in r:
            return "no capture" if "graphed_status" in r else "-"
        ms = r["graphed_ms_per_step"]
        rel = []
        if base and base["status"] == "ok":
            rel.append(f"{ms / base['ms_per_step']:.2f}x")
            if "graph_ms_per_step" in base:
                rel.append(f"{ms / base['graph_ms_per_step']:.2f}x")
        return f"{ms:.1f}" + (f" ({', '.join(rel)})" if rel else "")

    title = ("ms per decode step through kvq.integrations.graphs (the model's step replayed from CUDA graphs, kvq's "
             "append and fused decode eager between them: wall time, Python included; in brackets x the eager "
             "StaticCache step, then x StaticCache's GPU time)")
    return _grid(title, rows, shapes, caches, cell, keep=lambda c: any(has(r) for r in rows if r["cache"] == c))


def graph_table(rows: list, shapes: list, caches: list) -> str:
    """GPU ms per step (``--graph``: one captured step replayed), x StaticCache's in brackets; "" when no
    row has it. A cache whose step could not be captured shows "no capture"."""
    if not any("graph_ms_per_step" in r for r in rows):
        return ""

    def cell(r, base):
        if "graph_ms_per_step" not in r:
            return "no capture" if "graph_status" in r else "-"
        ok = base and "graph_ms_per_step" in base and r["cache"] != "StaticCache"
        rel = f" ({r['graph_ms_per_step'] / base['graph_ms_per_step']:.2f}x)" if ok else ""
        return f"{r['graph_ms_per_step']:.2f}{rel}"

    title = ("GPU time per decode step, ms (the step captured once in a CUDA graph and replayed: no Python; "
             "x StaticCache's in brackets)")
    return _grid(title, rows, shapes, caches, cell)


def max_batch_table(rows: list) -> str:
    """The ``--max-batch`` rows: per cache the largest batch that ran at that context, its step and tokens
    per second (a batch capped below what memory allows, as quanto's by its unpack limit, marked "capped");
    "" when there are none."""
    mb = [r for r in rows if r.get("max_batch")]
    if not mb:
        return ""
    out = ["The largest batch that fits the card (eager step at that batch)", "",
           "| cache | context | largest batch | ms per step | tokens per second |", "| --- | --- | --- | --- | --- |"]
    for r in mb:
        if r["status"] == "ok":
            batch = f"{r['batch']} (capped)" if r.get("capped") else r["batch"]
            out.append(f"| {r['cache']} | {r['context'] // 1024}K | {batch} | {r['ms_per_step']:.1f} | "
                       f"{r['tokens_per_s']:.0f} |")
        else:
            out.append(f"| {r['cache']} | {r['context'] // 1024}K | {status_word(r)} (at {r['batch']}) | - | - |")
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
