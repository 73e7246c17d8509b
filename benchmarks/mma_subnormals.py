"""Do the tensor cores scale exactly when an fp16 operand is a subnormal? (GPU; JSON to $OUT)

The CuPy tensor-core decode kernels can feed the value codes as fp16 subnormals, code * 2^(K - 24)
(``kvq.fast.cupy.paged.TUNE["v_subnormal"]``), and undo the power of two after the accumulation. This
probe runs one ``mma.sync.m16n8k16`` (f16 inputs, f32 accumulators) on random 2-bit codes as exact
integers and as subnormals at bit K (the accumulator C scaled alike), scales the second result by
2^(24 - K) and counts the accumulators whose bits differ, for B operands (the kernels' probabilities
times value scales, at most 1) in several binades:

    python benchmarks/mma_subnormals.py --out $OUT      # -> $OUT/mma_subnormals.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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

    rows = []
    for K in (0, 2, 4, 6):
        for lo, hi in ((-1, 0), (-6, 0), (-14, -8), (-24, -15)):
            n_diff, worst, n = 0, 0.0, 0
            for trial in range(a.trials):
                codes = rng.integers(0, 4, 128).astype(np.uint16)
                b = (rng.uniform(0.5, 1.0, 64) * 2.0 ** rng.integers(lo, hi + 1, 64)).astype(np.float16)
                c = np.zeros(128, np.float32) if trial % 2 else rng.standard_normal(128).astype(np.float32)
                d_int = mma(codes.astype(np.float16), b, c)
                d_sub = mma((codes << K).view(np.float16), b, (c * np.float32(2.0 ** (K - 24))).astype(np.float32))
                d_sub = (d_sub.astype(np.float64) * 2.0 ** (24 - K)).astype(np.float32)
                diff = d_sub != d_int
                n_diff += int(diff.sum())
                n += diff.size
                if diff.any():
                    rel = np.abs(d_sub - d_int)[diff] / np.maximum(np.abs(d_int[diff]), 1e-38)
                    worst = max(worst, float(rel.max()))
            row = {"K": K, "b_binades": [lo, hi], "accumulators": n, "differ": n_diff, "worst_rel": worst}
            print(json.dumps(row), flush=True)
            rows.append(row)
    res = {"meta": C.meta(torch.device("cuda")), "rows": rows}
    with open(os.path.join(a.out, "mma_subnormals.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
