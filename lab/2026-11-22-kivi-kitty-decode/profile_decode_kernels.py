"""Per-kernel GPU time of one KIVI / Kitty / OSCAR decode step (torch.profiler / CUPTI sees the CuPy
launches too).

    python lab/2026-11-22-kivi-kitty-decode/profile_decode_kernels.py --backend cupy --B 8 --T 32768 --methods KIVI-K2V2
    python lab/2026-11-22-kivi-kitty-decode/profile_decode_kernels.py --backend cupy --B 1 --T 32768 --methods OSCAR

Prints, per method, each kernel's name and mean time over ``--reps`` decodes and their sum; the cache is
the random-code cache of ``bench_kivi_kitty.build_cache`` (as ``profile_fused.py``); OSCAR's is
``bench_oscar.build_cache`` with its random orthogonal calibration. Eager launches: the host's launch
gaps separate the kernels that a graph replay runs side by side.

    python lab/2026-11-22-kivi-kitty-decode/profile_decode_kernels.py --B 8 --T 8192 --methods Kitty --timeline

``--timeline``: the decodes captured in one CUDA graph over cold caches (``profile_fused.cache_copies``,
``--copies``) and replayed under the profiler, as ``bench_kivi_kitty`` times them; per kernel its start
and end relative to the step's first kernel (median over the steps, us), so one sees which kernels
overlap and what waits; the median step span (first start to last end) and period (start to next start).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))   # profile_fused

import profile_fused as PF  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cupy", choices=("triton", "cupy"))
    ap.add_argument("--methods", default="KIVI-K2V2")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--timeline", action="store_true", help="graph replay: each kernel's start / end in the step")
    ap.add_argument("--copies", default="auto", help="--timeline: caches to rotate over (profile_fused)")
    ap.add_argument("--tune", default="", help="paged.Knobs values for the run, e.g. 'side_stream=False;tail_mma=True'")
    a = ap.parse_args()
    a.knobs = PF.apply_tune(a.backend, a.tune)      # {prefix: Knobs}, passed to every decode
    if a.timeline:
        for m in a.methods.split(","):
            print(json.dumps(timeline(m, a)))
        return
    for m in a.methods.split(","):
        mod, cfg, st, qs = PF.setup(m, a.B, a.T, a.backend)
        step = PF.decode_step(m, mod, cfg, st, a.backend, a.knobs)
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


def _med(xs):
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def timeline(m: str, a) -> dict:
    """Kernel starts / ends within a decode step, from a profiled CUDA-graph replay of --reps steps."""
    mod, cfg, st, qs = PF.setup(m, a.B, a.T, a.backend)
    states = PF.cache_copies(m, a.B, a.T, a.backend, st, a.copies)
    step = PF.decode_step(m, mod, cfg, None, a.backend, getattr(a, "knobs", None))   # (None: the defaults)
    args = PF.inputs(qs, states)
    reps = max(a.reps, len(args))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                           # warm-up (compilation) off the capture
        for i in range(len(args)):
            step(*args[i])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            step(*args[i % len(args)])
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()),
                 key=lambda e: e.time_range.start)
    # every kernel of step n + 1 waits for step n's last (the side streams fork from the main stream
    # after it), so in start order the steps are consecutive runs of len(evs) / reps kernels
    n = len(evs) // reps if evs and len(evs) % reps == 0 else 0
    steps = [evs[i:i + n] for i in range(0, len(evs), n)] if n else []
    per = collections.defaultdict(lambda: {"start": [], "end": []})
    spans = []
    for s in steps[1:] or steps:                            # the first step follows the replay's launch
        t0 = s[0].time_range.start
        spans.append(max(e.time_range.end for e in s) - t0)
        seen = collections.Counter()
        for e in s:
            key = f"{e.name[:60]}#{seen[e.name]}"
            seen[e.name] += 1
            per[key]["start"].append(e.time_range.start - t0)
            per[key]["end"].append(e.time_range.end - t0)
    res = {"method": m, "B": a.B, "T": a.T, "copies": len(states), "steps": len(steps),
           "graph_kernels": len(evs),
           "step_span_us": round(_med(spans), 2) if spans else None,
           "step_period_us": (round(_med([b[0].time_range.start - a_[0].time_range.start
                                          for a_, b in zip(steps, steps[1:])]), 2) if len(steps) > 1 else None),
           "kernels": {k: {"start_us": round(_med(v["start"]), 2), "end_us": round(_med(v["end"]), 2)}
                       for k, v in per.items()}}
    if not n:
        res["note"] = f"the profiler recorded {len(evs)} kernels for {reps} steps: not a whole number per step"
    del graph
    torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    main()
