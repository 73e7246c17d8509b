"""KIVI / Kitty paged decode: kvq.fast.triton.{kivi,kitty}.decode_attention against FP16 decode.

Shapes: batch {1, 8, 32} x context {8192, 32768, 131072}; H_q = 32, H_kv = 8, D = 128, T_q = 1, fp16 q;
methods KIVI-K2V2, KIVI-K4V4, Kitty, Kitty-Pro (the paper configurations, ``max_tokens`` raised to the
context). The cache is BUILT DIRECTLY (random packed codes, metadata, Kitty boost indices, page tables,
FP16 sink / buffers / window; counters set to the context length), not appended token by token. A shape
whose FP16 K + V (the SDPA baseline) exceed 40% of the free GPU memory is skipped.

Per shape and method: ``decode_attention`` (validation off) timed with ``common.bench`` (CUDA graph
replay where capture works); bytes read = packed K / V pages + their metadata (the fused kernel) +
the FP16 tokens the small tail segment reads (sink, buffers, window, mixed tokens) + page tables + q +
out; GB/s and % of the copy bandwidth; speedup vs torch SDPA FP16 (GQA folded into the query axis, as
``baselines.sdpa_fold`` and ``sdpa_gqa``, the faster of the two per shape) and vs kvq's own FP16 decode (``kvq.fast.decode_attention``) on FP16 K / V
of the same shape. Before timing, batch element 0 is checked against a float64 attention over the
dequantized cache (``dequantize`` of that element): max |out - ref| / max |ref| <= 1e-2,
|lse - ref| / max(1, |ref|) <= 1e-3.

Also: a small sweep of the fused kernel's launch knobs (``paged.Knobs``: num_warps, waves) at
B = 8, T = 32K, for the lead's choice of defaults; and per method: one page flush (quantize + pack of a full key Q-buffer of G tokens and one page of
values, B = 8, H_kv = 8) timed the same way.

    python3 benchmarks/bench_kivi_kitty.py --out /tmp/res [--quick] [--dry-run]
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

import common as C
import baselines as BL

BATCHES, CONTEXTS = (1, 8, 32), (8192, 32768, 131072)
QUICK_BATCHES, QUICK_CONTEXTS = (8,), (32768, 131072)
DRY_BATCHES, DRY_CONTEXTS = (1, 2), (100, 300)
H_Q, H_KV, D, T_Q = 32, 8, 128, 1
DRY_H_Q, DRY_H_KV, DRY_D = 4, 2, 32
METHODS = ("KIVI-K2V2", "KIVI-K4V4", "Kitty", "Kitty-Pro")
MEM_FRACTION = 0.4


#: fast backends timed per method (the CuPy rows are keyed "<method> [cupy]")
BACKENDS = tuple(os.environ.get("KVQ_BENCH_BACKENDS", "triton,cupy").split(","))


def _mods(backend: str = "triton"):
    import importlib
    return (importlib.import_module(f"kvq.fast.{backend}.kivi"), importlib.import_module(f"kvq.fast.{backend}.kitty"))


def row_name(method: str, backend: str) -> str:
    return method if backend == "triton" else f"{method} [{backend}]"


def config(method: str, T: int, dry: bool, backend: str = "triton"):
    kivi, kitty = _mods(backend)
    mod = kivi if method.startswith("KIVI") else kitty
    cfg = mod.CONFIGS[method]
    kw = {"max_tokens": max(T, 1)}
    if dry:
        kw.update(group_size=16, residual=8, sink=min(cfg.sink, 4))
    return mod, dataclasses.replace(cfg, **kw)


def build_cache(mod, cfg, B, Hkv, Dh, T, device, seed=0):
    """A cache of T tokens per sequence with random contents, its counters and page tables consistent."""
    from kvq.fast.caches import paged as paged
    g = torch.Generator(device=device).manual_seed(seed)
    st = mod.init(cfg, B, Hkv, Dh)
    c = paged.counts(cfg, T)
    N = st.k_table.shape[1]

    def rnd(t, lo, hi):                                  # uniform [lo, hi) into t's dtype, in place
        t.copy_(torch.rand(t.shape, generator=g, device=device) * (hi - lo) + lo)

    for name, t in st.k_pool.items():
        if t.dtype == torch.uint8 and name != "idx":
            t.copy_(torch.randint(0, 256, t.shape, generator=g, device=device, dtype=torch.uint8))
    qk = 15 if "low" in st.k_pool else 2 ** cfg.k_bits - 1
    rnd(st.k_pool["scale"], 0.5 / qk, 2.0 / qk)          # key ranges ~ 1..4 per channel
    rnd(st.k_pool["mn"], -2.0, -0.5)
    if "idx" in st.k_pool:                                # Kitty: d_boost random channels per (page, head)
        Pn, H, Dd = st.k_pool["idx"].shape
        Db = st.k_pool["high"].shape[2]
        order = torch.rand((Pn, H, Dd), generator=g, device=device).argsort(dim=-1)
        boost = torch.zeros((Pn, H, Dd), dtype=torch.bool, device=device)
        boost.scatter_(-1, order[..., :Db], True)
        rows = torch.cumsum(boost.to(torch.int32), -1) - 1
        st.k_pool["idx"].copy_(torch.where(boost, rows, torch.full_like(rows, Db)).to(torch.uint8))
    st.v_codes.copy_(torch.randint(0, 256, st.v_codes.shape, generator=g, device=device, dtype=torch.uint8))
    qv = 2 ** cfg.v_bits - 1
    rnd(st.v_scale, 1.0 / qv, 4.0 / qv)
    rnd(st.v_mn, -2.0, -1.0)
    for t in (st.sink_k, st.sink_v, st.k_buf, st.v_win, st.v_buf):
        if t.numel():
            t.copy_(torch.randn(t.shape, generator=g, device=device))
    ids = torch.arange(B * N, dtype=torch.int32, device=device).view(B, N)
    st.k_table[:, :c["n_kpages"]] = ids[:, :c["n_kpages"]]
    st.v_table[:, :c["n_vpages"]] = ids[:, :c["n_vpages"]]
    st.length, st.k_next, st.v_next = T, B * c["n_kpages"], B * c["n_vpages"]
    return st


def _one(st, b):
    """The state of batch element b alone (per-sequence tensors sliced, the pools shared)."""
    return dataclasses.replace(st, sink_k=st.sink_k[b:b + 1], sink_v=st.sink_v[b:b + 1], k_buf=st.k_buf[b:b + 1],
                               v_win=st.v_win[b:b + 1], v_buf=st.v_buf[b:b + 1], k_table=st.k_table[b:b + 1],
                               v_table=st.v_table[b:b + 1], shape=(1,) + tuple(st.shape[1:]))


def bytes_read(cfg, st, T, Hq) -> dict:
    """Bytes the decode reads: the fused kernel's packed pages + metadata, the tail's FP16 tokens, q, out."""
    from kvq.fast.caches import paged as paged
    B, H, Dh = st.shape
    G = cfg.group_size
    c = paged.counts(cfg, T)
    NF = min(c["n_kpages"] * G, c["n_vq"])
    NP = -(-NF // G)
    per_page = sum(t[0].numel() * t.element_size() for t in st.k_pool.values())       # one page, all heads
    per_page += sum(t[0].numel() * t.element_size() for t in (st.v_codes, st.v_scale, st.v_mn))
    fused = B * NP * per_page + 2 * B * NP * 4
    tail_tokens = T - NF                                                             # sink + rest
    tail = B * H * tail_tokens * Dh * 2 * 2
    q_out = 2 * B * Hq * T_Q * Dh * 2
    return {"fused": fused, "tail": tail, "q_out": q_out, "total": fused + tail + q_out, "pages": NP,
            "tail_tokens": tail_tokens}


def check_one(mod, cfg, st, q, out, lse, scale) -> dict:
    """Batch element 0 against float64 attention over its dequantized cache."""
    K, V = mod.dequantize(cfg, _one(st, 0))
    res = BL.check_first(q, out, lse, K, V, scale)
    del K, V
    return res


def run_shape(B, T, Hq, Hkv, Dh, device, copy_gbps, quick, dry, deadline) -> dict:
    scale = 1.0 / math.sqrt(Dh)
    fp16_kv = 2 * B * Hkv * T * Dh * 2
    shape = {"B": B, "T": T, "H_q": Hq, "H_kv": Hkv, "D": Dh, "T_q": T_Q, "fp16_kv_bytes": fp16_kv, "methods": {}}
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info()[0]
        if fp16_kv > MEM_FRACTION * free:
            shape["skipped"] = f"FP16 K+V {fp16_kv / 1e9:.1f} GB > {MEM_FRACTION:.0%} of free {free / 1e9:.1f} GB"
            return shape
    import kvq.fast as fast
    fast.set_validation(False)
    gen = torch.Generator(device=device).manual_seed(B * 7919 + T)
    q = torch.randn((B, Hq, T_Q, Dh), generator=gen, device=device, dtype=torch.float16)
    # FP16 baselines on K / V of the same shape
    base = BL.fp16_decode_baselines(q, B, T, Hkv, Dh, scale, device, quick, deadline, MEM_FRACTION)
    shape["fp16"] = base
    for backend, method in [(b, m) for b in BACKENDS for m in METHODS]:
        row = {"ms": None, "valid": False, "backend": backend}
        shape["methods"][row_name(method, backend)] = row
        if deadline is not None and deadline.expired():
            row["skipped"] = "time budget exhausted"
            continue
        try:
            mod, cfg = config(method, T, dry, backend)
            st = build_cache(mod, cfg, B, Hkv, Dh, T, device, seed=B + T)
            nb = bytes_read(cfg, st, T, Hq)
            row["bytes"] = nb
            out, lse = mod.decode_attention(cfg, st, q)
            row["check"] = check_one(mod, cfg, st, q, out, lse, scale)
            row["valid"] = row["check"]["ok"]
            copies = C.copies_for(nb["total"], device)
            states = [st] + [build_cache(mod, cfg, B, Hkv, Dh, T, device, seed=B + T + i) for i in range(1, copies)]
            t = C.bench(lambda s: mod.decode_attention(cfg, s, q, scale=scale), [(s,) for s in states],
                        device=device, quick=quick)
            row.update(ms=t["ms"], timing=t, n_copies=copies, gbps=C.gbps(nb["total"], t["ms"]))
            row["pct_copy"] = C.pct(row["gbps"], copy_gbps)
            for bname in ("sdpa_best", "kvq_fp16"):
                bms = base.get(bname, {}).get("ms")
                row[f"speedup_vs_{bname}"] = (bms / t["ms"]) if bms and t["ms"] else None
            del states, st
            C.free_cuda(device)
            # one kernel that only reads the same bytes, timed the same way: the best any kernel could do
            rc = C.read_ceiling(nb["total"], device, quick)
            row["read_ceiling"] = rc
            row["pct_read_ceiling"] = 100.0 * rc["ms"] / t["ms"] if rc and t["ms"] else None
        except Exception as e:
            row["error"] = C.err_str(e)
            row["valid"] = False
        C.free_cuda(device)
    return shape


def time_flush(device, quick, dry, deadline, backend: str = "triton") -> dict:
    """One page flush per method by the append's own writers (``backend``), B = 8, H_kv = 8 (dry: 2,
    2): the key Q-buffer (B, H, G, D) -> one key page in the pool (``kvq.fast.caches.paged.write_key_pages``)
    and G values -> one value page in the pool (``write_values``), each one kernel where the backend has
    it (``kvq.fast.triton._flush``, ``kvq.fast.cupy._flush``), else the quantizers and copies. ``fused``:
    whether both took the one-kernel writers (``kvq.fast.caches.codecs.FUSED_FLUSH``); ``keys_ms`` /
    ``values_ms``: each write timed alone."""
    from kvq.fast.caches import paged as _paged
    import kvq.fast as fast
    fast.set_validation(False)
    B, H, Dh = (2, DRY_H_KV, DRY_D) if dry else (8, H_KV, D)
    res = {}
    for method in METHODS:
        if deadline is not None and deadline.expired():
            res[method] = {"skipped": "time budget exhausted"}
            continue
        try:
            mod, cfg = config(method, 4096, dry, backend)
            G = cfg.group_size
            gen = torch.Generator(device=device).manual_seed(3)
            kp = torch.randn((B, H, 1, G, Dh), generator=gen, device=device, dtype=torch.float16)
            vp = torch.randn((B, H, G, Dh), generator=gen, device=device, dtype=torch.float16)

            st = mod.init(cfg, B, H, Dh)                       # the pools; value page b of sequence b
            st.v_table[:, 0] = torch.arange(B, dtype=torch.int32, device=device)
            # the append's own writers (kvq.fast.caches.paged): one kernel each where the backend has them
            keys_one = _paged.write_key_pages(cfg, mod.KeyCodec, st, kp, 0, 0)
            values_one = _paged.write_values(cfg, mod.KeyCodec, st, vp, 0)
            fused = keys_one and values_one

            def flush(kp_, vp_):
                _paged.write_key_pages(cfg, mod.KeyCodec, st, kp_, 0, 0)
                _paged.write_values(cfg, mod.KeyCodec, st, vp_, 0)

            t = C.bench(flush, [(kp, vp)], device=device, quick=quick)
            tk = C.bench(lambda kp_: _paged.write_key_pages(cfg, mod.KeyCodec, st, kp_, 0, 0), [(kp,)],
                         device=device, quick=quick)
            tv = C.bench(lambda vp_: _paged.write_values(cfg, mod.KeyCodec, st, vp_, 0), [(vp,)],
                         device=device, quick=quick)
            res[method] = {"ms": t["ms"], "keys_ms": tk["ms"], "values_ms": tv["ms"], "timing": t, "B": B,
                           "H_kv": H, "G": G, "D": Dh, "fused": fused, "backend": backend,
                           "bytes_in": 2 * kp.numel() * 2}
        except Exception as e:
            res[method] = {"error": C.err_str(e)}
    return res


def tune(device, quick, dry, deadline) -> dict:
    """Launch knobs of the fused kernel (``kvq.fast.triton.paged.Knobs``) at one shape, B = 8, T = 32K
    (dry: the tiny shape): num_warps 4 / 8 x waves 2 / 4, and split_p off (P rounded once: one dot fewer
    per page; the parity tests check it meets the tolerance too), for KIVI-K2V2 and Kitty. ms per call."""
    from kvq.fast.triton import paged
    import kvq.fast as fast
    fast.set_validation(False)
    B, T, Hq, Hkv, Dh = (1, 60, DRY_H_Q, DRY_H_KV, DRY_D) if dry else (8, 32768, H_Q, H_KV, D)
    res = {"B": B, "T": T, "rows": []}
    for method in ("KIVI-K2V2", "Kitty"):
        mod, cfg = config(method, T, dry)
        st = build_cache(mod, cfg, B, Hkv, Dh, T, device)
        q = torch.randn((B, Hq, T_Q, Dh), device=device, dtype=torch.float16)
        copies = C.copies_for(bytes_read(cfg, st, T, Hq)["total"], device)
        states = [st] + [build_cache(mod, cfg, B, Hkv, Dh, T, device, seed=i) for i in range(1, copies)]
        combos = [(w, x, True) for w in (4, 8) for x in (2, 4)] + [(8, 3, False), (4, 3, False)]
        for warps, waves, split_p in combos:
            if deadline is not None and deadline.expired():
                res["skipped"] = "time budget exhausted"
                return res
            knobs = paged.Knobs(num_warps=warps, waves=waves, split_p=split_p)
            row = {"method": method, "num_warps": warps, "waves": waves, "split_p": split_p}
            try:
                # mod.decode_attention's call, with these knobs instead of the defaults
                t = C.bench(lambda s, kn=knobs: paged.decode_attention(cfg, mod.KeyCodec, s, q, knobs=kn),
                            [(s,) for s in states], device=device, quick=True)
                row["ms"] = t["ms"]
            except Exception as e:
                row["error"] = C.err_str(e)
            res["rows"].append(row)
        del states, st
        C.free_cuda(device)
    return res


def run(device, *, copy_gbps=None, quick=False, dry_run=False, deadline=None) -> dict:
    batches, contexts, Hq, Hkv, Dh = C.shape_sizes(sys.modules[__name__], quick, dry_run)
    shapes = C.run_shapes(lambda B, T: run_shape(B, T, Hq, Hkv, Dh, device, copy_gbps, quick, dry_run, deadline),
                          batches, contexts, device)
    flush = time_flush(device, quick, dry_run, deadline, BACKENDS[0])      # the first backend timed
    try:
        tuning = tune(device, quick, dry_run, deadline)
    except Exception as e:
        tuning = {"error": C.err_str(e)}
    return {"tune": tuning, "copy_gbps": copy_gbps, "amortized_flush": amortized_flush(shapes, flush), "methods": list(METHODS), "targets": {"pct_copy_at_32k_plus": 70.0,
            "kivi_k2v2_speedup_vs_sdpa_128k_b8": 4.0},
            "bytes_rule": "packed K/V pages + metadata + page tables (fused) + FP16 tail tokens + q + out",
            "out_tol": BL.OUT_TOL, "lse_tol": BL.LSE_TOL, "shapes": shapes, "flush": flush}


def amortized_flush(shapes, flush) -> dict:
    """Flush cost per decode step: a page of keys and of values is quantized once every G steps, so
    the step pays flush_ms / G; as a percentage of the step's attention time at B = 8 (the batch the
    flush was timed at), per context (the Kitty slides report 0.17% of a step). The step is the row of
    the backend the flush was timed with where the run has one, else the Triton row, else the CuPy row
    (``step_row`` says which)."""
    out = {}
    for m, f in flush.items():
        if not f.get("ms"):
            continue
        per_step = f["ms"] / f["G"]
        rows = [s for s in shapes if s.get("B") == f["B"] and s.get("methods")]
        key = next((k for k in (row_name(m, f.get("backend", "triton")), row_name(m, "triton"), row_name(m, "cupy"))
                    if any((s["methods"].get(k) or {}).get("ms") for s in rows)), None)
        out[m] = {"flush_ms_per_step": per_step, "step_row": key, "pct_of_step": {
            str(s["T"]): 100.0 * per_step / s["methods"][key]["ms"] for s in rows
            if key and (s["methods"].get(key) or {}).get("ms")}}
    return out


def summary_lines(res: dict) -> list[str]:
    names = [row_name(m, b) for b in BACKENDS for m in METHODS]
    lines = [f"{'B':>3s} {'T':>7s} {'sdpa':>8s} {'kvq16':>8s} " + " ".join(f"{m:>16s}" for m in names)]
    for s in res.get("shapes", []):
        if s.get("skipped") or s.get("error"):
            lines.append(f"{s['B']:3d} {s['T']:7d}  {s.get('skipped') or s.get('error')}")
            continue
        f16 = s.get("fp16", {})
        ms = lambda r: f"{r['ms']:8.3f}" if r and r.get("ms") else f"{'-':>8s}"            # noqa: E731
        cells = []
        for m in names:
            r = s["methods"].get(m, {})
            if r.get("ms"):
                sp = r.get("speedup_vs_sdpa_best")
                pc = r.get("pct_copy")
                cells.append(f"{r['ms']:7.3f}{'' if r.get('valid') else '!'} x{sp or 0:4.1f} {pc or 0:3.0f}%")
            else:
                cells.append(f"{'err' if r.get('error') else 'skip':>16s}")
        lines.append(f"{s['B']:3d} {s['T']:7d} {ms(f16.get('sdpa_best'))} {ms(f16.get('kvq_fp16'))} "
                     + " ".join(f"{c:>16s}" for c in cells))
    errs = {f"{s['B']}x{s['T']} {m}": r["error"] for s in res.get("shapes", [])
            for m, r in s.get("methods", {}).items() if r.get("error")}
    lines += [f"  {n}: {e[:110]}" for n, e in errs.items()]
    fl = res.get("flush", {})
    lines.append("  flush (ms per page, K + V): " + ", ".join(
        f"{m} {r['ms']:.3f}" if r.get("ms") else f"{m} {'err' if r.get('error') else 'skip'}" for m, r in fl.items()))
    lines.append("  flush per step (amortized over G steps, % of the B=8 step): " + "; ".join(
        f"{m} " + ", ".join(f"{t}: {p:.2f}%" for t, p in a["pct_of_step"].items())
        for m, a in res.get("amortized_flush", {}).items()))
    tu = res.get("tune", {})
    if tu.get("rows"):
        lines.append(f"  tune at B={tu['B']} T={tu['T']} (ms): " + ", ".join(
            f"{r['method']} w{r['num_warps']}/x{r['waves']}{'' if r['split_p'] else '/p1'} "
            + (f"{r['ms']:.3f}" if r.get("ms") else "err")
            for r in tu["rows"]))
    lines.append("  (ms per call, x = speedup vs SDPA FP16, % of copy bandwidth; '!' = failed the check)")
    return lines


def main():
    BL.standalone_main(__doc__, "kivi_kitty.json", run, summary_lines)


if __name__ == "__main__":
    main()
