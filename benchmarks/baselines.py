"""What every kvq benchmark is measured against: the card's two ceilings and the FP16 decode baselines.

* Ceilings: device-to-device copy bandwidth (``measure_copy``) and bf16 matmul rate (``measure_matmul``);
  ``ceilings`` runs both (``bench_ceilings.py`` writes them as ``ceilings.json``).
* FP16 attention: the float64 reference with GQA (``reference``) and the check of a decode's first
  sequence against it (``check_first``, tolerances ``OUT_TOL`` / ``LSE_TOL``); torch SDPA two ways
  (``sdpa_gqa``, ``sdpa_fold``) and ``fp16_decode_baselines``, which times both and kvq's own FP16 decode
  on random FP16 K / V of a shape.
* ``standalone_main``: the command line of one benchmark module run on its own (``--out``, ``--quick``,
  ``--dry-run``, ``--copy-gbps``), measuring the copy ceiling unless given.

The layers: ``common`` (timing, metadata, JSON) <- ``baselines`` <- the ``bench_*.py`` scripts; nothing
here imports a benchmark script, so there is no import circle.

    import baselines as BL
    c = BL.ceilings("cuda")                                         # c["copy_gbps"], c["matmul_tflops"]
    out, lse = BL.reference(q, k, v, scale)                         # float64, (B, H_q, T_q, D) / (B, H_q, T_q)
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import common as C

#: the decode checks: max |out - ref| / max |ref| and max |lse - ref| / max(1, |ref|)
OUT_TOL, LSE_TOL = 1e-2, 1e-3


# ------------------------------------------------------------------------------------------- ceilings

def measure_copy(device, nbytes: int, quick: bool = False) -> dict:
    """``dst.copy_(src)`` on ``nbytes`` random bytes, measured twice; ``copy_gbps`` counts read + written."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    runs = []
    for _ in range(2):                       # the same measurement twice: the spread is the noise
        t = C.bench(lambda a, b: b.copy_(a), [(src, dst)], device=device, quick=quick, graph=False)
        runs.append({"ms": t["ms"], "gbps": C.gbps(2 * nbytes, t["ms"]), "timing": t})
    del src, dst
    C.free_cuda(device)
    best = max(r["gbps"] for r in runs)
    return {"buffer_bytes": nbytes, "bytes_moved": 2 * nbytes, "runs": runs, "copy_gbps": best}


def measure_matmul(device, n: int, quick: bool = False) -> dict:
    """``torch.mm`` of random bf16 n x n matrices (never zeros, which run faster): 2 n^3 flops a product."""
    dtype = torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    t = C.bench(lambda x, y, z: torch.mm(x, y, out=z), [(a, b, c)], device=device, quick=quick, graph=False)
    del a, b, c
    C.free_cuda(device)
    flops = 2 * n ** 3
    return {"n": n, "dtype": "bfloat16", "flops": flops, "ms": t["ms"],
            "tflops": flops / (t["ms"] * 1e-3) / 1e12, "timing": t}


def ceilings(device, *, quick: bool = False, dry_run: bool = False) -> dict:
    """Both ceilings (2 GiB copy, 8192^3 matmul; 1 GiB with ``quick``, tiny sizes for a dry run); each
    records an error string instead of raising."""
    copy_bytes = (4 * 2**20) if dry_run else (2**30 if quick else 2 * 2**30)
    mm_n = 256 if dry_run else 8192
    res = {"copy": None, "matmul": None, "copy_gbps": None, "matmul_tflops": None}
    try:
        res["copy"] = measure_copy(device, copy_bytes, quick)
        res["copy_gbps"] = res["copy"]["copy_gbps"]
    except Exception as e:
        res["copy"] = {"error": C.err_str(e)}
        C.free_cuda(device)
    try:
        res["matmul"] = measure_matmul(device, mm_n, quick)
        res["matmul_tflops"] = res["matmul"]["tflops"]
    except Exception as e:
        res["matmul"] = {"error": C.err_str(e)}
        C.free_cuda(device)
    return res


# ------------------------------------------------------------------------------------- FP16 attention

