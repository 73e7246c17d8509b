"""The two ceilings every kvq benchmark is measured against: HBM copy bandwidth and bf16 matmul rate.

* copy: ``dst.copy_(src)`` on a 2 GiB uint8 buffer of random bytes (far beyond L2); bytes counted =
  read + written = 2 x 2 GiB. Measured twice; the higher median is the ceiling (both are kept).
* matmul: ``torch.mm`` of random bf16 8192 x 8192 matrices, 2 * 8192^3 flops per product.

    python3 benchmarks/bench_ceilings.py --out /tmp/res            # writes ceilings.json
    from bench_ceilings import run; c = run("cuda")                # c["copy_gbps"], c["matmul_tflops"]
"""

from __future__ import annotations

import argparse

import torch

import common as C


def measure_copy(device, nbytes: int, quick: bool = False) -> dict:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    runs = []
    for _ in range(2):                       # the same measurement twice: the spread is the noise
        t = C.bench(lambda a, b: b.copy_(a), [(src, dst)], device=device, quick=quick, graph=False)
        runs.append({"ms": t["ms"], "gbps": C.gbps(2 * nbytes, t["ms"]), "timing": t})
    del src, dst
    C.free_cuda(device)
    best = max(r["gbps"] for r in runs)
    return {"buffer_bytes": nbytes, "bytes_moved": 2 * nbytes, "runs": runs, "copy_gbps": best}


def measure_matmul(device, n: int, quick: bool = False) -> dict:
    dtype = torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)      # random, never zeros (zeros run faster)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    t = C.bench(lambda x, y, z: torch.mm(x, y, out=z), [(a, b, c)], device=device, quick=quick, graph=False)
    del a, b, c
    C.free_cuda(device)
    flops = 2 * n ** 3
    return {"n": n, "dtype": "bfloat16", "flops": flops, "ms": t["ms"],
            "tflops": flops / (t["ms"] * 1e-3) / 1e12, "timing": t}


def run(device, *, quick: bool = False, dry_run: bool = False) -> dict:
    """Both ceilings; each records an error string instead of raising."""
    copy_bytes = (4 * 2**20) if dry_run else (2**30 if quick else 2 * 2**30)
    mm_n = 256 if dry_run else 8192
    res = {"copy": None, "matmul": None, "copy_gbps": None, "matmul_tflops": None}
    try:
        res["copy"] = measure_copy(device, copy_bytes, quick)
        res["copy_gbps"] = res["copy"]["copy_gbps"]
    except Exception as e:
        res["copy"] = {"error": C.err_str(e)}
        C.free_cuda(device)
    try:
        res["matmul"] = measure_matmul(device, mm_n, quick)
        res["matmul_tflops"] = res["matmul"]["tflops"]
    except Exception as e:
        res["matmul"] = {"error": C.err_str(e)}
        C.free_cuda(device)
    return res


def summary_lines(res: dict) -> list[str]:
    cp, mm = res.get("copy_gbps"), res.get("matmul_tflops")
    copy = f"{cp:8.0f} GB/s" if cp else f"error: {(res.get('copy') or {}).get('error')}"
    mat = f"{mm:8.1f} TFLOP/s" if mm else f"error: {(res.get('matmul') or {}).get('error')}"
    return [f"copy (read+write)   {copy}", f"bf16 matmul         {mat}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes; runs on the CPU if there is no GPU")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = run(device, quick=a.quick, dry_run=a.dry_run or device == "cpu")
    C.write_json(a.out, "ceilings.json", {"meta": C.meta(device), **res})
    print("\n".join(summary_lines(res)))


if __name__ == "__main__":
    main()
