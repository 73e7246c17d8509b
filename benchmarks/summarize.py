"""Markdown tables from a results folder (what README.md and the book quote).

    python benchmarks/summarize.py benchmarks/results/h100-93b0336
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(d: Path, name: str):
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None


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
    ce, q, dec, t = (_load(d, n) for n in ("ceilings.json", "quant.json", "decode.json", "gpu-tests.json"))
    meta = (dec or q or ce)["meta"]
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
        print(decode_table(dec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