def reference(q, k, v, scale):
    """float64 attention with GQA (query head h reads KV head h // (H_q / H_kv)); returns (out, lse)."""
    B, Hq, Tq, Dh = q.shape
    Hkv = k.shape[1]
    qg = q.double().reshape(B, Hkv, (Hq // Hkv) * Tq, Dh)             # (B, H_kv, group * T_q, D)
    s = torch.matmul(qg, k.double().transpose(-1, -2)) * scale         # (B, H_kv, group * T_q, T)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.double())
    return out.reshape(B, Hq, Tq, Dh), lse.reshape(B, Hq, Tq)


def check_first(q, out, lse, K, V, scale) -> dict:
    """Batch element 0 of a decode's (out, lse) against float64 attention over ``K`` / ``V`` (that
    sequence's cache, dequantized: (1, H_kv, T, D)): the errors and ``ok`` (finite, within the tolerances)."""
    ro, rl = reference(q[:1], K, V, scale)
    o = out[:1].double()
    res = {"out_max_rel_err": float((o - ro).abs().max() / ro.abs().max()),
           "lse_max_err": float(((lse[:1].double() - rl).abs() / rl.abs().clamp(min=1.0)).max())}
    res["ok"] = bool(torch.isfinite(o).all()) and res["out_max_rel_err"] <= OUT_TOL and res["lse_max_err"] <= LSE_TOL
    return res


def sdpa_gqa(q, k, v, scale):
    """torch SDPA with ``enable_gqa=True``; returns (out, None): SDPA gives no lse."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), None


def sdpa_fold(q, k, v, scale):
    """torch SDPA with the H_q / H_kv query heads of a group folded into the query axis (decode: no mask)."""
    B, Hq, Tq, Dh = q.shape
    Hkv = k.shape[1]
    o = F.scaled_dot_product_attention(q.view(B, Hkv, (Hq // Hkv) * Tq, Dh), k, v, scale=scale)
    return o.view(B, Hq, Tq, Dh), None


def fp16_decode_baselines(q, B, T, Hkv, Dh, scale, device, quick, deadline, mem_fraction=0.4) -> dict:
    """FP16 decode baselines on random FP16 K / V (B, Hkv, T, Dh) for the query q: torch SDPA two ways
    (:func:`sdpa_fold` / :func:`sdpa_gqa`) and kvq's FP16 ``decode_attention``, each timed with
    ``common.bench``; ``sdpa_best`` is the faster SDPA variant. Skipped (with the reason) when K + V exceed
    ``mem_fraction`` of the free GPU memory; a deadline past its end skips the rest."""
    import kvq.fast as fast
    base = {}
    fp16_kv = 2 * B * Hkv * T * Dh * 2
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info()[0]
        if fp16_kv > mem_fraction * free:
            return {"skipped": f"FP16 K+V {fp16_kv / 1e9:.1f} GB > {mem_fraction:.0%} of free {free / 1e9:.1f} GB"}
    gen = torch.Generator(device=device).manual_seed(B * 31 + T)
    try:
        copies = C.copies_for(fp16_kv, device)
        ins = [(q, torch.randn((B, Hkv, T, Dh), generator=gen, device=device, dtype=torch.float16),
                torch.randn((B, Hkv, T, Dh), generator=gen, device=device, dtype=torch.float16))
               for _ in range(copies)]
        for name, fn in (("sdpa_fold", lambda q_, k_, v_: sdpa_fold(q_, k_, v_, scale)),
                         ("sdpa_gqa", lambda q_, k_, v_: sdpa_gqa(q_, k_, v_, scale)),
                         ("kvq_fp16", lambda q_, k_, v_: fast.decode_attention(q_, [(k_, v_)], scale=scale))):
            if deadline is not None and deadline.expired():
                base[name] = {"skipped": "time budget exhausted"}
                continue
            try:
                t = C.bench(fn, ins, device=device, quick=quick)
                base[name] = {"ms": t["ms"], "timing": t, "n_copies": copies}
            except Exception as e:
                base[name] = {"error": C.err_str(e)}
        del ins
    except Exception as e:
        base["error"] = C.err_str(e)
    C.free_cuda(device)
    sdpas = [(base[n]["ms"], n) for n in ("sdpa_gqa", "sdpa_fold") if base.get(n, {}).get("ms")]
    if sdpas:                                      # the baseline is the faster SDPA variant
        base["sdpa_best"] = {"ms": min(sdpas)[0], "impl": min(sdpas)[1]}
    return base


# ------------------------------------------------------------------------------------- command line

def standalone_main(doc: str, json_name: str, run, summary_lines) -> None:
    """Command line of one benchmark module run on its own (``--out``, ``--quick``, ``--dry-run``,
    ``--copy-gbps``): measures the copy ceiling unless given, runs, writes ``json_name``, prints the
    summary. ``run_all.py`` runs the same ``run`` functions in one process."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes; runs on the CPU if there is no GPU")
    ap.add_argument("--copy-gbps", type=float, default=None, help="copy ceiling; measured if omitted")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dry = a.dry_run or device == "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    copy_gbps = a.copy_gbps
    if copy_gbps is None:
        copy_gbps = ceilings(device, quick=True, dry_run=dry)["copy_gbps"]
    C.write_result(a.out, json_name, run(device, copy_gbps=copy_gbps, quick=a.quick, dry_run=dry), summary_lines,
                   device)
