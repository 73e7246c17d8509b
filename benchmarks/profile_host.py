"""Where a decode call's host (Python) time goes: the eager cost a user pays per call, without CUDA graphs.

    python benchmarks/profile_host.py --out $OUT                        # KIVI-K2V2, Kitty, OSCAR on CuPy, 1 x 32K
    python benchmarks/profile_host.py --methods KIVI-K2V2 --B 8 --T 32768 --calls 300
    python benchmarks/profile_host.py --backend triton --validation off        # as a model's decode step runs

For each method (``profile_fused.setup``: the benchmarks' random-code caches) it times ``--calls`` decode
calls launched back to back from Python:
- ``host_us``: host clock per call until the last call returns (the CPU work of a call: Python glue,
  allocations, stream forks, launches), without waiting for the GPU;
- ``wall_us``: host clock per call including the final ``torch.cuda.synchronize`` (with short kernels the
  host is the bottleneck and the two agree);
- ``gpu_us``: the same calls replayed from a CUDA graph, per call (GPU time alone);
and for torch SDPA (FP16, GQA) over a cache of the same shape, the same three numbers. Then it runs the
calls under cProfile and writes the functions with the most own time and the most cumulative time to
``$OUT/host_<method>.txt``. Everything lands in ``$OUT/host.json``. ``--validation off`` leaves out the fast
tier's NaN / inf check of q (a device read per call: ``kvq.fast.set_validation``), as a model's decode step
does; the default keeps it, as a direct call does.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import profile_fused as PF  # noqa: E402


ROUNDS = 5


def host_rounds(fn, calls: int) -> tuple:
    """(host us, wall us) per call of ``fn()`` launched back to back, medians over ROUNDS rounds of
    ``calls`` calls (after a warm-up)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6 / calls)
        wall.append((t2 - t0) * 1e6 / calls)
    return statistics.median(host), statistics.median(wall)


def host_times(fn, calls: int) -> dict:
    """``host_us`` / ``wall_us`` per call of ``fn()`` (``host_rounds``), and ``gpu_us`` per call from a
    CUDA graph of the same calls (None if capture fails)."""
    h, w = host_rounds(fn, calls)
    out = {"host_us": h, "wall_us": w, "gpu_us": None}
    try:
        g = C.bench(fn, [()], device="cuda", quick=True)
        out["gpu_us"] = g["ms"] * 1e3 if g["method"] == "cuda-graph-replay" else None
    except Exception as e:                                   # noqa: BLE001 (reported, not fatal)
        out["graph_error"] = C.err_str(e)
    return out


def profile_text(fn, calls: int, top: int) -> str:
    """cProfile of ``calls`` calls: the ``top`` functions by own time, then by cumulative time."""
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return s.getvalue()


def breakdown(fn, calls: int) -> dict:
    """Host us per call (``host_rounds``) of the CuPy decode ``fn`` with parts of its work left out: the
    kernel launches (``_loader.run`` a no-op: the Python glue, allocations and stream waits), then the
    stream waits too; the argument packing of its launches alone; ``torch.empty`` of a small tensor."""
    import kvq.fast.cupy._loader as L

    real_run, real_wait = L.run, L.stream_wait
    prepared = getattr(L, "Prepared", None)                 # planned launches (kvq.fast.cupy.paged's plans)
    real_prep = prepared.launch if prepared is not None else None
    per = []
    L.run = lambda *a, **k: None
    if prepared is not None:
        prepared.launch = lambda self, values, dev, stream: None
    try:
        out = {"no_launch_us": host_rounds(fn, calls)[0]}
        L.stream_wait = lambda *a, **k: None
        out["no_launch_no_wait_us"] = host_rounds(fn, calls)[0]
        L.run = lambda fn_, grid, block, args, dev, shared_mem=0, stream=None: per.append(args)
        if prepared is not None:
            prepared.launch = lambda self, values, dev, stream: per.append(self.bind(values))
        fn()                                       # one call: its launches' arguments
    finally:
        L.run, L.stream_wait = real_run, real_wait
        if prepared is not None:
            prepared.launch = real_prep
    out["launches_per_call"] = len(per)
    out["args_per_launch"] = [len(a) for a in per]
    out["pack_us_per_call"] = host_rounds(lambda: [L.pack_args(a) for a in per], calls)[0]
    out["torch_empty_us"] = host_rounds(lambda: torch.empty((4, 128), device="cuda"), calls)[0]
    return out


def ab_launch(a) -> None:
    """Host us per call of each method's decode with CuPy's launcher and with kvq's packed one, the two
    alternating (cupy, packed, cupy, packed, ...: three of each), in one process: the launcher's share
    of the host time without the host's run-to-run drift between processes."""
    import kvq.fast.cupy._loader as L

    res = {"meta": C.meta(torch.device("cuda")), "B": a.B, "T": a.T, "calls": a.calls, "rows": []}
    for m in a.methods.split(","):
        mod, cfg, st, qs = PF.setup(m, a.B, a.T, "cupy")
        step = PF.decode_step(m, mod, cfg, st, "cupy")
        fn = lambda: step(qs[0])  # noqa: E731
        got = {"cupy": [], "packed": []}
        for _ in range(3):
            for mode in ("cupy", "packed"):
                L.LAUNCH_MODE = mode
                got[mode].append(host_rounds(fn, a.calls)[0])
        L.LAUNCH_MODE = "packed"
        row = {"method": m, **{f"{k}_us": v for k, v in got.items()},
               **{f"{k}_median_us": statistics.median(v) for k, v in got.items()}}
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        st = step = fn = None
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "host_ab.json"), "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--methods", default="KIVI-K2V2,Kitty,OSCAR")
    ap.add_argument("--backend", default="cupy", choices=("triton", "cupy"))
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--validation", default="on", choices=("on", "off"),
                    help="the fast tier's NaN / inf checks (kvq.fast.set_validation): on, the default of a direct "
                    "call (a device read per call); off, as a model's decode step runs them")
    ap.add_argument("--ab-launch", action="store_true", help="CuPy: host us per call with _loader.LAUNCH_MODE "
                    "'cupy' and 'packed' alternately, three rounds each, in one process (JSON host_ab.json)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from kvq.fast import set_validation
    set_validation(a.validation == "on")
    if a.ab_launch:
        return ab_launch(a)
    res = {"meta": C.meta(torch.device("cuda")), "backend": a.backend, "B": a.B, "T": a.T, "calls": a.calls,
           "validation": a.validation, "rows": []}
    g = torch.Generator(device="cuda").manual_seed(2)
    kv = [torch.randn((a.B, 8, a.T, 128), generator=g, device="cuda", dtype=torch.float16) for _ in range(2)]
    q = torch.randn((a.B, 32, 1, 128), generator=g, device="cuda", dtype=torch.float16)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True)  # noqa: E731
    row = {"method": "SDPA FP16", **host_times(sdpa, a.calls)}
    print(json.dumps(row), flush=True)
    res["rows"].append(row)
    kv = None
    for m in a.methods.split(","):
        mod, cfg, st, qs = PF.setup(m, a.B, a.T, a.backend)
        step = PF.decode_step(m, mod, cfg, st, a.backend)
        fn = lambda: step(qs[0])  # noqa: E731
        row = {"method": m, **host_times(fn, a.calls)}
        if a.backend == "cupy":
            row.update(breakdown(fn, a.calls))
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        with open(os.path.join(a.out, f"host_{m}.txt"), "w") as f:
            f.write(profile_text(fn, a.calls, a.top))
        st = step = fn = None
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "host.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
