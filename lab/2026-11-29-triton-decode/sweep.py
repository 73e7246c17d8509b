"""Issue 39's first GPU step: the Triton KIVI / Kitty fused decode's launch and numerics knobs
(``kvq.fast.triton.paged.Knobs``), one at a time from the defaults, at the issue's shapes, by GPU time.

Each variant is checked before it is timed (batch element 0 against float64 attention over the dequantized
cache: ``bench_kivi_kitty.check_one``, the suite's tolerances) and timed by ``common.bench`` (medians of
CUDA-graph replays over cache copies beyond L2). The caches are the suite's (``bench_kivi_kitty.build_cache``).
Written after every shape, so a cut-short run keeps what it measured.

    python3 lab/2026-11-29-triton-decode/sweep.py --out /tmp/res/sweep.json [--shapes 8x32768 1x32768] [--budget-s 300]
    python3 lab/2026-11-29-triton-decode/sweep.py --out /tmp/sweep.json --dry-run          # CPU, interpreter, tiny
    python3 lab/2026-11-29-triton-decode/sweep.py --grid tokens-3 --out /tmp/res/tokens.json  # TOKENS.md's sweeps

``--grid tokens-1`` / ``tokens-3``: the rows kernel (``Knobs(tokens=None)``) against ``_tokens_kernel`` at each
``TokensKnobs`` of ``TOKENS_1`` / ``TOKENS_3``. ``--grid fused-tail``: the tail in the tokens kernel's launch
(the tail read where it lies) against the gathered tail and the rows kernel, with SDPA FP16 per shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

SHAPES = ("1x32768", "1x131072", "8x32768", "8x131072", "32x32768")
METHODS = ("KIVI-K2V2", "Kitty")

#: one knob at a time from the defaults (None: the defaults themselves)
VARIANTS = (None, {"k_terms": 1}, {"split_p": True}, {"words": False}, {"num_warps": 8}, {"waves": 1.5}, {"waves": 2},
            {"waves": 6}, {"block_t": 64}, {"block_t": 32}, {"num_stages": 3}, {"num_stages": 4},
            {"k_terms": 1, "num_stages": 3})

#: --grid tokens-1 (TOKENS.md, the first GPU call): the rows kernel, then _tokens_kernel's (warps, block_t) at each waves
TOKENS_1 = ({"tokens": None},) + tuple({"tokens": {"num_warps": w, "block_t": bt, "waves": wv}}
                                       for w, bt in ((1, 32), (1, 64), (2, 64), (2, 128), (4, 64), (4, 128))
                                       for wv in (2, 4, 8))
#: --grid tokens-3 (TOKENS.md, the third GPU call): around the first call's best, with a register cap
TOKENS_3 = ({"tokens": None},) + tuple({"tokens": dict(zip(("num_warps", "block_t", "waves", "maxnreg"), t))}
                                       for t in ((1, 64, 8, None), (1, 32, 8, None), (1, 32, 12, 168), (1, 32, 16, 128),
                                                 (1, 64, 12, 168), (1, 64, 16, 128), (2, 128, 4, None), (2, 64, 6, 168),
                                                 (2, 128, 6, 168)))
#: --grid tokens-5 (TOKENS.md, the sixth GPU call): the pipelining depth at the defaults and at the 1-warp plan
TOKENS_5 = ({"tokens": None}, {}) + tuple({"tokens": dict(num_warps=w, block_t=bt, waves=wv, num_stages=ns)}
                                          for w, bt, wv, ns in ((2, 128, 4, 1), (2, 128, 4, 3), (2, 128, 4, 4),
                                                                (1, 64, 8, 3), (2, 64, 4, 3)))
#: --grid tokens-7 (TOKENS.md, the seventh GPU call): registers capped so that more warps fit an SM (TOKENS.md
#: "What bounds": 4 programs of 2 warps at 254 registers), waves at the programs that then fit
TOKENS_7 = ({"tokens": None}, {}) + tuple({"tokens": dict(zip(("num_warps", "block_t", "waves", "maxnreg"), t))}
                                          for t in ((4, 128, 4, 128), (4, 64, 4, 128), (4, 128, 3, 168), (2, 64, 8, 128),
                                                    (4, 128, 4, None)))
#: --grid fused-tail (lab/2026-11-29-fused-tail): the tail read where it lies and gathered into fp32 for the
#: FP16 partial kernel (explicitly: the default changed between the calls), and the rows kernel; with each
#: shape's SDPA FP16 baseline
FUSED_TAIL = ({"tail_in_place": True}, {"tail_in_place": False}, {"tokens": None})
GRIDS = {"knobs": VARIANTS, "tokens-1": TOKENS_1, "tokens-3": TOKENS_3, "tokens-5": TOKENS_5, "tokens-7": TOKENS_7,
         "fused-tail": FUSED_TAIL}


def knobs_of(paged, v):
    """``paged.Knobs`` of a variant dict (its ``tokens`` entry a dict of ``TokensKnobs`` fields or None)."""
    v = dict(v or {})
    if isinstance(v.get("tokens"), dict):
        v["tokens"] = paged.TokensKnobs(**v["tokens"])
    return paged.Knobs(**v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    ap.add_argument("--grid", choices=tuple(GRIDS), default="knobs")
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")        # before kvq's Triton kernels are decorated
    import torch

    import bench_kivi_kitty as KK
    import common as C
    import kvq.fast as fast
    from kvq.fast.triton import paged

    device = "cpu" if a.dry_run else "cuda"
    fast.set_validation(False)
    deadline = C.Deadline(a.budget_s)
    shapes = [(1, 60), (2, 100)] if a.dry_run else [tuple(int(x) for x in s.split("x")) for s in a.shapes]
    Hq, Hkv, Dh = (KK.DRY_H_Q, KK.DRY_H_KV, KK.DRY_D) if a.dry_run else (KK.H_Q, KK.H_KV, KK.D)
    variants = GRIDS[a.grid]
    doc = {"meta": C.meta(device, argv), "variants": [v or {} for v in variants], "rows": [],
           "defaults": {f: str(getattr(paged.DEFAULT_KNOBS, f)) for f in paged.Knobs.__dataclass_fields__}}
    t0 = time.monotonic()
    for B, T in shapes:
        if a.grid == "fused-tail" and not deadline.expired():      # the shape's FP16 baselines, same process
            import baselines as BL
            g = torch.Generator(device=device).manual_seed(B * 7919 + T)
            q = torch.randn((B, Hq, KK.T_Q, Dh), generator=g, device=device, dtype=torch.float16)
            base = BL.fp16_decode_baselines(q, B, T, Hkv, Dh, 1.0 / math.sqrt(Dh), device, True, deadline,
                                            KK.MEM_FRACTION)
            doc["rows"].append({"B": B, "T": T, "method": "SDPA FP16 (best)",
                                "us": 1e3 * base["sdpa_best"]["ms"] if base.get("sdpa_best", {}).get("ms") else None})
            print(f"{B}x{T} SDPA best: {doc['rows'][-1]['us']} us", flush=True)
            C.free_cuda(device)
        for method in a.methods:
            mod, cfg = KK.config(method, T, a.dry_run)
            g = torch.Generator(device=device).manual_seed(B * 31 + T)
            q = torch.randn((B, Hq, KK.T_Q, Dh), generator=g, device=device, dtype=torch.float16)
            st = KK.build_cache(mod, cfg, B, Hkv, Dh, T, device, seed=B + T)
            copies = C.copies_for(KK.bytes_read(cfg, st, T, Hq)["total"], device)
            states = [st] + [KK.build_cache(mod, cfg, B, Hkv, Dh, T, device, seed=B + T + i) for i in range(1, copies)]
            scale = 1.0 / math.sqrt(Dh)
            for v in variants:
                row = {"B": B, "T": T, "method": method, "knobs": v or {}}
                if deadline.expired():
                    row["skipped"] = "time budget exhausted"
                    doc["rows"].append(row)
                    continue
                try:
                    knobs = knobs_of(paged, v)
                    out, lse = paged.decode_attention(cfg, mod.KeyCodec, st, q, scale=scale, knobs=knobs)
                    row["check"] = KK.check_one(mod, cfg, st, q, out, lse, scale)
                    t = C.bench(lambda s, kn=knobs: paged.decode_attention(cfg, mod.KeyCodec, s, q, scale=scale, knobs=kn),
                                [(s,) for s in states], device=device, quick=True)
                    row.update(us=1e3 * t["ms"], method_timing=t["method"])
                except Exception as e:                    # noqa: BLE001 - recorded in the row
                    row["error"] = C.err_str(e)
                doc["rows"].append(row)
                print(f"[{time.monotonic() - t0:6.1f} s] {B}x{T} {method} {v or 'defaults'}: "
                      f"{row.get('us', float('nan')):.1f} us check={row.get('check', {}).get('ok')}"
                      + (f" ERR {row['error'][:120]}" if "error" in row else ""), flush=True)
            del states, st
            C.free_cuda(device)
        C.write_json(os.path.dirname(os.path.abspath(a.out)), os.path.basename(a.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
