"""The two ceilings every kvq benchmark is measured against: HBM copy bandwidth and bf16 matmul rate.

* copy: ``dst.copy_(src)`` on a 2 GiB uint8 buffer of random bytes (far beyond L2); bytes counted =
  read + written = 2 x 2 GiB. Measured twice; the higher median is the ceiling (both are kept).
* matmul: ``torch.mm`` of random bf16 8192 x 8192 matrices, 2 * 8192^3 flops per product.

    python3 benchmarks/bench_ceilings.py --out /tmp/res            # writes ceilings.json
    from bench_ceilings import run; c = run("cuda")                # c["copy_gbps"], c["matmul_tflops"]

The measurements live in ``baselines.py`` (every benchmark's copy ceiling); this is their command line.
"""

from __future__ import annotations

import argparse

import torch

import common as C
from baselines import ceilings as run        # bench_ceilings.run: both ceilings (run_all.py, the docstring)


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
