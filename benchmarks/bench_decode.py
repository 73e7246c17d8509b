"""FP16 decode attention: kvq.fast.decode_attention (triton, cupy) against torch SDPA, with GQA.

Shapes: batch {1, 8, 32} x context {4096, 32768, 131072}; H_q = 32, H_kv = 8, D = 128, T_q = 1, one KV
segment, fp16. A shape whose K + V exceed 40% of the free GPU memory is skipped. Inputs are rotated
(``common.copies_for``) only where one set is under 4x L2; larger sets already stream from HBM.

SDPA (torch picks its backend; the one it picks is recorded) runs two ways, each timed:
* ``sdpa_gqa``: ``enable_gqa=True`` (where this torch has it; else ``sdpa_repeat``: K / V repeated to
  H_q heads OUTSIDE the timed region, so that variant reads 4x the K / V bytes);
* ``sdpa_fold``: the H_q / H_kv query heads of a group folded into the query-length axis,
  q.view(B, H_kv, 4 * T_q, D): the same function for decode (no mask), and K / V are read once.
The baseline of the ratio is the faster valid SDPA variant.

Bytes (the minimum, each once): K + V + q + out. floor_ms = bytes / measured copy bandwidth.
Before timing, every implementation's output is checked against a float64 reference on the first and
last batch element: max |out - ref| / max |ref| <= 1e-2 and max |lse - ref| / max(1, |ref|) <= 1e-3
(kvq only; SDPA returns no lse); NaN fails. A failed check marks that row invalid.

    python3 benchmarks/bench_decode.py --out /tmp/res [--quick] [--dry-run]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import common as C
from baselines import LSE_TOL, OUT_TOL, reference, sdpa_fold, sdpa_gqa, standalone_main

BATCHES, CONTEXTS = (1, 8, 32), (4096, 32768, 131072)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 32), (4096, 131072)
DRY_BATCHES, DRY_CONTEXTS = (1, 2), (256,)
H_Q, H_KV, D, T_Q = 32, 8, 128, 1
DRY_H_Q, DRY_H_KV = 4, 2
MEM_FRACTION = 0.4


# ------------------------------------------------------------------------------------ check

def check(result, q, k, v, scale) -> dict:
    """Compare batch elements 0 and B-1 of an implementation's (out, lse or None) with float64."""
    out, lse = result
    B = q.shape[0]
    idx = sorted({0, B - 1})
    res = {"batch_checked": idx, "out_max_rel_err": 0.0, "out_norm_rel_err": 0.0, "lse_max_err": None}
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
        return dict(res, ok=False, error=f"out is {tuple(out.shape)} {out.dtype}, expected "
                                         f"{tuple(q.shape)} {q.dtype}")
    for b in idx:
        ro, rl = reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], scale)
        o = out[b:b + 1].double()
        if not bool(torch.isfinite(o).all()):
            return dict(res, ok=False, error="non-finite output")
        res["out_max_rel_err"] = max(res["out_max_rel_err"], float((o - ro).abs().max() / ro.abs().max()))
        res["out_norm_rel_err"] = max(res["out_norm_rel_err"], float((o - ro).norm() / ro.norm()))
        if lse is not None:
            lb = lse[b:b + 1].double()
            if tuple(lse.shape) != tuple(q.shape[:3]) or not bool(torch.isfinite(lb).all()):
                return dict(res, ok=False, error=f"lse is {tuple(lse.shape)} or non-finite")
            err = float(((lb - rl).abs() / rl.abs().clamp(min=1.0)).max())
            res["lse_max_err"] = max(res["lse_max_err"] or 0.0, err)
    res["ok"] = res["out_max_rel_err"] <= OUT_TOL and (res["lse_max_err"] is None
                                                       or res["lse_max_err"] <= LSE_TOL)
    return res


# ------------------------------------------------------------------------------------ implementations

def _fast():
    import kvq.fast as fast
    fast.set_validation(False)
    return fast


def kvq_fn(backend, scale):
    def fn(q, k, v):
        return _fast().decode_attention(q, [(k, v)], scale=scale, backend=backend)
    return fn


def sdpa_plain(q, k, v, scale):                    # K / V already repeated to H_q heads
    return F.scaled_dot_product_attention(q, k, v, scale=scale), None


