"""BitDecoding's Residual Kernel (kvq.fast.cupy.bitdecoding.pack_keys + pack_values): time to quantize and
pack pages into the induced layout, next to a size-matched read ceiling (BitDecoding paper, Table II).

Two cases per configuration (KC4, KC2, KT4, KT2; 8 KV heads, head dim 128, fp16 input):
  prefill  B = 1, T = 128K tokens: every page of the context at once (T / N_r pages per head);
  step     one full residual block per (sequence, KV head) for B in {1, 8, 32}: what one decode step pays
           when the residual fills, and that cost spread over the N_r steps it serves (``per_step_us``).
Bytes: the fp16 K and V read once, the words and half2 params written once. Inputs rotate over copies
beyond L2 (common.copies_for); times are medians of CUDA-graph replays (common.bench). Every output is
checked bit for bit against kvq.reference.bitdecoding on the first page before timing.

    python3 benchmarks/bench_bitdecoding_pack.py --out /tmp/res [--quick]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import common as C

H, D = 8, 128


def _case(cfg, n_pages, device, quick):
    from kvq.fast.cupy import bitdecoding as F
    from kvq.reference import bitdecoding as R

    dev = torch.device(device)
    shape = (n_pages, cfg.n_r, D)
    in_bytes = 2 * n_pages * cfg.n_r * D * 2
    copies = C.copies_for(in_bytes, device)
    inputs = [(torch.randn(shape, device=dev).half(), torch.randn(shape, device=dev).half()) for _ in range(copies)]
    k0, v0 = inputs[0]
    kw, kp = F.pack_keys(cfg, k0)
    vw, vp = F.pack_values(cfg, v0)
    rkw, rkp = R.pack_keys(cfg, k0[0].cpu().numpy())
    rvw, rvp = R.pack_values(cfg, v0[0].cpu().numpy())
    ok = all(np.array_equal(a[0].view(torch.int16).cpu().numpy().view(b.dtype) if a.dtype == torch.uint16
                            else a[0].cpu().numpy(), b) for a, b in ((kw, rkw), (kp, rkp), (vw, rvw), (vp, rvp)))
    out_bytes = sum(t.numel() * t.element_size() for t in (kw, kp, vw, vp))

    def step(k, v):
        F.pack_keys(cfg, k)
        F.pack_values(cfg, v)

    from kvq import fast

    with fast.validation(False):                      # the NaN / overflow checks are host syncs
        t = C.bench(step, inputs, device=device, quick=quick)
    del inputs
    C.free_cuda(device)
    nbytes = in_bytes + out_bytes
    return {"pages": n_pages, "bit_exact_first_page": bool(ok), "ms": t["ms"], "method": t["method"],
            "bytes": nbytes, "gbps": C.gbps(nbytes, t["ms"]),
            "read_ceiling": C.read_ceiling(nbytes, device, quick=quick), "timing": t}


def run(device="cuda", quick=False):
    from kvq.reference import bitdecoding as R

    rows = []
    for name, cfg in R.CONFIGS.items():
        pre = _case(cfg, H * (131072 // cfg.n_r), device, quick)
        rows.append({"config": name, "case": "prefill", "B": 1, "T": 131072, "N_r": cfg.n_r, **pre})
        for B in ((1, 32) if quick else (1, 8, 32)):
            st = _case(cfg, B * H, device, quick)
            st["per_step_us"] = st["ms"] * 1e3 / cfg.n_r
            rows.append({"config": name, "case": "step", "B": B, "N_r": cfg.n_r, **st})
    return {"rows": rows, "H_kv": H, "D": D}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    res = run("cuda", a.quick)
    res["meta"] = C.meta("cuda", argv)
    path = C.write_json(a.out, "bitdecoding_pack", res)
    for r in res["rows"]:
        ceil = r["read_ceiling"]["ms"] if r["read_ceiling"] else float("nan")
        print(f"{r['config']:16s} {r['case']:8s} B={r['B']:3d} pages={r['pages']:6d} {r['ms'] * 1e3:9.2f} us "
              f"{r['gbps']:8.1f} GB/s  read ceiling {ceil * 1e3:8.2f} us  exact={r['bit_exact_first_page']}"
              + (f"  per step {r['per_step_us']:.3f} us" if "per_step_us" in r else ""))
    print(path)


if __name__ == "__main__":
    main()
