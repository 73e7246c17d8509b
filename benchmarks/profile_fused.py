"""Profile the fused KIVI / Kitty decode kernel on the GPU: a launch-knob sweep, then one launch for ncu.

    python benchmarks/profile_fused.py --out $OUT                   # sweep launch knobs, JSON to $OUT/fused_sweep.json
    python benchmarks/profile_fused.py --backend cupy --grid "num_warps=2,4;waves=2,3,4"       # the CuPy kernel
    python benchmarks/profile_fused.py --backend cupy --grid "side_stream=True,False"   # knob values: ints, True / False, strings
    ncu --set full -k regex:_fused -c 1 python benchmarks/profile_fused.py --once   # one decode, for ncu
    (lab/2026-11-22-kivi-kitty-decode/ncu_page.sh runs that for the CuPy page kernel; --tune sets paged.Knobs fields for the --once decode)

Shape: B = 8, T = 32K, 32 query / 8 KV heads, head dim 128 (the issue's "batch 8" row). The cache is
filled with random codes (``bench_kivi_kitty.build_cache``); times are medians of CUDA-graph replays
(``common.bench``) of the whole decode (fused kernel + tail + merge). ``--copies auto`` (the default)
rotates over as many caches as the benchmarks do (``common.copies_for``: one rotation touches 4x the
L2), so that a cache smaller than the L2 (8 x 8K: about 40 MB, the H100's L2 holds 50) is read from
DRAM as in ``bench_kivi_kitty``; ``--copies 1`` times one cache, warm in the L2 where it fits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kivi_kitty as BK  # noqa: E402
import common as C  # noqa: E402


#: OSCAR's method names here: the whole decode, and the decode for a W_O with R_V^T folded in
OSCAR_METHODS = ("OSCAR", "OSCAR-RVfold")


def setup(method: str, B: int, T: int, backend: str = "triton", seed: int = 0):
    """(module, config, cache state, 4 fp16 queries) of a method ("OSCAR", "OSCAR-RVfold": bench_oscar's
    random-code cache)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    qs = [torch.randn((B, 32, 1, 128), generator=g, device="cuda", dtype=torch.float16) for _ in range(4)]
    if method in OSCAR_METHODS:
        import bench_oscar as BO
        mod = BO._mod(backend)
        cfg = BO.config(mod, T, dry=False)
        return mod, cfg, BO.build_cache(mod, cfg, B, 8, 128, T, "cuda", seed=seed), qs
    mod, cfg = BK.config(method, T, dry=False, backend=backend)
    st = BK.build_cache(mod, cfg, B, 8, 128, T, "cuda", seed=seed)
    return mod, cfg, st, qs


def state_bytes(st) -> int:
    """Bytes of every tensor of a cache state (its pools, tables and FP16 buffers)."""
    return sum(t.numel() * t.element_size() for t in st.arrays().values())


def cache_copies(method: str, B: int, T: int, backend: str, st, copies: str) -> list:
    """``st`` and further random caches of the same shape: ``copies`` = "auto" (``common.copies_for`` on
    the state's bytes) or a count."""
    n = C.copies_for(state_bytes(st), "cuda") if copies == "auto" else int(copies)
    if n < 1:
        raise ValueError(f"--copies {copies!r}: 'auto' or a count >= 1")
    return [st] + [setup(method, B, T, backend, seed=i)[2] for i in range(1, n)]


@contextlib.contextmanager
def _oscar_knobs(backend: str, knobs: dict):
    """OSCAR's decode knobs for the calls inside: ``kvq.fast.<backend>.oscar.decode_attention`` takes no
    knobs argument (it calls ``oscar_decode.decode`` with the defaults), so its module's ``DEFAULT_KNOBS``
    is swapped for the duration of the call (CuPy: the "oscar." knobs with the paged decode's side_stream /
    max_blocks_per_sm; Triton: the defaults)."""
    if backend != "cupy" or "oscar." not in knobs:
        yield
        return
    import importlib
    OD = importlib.import_module("kvq.fast.cupy.oscar_decode")
    old = OD.DEFAULT_KNOBS
    OD.DEFAULT_KNOBS = dataclasses.replace(knobs["oscar."], paged=knobs[""])
    try:
        yield
    finally:
        OD.DEFAULT_KNOBS = old


def decode_step(method: str, mod, cfg, st=None, backend: str = "triton", knobs: dict | None = None):
    """q -> decode_attention over the cache ``st``, or with ``st`` None (q, state) -> decode_attention over
    that state (OSCAR with bench_oscar's random orthogonal calibration; "OSCAR-RVfold": the output left in
    R_V's frame, ``rotate_back=False``, for a W_O with R_V^T folded in). ``knobs``: the launch knobs
    (``apply_tune``'s dict; None: the defaults); KIVI / Kitty decode through ``paged.decode_attention``
    with them (what ``mod.decode_attention`` calls with the defaults)."""
    import importlib
    knobs = knob_defaults(backend) if knobs is None else knobs
    if method in OSCAR_METHODS:
        import bench_oscar as BO
        calib = BO.calibration(mod, 8, 128)
        back = method == "OSCAR"

        def step(q, s):
            with _oscar_knobs(backend, knobs):
                return mod.decode_attention(cfg, calib, s, q, rotate_back=back)
    else:
        paged = importlib.import_module(f"kvq.fast.{backend}.paged")
        step = lambda q, s: paged.decode_attention(cfg, mod.KeyCodec, s, q, knobs=knobs[""])  # noqa: E731
    return step if st is None else (lambda q: step(q, st))


