"""Does a model's decode step with a kvq cache wait on the GPU, and what does that cost? (issue 37, item 3)

    python3 lab/2026-11-28-step-syncs/step_syncs.py --out $OUT/step_syncs.json

One Llama-3.1-8B-shaped model (random fp16 weights, the end-to-end benchmark's model and fill), each cache
filled to the context, then decode steps timed (wall clock, synchronized around each step, median) in
alternating blocks with kvq.fast's validation on (the default: NaN / inf scans of each appended token, a
device read per layer) and off. For one step of each mode it counts the synchronizing CUDA calls
(torch.cuda.set_sync_debug_mode("warn") warnings; CuPy's own calls are not seen by torch).
``--caches`` takes the benchmark's names and "OSCAR-calibrated:<backend>" (one calibration object per layer).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def _bench():
    try:
        return importlib.import_module("kvq.commands.bench_e2e")
    except ImportError:
        return importlib.import_module("benchmarks.bench_e2e")


def count_syncs(step) -> int:
    import torch
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(x.message).lower() for x in w)


def make(B, name, model, batch, context, extra):
    """The benchmark's cache, or "OSCAR-calibrated:<backend>": OSCAR with one calibration object per layer
    (identity rotations, as the benchmark's, but distinct arrays, as a calibrated model's are; the benchmark's
    "identity" shares one object among the layers)."""
    if not name.startswith("OSCAR-calibrated"):
        return B.make(name, model, batch, context, extra)
    from kvq.integrations.transformers import make_cache
    from kvq.reference import oscar
    model.set_attn_implementation("sdpa")
    c = model.config
    calib = [oscar.identity_calibration(c.head_dim) for _ in range(c.num_hidden_layers)]
    return make_cache("OSCAR", model, backend=name.partition(":")[2], calibration=calib, max_tokens=context + extra)


def main() -> None:
    import torch

    import kvq.fast as F
    from kvq.fast import common as C
    B = _bench()
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1x32768", "8x32768"])
    ap.add_argument("--caches", nargs="+", default=["StaticCache", "KIVI-K2V2:cupy", "KIVI-K2V2:triton"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = B.build_model(False, "cuda", 131072 + 64)
    rows = []
    for shp in a.shapes:
        batch, context = (int(x) for x in shp.split("x"))
        for name in a.caches:
            cache = make(B, name, model, batch, context, 2 * a.blocks * a.steps + 8)
            B.fill(cache, model, batch, context, 4096)
            if ":" in name:
                from kvq.integrations.attention import use_kvq_attention
                use_kvq_attention(model)
            step = B.step_fn(model, cache, batch, context)
            step(); step()
            row = {"cache": name, "batch": batch, "context": context, "on": [], "off": []}
            for mode in ("on", "off"):
                with C.validation(mode == "on"):
                    row[f"syncs_{mode}"] = count_syncs(step)
            for _ in range(a.blocks):
                for mode in ("on", "off"):
                    with C.validation(mode == "on"):
                        for _ in range(a.steps):
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            step()
                            torch.cuda.synchronize()
                            row[mode].append(1e3 * (time.perf_counter() - t0))
            for mode in ("on", "off"):
                row[f"ms_{mode}"] = statistics.median(row[mode])
            print(json.dumps({k: v for k, v in row.items() if k not in ("on", "off")}), flush=True)
            rows.append(row)
            del cache, step
            model.set_attn_implementation("sdpa")
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "commit": os.environ.get("KVQ_COMMIT", "unknown"), "validation_default": F.validation_enabled()
            if hasattr(F, "validation_enabled") else None}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
