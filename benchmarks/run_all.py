"""Run every kvq benchmark in one process (CUDA initializes once): ceilings, quant, decode, kivi_kitty, oscar, aqua.

Writes ``ceilings.json``, ``quant.json``, ``decode.json``, ``kivi_kitty.json``, ``oscar.json`` and ``aqua.json`` to ``--out``
(each as soon as its section ends, so a later timeout loses nothing already measured) and prints a short summary table last.
A wall-clock budget (``--budget-s``) is shared by the sections: quant may use at most 45% of it,
kivi_kitty at most 90 s (leaving 45 s for oscar when it runs), oscar at most 120 s (each shape timed
twice: with and without the rotation back), aqua what is left (at most 90 s); measurements past the
budget are recorded as skipped.

    python3 benchmarks/run_all.py --out benchmarks/results/<card>            # on the GPU machine (h100, h200, ...)
    python3 benchmarks/run_all.py --out /tmp/kvq-dry --dry-run                  # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

OSCAR_RESERVE_S = 45.0                    # of the shared budget, kept back from kivi_kitty for oscar


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="result folder (default benchmarks/results/run-<UTC time>)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and timed rounds")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes; without a GPU, on the CPU with TRITON_INTERPRET=1")
    ap.add_argument("--budget-s", type=float, default=250.0, help="wall-clock budget for all sections")
    ap.add_argument("--only", default="ceilings,quant,decode,kivi_kitty,oscar,aqua", help="comma-separated sections to run")
    a = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dry = a.dry_run or device == "cpu"
    if device == "cpu":                   # before any Triton kernel is defined (kvq.fast imports lazily)
        os.environ.setdefault("TRITON_INTERPRET", "1")

    import bench_aqua
    import bench_ceilings
    import bench_decode
    import bench_kivi_kitty
    import bench_oscar
    import bench_quant
    import common as C

    out = Path(a.out) if a.out else HERE / "results" / ("run-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    sections = set(a.only.split(","))
    deadline = C.Deadline(a.budget_s)
    header = C.meta(device)
    header["mode"] = "dry-run" if dry else ("quick" if a.quick else "full")
    print(f"device: {header['device'].get('name')}  commit: {header['commit']}  mode: {header['mode']}",
          flush=True)
    summary = []
    t0 = time.monotonic()

    copy_gbps = None
    needs_copy = any(s in sections for s in ("quant", "decode", "kivi_kitty", "oscar"))   # report % of it
    if "ceilings" in sections or needs_copy:
        ceil = bench_ceilings.run(device, quick=a.quick, dry_run=dry)
        copy_gbps = ceil["copy_gbps"]
        C.write_json(out, "ceilings.json", {"meta": header, **ceil})
        summary += ["== ceilings"] + bench_ceilings.summary_lines(ceil)
        print(f"[{time.monotonic() - t0:6.1f} s] ceilings done", flush=True)

    if "quant" in sections:
        quant_deadline = C.Deadline(min(deadline.left(), 0.45 * a.budget_s))
        try:
            q = bench_quant.run(device, copy_gbps=copy_gbps, quick=a.quick, dry_run=dry, deadline=quant_deadline)
        except Exception as e:                           # e.g. out of memory for the input itself
            q = {"error": C.err_str(e), "rows": []}
        C.write_json(out, "quant.json", {"meta": header, **q})
        shape = bench_quant.DRY_SHAPE if dry else bench_quant.SHAPE
        summary += [f"== quant: x {shape} fp16, ms per call"] + bench_quant.summary_lines(q)
        print(f"[{time.monotonic() - t0:6.1f} s] quant done", flush=True)

    if "decode" in sections:
        try:
            d = bench_decode.run(device, copy_gbps=copy_gbps, quick=a.quick, dry_run=dry, deadline=deadline)
        except Exception as e:
            d = {"error": C.err_str(e), "shapes": []}
        C.write_json(out, "decode.json", {"meta": header, **d})
        summary += ["== decode: fp16 K/V, T_q 1, ms per call"] + bench_decode.summary_lines(d)
        print(f"[{time.monotonic() - t0:6.1f} s] decode done", flush=True)

    if "kivi_kitty" in sections:
        reserve = OSCAR_RESERVE_S if "oscar" in sections else 0.0        # oscar's share, kept back
        kk_deadline = C.Deadline(min(max(deadline.left() - reserve, 0.0), 90.0))
        try:
            kk = bench_kivi_kitty.run(device, copy_gbps=copy_gbps, quick=a.quick, dry_run=dry, deadline=kk_deadline)
        except Exception as e:
            kk = {"error": C.err_str(e), "shapes": []}
        C.write_json(out, "kivi_kitty.json", {"meta": header, **kk})
        summary += ["== kivi_kitty: paged quantized decode, fp16 q, T_q 1, ms per call"] + \
            bench_kivi_kitty.summary_lines(kk)
        print(f"[{time.monotonic() - t0:6.1f} s] kivi_kitty done", flush=True)

    for name, mod, cap_s, title in (
            ("oscar", bench_oscar, 120.0, "fused INT2 decode over the paged history, fp16 q, T_q 1"),
            ("aqua", bench_aqua, 90.0, "AQUA-KV encode / decode per layer, predictor cost, decode attention "
                                       "(fp32 history), fp16 q, T_q 1")):
        if name not in sections:
            continue
        sec_deadline = C.Deadline(min(max(deadline.left(), 0.0), cap_s))
        try:
            res = mod.run(device, copy_gbps=copy_gbps, quick=a.quick, dry_run=dry, deadline=sec_deadline)
        except Exception as e:
            res = {"error": C.err_str(e), "shapes": []}
        C.write_json(out, f"{name}.json", {"meta": header, **res})
        summary += [f"== {name}: {title}, ms per call"] + mod.summary_lines(res)
        print(f"[{time.monotonic() - t0:6.1f} s] {name} done", flush=True)

    print(f"\nresults in {out}  ({time.monotonic() - t0:.1f} s)")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
