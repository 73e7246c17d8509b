"""KIVI / Kitty decode steps over one page period of context: T0 + {0, 32, 64, 96} tokens.

A decode step's time depends on T mod G (G = 128): the key Q-buffer of fp16 keys grows from 0 to G - 1
tokens between flushes, so what the step reads besides the pages (the tail) changes with the phase. At
T = 8192 exactly, KIVI-K2V2 (no sink) has an empty key Q-buffer while Kitty (sink 32) holds 96 fp16 keys,
so one context length compares the two at different points of their page cycles. This script times
``bench_kivi_kitty.run_shape`` (the same caches, timing, checks and bytes) at four phases per shape and
reports each method's time per phase, its mean over the phases (the step a long generation averages),
and the ratios to KIVI-K2V2, per phase and of the means.

    python3 lab/2026-11-23-phase-sweep/phase_sweep.py --out DIR [--shapes "32 8192;8 32768"] [--backends cupy]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]                 # lab/<folder>/<this file> -> the repository
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]       # kvq, and the benchmark helpers it imports

import bench_ceilings  # noqa: E402
import bench_kivi_kitty as K  # noqa: E402
import common as C  # noqa: E402

OFFSETS = (0, 32, 64, 96)


def run(device, shapes, offsets=OFFSETS, copy_gbps=None, dry=False) -> dict:
    res = {"offsets": list(offsets), "copy_gbps": copy_gbps, "shapes": []}
    Hq, Hkv, Dh = (K.DRY_H_Q, K.DRY_H_KV, K.DRY_D) if dry else (K.H_Q, K.H_KV, K.D)
    for B, T0 in shapes:
        rows = []
        for off in offsets:
            s = K.run_shape(B, T0 + off, Hq, Hkv, Dh, device, copy_gbps, False, dry, None)
            rows.append({"T": T0 + off, "sdpa_ms": s.get("fp16", {}).get("sdpa_best", {}).get("ms"),
                         "methods": {m: {k: r.get(k) for k in ("ms", "valid", "pct_copy", "error")}
                                     for m, r in s["methods"].items()}})
        res["shapes"].append({"B": B, "T0": T0, "phases": rows, "summary": summarize(rows)})
    return res


def summarize(rows) -> dict:
    """Per method: mean ms over the phases (None if any phase failed), ratio of means to KIVI-K2V2 (same
    backend) and the per-phase ratios."""
    out = {}
    names = rows[0]["methods"].keys()
    for m in names:
        ms = [r["methods"][m]["ms"] for r in rows]
        ok = all(x is not None and r["methods"][m]["valid"] for x, r in zip(ms, rows))
        out[m] = {"mean_ms": sum(ms) / len(ms) if ok else None, "ms": ms}
    for m, o in out.items():
        ref = "KIVI-K2V2" + m[len(m.split(" [")[0]):]                # the same backend's KIVI-K2V2 row
        base = out.get(ref, {})
        if o["mean_ms"] and base.get("mean_ms"):
            o["ratio_of_means"] = o["mean_ms"] / base["mean_ms"]
            o["ratios"] = [a / b for a, b in zip(o["ms"], base["ms"])]
    return out


def summary_lines(res) -> list[str]:
    lines = []
    for s in res["shapes"]:
        lines.append(f"B={s['B']} T0={s['T0']} (+{', +'.join(str(o) for o in res['offsets'])}):")
        for m, o in s["summary"].items():
            ms = " ".join(f"{x:.4f}" if x is not None else "-" for x in o["ms"])
            extra = (f" mean {o['mean_ms']:.4f} ms; / KIVI-K2V2: of means {o['ratio_of_means']:.3f}, per phase "
                     + " ".join(f"{r:.2f}" for r in o["ratios"])) if o.get("ratio_of_means") else ""
            lines.append(f"  {m:18s} {ms}{extra}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="32 8192;8 8192;8 32768", help="'B T0;B T0;...'")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU, Triton interpreter)")
    a = ap.parse_args()
    device = C.device_or_exit(a.dry_run, "phase_sweep.py")
    shapes = [tuple(int(x) for x in s.split()) for s in a.shapes.split(";") if s.strip()]
    copy = bench_ceilings.run(device, quick=True, dry_run=a.dry_run)["copy_gbps"]
    C.write_result(a.out, "phase_sweep.json", run(device, shapes, copy_gbps=copy, dry=a.dry_run), summary_lines,
                   device)


if __name__ == "__main__":
    main()
