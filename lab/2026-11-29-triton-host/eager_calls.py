"""Host us per eager call of the Triton OSCAR and BitDecoding decodes, whose launches go through
``kvq.fast.triton._launch.launch`` (kept compiled kernels) since f37fc9a's successor, against the same calls
through Triton's dispatch (``_launch.current_stream`` answering None), alternating rounds in one process.

    python3 lab/2026-11-29-triton-host/eager_calls.py --out $OUT/eager_calls.json [--B 1 --T 32768]

Calls launched back to back from Python, validation off; host us = the host clock per call until the last
call returns (``benchmarks/profile_host.host_rounds``: medians of 5 rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    import bench_bitdecoding_decode as BB
    import profile_fused as PF
    import profile_host as PH
    from kvq.fast import common as C
    from kvq.fast.triton import _launch as L
    from kvq.fast.triton import bitdecoding_decode as BDD
    import dataclasses

    from kvq.reference import bitdecoding as R

    C.set_validation(False)
    real = L.current_stream
    calls = {}
    mod, cfg, st, qs = PF.setup("OSCAR", a.B, a.T, "triton")
    step = PF.decode_step("OSCAR", mod, cfg, st, "triton")
    calls["OSCAR"] = lambda: step(qs[0])
    bcfg = dataclasses.replace(R.CONFIGS["BitDecoding-KC2"], max_tokens=a.T)
    bst = BB.build_state(bcfg, a.B, a.T, "cuda")
    q = torch.randn((a.B, 32, 1, 128), device="cuda", dtype=torch.float16)
    calls["BitDecoding-KC2"] = lambda: BDD.decode(bcfg, bst, q)
    rows = []
    for name, fn in calls.items():
        got = {"compiled": [], "dispatch": []}
        for _ in range(a.rounds):
            for mode, cs in (("compiled", real), ("dispatch", lambda device_index: None)):
                L.current_stream = cs
                got[mode].append(PH.host_rounds(fn, a.calls)[0])
        L.current_stream = real
        row = {"method": name, "B": a.B, "T": a.T, **{f"host_us_{m}": statistics.median(v) for m, v in got.items()},
               "raw": got}
        print(json.dumps({k: v for k, v in row.items() if k != "raw"}), flush=True)
        rows.append(row)
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "commit": os.environ.get("KVQ_COMMIT", "unknown")}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
