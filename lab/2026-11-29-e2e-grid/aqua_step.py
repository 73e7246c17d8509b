"""Where does an AQUA-KV decode step's GPU time go, without and with predictors? (issue 37, NOTE.md)

    python lab/2026-11-29-e2e-grid/aqua_step.py --out $OUT/aqua_step.json [--context 32768]

The benchmark's model (``kvq bench e2e``: Llama-3.1-8B-shaped, random fp16 weights) at batch 1, with two
AQUA-KV caches on the Triton backend, each filled through ``update`` as the benchmark fills:
- ``identity``: the benchmark's calibration (no predictors: prediction off);
- ``predictors``: ridge predictors for every layer >= 1 (keys F x F, values 2F x F, N(0, 1/F) entries,
  zero intercepts), so each step multiplies every layer's history by them, as a calibrated cache does.

For each: ms per step (wall, synchronized, median of ``--steps`` after 2 warm-ups), then one step under
torch.profiler: GPU time in total and by kernel name (the top ``--top``), and the share of the fp32
GEMMs (kernel names with "gemm").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

from kvq.commands import bench_e2e as E  # noqa: E402


def predictors(L: int, F: int, seed: int = 0):
    from kvq.reference.aqua import AquaPredictors, Predictor
    rng = np.random.default_rng(seed)
    mk = lambda rows: Predictor(((rng.standard_normal((rows, F)) / np.sqrt(rows)).astype(np.float32),),   # noqa: E731
                                np.zeros(F, np.float32))
    return AquaPredictors(tuple([None] + [mk(F) for _ in range(L - 1)]), tuple([None] + [mk(2 * F) for _ in range(L - 1)]))


def one(model, kind: str, context: int, steps: int, top: int, dev: str, tiny: bool) -> dict:
    from kvq.integrations.attention import use_kvq_attention
    from kvq.integrations.transformers import make_cache
    c = model.config
    F = c.num_key_value_heads * c.head_dim
    calib = "identity" if kind == "identity" else predictors(c.num_hidden_layers, F)
    model.set_attn_implementation("sdpa")
    cache = make_cache("AQUA-KV", model, backend="triton", calibration=calib, max_tokens=context + steps + 8)
    t0 = time.perf_counter()
    E.fill(cache, model, 1, context, 4096 if not tiny else 64)
    E.sync(dev)
    fill_s = time.perf_counter() - t0
    use_kvq_attention(model)
    step = E.step_fn(model, cache, 1, context)
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        E.sync(dev)
        t = time.perf_counter()
        step()
        E.sync(dev)
        times.append(1e3 * (time.perf_counter() - t))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA if dev != "cpu" else ProfilerActivity.CPU]) as prof:
        step()
        E.sync(dev)
    t_of = (lambda e: e.self_device_time_total) if dev != "cpu" else (lambda e: e.self_cpu_time_total)  # noqa: E731
    ev = [e for e in prof.key_averages() if t_of(e) > 0]
    total = sum(t_of(e) for e in ev) / 1e3
    by = sorted(((e.key, t_of(e) / 1e3, e.count) for e in ev), key=lambda x: -x[1])
    gemm = sum(ms for name, ms, _ in by if "gemm" in name.lower())
    row = {"kind": kind, "context": context, "fill_s": fill_s, "ms_per_step": statistics.median(times),
           "ms_all": times, "gpu_ms_profiled": total, "gemm_ms": gemm,
           "kernels": [{"name": n[:160], "ms": ms, "calls": k} for n, ms, k in by[:top]],
           "kvq_allocated_bytes": int(cache.store.allocated_bytes()),
           "at_rest_bytes": int(torch.cuda.memory_allocated()) if dev != "cpu" else 0}
    del cache, step
    if dev != "cpu":
        torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--kinds", nargs="+", default=["identity", "predictors"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the 2-layer model (a smoke test, e.g. on the CPU)")
    args = ap.parse_args()
    model = E.build_model(args.tiny, args.device, args.context + 64)
    base = torch.cuda.memory_allocated() if args.device != "cpu" else 0
    info = E.device_info(args.device)
    rows = []
    for kind in args.kinds:
        try:
            r = one(model, kind, args.context, args.steps, args.top, args.device, args.tiny)
            r["at_rest_bytes"] -= base
        except Exception as e:                                   # noqa: BLE001 - recorded, the next kind runs
            r = {"kind": kind, "failed": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps({k: v for k, v in r.items() if k != "kernels"}), flush=True)
        for k in r.get("kernels", [])[:8]:
            print(f"    {k['ms']:9.3f} ms  x{k['calls']:<5d} {k['name'][:100]}", flush=True)
        rows.append(r)
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
