"""Where does a model's decode step with a kvq cache spend its host time, and what did the launch plans
save? (issue 37, item 3: host overhead)

    python3 lab/2026-11-28-decode-host/step_host.py --out $OUT/step_host.json
    python3 lab/2026-11-28-decode-host/step_host.py --kvq .before --out ...   # another checkout's kvq

One Llama-3.1-8B-shaped model (random fp16 weights: the end-to-end benchmark's model and fill), each cache
filled to the context, then decode steps: wall ms per step (synchronized on both sides, median), host ms
(until ``model(...)`` returns, before the synchronization: the Python a user pays), with kvq.fast's
validation on (the library default) and off, in alternating blocks; and a cProfile of three steps with
validation off (the 30 functions with the most own time, and kvq's / the caches' functions by cumulative
time), kept in the JSON.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvq", default=None, help="import kvq from this directory (another checkout's, e.g. .before)")
    ap.add_argument("--shapes", nargs="+", default=["1x32768", "8x32768"])
    ap.add_argument("--caches", nargs="+", default=["StaticCache", "KIVI-K2V2:cupy", "Kitty:cupy"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.kvq:
        sys.path.insert(0, os.path.abspath(a.kvq))
    import torch

    import kvq
    from kvq.commands import bench_e2e as B
    from kvq.fast import common as C
    model = B.build_model(False, "cuda", 131072 + 64)
    rows = []
    for shp in a.shapes:
        batch, context = (int(x) for x in shp.split("x"))
        for name in a.caches:
            cache = B.make(name, model, batch, context, 2 * a.blocks * a.steps + 16)
            B.fill(cache, model, batch, context, 4096)
            if ":" in name:
                from kvq.integrations.attention import use_kvq_attention
                use_kvq_attention(model)
            step = B.step_fn(model, cache, batch, context)
            step(); step()
            row = {"cache": name, "batch": batch, "context": context}
            times = {m: {"wall": [], "host": []} for m in ("on", "off")}
            for _ in range(a.blocks):
                for mode in ("on", "off"):
                    with C.validation(mode == "on"):
                        for _ in range(a.steps):
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            step()
                            t1 = time.perf_counter()
                            torch.cuda.synchronize()
                            t2 = time.perf_counter()
                            times[mode]["wall"].append(1e3 * (t2 - t0))
                            times[mode]["host"].append(1e3 * (t1 - t0))
            for mode in ("on", "off"):
                row[f"wall_ms_{mode}"] = statistics.median(times[mode]["wall"])
                row[f"host_ms_{mode}"] = statistics.median(times[mode]["host"])
            with C.validation(False):
                torch.cuda.synchronize()
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
            row["profile_tottime"] = s.getvalue()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats("kvq|cache_utils|sdpa", 60)
            row["profile_cumulative_kvq"] = s.getvalue()
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), flush=True)
            rows.append(row)
            del cache, step
            model.set_attn_implementation("sdpa")
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "label": a.label,
            "kvq_path": os.path.dirname(kvq.__file__), "commit": os.environ.get("KVQ_COMMIT", "unknown")}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
