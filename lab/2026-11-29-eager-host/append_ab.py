"""What does one decode token's append cost on the host, with the one-kernel token append (``Ops.token_append``)
and without it (the copies and the eviction launch it replaced)? (issue 37, item 3: host overhead)

    python3 lab/2026-11-29-eager-host/append_ab.py --out $OUT/append_ab.json

For each method and backend: one sequence, 8 KV heads, head dim 128, filled with a random prompt of --T tokens,
then one token per append, in blocks of --tokens appends (a key page's completion, the general routing, falls
once in each block of 128), the blocks alternating between the codec's ops with ``token_append`` (on) and
without it (off), in one process, validation off (``make_cache``'s default on CUDA). Per block: host us per
append until the last append returns, and wall us per append with the final synchronization; medians over
the blocks of each mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="KIVI-K2V2,Kitty")
    ap.add_argument("--backends", default="cupy,triton")
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=6, help="blocks of each mode")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    from kvq.fast import common as C
    import common as BC
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    n_tok = a.tokens * a.blocks * 2 + 64
    for backend in a.backends.split(","):
        for method in a.methods.split(","):
            mod = importlib.import_module(f"kvq.fast.{backend}.{'kivi' if method.startswith('KIVI') else 'kitty'}")
            cfg = dataclasses.replace(mod.CONFIGS[method], max_tokens=a.T + n_tok + 256)
            st = mod.init(cfg, 1, 8, 128, device="cuda")
            k, v = (torch.randn((1, 8, a.T, 128), generator=g, device="cuda", dtype=torch.float16) for _ in range(2))
            mod.append(cfg, st, k, v)
            kt, vt = (torch.randn((1, 8, n_tok, 128), generator=g, device="cuda", dtype=torch.float16)
                      for _ in range(2))
            ops = {"on": mod.KeyCodec.ops, "off": dataclasses.replace(mod.KeyCodec.ops, token_append=None)}
            times = {m: {"host": [], "wall": []} for m in ops}
            i = 0
            try:
                with C.validation(False):
                    for m in ("on", "off"):                            # warm-up (Triton's compiles)
                        mod.KeyCodec.ops = ops[m]
                        for _ in range(32):
                            mod.append(cfg, st, kt[:, :, i:i + 1], vt[:, :, i:i + 1])
                            i += 1
                    for blk in range(2 * a.blocks):
                        m = "on" if blk % 2 == 0 else "off"
                        mod.KeyCodec.ops = ops[m]
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(a.tokens):
                            mod.append(cfg, st, kt[:, :, i:i + 1], vt[:, :, i:i + 1])
                            i += 1
                        t1 = time.perf_counter()
                        torch.cuda.synchronize()
                        t2 = time.perf_counter()
                        times[m]["host"].append((t1 - t0) * 1e6 / a.tokens)
                        times[m]["wall"].append((t2 - t0) * 1e6 / a.tokens)
            finally:
                mod.KeyCodec.ops = ops["on"]
            row = {"method": method, "backend": backend, "T": a.T,
                   **{f"{m}_{x}_us": statistics.median(times[m][x]) for m in ops for x in ("host", "wall")},
                   "blocks": times}
            print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "blocks"}), flush=True)
            rows.append(row)
            st = k = v = kt = vt = None
            torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump({"meta": BC.meta(torch.device("cuda")), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
