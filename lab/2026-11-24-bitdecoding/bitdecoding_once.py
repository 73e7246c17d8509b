"""One BitDecoding decode, for the tools that watch a single launch (issue 6): Nsight Compute's tensor-pipe
and DRAM counters, and compute-sanitizer's memcheck over caches of odd lengths.

    python3 lab/2026-11-24-bitdecoding/bitdecoding_once.py --backend cupy --B 8 --T 131072 --gq 4 --bits 2     # one decode
    compute-sanitizer --tool memcheck python3 lab/2026-11-24-bitdecoding/bitdecoding_once.py --sanitize           # odd lengths

``--sanitize`` builds real caches with ``kvq.fast.<backend>.bitdecoding.init`` / ``append`` (random fp16
tokens, the paper's KC2 / KC4 / KT2 configurations, W_n = 4, D = 128) at lengths 1, 7, 255, 257, 1000,
1531 and 2 N_r + 3, appended in uneven pieces, and decodes each with fp16 q at g_q 1, 4 and 5 and T_q 1
and 2 (and fp32 q, the Triton kernel and the CuPy fallback), checking every result against the reference
tier (float64 truth) by the same rule-7 check as the parity tests. It prints one line per case and exits
non-zero on a mismatch; under memcheck any out-of-bounds access is reported by the tool.
Without ``--sanitize`` it runs one decode of a cache built directly (``bench_bitdecoding_decode.build_state``)
after one warm-up call, so ``ncu --launch-skip 1`` (or a kernel-name filter) sees a compiled kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))   # bench_bitdecoding_decode


def once(a) -> None:
    import bench_bitdecoding_decode as BB
    from kvq.reference import bitdecoding as R
    import kvq.fast as fast
    fast.set_validation(False)
    cfg = dataclasses.replace(R.CONFIGS[f"BitDecoding-K{a.mode[0].upper()}{a.bits}"], max_tokens=a.T)
    mod = importlib.import_module(f"kvq.fast.{a.backend}.bitdecoding_decode")
    st = BB.build_state(cfg, a.B, a.T, "cuda")
    q = torch.randn((a.B, BB.H_KV * a.gq, 1, BB.D), device="cuda", dtype=torch.float16)
    scale = 1.0 / math.sqrt(BB.D)
    for _ in range(2):                                   # warm-up (compile), then the launch to profile
        out, lse = mod.decode(cfg, st, q, scale=scale)
    torch.cuda.synchronize()
    print(f"{a.backend} KC{a.bits} B={a.B} T={a.T} g_q={a.gq}: out finite {bool(torch.isfinite(out).all())}")


def sanitize(a) -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "parity"))
    from tolerance import check_close
    from kvq.reference import bitdecoding as R
    D, H = 128, 2
    bad = 0
    rng = np.random.default_rng(0)
    for name in ("BitDecoding-KC2", "BitDecoding-KC4", "BitDecoding-KT2"):
        cfg = dataclasses.replace(R.CONFIGS[name], max_tokens=4096)
        Nr = cfg.n_r
        for L in (1, 7, 255, 257, 1000, 1531, 2 * Nr + 3):
            k = rng.standard_normal((2, H, L, D)).astype(np.float16)
            v = rng.standard_normal((2, H, L, D)).astype(np.float16)
            rs = R.init(cfg, 2, H, D)
            cuts = sorted({0, L, *rng.integers(0, L + 1, size=3).tolist()})
            for i, j in zip(cuts[:-1], cuts[1:]):
                R.append(cfg, rs, k[:, :, i:j], v[:, :, i:j])
            for backend in a.backends:
                F = importlib.import_module(f"kvq.fast.{backend}.bitdecoding")
                fs = F.init(cfg, 2, H, D)
                for i, j in zip(cuts[:-1], cuts[1:]):
                    F.append(cfg, fs, torch.from_numpy(k[:, :, i:j]).cuda(), torch.from_numpy(v[:, :, i:j]).cuda())
                for gq, tq, dt in ((1, 1, torch.float16), (4, 1, torch.float16), (5, 2, torch.float16),
                                   (4, 1, torch.float32)):
                    q32 = rng.standard_normal((2, H * gq, tq, D)).astype(np.float32)
                    q = torch.from_numpy(q32).cuda().to(dt)
                    out, lse = F.decode_attention(cfg, fs, q)
                    torch.cuda.synchronize()
                    qr = q.cpu().float().numpy()
                    o64, l64 = R.decode_attention(cfg, rs, qr.astype(np.float64))
                    o32, l32 = R.decode_attention(cfg, rs, qr)
                    try:
                        check_close(out, o64, o32, dt, "out")
                        check_close(lse, l64, l32, torch.float32, "lse")
                        res = "ok"
                    except AssertionError as e:
                        bad += 1
                        res = f"MISMATCH {str(e)[:120]}"
                    print(f"{name} L={L} {backend} g_q={gq} T_q={tq} {str(dt)[6:]}: {res}", flush=True)
    print(f"sanitize: {bad} mismatches")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sanitize", action="store_true", help="odd-length caches, every backend, checked")
    ap.add_argument("--backends", nargs="+", default=["cupy", "triton"])
    ap.add_argument("--backend", default="cupy", choices=("cupy", "triton"))
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=131072)
    ap.add_argument("--gq", type=int, default=4)
    ap.add_argument("--bits", type=int, default=2, choices=(2, 4))
    ap.add_argument("--mode", default="channel", choices=("channel", "tensor"))
    a = ap.parse_args(argv)
    if a.sanitize:
        return sanitize(a)
    once(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