def knob_classes(backend: str) -> dict:
    """The launch-knob classes a run may set: ``kvq.fast.<backend>.paged.Knobs`` (keys as they are) and, on
    CuPy, OSCAR's ``kvq.fast.cupy.oscar_decode.Knobs`` (keys prefixed "oscar."; its ``paged`` field is the
    paged knobs, not set by key)."""
    import importlib
    out = {"": importlib.import_module(f"kvq.fast.{backend}.paged").Knobs}
    if backend == "cupy":
        out["oscar."] = importlib.import_module("kvq.fast.cupy.oscar_decode").Knobs
    return out


def knob_defaults(backend: str) -> dict:
    """{prefix: the default Knobs} of ``knob_classes``."""
    return {p: cls() for p, cls in knob_classes(backend).items()}


def _fields(cls) -> list:
    return [f.name for f in dataclasses.fields(cls) if f.name != "paged"]


def _value(v: str):
    return int(v) if v.isdigit() else {"True": True, "False": False, "None": None}.get(v, v)


def set_tune(backend: str, key: str, value, knobs: dict) -> dict:
    """``knobs`` (``knob_defaults``' dict) with one knob set: ``key`` of paged.Knobs, or "oscar.<key>" of
    oscar_decode.Knobs (CuPy). A new dict (Knobs are immutable); SystemExit for an unknown key, the Knobs'
    ValueError for a bad value."""
    classes = knob_classes(backend)
    for prefix, cls in sorted(classes.items(), key=lambda kv: -len(kv[0])):
        if key.startswith(prefix) and key[len(prefix):] in _fields(cls):
            return {**knobs, prefix: dataclasses.replace(knobs[prefix], **{key[len(prefix):]: value})}
    known = sorted(p + k for p, cls in classes.items() for k in _fields(cls))
    raise SystemExit(f"--tune / --grid: {key!r} is not a TUNE key ({known})")


def apply_tune(backend: str, spec: str, knobs: dict | None = None) -> dict:
    """``knobs`` (None: the defaults) with the values of "key=value;key=value" set (``set_tune``; ints,
    True / False / None, strings): {prefix: Knobs}."""
    knobs = knob_defaults(backend) if knobs is None else dict(knobs)
    if not spec:
        return knobs
    for part in spec.split(";"):
        k, v = part.split("=")
        knobs = set_tune(backend, k, _value(v), knobs)
    return knobs


def inputs(qs: list, states: list) -> list:
    """(q, state) pairs for ``common.bench``: every state once per rotation, the queries in turn."""
    return [(qs[i % len(qs)], s) for i, s in enumerate(states)] if len(states) > 1 else [(q, states[0]) for q in qs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--once", action="store_true", help="one decode per method (for ncu)")
    ap.add_argument("--tune", default="", help="--once: launch knob values (paged.Knobs fields; 'oscar.<key>' "
                    "for oscar_decode.Knobs fields), e.g. 'max_blocks_per_sm=4'")
    ap.add_argument("--methods", default="KIVI-K2V2,Kitty", help="KIVI-*, Kitty, Kitty-Pro, OSCAR, OSCAR-RVfold")
    ap.add_argument("--backend", default="triton", choices=("triton", "cupy"))
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--grid", default="block_t=32,64,128;num_warps=4,8;waves=3")
    ap.add_argument("--copies", default="auto", help="caches to rotate over: 'auto' (cold L2, as the "
                    "benchmarks) or a count (1: one cache, warm in the L2 where it fits)")
    a = ap.parse_args()
    methods = a.methods.split(",")
    if a.once:
        knobs = apply_tune(a.backend, a.tune)
        for m in methods:
            mod, cfg, st, qs = setup(m, a.B, a.T, a.backend)
            decode_step(m, mod, cfg, st, a.backend, knobs)(qs[0])
            torch.cuda.synchronize()
        return
    keys, vals = [], []
    for part in a.grid.split(";"):
        k, v = part.split("=")
        keys.append(k)
        vals.append([_value(x) for x in v.split(",")])
    rows = []
    for m in methods:
        mod, cfg, st, qs = setup(m, a.B, a.T, a.backend)
        states = cache_copies(m, a.B, a.T, a.backend, st, a.copies)
        for combo in itertools.product(*vals):
            try:
                knobs = knob_defaults(a.backend)
                for k, v in zip(keys, combo):
                    knobs = set_tune(a.backend, k, v, knobs)
                step = decode_step(m, mod, cfg, None, a.backend, knobs)
                t = C.bench(step, inputs(qs, states), device="cuda")
                row = {"method": m, **dict(zip(keys, combo)), "ms": t["ms"], "copies": len(states)}
            except Exception as e:                                  # a knob the kernel cannot take
                row = {"method": m, **dict(zip(keys, combo)), "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(row), flush=True)
            rows.append(row)
        st = states = None
        torch.cuda.empty_cache()
    res = {"meta": C.meta(torch.device("cuda")), "backend": a.backend, "B": a.B, "T": a.T, "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"fused_sweep_{a.backend}_B{a.B}_T{a.T}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