def has_enable_gqa(device) -> bool:
    try:
        q = torch.randn(1, 4, 1, 16, device=device, dtype=torch.float16)
        k = torch.randn(1, 2, 8, 16, device=device, dtype=torch.float16)
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        return True
    except TypeError:
        return False


def sdpa_backend(q, k, v, scale, enable_gqa) -> str:
    """The backend torch would pick for these inputs (torch._fused_sdp_choice), by name."""
    try:
        from torch.nn.attention import SDPBackend
        names = {int(b): n for n, b in SDPBackend.__members__.items()}
        kw = {"enable_gqa": True} if enable_gqa else {}
        return names.get(int(torch._fused_sdp_choice(q, k, v, None, 0.0, False, scale=scale, **kw)), "?")
    except Exception as e:
        return f"unknown ({C.err_str(e, 120)})"


# ------------------------------------------------------------------------------------ run

def _measure(name, fn, inputs, scale, nbytes, device, copy_gbps, quick, deadline, extra=None):
    row = {"impl": name, "ms": None, "gbps": None, "pct_copy": None, "valid": False, **(extra or {})}
    if deadline is not None and deadline.expired():
        row["skipped"] = "time budget exhausted"
        return row
    try:
        q, k, v = inputs[0]
        row["check"] = check(fn(q, k, v), q, k, v, scale)
        row["valid"] = bool(row["check"]["ok"])
        t = C.bench(fn, inputs, device=device, quick=quick)
        row.update(ms=t["ms"], timing=t, gbps=C.gbps(nbytes, t["ms"]))
        row["pct_copy"] = C.pct(row["gbps"], copy_gbps)
    except Exception as e:
        row["error"] = C.err_str(e)
        row["valid"] = False
        C.free_cuda(device)
    return row


