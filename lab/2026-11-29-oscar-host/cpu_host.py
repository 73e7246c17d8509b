"""The Python of one eager Triton KIVI / Kitty decode call on the CPU, launches stubbed out: where do the us go
that are not launches? (Triton's interpreter for the state; ``Launch.__call__`` replaced by a no-op, the plan
forced ready so the address path runs as on the GPU.)

    TRITON_INTERPRET=1 python lab/2026-11-29-decode-40us/cpu_host.py [--method KIVI-K2V2] [--B 1] [--T 32768]
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_kivi_kitty as BK  # noqa: E402
from kvq.fast.triton import _launch as L  # noqa: E402
from kvq.fast.triton import paged as P  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="KIVI-K2V2")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    mod, cfg = BK.config(a.method, a.T, dry=False, backend="triton")
    st = BK.build_cache(mod, cfg, a.B, 8, 128, a.T, "cpu")
    q = torch.randn((a.B, 32, 1, 128), dtype=torch.float16)
    L.Launch.__call__ = lambda self, args, stream, dev: None
    L.current_stream = lambda i: 0
    mod.decode_attention(cfg, st, q)
    # force every plan ready (the address path)
    import gc
    for o in gc.get_objects():
        if isinstance(o, P.DecodePlan):
            o.ready = True
    from kvq.fast import common as FC
    FC.set_validation(False)
    fn = lambda: mod.decode_attention(cfg, st, q)  # noqa: E731
    for _ in range(200):
        fn()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        best.append((time.perf_counter() - t0) * 1e6 / a.calls)
    print(f"{a.method} B={a.B} T={a.T}: us per call (launches stubbed) {sorted(best)}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.calls):
        fn()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
