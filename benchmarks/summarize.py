"""Markdown tables from a results folder (what README.md and the book quote).

    python benchmarks/summarize.py benchmarks/results/h100-93b0336
    python benchmarks/summarize.py benchmarks/results/h100-c6508dc     # KIVI / Kitty and OSCAR decode too

The book's chapters import ``kivi_kitty_table`` / ``oscar_table`` and ``load`` from here, so the
numbers they show are the committed JSON's.
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
    """``fused_ceilings.json`` (``benchmarks/fused_ceilings.py``) as a Markdown table: per shape and method
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
