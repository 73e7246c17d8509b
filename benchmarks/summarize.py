"""Markdown tables from a results folder (what docs/results.md, README.md and the book quote).

    python benchmarks/summarize.py benchmarks/results/h100               # the latest run on a card
    python benchmarks/summarize.py lab/2026-11-22-kivi-kitty-decode/results/h100-136989f   # one run (one commit)
    python benchmarks/summarize.py lab/2026-11-22-kivi-kitty-decode/results/h100-c6508dc   # OSCAR decode too

The book's chapters import ``kivi_kitty_table`` / ``oscar_table`` and ``load`` from here, and
``results_page.py`` builds docs/results.md from these tables (one per benchmark JSON), so the numbers
they show are the committed JSON's. A cell with no measurement is "—", never a number.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(d, name: str):
    """The JSON ``name`` of results folder ``d``, or None where the run did not write it."""
    p = Path(d) / name
    return json.loads(p.read_text()) if p.exists() else None


def run_line(res) -> str:
    """Device, commit and date of a benchmark JSON, and the copy ceiling it measured."""
    m = res["meta"]
    c = m["commit"]
    head, plus, rest = c.partition("+")         # "fd9acd6+tail-rule": a tree that was not a commit
    commit = head[:7] + plus + rest
    return (f"{m['device']['name']}, commit `{commit}`, {m['date_utc'][:10]}; copy ceiling "
            f"{res['copy_gbps']:.0f} GB/s")


def _sdpa_ms(s) -> float:
    return s["fp16"]["sdpa_best"]["ms"]


def kivi_kitty_table(kk, methods=("KIVI-K2V2", "KIVI-K4V4", "Kitty", "Kitty-Pro"), backend="cupy",
                     ratio_to="KIVI-K2V2") -> str:
    """``kivi_kitty.json`` as a Markdown table: per shape, SDPA FP16 and per method the time, the
    speedup over SDPA and the percent of copy bandwidth (backend "cupy" or "triton"); with
    ``ratio_to``, each other method's time over that method's."""
    key = (lambda m: f"{m} [cupy]") if backend == "cupy" else (lambda m: m)
    head = ["batch x context", "SDPA FP16 (ms)"]
    for m in methods:
        head += [f"{m} (ms)", "vs SDPA", "% copy"] + ([f"/ {ratio_to}"] if ratio_to and m != ratio_to else [])
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for s in kk["shapes"]:
        sd = _sdpa_ms(s)
        cells = [f"{s['B']} x {s['T'] // 1024}K", f"{sd:.3f}"]
        for m in methods:
            r = s["methods"][key(m)]
            cells += [f"{r['ms']:.3f}", f"{sd / r['ms']:.1f}x", f"{r['pct_copy']:.0f}%"]
            if ratio_to and m != ratio_to:
                cells.append(f"{r['ms'] / s['methods'][key(ratio_to)]['ms']:.2f}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def read_ceiling_table(kk, methods=("KIVI-K2V2", "KIVI-K4V4", "Kitty", "Kitty-Pro"), key=lambda m: f"{m} [cupy]") -> str:
    """The size-matched read ceiling of ``kivi_kitty.json`` / ``oscar.json`` (``common.read_ceiling``): per
    shape and method, one kernel that only reads the step's bytes, as % of copy bandwidth, and the step's
    time as % of that kernel's ("" where a run has none)."""
    head = ["batch x context"]
    for m in methods:
        head += [f"{m}: read-only kernel, % copy", f"{m} step, % of it"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for s in kk["shapes"]:
        cells = [f"{s['B']} x {s['T'] // 1024}K"]
        for m in methods:
            r = (s["methods"] if "methods" in s else s).get(key(m)) or {}
            rc, ms = r.get("read_ceiling"), r.get("ms")
            if rc and ms:
                # the same bytes in rc["ms"] instead of ms: the step's % of copy scaled by ms / rc["ms"]
                cells += [f"{r['pct_copy'] * ms / rc['ms']:.0f}%", f"{100.0 * rc['ms'] / ms:.0f}%"]
            else:
                cells += ["", ""]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def fused_ceilings_table(fc) -> str:
    """``fused_ceilings.json`` (``lab/2026-11-22-kivi-kitty-decode/fused_ceilings.py``) as a Markdown table: per shape and method
    the page kernel's time as it is, with its page copies left out (compute only) and with its compute
    left out (copies only), us, and compute only over copies only (above 1: the compute is the longer)."""
    by = {}
    for r in fc["rows"]:
        by.setdefault((r["method"], r["B"], r["T"]), {})[r["mode"]] = r["fused_us"]
    head = ["batch x context", "method", "as it is (us)", "compute only (us)", "copies only (us)",
            "compute / copies"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (m, B, T), t in by.items():
        if not all(t.get(k) for k in (0, 1, 2)):
            continue
        rows.append(f"| {B} x {T // 1024}K | {m} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | {t[1] / t[2]:.2f} |")
    return "\n".join(rows)


def _shape_table(o, header: list, cells) -> str:
    """A Markdown table over ``o["shapes"]``: the column names ``header`` (the first is the shape's), then
    per shape its "B x TK" label and the strings ``cells(shape)``."""
    rows = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    rows += [f"| {s['B']} x {s['T'] // 1024}K | " + " | ".join(cells(s)) + " |" for s in o["shapes"]]
    return "\n".join(rows)


def oscar_table(o) -> str:
    """``oscar.json`` as a Markdown table: per shape, SDPA FP16, the Triton and CuPy OSCAR decode times,
    their speedups over SDPA and the CuPy kernel's percent of copy bandwidth."""
    def cells(s):
        sd, tr, cu = _sdpa_ms(s), s["oscar"], s["oscar [cupy]"]
        return [f"{sd:.3f}", f"{tr['ms']:.3f}", f"{cu['ms']:.3f}", f"{sd / tr['ms']:.2f}x / {sd / cu['ms']:.2f}x",
                f"{cu['pct_copy']:.1f}%"]

    return _shape_table(o, ["batch x context", "SDPA FP16 (ms)", "OSCAR Triton (ms)", "OSCAR CuPy (ms)",
                            "vs SDPA (Triton / CuPy)", "% copy (CuPy)"], cells)


def oscar_folded_table(o, method: str = "oscar [cupy]") -> str:
    """One backend's OSCAR rows of ``oscar.json`` with the decode for a W_O with R_V^T folded in
    (``rv_folded``: the call with ``rotate_back=False``): per shape SDPA FP16, the whole decode and the
    folded one (ms, speedup over SDPA) and the whole decode's percent of copy bandwidth."""
    def cells(s):
        sd, r = _sdpa_ms(s), s[method]
        f = r["rv_folded"]["ms"]
        return [f"{sd:.3f}", f"{r['ms']:.3f}", f"{sd / r['ms']:.2f}x", f"{f:.3f}", f"{sd / f:.2f}x",
                f"{r['pct_copy']:.1f}%"]

    return _shape_table(o, ["batch x context", "SDPA FP16 (ms)", "OSCAR (ms)", "vs SDPA", "R_V folded (ms)",
                            "vs SDPA", "% copy"], cells)


def decode_table(dec) -> str:
    rows = ["| batch x context | floor (ms) | SDPA (ms) | kvq Triton (ms) | Triton / SDPA | kvq CUDA (ms) | CUDA / SDPA "
            "| eager per call: SDPA / Triton / CUDA (ms) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in dec["shapes"]:
        im = s.get("impls", {})
        sd = im.get("sdpa_gqa") or im.get("sdpa_fold") or {}
        tr, cu = im.get("triton", {}), im.get("cupy", {})

        def ms(r):
            return f"{r['ms']:.3f}" if r.get("valid") else "invalid"

        def eager(r):
            return f"{r['timing']['eager']['median_ms']:.3f}" if r.get("timing") else "-"

        rows.append(f"| {s['B']} x {s['T'] // 1024}K | {s['floor_ms']:.3f} | {ms(sd)} | {ms(tr)} | "
                    f"{tr['ms'] / sd['ms']:.2f} | {ms(cu)} | {cu['ms'] / sd['ms']:.2f} | "
                    f"{eager(sd)} / {eager(tr)} / {eager(cu)} |")
    return "\n".join(rows)


def quant_table(q) -> str:
    rows = ["| op | layout | G | bits | Triton (ms) | % copy BW | CUDA (ms) | % copy BW |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    table = {}
    for r in q["rows"]:                                   # one row per (op, layout, G, bits, impl)
        table.setdefault((r["op"], r["layout"], r["group_size"], r["bits"]), {})[r["impl"]] = r

    def cell(x):
        if not x or not x.get("valid", False):
            return "invalid | -"
        return f"{x['ms']:.3f} | {x['pct_copy']:.0f}%"

    for (op, layout, G, bits), im in table.items():
        rows.append(f"| {op} | {layout} | {G} | {bits} | {cell(im.get('triton'))} | {cell(im.get('cupy'))} |")
    return "\n".join(rows)


# ------------------------------------------------------------------------------ tables of the results page

#: what a cell without a measurement shows
NONE = "—"


def md_table(header: list, rows: list) -> str:
    """A Markdown table: the column names ``header`` and one list of cell strings per row."""
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def _ok(r) -> bool:
    """A timed row that has a time and passed its correctness check (where it records one)."""
    if not r or r.get("ms") is None or r.get("error") or r.get("skipped"):
        return False
    return bool(r.get("valid", (r.get("check") or {}).get("ok", True)))


def _shape_label(s) -> str:
    return f"{s['B']} x {s['T'] // 1024}K" + (f", g_q {s['g_q']}" if "g_q" in s else "")


def speed_table(shapes, rows_of, pct_copy: bool = False) -> str:
    """Decode steps against FP16: per shape the best SDPA FP16 time (``fp16.sdpa_best``) and, per row of
    ``rows_of(shape)`` (name -> timed row), its time and speed-up over SDPA (and its % of copy bandwidth
    with ``pct_copy``); a row that failed its check, erred or was skipped shows NONE."""
    names = list(dict.fromkeys(n for s in shapes for n in rows_of(s)))
    head = ["batch x context", "SDPA FP16 (ms)"]
    for n in names:
        head += [f"{n} (ms)", "vs SDPA"] + (["% copy"] if pct_copy else [])
    rows = []
    for s in shapes:
        sd = ((s.get("fp16") or {}).get("sdpa_best") or {}).get("ms")
        cells = [_shape_label(s), f"{sd:.3f}" if sd else NONE]
        for n in names:
            r = rows_of(s).get(n)
            good = _ok(r)
            cells += [f"{r['ms']:.3f}" if good else NONE, f"{sd / r['ms']:.2f}x" if good and sd else NONE]
            if pct_copy:
                cells.append(f"{r['pct_copy']:.0f}%" if good and r.get("pct_copy") else NONE)
        rows.append(cells)
    return md_table(head, rows)


def ceilings_table(ce) -> str:
    """``ceilings.json``: the copy bandwidth (read + write) and the bf16 matmul rate."""
    cp, mm = ce.get("copy_gbps"), ce.get("matmul_tflops")
    return md_table(["device-to-device copy (GB/s, read + write)", "bf16 matmul (TFLOP/s)"],
                    [[f"{cp:.0f}" if cp else NONE, f"{mm:.0f}" if mm else NONE]])


def gpu_tests_table(t) -> str:
    """``gpu-tests.json`` (``junit_summary.py``): the GPU suite's counts and pytest's verdict."""
    return md_table(["tests", "passed", "failed", "errors", "skipped", "pytest"],
                    [[str(t.get(k, NONE)) for k in ("tests", "passed", "failed", "errors", "skipped")]
                     + [str(t.get("rc_meaning", t.get("rc", NONE)))]])


def aqua_tables(a) -> str:
    """``aqua.json``: per backend the per-layer encode / decode throughput, the fused decode's speed-up over
    the unfused sequence and the predictors' time per token; then decode attention against SDPA FP16."""
    rows = []
    for b, r in a.get("backends", {}).items():
        enc, dec, pr = r.get("encode") or {}, r.get("decode") or {}, r.get("predictor") or {}

        def tps(x):
            v = (x or {}).get("tokens_per_s")
            return f"{v / 1e6:.1f}M" if v else NONE

        fs, us = dec.get("fused_speedup"), pr.get("predictor_us_per_token")
        rows.append([b, tps(enc.get("layer1")), tps(dec.get("layer1")), f"{fs:.1f}x" if fs else NONE,
                     f"{us:.3f}" if us else NONE])
    layer = md_table(["backend", "encode (tokens/s, residual layer)", "decode (tokens/s, residual layer)",
                      "fused decode vs unfused", "predictors (us per token)"], rows)
    return layer + "\n\n" + speed_table(a["shapes"], lambda s: s.get("aqua") or {})


def bitdecoding_pack_table(p) -> str:
    """``bitdecoding_pack.json``: the Residual Kernel per configuration and case (a whole 128K prefill, or
    one decode step's full residual blocks and that cost spread over the N_r steps a page serves), next to
    one read-only kernel on the same bytes."""
    rows = []
    for r in p["rows"]:
        rc = (r.get("read_ceiling") or {}).get("ms")
        good = _ok(r)
        rows.append([r["config"], r["case"], str(r.get("B", NONE)), f"{r['ms'] * 1e3:.1f}" if good else NONE,
                     f"{rc * 1e3:.1f}" if rc else NONE,
                     f"{r['per_step_us']:.2f}" if r.get("per_step_us") is not None else NONE])
    return md_table(["config", "case", "batch", "Residual Kernel (us)", "read-only kernel, same bytes (us)",
                     "per decode step (us)"], rows)


def ppl_table(ppl) -> str:
    """``ppl.json`` (``kvq eval ppl``): per method its bits per element (paper accounting, and the state's at
    the evaluation length), perplexity and the change against no cache."""
    base = next((r["ppl"] for r in ppl["rows"] if r["method"] == "no cache"), None)
    rows = []
    for r in ppl["rows"]:
        v = r.get("ppl")
        rows.append([r["method"], _fmt(r.get("bits_per_element_paper"), ".3f"), _fmt(r.get("bits_per_element"), ".3f"),
                     _fmt(v, ".4f"), f"{100.0 * (v / base - 1):+.2f}%" if v and base else NONE])
    return md_table(["method", "bits / element (paper)", f"bits / element (state, {ppl.get('seq_len', '?')} tokens)",
                     "perplexity", "vs no cache"], rows)


def attention_table(att) -> str:
    """``attention.json`` (``kvq eval attention``): per method its bits per element and the mean over layers
    of the K / V relative MSE, attention KL and output MSE."""
    rows = []
    for r in att["rows"]:
        m = r.get("mean") or {}
        rows.append([r["method"], _fmt(r.get("bits_per_element"), ".3f")]
                    + [_fmt(m.get(k), ".3e") for k in ("k_rel_mse", "v_rel_mse", "attention_kl", "output_mse")]
                    + [r.get("skipped", "")])
    return md_table(["method", "bits / element", "K rel. MSE", "V rel. MSE", "attention KL", "output MSE", "note"], rows)


def train_table(tr) -> str:
    """``train.json`` (``train_tiny_lm.py``): the model, the training run and its held-out bits per byte."""
    return md_table(["parameters", "steps", "tokens seen", "train wall (s)", "stopped by", "held-out bits / byte"],
                    [[f"{tr.get('n_params', 0):,}", str(tr.get("steps", NONE)), f"{tr.get('tokens_seen', 0):,}",
                      _fmt(tr.get("train_wall_s"), ".1f"), str(tr.get("stop_reason", NONE)),
                      _fmt(tr.get("final_eval_bits_per_byte"), ".3f")]])


def throughput_table(tp) -> str:
    """``throughput.json`` (``throughput_tiny_lm.py``): per method the largest batch that fit the memory
    budget, its tokens per second and the best tokens per second of any batch."""
    rows = [[m, str(s.get("max_batch", NONE)), _fmt(s.get("tokens_per_s"), ".0f"), _fmt(s.get("best_tokens_per_s"), ".0f")]
            for m, s in tp.get("summary", {}).items()]
    return md_table(["method", f"largest batch in {tp.get('budget_gib', '?')} GiB", "tokens/s at it",
                     "best tokens/s"], rows)


def _fmt(v, spec: str) -> str:
    return NONE if v is None else format(v, spec)


def main(argv=None) -> int:
    d = Path((argv or sys.argv[1:])[0])
    ce, q, dec, t, kk, o, fc = (load(d, n) for n in ("ceilings.json", "quant.json", "decode.json", "gpu-tests.json",
                                                    "kivi_kitty.json", "oscar.json", "fused_ceilings.json"))
    meta = (dec or q or kk or o or ce or fc)["meta"]
    print(f"Device {meta['device']['name']}, torch {meta['device']['torch']}, triton {meta['device']['triton']}, "
          f"cupy {meta['device']['cupy']}; commit {meta['commit'][:7]}; {meta['date_utc'][:10]}.\n")
    if ce:
        print(f"Ceilings: device-to-device copy {ce['copy_gbps']:.0f} GB/s (read + write), "
              f"bf16 matmul {ce['matmul_tflops']:.0f} TFLOP/s.\n")
    if t:
        print(f"GPU tests (`pytest -m gpu`): {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
              f"{t['skipped']} skipped.\n")
    if q:
        print(quant_table(q) + "\n")
    if dec:
        print(decode_table(dec) + "\n")
    if kk:
        print(kivi_kitty_table(kk) + "\n")
        if any((r or {}).get("read_ceiling") for s in kk["shapes"] for r in s["methods"].values()):
            print(read_ceiling_table(kk) + "\n")
    if o and "oscar [cupy]" in o["shapes"][0] and "oscar" in o["shapes"][0]:
        print(oscar_table(o) + "\n")
    if o and all((s.get("oscar [cupy]") or {}).get("rv_folded") for s in o["shapes"]):
        print(oscar_folded_table(o) + "\n")
    if o and any((s.get("oscar [cupy]") or {}).get("read_ceiling") for s in o["shapes"]):
        print(read_ceiling_table(o, methods=("oscar [cupy]",), key=lambda m: m) + "\n")
    if fc:
        print(fused_ceilings_table(fc) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
