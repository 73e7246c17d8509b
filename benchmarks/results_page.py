"""The results page: docs/results.md and README.md's method table, generated from the committed JSON.

    python benchmarks/results_page.py              # (make results) write docs/results.md, refill README.md's table
    python benchmarks/results_page.py --check      # exit 1 where either differs from what the JSON gives

Input: ``benchmarks/results/<card>/*.json``, the latest run of each benchmark on each card (a card folder is
named without a dash: ``h100``, ``h200``, ``cpu``; older runs live in ``lab/<date>-<question>/results/``). A file ``<name>.json`` or ``<name>_<part>.json`` (one run
written in parts) belongs to the benchmark ``<name>`` of :data:`BENCHMARKS`; a JSON of no known benchmark
is an error, so that nothing committed goes unshown. The long-context model's run
(``benchmarks/train_long_lm.py``) is the card file ``benchmarks/results/<card>/long_lm.json``, rendered by
``kvq.evaluation.long_lm_report`` (protocol, perplexity by position bucket, retrieval by depth and context).

Output: docs/results.md, one section per card and one table per benchmark, each under the card, commit,
date and protocol of its JSON; and, between the markers ``<!-- results:methods -->`` and
``<!-- /results -->`` of README.md, the table that helps choose a method (:func:`methods_table`), with
the figure of quality against bits per element it shows (:func:`quality_figure`,
``docs/figures/long_lm_quality_vs_bits.png``). Every number comes from the JSON; a cell with no
measurement is "—".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT)):                   # the benchmark helpers; kvq from this checkout
    if _p not in sys.path:
        sys.path.insert(0, _p)

import e2e_table  # noqa: E402
import summarize as S  # noqa: E402

from kvq import evaluation as E  # noqa: E402  (the long-context model's tables)

RESULTS = HERE / "results"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:methods -->", "<!-- /results -->"
NONE = S.NONE
#: the batch x context shapes of the end-to-end benchmark the method table quotes
SPEED_SHAPES = ((8, 32768), (1, 32768))


# ------------------------------------------------------------------------------------------ benchmarks

def _rows_by_backend(shapes, rows_of, pct_copy: bool = False) -> str:
    """:func:`summarize.speed_table` once per backend: the rows named "... [cupy]" (the CUDA kernels), then
    the others (Triton); a backend without any row is left out."""
    parts = []
    for label, mine in (("CUDA kernels (CuPy)", lambda n: "[cupy]" in n), ("Triton", lambda n: "[cupy]" not in n)):
        names = {n for s in shapes for n in rows_of(s) if mine(n)}
        if names:
            t = S.speed_table(shapes, lambda s: {n: r for n, r in rows_of(s).items() if n in names}, pct_copy)
            parts.append(f"{label}:\n\n{t}")
    return "\n\n".join(parts)


def _oscar_rows(s) -> dict:
    """The OSCAR rows of a shape, and for a row timed with R_V folded into W_O that decode as its own row."""
    rows = {}
    for n, r in s.items():
        if n.startswith("oscar") and isinstance(r, dict):
            rows[n] = r
            if (r.get("rv_folded") or {}).get("ms") is not None:
                rows[f"{n} R_V folded"] = {"ms": r["rv_folded"]["ms"], "valid": r.get("valid")}
    return rows


def _e2e(doc) -> str:
    head, _, table = e2e_table.table(doc).partition("\n\n")
    return table + "\n\nFirst table: ms per decode step (eager wall time around `model(...)`, Python included), in " \
                   "brackets the step over transformers' FP16 StaticCache of the same shape; last column: the cache's " \
                   "bytes at rest and the peak extra bytes of a step at the largest shape it ran. Where the run has " \
                   "them, the GPU time of the step (`--graph`: one step captured in a CUDA graph and replayed, no " \
                   "Python) and the largest batch that fits the card (`--max-batch`) follow."


#: (name, title, how it is measured, table) in the page's order
BENCHMARKS = [
    ("ceilings", "Ceilings", "`bench_ceilings.py`: `dst.copy_(src)` on 2 GiB (read + write counted) and a bf16 "
     "8192^3 matmul; the yardsticks of every other table", S.ceilings_table),
    ("quant", "Quantize + pack, unpack + dequantize", "`bench_quant.py`: x = (8, 8, 16384, 128) fp16, bytes = "
     "input + packed + metadata once, GPU time by CUDA-graph replay; target 60% of copy bandwidth", S.quant_table),
    ("decode", "FP16 decode attention", "`bench_decode.py`: 32 query / 8 KV heads of 128, one query token, against "
     "torch SDPA (GQA); target kvq <= 1.2x SDPA", S.decode_table),
    ("kivi_kitty", "KIVI / Kitty decode", "`bench_kivi_kitty.py`: one decode step over a paged 2- / 4-bit cache "
     "(32 query / 8 KV heads of 128) against the best FP16 SDPA variant of the same shape",
     lambda d: _rows_by_backend(d["shapes"], lambda s: s.get("methods") or {}, pct_copy=True)),
    ("oscar", "OSCAR decode", "`bench_oscar.py`: one decode step over the rotated INT2 cache against the best FP16 "
     "SDPA variant; `R_V folded`: the decode for a W_O with R_V^T folded in",
     lambda d: _rows_by_backend(d["shapes"], _oscar_rows, pct_copy=True)),
    ("aqua", "AQUA-KV", "`bench_aqua.py`: per-layer encode / decode of the HIGGS residuals with the cross-layer "
     "predictors, then decode attention over a reconstructed 2-layer cache against SDPA", S.aqua_tables),
    ("bitdecoding_pack", "BitDecoding: the Residual Kernel", "`bench_bitdecoding_pack.py`: pages packed into the "
     "induced layout, 8 KV heads of 128, next to one read-only kernel on the same bytes",
     S.bitdecoding_pack_table),
    ("bitdecoding_decode", "BitDecoding: fused decode", "`bench_bitdecoding_decode.py`: one decode step at g_q query "
     "heads per KV head (8 KV heads of 128) against the best FP16 SDPA variant, beside the KIVI / Kitty Triton "
     "decodes", lambda d: _rows_by_backend(d["shapes"], lambda s: s.get("rows") or {})),
    ("e2e", "End to end: one decode step of a Llama-3.1-8B-shaped model", "`kvq bench e2e` "
     "(`benchmarks/bench_e2e.py`): 32 layers, 32 query / 8 KV heads of 128, random fp16 weights, every cache "
     "filled through its own `update`", _e2e),
    ("gpu-tests", "GPU test suite", "`pytest -m gpu` over the whole suite (`benchmarks/device.sh`, "
     "`device_session.sh`), summarized by `junit_summary.py`", S.gpu_tests_table),
    ("train", "Tiny LM: training", "`train_tiny_lm.py`: the byte-level Llama-style LM (6 layers, GQA 4:2, head "
     "dim 128) trained from scratch on the Python standard library", S.train_table),
    ("ppl", "Tiny LM: perplexity with each cache", "`kvq eval ppl` on the tiny LM's held-out text",
     S.ppl_table),
    ("throughput", "Tiny LM: throughput at a memory budget", "`throughput_tiny_lm.py`: generation with batch "
     "1, 2, 4, ... until the batch no longer fits the budget", S.throughput_table),
    ("attention", "MiniLM: attention-level errors", "`kvq eval attention` on the pretrained MiniLM's real "
     "activations", S.attention_table),
    ("long_lm", "Long-context LM: perplexity by position and retrieval", "`train_long_lm.py`: a byte-level "
     "Llama (RoPE, GQA, head dim 128) trained from scratch with planted key-value retrieval, then FP16 and every "
     "method at its paper's configuration and at equal memory; its protocol, then the tables "
     "(`kvq.evaluation.long_lm_report`)", lambda d: E.long_lm_report(d)),
]
_BY_NAME = {b[0]: b for b in BENCHMARKS}


def benchmark_of(path: Path) -> str:
    """The benchmark a results file belongs to: its stem, or the stem up to ``_<part>``; ValueError when it
    is no benchmark of :data:`BENCHMARKS`."""
    stem = path.stem
    for name in sorted(_BY_NAME, key=len, reverse=True):
        if stem == name or stem.startswith(name + "_"):
            return name
    raise ValueError(f"{path}: no benchmark of results_page.BENCHMARKS is named {stem!r}; expected one of "
                     f"{', '.join(_BY_NAME)} (or <name>_<part>.json)")


def card_dirs(results: Path) -> list[Path]:
    """The card folders under ``results`` (names without a dash), GPU cards first, then by name."""
    if not results.is_dir():
        raise ValueError(f"results={results} is not a folder; expected benchmarks/results")
    return sorted((p for p in results.iterdir() if p.is_dir() and re.fullmatch(r"[a-z0-9]+", p.name)),
                  key=lambda p: (p.name == "cpu", p.name))


def load_card(card: Path) -> dict:
    """``{benchmark: [(file name, JSON), ...]}`` of one card folder, files in name order."""
    out = {}
    for p in sorted(card.glob("*.json")):
        out.setdefault(benchmark_of(p), []).append((p.name, json.loads(p.read_text())))
    return out


# ------------------------------------------------------------------------------------------ metadata

def _short(commit) -> str:
    head, plus, rest = str(commit).partition("+")          # "fd9acd6+tail-rule": a tree that was not a commit
    return head[:7] + plus + rest


def run_info(doc: dict) -> dict:
    """Device, commit, date and protocol of a results JSON, whichever layout it has: ``meta`` (the
    benchmarks, ``kvq eval``), ``info`` (``kvq bench e2e``) or top-level fields (training, throughput, tests)."""
    meta = doc.get("meta") or doc.get("info") or doc
    dev = meta.get("device")
    device = dev.get("name") if isinstance(dev, dict) else (doc.get("device_name") or dev)
    argv = [str(a) for a in (meta.get("argv") or doc.get("argv") or [])]
    script = doc.get("script")                          # train.json records its script apart from its argv
    if script and argv and not argv[0].endswith(".py"):
        argv.insert(0, script)
    command = " ".join(argv) or None
    if doc.get("parts"):                                # runs of one model merged (train_long_lm.py --merge)
        command = " ; ".join(" ".join([script or ""] + [str(a) for a in part["argv"]]).strip()
                             for part in doc["parts"]) + f" (merged: {len(doc['parts'])} runs)"
    protocol = doc.get("protocol")
    if protocol:
        protocol = protocol.split(". ")[0].rstrip(".") + "."
    return {"device": device or NONE, "commit": _short(meta.get("commit") or doc.get("commit") or NONE),
            "date": str(meta.get("date_utc") or meta.get("date") or doc.get("date_utc") or NONE)[:10],
            "mode": meta.get("mode"), "command": command, "protocol": protocol}


def _run_line(card: str, name: str, doc: dict) -> str:
    i = run_info(doc)
    line = f"Card `{card}` ({i['device']}), commit `{i['commit']}`, {i['date']}; `{name}`."
    if i["protocol"]:
        line += f" Protocol: {i['protocol']}"
    if i["command"]:
        line += f" Run: `{i['command']}`" + (f" ({i['mode']})" if i["mode"] else "") + "."
    note = (doc.get("info") or {}).get("note")
    if note:                                            # what the file keeps of its run, and why (e2e's info)
        line += f" Note: {note}."
    return line


# ------------------------------------------------------------------------------------------ the page

def page(results: Path = RESULTS) -> str:
    """docs/results.md: per card, per benchmark its title, how it is measured, and per JSON file its run
    line and table."""
    out = ["# Measured results", "",
           "<!-- generated by `python benchmarks/results_page.py` (`make results`) from "
           "benchmarks/results/<card>/*.json; do not edit by hand -->", "",
           "The latest run of each benchmark on each card, read from the JSON committed under "
           "`benchmarks/results/<card>/`. How each is measured: [`benchmarks/README.md`](../benchmarks/README.md) "
           "(GPU time is the median of CUDA-graph replays with inputs rotated beyond L2; every quantized row passes "
           "a float64 check before it is timed). Compare timings only within one card. Older runs, and the "
           "investigations behind the kernels, are in [`lab/`](../lab/README.md). A cell with no measurement "
           "(an error, a failed check, a skipped shape) shows \"—\".", ""]
    for card in card_dirs(results):
        runs = load_card(card)
        devices = sorted({run_info(d)["device"] for files in runs.values() for _, d in files})
        out += [f"## {card.name}", "", f"Device: {', '.join(devices)}.", ""]
        for name, title, how, table in BENCHMARKS:
            for fname, doc in runs.get(name, []):
                out += [f"### {title}" + (f" (`{fname}`)" if len(runs[name]) > 1 else ""), "",
                        how + ".", "", _run_line(card.name, fname, doc), "", table(doc), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _newest(results: Path, name: str, keep=None):
    """(card, file name, JSON) of the newest run of benchmark ``name`` over every card (of those for which
    ``keep(JSON)`` is true, when given), or None."""
    found = [(run_info(d)["date"], c.name, f, d) for c in card_dirs(results) for f, d in load_card(c).get(name, [])
             if keep is None or keep(d)]
    if not found:
        return None
    # the newest run; on one date the benchmark's main file (``e2e.json`` before ``e2e_graph.json``)
    _, card, fname, doc = max(found, key=lambda x: (x[0], x[2] == f"{name}.json"))
    return card, fname, doc


def _has_speed_shapes(doc) -> bool:
    """An e2e run that measured StaticCache at every one of :data:`SPEED_SHAPES` (the table's columns): a
    newer run of other shapes only does not replace it there."""
    ran = {(r["batch"], r["context"]) for r in doc.get("rows", []) if r["cache"] == "StaticCache"
           and not r.get("max_batch")}
    return set(SPEED_SHAPES) <= ran


def _speedups(e2e_doc, method: str) -> tuple:
    """The end-to-end step of ``method``'s fastest backend at each of :data:`SPEED_SHAPES` against
    StaticCache's: (cells, backend)."""
    rows = [r for r in e2e_doc["rows"] if not r.get("max_batch")]
    at = {(r["cache"], r["batch"], r["context"]): r for r in rows}
    caches = sorted({r["cache"] for r in rows if r["cache"] == method or r["cache"].startswith(method + ":")})
    if not caches:
        return [NONE] * len(SPEED_SHAPES), None
    first = SPEED_SHAPES[0]

    def ms(c, shape):
        r = at.get((c, *shape))
        return r["ms_per_step"] if r and r.get("status") == "ok" else None

    best = min(caches, key=lambda c: ms(c, first) or float("inf"))
    cells = []
    for shape in SPEED_SHAPES:
        base, mine, r = ms("StaticCache", shape), ms(best, shape), at.get((best, *shape))
        if mine and base:
            cells.append(f"{base / mine:.2f}x")
        else:
            cells.append(r["status"] if r and r.get("status") != "ok" else NONE)
    return cells, {"cupy": "CuPy", "triton": "Triton"}.get(best.partition(":")[2], best.partition(":")[2] or None)


def _calibration(method: str) -> str:
    from kvq.integrations import methods as M
    try:
        kind = M.get_method(method).calibration
    except (KeyError, ValueError):
        return NONE
    return f"yes (`kvq calibrate {kind}`)" if kind else "no"


#: the README's quality-against-bits figure, drawn from the newest long_lm.json by :func:`quality_figure`
FIGURE = ROOT / "docs" / "figures" / "long_lm_quality_vs_bits.png"


def methods_table(results: Path = RESULTS) -> str:
    """The README's table to choose a method: per method of the evaluation model's run (the newest
    ``long_lm.json``: a 16K-context LM trained here), its paper configuration's bits per element,
    perplexity against FP16's and retrieval accuracy at the model's context; MiniLM's attention KL (the
    newest ``attention.json``), the end-to-end decode step against FP16 (the newest ``e2e`` run that measured
    :data:`SPEED_SHAPES`) and
    whether it needs a calibration; then the sources and the quality-against-bits figure."""
    lm, att = (_newest(results, n) for n in ("long_lm", "attention"))
    e2e = _newest(results, "e2e", keep=_has_speed_shapes)
    if lm is None:
        raise ValueError(f"no long_lm.json under {results}/<card>/: the method table lists the evaluated methods")
    paper = E.long_lm_paper_rows(lm[2])
    n = lm[2]["ppl_by_position"].get("context")
    kl = {r["method"]: (r.get("mean") or {}).get("attention_kl") for r in (att[2]["rows"] if att else [])}
    base = (paper.get("FP16") or {}).get("ppl")
    shapes = " / ".join(f"{b} x {t // 1024}K" for b, t in SPEED_SHAPES)
    head = ["method", f"bits / element at {n // 1024}K (paper / state)", f"perplexity at {n // 1024}K (vs FP16)",
            f"retrieval at {n // 1024}K", "MiniLM attention KL", f"decode step vs FP16 ({shapes})", "calibration"]
    rows = []
    for m, r in paper.items():
        v = r["ppl"]
        quality = f"{v:.3f} ({100.0 * (v / base - 1):+.2f}%)" if v and base else NONE
        cells, backend = _speedups(e2e[2], m) if e2e else ([NONE] * len(SPEED_SHAPES), None)
        speed = " / ".join(cells) + (f" ({backend})" if backend and any(c != NONE for c in cells) else "")
        rows.append([m, f"{S._fmt(r['bits_paper'], '.2f')} / {S._fmt(r['bits'], '.2f')}", quality,
                     S._fmt(r["retrieval"], ".3f"), S._fmt(kl.get(m), ".3g"), speed, _calibration(m)])

    def src(x):
        i = run_info(x[2])
        return f"`benchmarks/results/{x[0]}/{x[1]}` ({i['device']}, commit `{i['commit']}`, {i['date']})"

    notes = [f"Bits, perplexity and retrieval: {src(lm)}, each method at its paper's configuration (the "
             "equal-memory rows and the protocol: [docs/results.md](docs/results.md))."]
    notes.append(f"Attention KL: {src(att)}." if att else "Attention KL: no `attention.json` committed.")
    notes.append(f"Speed: {src(e2e)}: transformers' FP16 StaticCache step over the method's fastest backend's "
                 "(above 1x: faster than FP16; `oom`: did not fit)." if e2e else "Speed: no `e2e.json` committed.")
    notes.append("\"—\": not measured. Every number comes from that JSON (`make results` regenerates this table "
                 "and the figure); all measurements: [docs/results.md](docs/results.md).")
    figure = (f"![Perplexity against bits per element on the {n // 1024}K-context evaluation model, one series "
              f"per method](docs/figures/{FIGURE.name})")
    return S.md_table(head, rows) + "\n\n" + " ".join(notes) + "\n\n" + figure


def quality_figure(results: Path = RESULTS, path: Path = FIGURE) -> Path:
    """Draw perplexity against bits per element (state accounting) of the newest ``long_lm.json``, one
    series per method (hollow: the paper's configuration), FP16 as a line, the budgets dashed; write
    ``path`` (PNG). ValueError when no long_lm.json is committed."""
    lm = _newest(results, "long_lm")
    if lm is None:
        raise ValueError(f"no long_lm.json under {results}/<card>/: nothing to draw")
    import matplotlib
    matplotlib.use("Agg")
    from kvq.viz.evaluation import plot_quality_vs_bits
    doc = lm[2]
    pts, fp = E.long_lm_quality_points(doc)
    n = doc["ppl_by_position"].get("context")
    fig = plot_quality_vs_bits(pts, quality=f"perplexity at {n} tokens", budgets=doc["args"].get("budgets"),
                               reference=None if fp is None else ("FP16", fp),
                               title=f"Long-context LM ({run_info(doc)['device']}): perplexity against bits "
                                     "per element")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def fill_markers(text: str, table: str, where: str = "README.md") -> str:
    """``text`` with what stands between :data:`BEGIN` and :data:`END` replaced by ``table``."""
    if text.count(BEGIN) != 1 or text.count(END) < 1 or text.index(END) < text.index(BEGIN):
        raise ValueError(f"{where} must hold one {BEGIN} ... {END} pair (the generated method table goes between)")
    a = text.index(BEGIN) + len(BEGIN)
    b = text.index(END, a)
    return text[:a] + "\n" + table + "\n" + text[b:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(RESULTS), help="the results folder (benchmarks/results)")
    ap.add_argument("--out", default=str(PAGE), help="the page to write (docs/results.md)")
    ap.add_argument("--readme", default=str(README), help="the README whose method table to refill")
    ap.add_argument("--figure", default=str(FIGURE), help="the README's quality-against-bits figure (PNG)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 where a file is out of date")
    a = ap.parse_args(argv)
    results, out, readme = Path(a.results), Path(a.out), Path(a.readme)
    try:
        new_page = page(results)
        new_readme = fill_markers(readme.read_text(), methods_table(results), str(readme))
    except (ValueError, OSError) as e:
        print(f"results_page: {e}", file=sys.stderr)
        return 2
    stale = [p for p, text in ((out, new_page), (readme, new_readme)) if not p.exists() or p.read_text() != text]
    figure = Path(a.figure)
    if a.check:
        if not figure.is_file():
            stale.append(figure)
        for p in stale:
            print(f"results_page: {p} is out of date; run `make results`", file=sys.stderr)
        return 1 if stale else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(new_page)
    readme.write_text(new_readme)
    try:
        quality_figure(results, figure)
    except (ValueError, OSError) as e:
        print(f"results_page: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}, the method table of {readme} and {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
