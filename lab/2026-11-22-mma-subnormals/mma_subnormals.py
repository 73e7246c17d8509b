"""Do the tensor cores keep fp16 subnormal operands exact? (GPU; JSON to $OUT) A record of why kvq's
tensor-core decode kernels unpack value codes with lop3 + fma.f16x2 and not as subnormals.

The idea: a B-bit code at bit K of an fp16 half is the subnormal code * 2^(K - 24), so one lop3 (a mask)
would feed two codes to mma.sync, and a power of two per row after the accumulation would undo the scale;
that saves the fma.f16x2, 256 of the ~2300 instructions per page of paged_decode_mma2. It is exact only if
the tensor cores multiply and align subnormal products exactly. This probe runs one
``mma.sync.m16n8k16`` (f16 inputs, f32 accumulators) on random 2-bit codes as exact integers and as
subnormals at bit K (C scaled alike), scales the second result by 2^(24 - K), and measures both against
the exact float64 sum in fp32 ulps, for B operands (the kernels' probabilities times value scales, at
most 1) in several binades:

    python lab/2026-11-22-mma-subnormals/mma_subnormals.py --out $OUT      # -> $OUT/mma_subnormals.json

Measured on the H100 (results/h100-b44102e/mma_subnormals.json here): integer codes stay within
1 ulp; subnormal codes lose about one bit per leading zero of the 10-bit significand: up to 4736 ulps at
K = 0, 128 at K = 4, 16 at K = 6, within 1 ulp only at K = 8 (no leading zero). Tried in the decode
kernels (commit 53606f6): 7% faster at 32 x 32K, and KIVI-K4V4 then missed the tolerance rule; reverted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))   # common

_SRC = r'''
extern "C" __global__ void mma_once(const unsigned* A, const unsigned* B, const float* C, float* D) {
    const int l = threadIdx.x;
    unsigned a0 = A[4 * l], a1 = A[4 * l + 1], a2 = A[4 * l + 2], a3 = A[4 * l + 3], b0 = B[2 * l], b1 = B[2 * l + 1];
    float c0 = C[4 * l], c1 = C[4 * l + 1], c2 = C[4 * l + 2], c3 = C[4 * l + 3];
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n" : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    D[4 * l] = c0; D[4 * l + 1] = c1; D[4 * l + 2] = c2; D[4 * l + 3] = c3;
}'''


def main() -> None:
    import cupy as cp
    import torch

    import common as C

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--trials", type=int, default=200)
    a = ap.parse_args()
    ker = cp.RawKernel(_SRC, "mma_once")
    rng = np.random.default_rng(0)

    def mma(a16, b16, c):
        d = cp.zeros(128, cp.float32)
        ker((1,), (32,), (cp.asarray(a16.view(np.uint32)), cp.asarray(b16.view(np.uint32)), cp.asarray(c), d))
        return d.get()

    # the PTX ISA's m16n8k16 fragments (lane l = 4 g + t): A a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g,
    # 2t+8..), a3 (g+8, 2t+8..); B b0 (k 2t..2t+1, n g), b1 (k 2t+8..2t+9, n g); C / D c0, c1 (g, 2t..2t+1),
    # c2, c3 (g+8, 2t..2t+1)
    l = np.arange(32)
    g, t = l // 4, l % 4
    a_rc = np.stack([np.stack([r, c + h], -1) for r, c in ((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                                            (g + 8, 2 * t + 8)) for h in (0, 1)], 1)   # [32, 8, 2]
    b_kn = np.stack([np.stack([k + h, g], -1) for k in (2 * t, 2 * t + 8) for h in (0, 1)], 1)          # [32, 4, 2]
    c_rn = np.stack([np.stack([r, 2 * t + h], -1) for r in (g, g + 8) for h in (0, 1)], 1)              # [32, 4, 2]

    def exact(a16, b16, c):
        A, Bm, Cm = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        A[a_rc[..., 0].ravel(), a_rc[..., 1].ravel()] = a16.astype(np.float64)
        Bm[b_kn[..., 0].ravel(), b_kn[..., 1].ravel()] = b16.astype(np.float64)
        Cm[c_rn[..., 0].ravel(), c_rn[..., 1].ravel()] = c.astype(np.float64)
        D = A @ Bm + Cm                                          # exact: few terms, float64
        return D[c_rn[..., 0].ravel(), c_rn[..., 1].ravel()]

    rows = []
    for K in (0, 2, 4, 6, 8):
        for lo, hi in ((-1, 0), (-6, 0), (-14, -8)):
            n_diff, e_int, e_sub = 0, [], []
            for trial in range(a.trials):
                codes = rng.integers(0, 4, 256).astype(np.uint16)        # A: 16 x 16 halves
                b = (rng.uniform(0.5, 1.0, 128) * 2.0 ** rng.integers(lo, hi + 1, 128)).astype(np.float16)
                c = np.zeros(128, np.float32) if trial % 2 else rng.standard_normal(128).astype(np.float32)
                d_int = mma(codes.astype(np.float16), b, c)
                d_sub = mma((codes << K).view(np.float16), b, (c * np.float32(2.0 ** (K - 24))).astype(np.float32))
                d_sub = (d_sub.astype(np.float64) * 2.0 ** (24 - K)).astype(np.float32)
                ex = exact(codes.astype(np.float16), b, c)
                ulp = np.spacing(np.abs(ex).astype(np.float32)).astype(np.float64)
                n_diff += int((d_sub != d_int).sum())
                e_int.append(np.abs(d_int - ex) / ulp)
                e_sub.append(np.abs(d_sub - ex) / ulp)
            e_int, e_sub = np.concatenate(e_int), np.concatenate(e_sub)
            row = {"K": K, "b_binades": [lo, hi], "accumulators": int(e_int.size), "differ": n_diff,
                   "err_ulps_int": {"max": float(e_int.max()), "mean": float(e_int.mean())},
                   "err_ulps_sub": {"max": float(e_sub.max()), "mean": float(e_sub.mean())}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    res = {"meta": C.meta(torch.device("cuda")), "rows": rows}
    with open(os.path.join(a.out, "mma_subnormals.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