def run_shape(B, T, Hq, Hkv, device, copy_gbps, quick, deadline, gqa_ok) -> dict:
    kv_bytes = 2 * B * Hkv * T * D * 2
    q_bytes = B * Hq * T_Q * D * 2
    nbytes = kv_bytes + 2 * q_bytes                                  # K + V + q + out
    shape = {"B": B, "T": T, "H_q": Hq, "H_kv": Hkv, "D": D, "T_q": T_Q, "bytes": nbytes,
             "kv_bytes": kv_bytes, "floor_ms": (nbytes / (copy_gbps * 1e9) * 1e3) if copy_gbps else None,
             "impls": {}, "ratio_vs_sdpa": {}, "baseline": None}
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info()[0]
        if kv_bytes > MEM_FRACTION * free:
            shape["skipped"] = f"K+V {kv_bytes / 1e9:.1f} GB > {MEM_FRACTION:.0%} of free {free / 1e9:.1f} GB"
            return shape
    copies = C.copies_for(nbytes, device)
    shape["n_copies"] = copies
    scale = 1.0 / math.sqrt(D)
    gen = torch.Generator(device=device).manual_seed(B * 1000003 + T)
    inputs = [tuple(torch.randn(s, generator=gen, device=device, dtype=torch.float16)
                    for s in ((B, Hq, T_Q, D), (B, Hkv, T, D), (B, Hkv, T, D))) for _ in range(copies)]
    q0, k0, v0 = inputs[0]
    shape["sdpa_backend"] = {"gqa" if gqa_ok else "repeat": sdpa_backend(q0, k0, v0, scale, gqa_ok),
                             "fold": sdpa_backend(q0.view(B, Hkv, (Hq // Hkv) * T_Q, D), k0, v0, scale, False)}
    args = (scale, nbytes, device, copy_gbps, quick, deadline)
    impls = shape["impls"]
    for backend in ("triton", "cupy"):
        impls[backend] = _measure(backend, kvq_fn(backend, scale), inputs, *args)
    impls["sdpa_fold"] = _measure("sdpa_fold", lambda q, k, v: sdpa_fold(q, k, v, scale), inputs, *args)
    if gqa_ok:
        impls["sdpa_gqa"] = _measure("sdpa_gqa", lambda q, k, v: sdpa_gqa(q, k, v, scale), inputs, *args)
    elif torch.device(device).type != "cuda" or 4 * kv_bytes * copies < MEM_FRACTION * torch.cuda.mem_get_info()[0]:
        g = Hq // Hkv                                                  # repeat outside the timed region
        rep = [(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) for q, k, v in inputs]
        impls["sdpa_repeat"] = _measure("sdpa_repeat", lambda q, k, v: sdpa_plain(q, k, v, scale), rep, *args,
                                        extra={"note": "K/V repeated to H_q heads before timing"})
        del rep
    base = [r for n, r in impls.items() if n.startswith("sdpa") and r["valid"] and r["ms"]]
    if base:
        best = min(base, key=lambda r: r["ms"])
        shape["baseline"] = best["impl"]
        for backend in ("triton", "cupy"):
            r = impls[backend]
            shape["ratio_vs_sdpa"][backend] = (r["ms"] / best["ms"]) if r["valid"] and r["ms"] else None
    del inputs, q0, k0, v0
    C.free_cuda(device)
    return shape


def run(device, *, copy_gbps=None, quick=False, dry_run=False, deadline=None) -> dict:
    if dry_run:
        batches, contexts, Hq, Hkv = DRY_BATCHES, DRY_CONTEXTS, DRY_H_Q, DRY_H_KV
    elif quick:
        batches, contexts, Hq, Hkv = QUICK_BATCHES, QUICK_CONTEXTS, H_Q, H_KV
    else:
        batches, contexts, Hq, Hkv = BATCHES, CONTEXTS, H_Q, H_KV
    gqa_ok = has_enable_gqa(device)
    shapes = []
    for T in contexts:
        for B in batches:
            try:
                shapes.append(run_shape(B, T, Hq, Hkv, device, copy_gbps, quick, deadline, gqa_ok))
            except Exception as e:                                  # allocation, generator, ...
                shapes.append({"B": B, "T": T, "error": C.err_str(e)})
                C.free_cuda(device)
    return {"copy_gbps": copy_gbps, "target_ratio_vs_sdpa": 1.2, "sdpa_enable_gqa": gqa_ok,
            "bytes_rule": "K + V + q + out, each once", "out_tol": OUT_TOL, "lse_tol": LSE_TOL,
            "shapes": shapes}


def summary_lines(res: dict) -> list[str]:
    def ms(r):
        if not r:
            return f"{'-':>8s}"
        if r.get("error") or r.get("skipped"):
            return f"{'err' if r.get('error') else 'skip':>8s}"
        return f"{r['ms']:8.3f}" + ("" if r.get("valid") else "!")

    lines = [f"{'B':>3s} {'T':>7s} {'floor':>8s} {'triton':>8s} {'cupy':>8s} {'sdpa':>8s} {'base':>10s} "
             f"{'tri/sdpa':>8s} {'cupy/sd':>8s} {'%copy(tri)':>10s}"]
    for s in res.get("shapes", []):
        if s.get("skipped") or s.get("error"):
            lines.append(f"{s['B']:3d} {s['T']:7d}  {s.get('skipped') or s.get('error')}")
            continue
        im = s["impls"]
        base = im.get(s["baseline"]) if s["baseline"] else None
        rt = s["ratio_vs_sdpa"]
        f = lambda x: f"{x:8.2f}" if x else f"{'-':>8s}"                             # noqa: E731
        pc = im["triton"].get("pct_copy")
        lines.append(f"{s['B']:3d} {s['T']:7d} {f(s['floor_ms']) if s['floor_ms'] else '-':>8s} "
                     f"{ms(im['triton'])} {ms(im['cupy'])} {ms(base)} {s['baseline'] or '-':>10s} "
                     f"{f(rt.get('triton'))} {f(rt.get('cupy'))} {f(pc):>10s}")
    errs = {n: r["error"] for s in res.get("shapes", []) for n, r in s.get("impls", {}).items() if r.get("error")}
    lines += [f"  {n}: {e[:110]}" for n, e in errs.items()]
    lines.append("  (ms per call; '!' = failed the correctness check; floor = bytes / copy bandwidth)")
    return lines


def main():
    standalone_main(__doc__, "decode.json", run, summary_lines)


if __name__ == "__main__":
    main()
