"""GPU time per kernel of one eager decode call (torch.profiler's CUDA activity), per method and backend: where a
Triton decode's GPU time goes against the CuPy one's (profile_host's ``gpu_us`` is the call's total).

    python3 lab/2026-11-30-planned-append/kernel_times.py --out $OUT/kernels.json [--B 1 --T 32768]
    python3 lab/2026-11-30-planned-append/kernel_times.py --cases OSCAR:triton --tail-min-keys 32 256 --B 8 --out ...

Each call: ``benchmarks/profile_fused.decode_step`` over its random-code cache (validation off), 10 warm-up
calls, then 20 calls under the profiler; per kernel: calls per decode call and us per decode call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))

import torch  # noqa: E402

import profile_fused as PF  # noqa: E402
from kvq.fast import set_validation  # noqa: E402

CALLS = 20


def kernels(fn) -> list:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t:
            rows.append({"kernel": e.key[:120], "calls_per_call": e.count / CALLS, "us_per_call": t / CALLS})
    return sorted(rows, key=lambda r: -r["us_per_call"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--cases", nargs="+", default=["OSCAR:triton", "OSCAR:cupy", "KIVI-K2V2:triton", "KIVI-K2V2:cupy"])
    ap.add_argument("--tail-min-keys", type=int, nargs="+", default=None,
                    help="Triton OSCAR: time each case once per value of oscar_decode.TAIL_MIN_KEYS (256: the "
                    "general split rule's floor, as before a012ac0)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    set_validation(False)
    out = {"B": a.B, "T": a.T, "card": torch.cuda.get_device_name(), "cases": {}}
    from kvq.fast.triton import oscar_decode as OD
    default = OD.TAIL_MIN_KEYS
    runs = [(c, None) for c in a.cases] if not a.tail_min_keys else \
        [(c, k) for c in a.cases for k in a.tail_min_keys]
    for case, tmk in runs:
        method, backend = case.split(":")
        OD.TAIL_MIN_KEYS = default if tmk is None else tmk
        OD._decode_plan.cache_clear()
        mod, cfg, st, qs = PF.setup(method, a.B, a.T, backend)
        step = PF.decode_step(method, mod, cfg, st, backend)
        rows = kernels(lambda: step(qs[0]))
        name = case if tmk is None else f"{case} TAIL_MIN_KEYS={tmk}"
        out["cases"][name] = rows
        print(json.dumps({"case": name, "total_us": round(sum(r["us_per_call"] for r in rows), 1),
                          "top": [(r["kernel"][:60], round(r["us_per_call"], 1), r["calls_per_call"]) for r in rows[:8]]}),
              flush=True)
        st = step = None
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
