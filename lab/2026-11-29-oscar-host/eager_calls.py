"""Host us per eager call of the Triton decodes (OSCAR, BitDecoding-KC2, KIVI-K2V2, Kitty) and of torch SDPA
FP16 over a cache of the same shape, in one process, validation off: the Python a user pays per call.

    python3 lab/2026-11-29-oscar-host/eager_calls.py --out $OUT/eager-after.json [--B 1 --T 32768]
    python3 lab/2026-11-29-oscar-host/eager_calls.py --kvq .before --out ...      # another tree's kvq

Calls launched back to back from Python; host us = the host clock per call until the last call returns
(``benchmarks/profile_host.host_rounds``: medians of 5 rounds of ``--calls`` calls), taken ``--rounds``
times over the calls in turn (medians reported, every round kept). SDPA's figure in the same process is the
host's own speed, for comparing processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvq", default=None, help="import kvq from this directory (e.g. .before)")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    if a.kvq:
        sys.path.insert(0, os.path.abspath(a.kvq))
    sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))
    import torch
    import torch.nn.functional as F

    import bench_bitdecoding_decode as BB
    import kvq
    import profile_fused as PF
    import profile_host as PH
    from kvq.fast import common as C
    from kvq.fast.triton import bitdecoding_decode as BDD
    from kvq.reference import bitdecoding as R

    C.set_validation(False)
    B, T = a.B, a.T
    calls = {}
    for m in ("OSCAR", "KIVI-K2V2", "Kitty"):
        mod, cfg, st, qs = PF.setup(m, B, T, "triton")
        step = PF.decode_step(m, mod, cfg, st, "triton")
        calls[m] = (lambda step=step, q=qs[0]: step(q))
    bcfg = dataclasses.replace(R.CONFIGS["BitDecoding-KC2"], max_tokens=T)
    bst = BB.build_state(bcfg, B, T, "cuda")
    q = torch.randn((B, 32, 1, 128), device="cuda", dtype=torch.float16)
    calls["BitDecoding-KC2"] = lambda: BDD.decode(bcfg, bst, q)
    k = torch.randn((B, 8, T, 128), device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    calls["SDPA FP16"] = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    got = {name: [] for name in calls}
    for _ in range(a.rounds):
        for name, fn in calls.items():
            got[name].append(PH.host_rounds(fn, a.calls)[0])
    rows = [{"method": n, "B": B, "T": T, "host_us": statistics.median(v), "rounds": v} for n, v in got.items()]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "rounds"}), flush=True)
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "kvq": os.path.dirname(kvq.__file__),
            "commit": os.environ.get("KVQ_COMMIT", "unknown")}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
