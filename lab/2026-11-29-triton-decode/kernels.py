"""Where one Triton KIVI / Kitty decode call's GPU time goes: each kernel's device time under torch.profiler,
with the fused part by ``_tokens_kernel`` (the default) and by the rows kernel (``Knobs(tokens=None)``).

The caches are the suite's (``bench_kivi_kitty.build_cache``); 20 eager calls per case after 3 warm-ups, one
query token, 32 query / 8 KV heads of 128. Prints and writes one JSON: per case, each kernel's mean device us
per call (its name as the profiler gives it) and their sum.

    python3 lab/2026-11-29-triton-decode/kernels.py --out /tmp/res/kernels.json [--shapes 1x32768 8x32768]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=["1x32768", "1x131072", "8x32768"])
    ap.add_argument("--methods", nargs="+", default=["KIVI-K2V2", "Kitty"])
    a = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import bench_kivi_kitty as KK
    import common as C
    import kvq.fast as fast
    from kvq.fast.triton import paged

    fast.set_validation(False)
    doc = {"meta": C.meta("cuda", argv), "rows": []}
    for shape in a.shapes:
        B, T = (int(x) for x in shape.split("x"))
        for method in a.methods:
            mod, cfg = KK.config(method, T, False)
            q = torch.randn((B, KK.H_Q, 1, KK.D), device="cuda", dtype=torch.float16)
            st = KK.build_cache(mod, cfg, B, KK.H_KV, KK.D, T, "cuda", seed=B + T)
            for name, knobs in (("tokens", paged.Knobs()), ("rows", paged.Knobs(tokens=None))):
                call = lambda: paged.decode_attention(cfg, mod.KeyCodec, st, q, scale=1 / math.sqrt(KK.D),  # noqa: E731
                                                      knobs=knobs)
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                n = 20
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(n):
                        call()
                    torch.cuda.synchronize()
                us = collections.defaultdict(float)
                for e in prof.events():
                    if e.device_type.name == "CUDA":
                        us[e.name[:60]] += e.device_time / n if hasattr(e, "device_time") else e.cuda_time / n
                row = {"B": B, "T": T, "method": method, "fused": name, "kernels_us": dict(us),
                       "sum_us": sum(us.values())}
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
            del st
            torch.cuda.empty_cache()
    C.write_json(os.path.dirname(os.path.abspath(a.out)), os.path.basename(a.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
