"""A model's eager decode step with a Triton kvq cache, the decode's launches by their compiled kernels
("compiled", the library's path) against the same plans through Triton's dispatch ("dispatch":
``_launch.current_stream`` answers None), alternating blocks in one process (the host's drift between
processes is larger than the change: lab/2026-11-29-eager-host/NOTE.md).

    python3 lab/2026-11-29-triton-host/step_ab.py --out $OUT/step_ab.json

The model and fill are ``kvq bench e2e``'s (Llama-3.1-8B-shaped, random fp16 weights); validation off.
Per cache: ``--blocks`` blocks of ``--steps`` steps per mode, wall ms (synchronized) and host ms (until
``model(...)`` returns) per step, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1x32768"])
    ap.add_argument("--caches", nargs="+", default=["KIVI-K2V2:triton", "Kitty:triton"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    from kvq.commands import bench_e2e as B
    from kvq.fast import common as C
    from kvq.fast.triton import _launch as L
    from kvq.integrations.attention import use_kvq_attention

    real = L.current_stream
    modes = {"compiled": real, "dispatch": lambda device_index: None}
    model = B.build_model(False, "cuda", 131072 + 64)
    rows = []
    C.set_validation(False)
    for shp in a.shapes:
        batch, context = (int(x) for x in shp.split("x"))
        for name in a.caches:
            cache = B.make(name, model, batch, context, 2 * a.blocks * a.steps + 16)
            B.fill(cache, model, batch, context, 4096)
            use_kvq_attention(model)
            step = B.step_fn(model, cache, batch, context)
            step(); step()
            times = {m: {"wall": [], "host": []} for m in modes}
            for _ in range(a.blocks):
                for m, fn in modes.items():
                    L.current_stream = fn
                    for _ in range(a.steps):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        step()
                        t1 = time.perf_counter()
                        torch.cuda.synchronize()
                        t2 = time.perf_counter()
                        times[m]["wall"].append(1e3 * (t2 - t0))
                        times[m]["host"].append(1e3 * (t1 - t0))
            L.current_stream = real
            row = {"cache": name, "batch": batch, "context": context}
            for m in modes:
                row[f"wall_ms_{m}"] = statistics.median(times[m]["wall"])
                row[f"host_ms_{m}"] = statistics.median(times[m]["host"])
            row["raw"] = times
            print(json.dumps({k: v for k, v in row.items() if k != "raw"}), flush=True)
            rows.append(row)
            del cache, step
            model.set_attn_implementation("sdpa")
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "commit": os.environ.get("KVQ_COMMIT", "unknown")}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
