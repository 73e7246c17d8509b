"""Issue 39's baseline: the fused decodes' GPU time (CUDA-graph replay) on the Triton and CuPy backends against
torch SDPA FP16, at the issue's shapes (batch x context 1 x 32K, 1 x 128K, 8 x 32K, 8 x 128K, 32 x 32K; 32 query /
8 KV heads of 128, one query token), in one process on one card.

It runs the suite's own benchmarks with their shapes narrowed to the issue's (nothing else is changed):
``bench_kivi_kitty`` (KIVI-K2V2, KIVI-K4V4, Kitty, Kitty-Pro), ``bench_oscar`` (OSCAR) and
``bench_bitdecoding_decode`` (BitDecoding-KC2 / KC4 at g_q = 4), and writes their JSON under ``--out``.

    python3 lab/2026-11-29-triton-decode/baseline.py --out /tmp/res [--budget-s 300]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

SHAPES = ((1, 32768), (1, 131072), (8, 32768), (8, 131072), (32, 32768))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--only", default="kivi_kitty,oscar,bitdecoding")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    import bench_bitdecoding_decode as BD
    import bench_ceilings
    import bench_kivi_kitty as KK
    import bench_oscar as OS
    import common as C

    meta = C.meta("cuda")
    t0 = time.monotonic()
    ceil = bench_ceilings.run("cuda", quick=True, dry_run=False)
    C.write_json(a.out, "ceilings.json", {"meta": meta, **ceil})
    only = a.only.split(",")
    share = a.budget_s / len(only)
    for name, mod in (("kivi_kitty", KK), ("oscar", OS)):
        if name not in only:
            continue
        deadline, shapes = C.Deadline(share), []
        for B, T in SHAPES:             # the module's own shape run, at the shapes only
            try:
                shapes.append(mod.run_shape(B, T, mod.H_Q, mod.H_KV, mod.D, "cuda", ceil["copy_gbps"], False, False,
                                            deadline))
            except Exception as e:      # noqa: BLE001 - recorded, as C.run_shapes does
                shapes.append({"B": B, "T": T, "error": C.err_str(e)})
                C.free_cuda("cuda")
        C.write_json(a.out, f"{name}.json", {"meta": meta, "backends": list(KK.BACKENDS), "shapes": shapes})
        print(f"[{time.monotonic() - t0:6.1f} s] {name} done", flush=True)
    if "bitdecoding" in only:
        for B, T in SHAPES:
            BD.main(["--out", a.out, "--batches", str(B), "--contexts", str(T), "--gq", "4",
                     "--others", "--budget-s", str(share / len(SHAPES)), "--name", f"bitdecoding_{B}x{T}.json"])
        print(f"[{time.monotonic() - t0:6.1f} s] bitdecoding done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
