"""Two ceilings of the CuPy fused KIVI / Kitty page kernel (paged_decode_mma2): its time with the page
copies left out (compute only) and with the compute left out (copies only), next to its full time.

    python lab/2026-11-22-kivi-kitty-decode/fused_ceilings.py --shapes "8 32768 KIVI-K2V2;32 8192 Kitty" --out $OUT

The probes live in a patched COPY of ``kvq/`` (a temporary folder; the checkout is not touched, no
production kernel carries them): ``paged.cu`` gets a device global ``kvq_probe`` read by the kernel,
set from here between runs (one compile for the three modes):

- mode 0: the kernel as it is (the probe checks are never taken);
- mode 1, compute only: ``stage_k2`` / ``stage_v2`` return at once: no cp.async copies (the loop still
  reads the next page's table entries), the loop computes on whatever the slots hold (the results are
  garbage, the time is the compute's, the copies' own instructions left out);
- mode 2, copies only: each page waits for its key copies, issues the next page's, waits for its value
  copies, issues the next page's, and skips all of its compute.

Each mode is timed as ``profile_decode_kernels.py --timeline`` times a step (a CUDA graph over cold
caches, the median kernel start / end), with ``Knobs(side_stream=False)`` so that the page kernel
runs alone; the tail and merge kernels follow it, unchanged. One JSON line per (shape, mode) on stdout,
all of them in ``<out>/fused_ceilings.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))                  # lab/<folder>: profile_decode_kernels
ROOT = os.path.dirname(os.path.dirname(HERE))                       # the repository
BENCH = os.path.join(ROOT, "benchmarks")                            # common, profile_fused

# (old, new) text edits of paged.cu; each old text must occur exactly once
_PATCH = [
    ("template <int KITTY, int KB = 2>\n__device__ __forceinline__ void stage_k2(",
     'extern "C" {\n__device__ int kvq_probe = 0;\n}\n'
     "template <int KITTY, int KB = 2>\n__device__ __forceinline__ void stage_k2("),
    ("    constexpr int D = 128, GB = 16 * KB;\n    const i64 kph =",
     "    if (kvq_probe & 1) return;\n    constexpr int D = 128, GB = 16 * KB;\n    const i64 kph ="),
    ("    constexpr int G = KVQ_G, VBY = 16 * VB;\n    const i64 vph =",
     "    if (kvq_probe & 1) return;\n    constexpr int G = KVQ_G, VBY = 16 * VB;\n    const i64 vph ="),
    ("        p_wait<1>();                               // the keys of page j\n        __syncwarp();\n",
     "        p_wait<1>();                               // the keys of page j\n        __syncwarp();\n"
     "        if (kvq_probe & 2) {\n"
     "            if (more) stage_k2<KITTY, KB>(kslot, kpn, hk, Hkv, kc, kh, ki, ks, km, db, lane);\n"
     "            p_commit();\n            p_wait<1>();\n            __syncwarp();\n"
     "            if (more) stage_v2<VB>(vslot, vtab[j + NW], hk, Hkv, vc, vs, vm, lane);\n"
     "            p_commit();\n            continue;\n        }\n"),
]


def patched_tree(dst: str) -> str:
    """A copy of this checkout's kvq/ under dst with the probes in paged.cu; returns dst."""
    shutil.copytree(os.path.join(ROOT, "kvq"), os.path.join(dst, "kvq"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = os.path.join(dst, "kvq", "fast", "cupy", "paged.cu")
    with open(path) as f:
        text = f.read()
    for old, new in _PATCH:
        if text.count(old) != 1:
            raise SystemExit(f"fused_ceilings: paged.cu changed, the probe patch no longer applies at {old[:60]!r}")
        text = text.replace(old, new)
    with open(path, "w") as f:
        f.write(text)
    return dst


MODES = {0: "full", 1: "compute only", 2: "copies only"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8 32768 KIVI-K2V2", help='"B T method" triples separated by ";"')
    ap.add_argument("--reps", type=int, default=24)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    if "kvq" in sys.modules:
        raise SystemExit("fused_ceilings: kvq was imported before the patched copy")
    tmp = tempfile.mkdtemp(prefix="kvq-ceilings-")
    sys.path.insert(0, patched_tree(tmp))
    sys.path.insert(1, HERE)
    sys.path.insert(2, BENCH)
    import cupy

    from kvq.fast.cupy import _loader as L

    import common as C
    import profile_decode_kernels as PDK

    assert L.__file__.startswith(tmp), L.__file__
    flag = cupy.ndarray((1,), cupy.int32, L.module("paged.cu").get_global("kvq_probe"))
    knobs = PDK.PF.apply_tune("cupy", "side_stream=False")      # the page kernel alone on its stream
    rows = []
    try:
        for spec in a.shapes.split(";"):
            B, T, method = spec.split()
            for mode in MODES:
                flag.fill(mode)
                cupy.cuda.Device().synchronize()
                r = PDK.timeline(method, argparse.Namespace(backend="cupy", B=int(B), T=int(T), reps=a.reps,
                                                            copies="auto", knobs=knobs))
                fused = [v for k, v in r["kernels"].items() if k.startswith("void paged_decode_mma2")]
                row = {"method": method, "B": int(B), "T": int(T), "mode": mode, "probe": MODES[mode],
                       "fused_us": fused[0]["end_us"] - fused[0]["start_us"] if len(fused) == 1 else None,
                       "step_span_us": r["step_span_us"], "kernels": r["kernels"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        flag.fill(0)
        import torch
        res = {"meta": C.meta(torch.device("cuda")), "rows": rows}
        with open(os.path.join(a.out, "fused_ceilings.json"), "w") as f:
            json.dump(res, f, indent=1)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
