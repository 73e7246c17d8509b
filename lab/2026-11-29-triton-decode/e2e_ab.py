"""The model-level effect of ``_tokens_kernel``: ``kvq bench e2e`` (a Llama-3.1-8B-shaped model, one decode
step, eager wall time and CUDA-graph replay) with the Triton caches run twice in one process, "rows" (the
Triton paged decode's knobs as before TOKENS.md: ``Knobs(tokens=None, tail_keys=256)``, the rows kernel and
the fp32 tail in splits of at least 256 tokens) and "tokens" (the defaults), alternating rounds.

    python3 lab/2026-11-29-triton-decode/e2e_ab.py --out /tmp/res [--rounds rows tokens] [-- bench_e2e options]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT]

E2E = ["--shapes", "8x32768", "1x32768", "--caches", "StaticCache", "KIVI-K2V2:triton", "Kitty:triton", "--steps", "4",
       "--warmup", "2", "--graph", "5"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", nargs="+", default=["rows", "tokens"], choices=("rows", "tokens"))
    ap.add_argument("e2e", nargs="*", default=None, help="bench_e2e options (default: E2E)")
    a = ap.parse_args(argv)
    from kvq.commands import bench_e2e
    from kvq.fast.triton import paged

    os.makedirs(a.out, exist_ok=True)
    knobs = {"rows": paged.Knobs(tokens=None, tail_keys=256), "tokens": paged.Knobs()}
    for i, name in enumerate(a.rounds):
        paged.DEFAULT_KNOBS = knobs[name]
        out = os.path.join(a.out, f"e2e-{i}-{name}.json")
        rc = bench_e2e.main((a.e2e or E2E) + ["--out", out], prog=None)
        print(json.dumps({"round": i, "knobs": name, "rc": rc}), flush=True)
    paged.DEFAULT_KNOBS = knobs["tokens"]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
