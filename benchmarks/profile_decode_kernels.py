"""Per-kernel GPU time of one KIVI / Kitty / OSCAR decode step (torch.profiler / CUPTI sees the CuPy
launches too).

    python benchmarks/profile_decode_kernels.py --backend cupy --B 8 --T 32768 --methods KIVI-K2V2
    python benchmarks/profile_decode_kernels.py --backend cupy --B 1 --T 32768 --methods OSCAR

Prints, per method, each kernel's name and mean time over ``--reps`` decodes and their sum; the cache is
the random-code cache of ``bench_kivi_kitty.build_cache`` (as ``profile_fused.py``); OSCAR's is
``bench_oscar.build_cache`` with its random orthogonal calibration.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import profile_fused as PF  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cupy", choices=("triton", "cupy"))
    ap.add_argument("--methods", default="KIVI-K2V2")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    for m in a.methods.split(","):
        mod, cfg, st, qs = PF.setup(m, a.B, a.T, a.backend)
        step = PF.decode_step(m, mod, cfg, st, a.backend)
        for _ in range(3):
            step(qs[0])
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(a.reps):
                step(qs[i % len(qs)])
            torch.cuda.synchronize()
        tot = collections.defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                tot[ev.name[:70]] += ev.device_time / a.reps
        rows = sorted(tot.items(), key=lambda kv: -kv[1])
        print(json.dumps({"method": m, "B": a.B, "T": a.T, "us_per_decode": round(sum(tot.values()), 2),
                          "kernels_us": {k: round(v, 2) for k, v in rows}}))
        st = step = None                        # free the cache before the next method's
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
