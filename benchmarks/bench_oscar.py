"""OSCAR decode: kvq.fast.triton.oscar.decode_attention against FP16 decode (issue 4's benchmark).

Shapes: batch {1, 8, 32} x context {32768, 65536, 131072}; Qwen3-8B-like heads H_q = 32, H_kv = 8, D = 128,
T_q = 1, fp16 q; the OSCAR configuration (sink 64, window 256, G 128, page 128, INT2, fp16 metadata;
``max_tokens`` raised to the context). The cache is BUILT DIRECTLY (random packed INT2 pages, scale / min,
page table, FP16 sink and window in the rotated frame; counters set to the context length), not appended
token by token; the calibration is a random orthogonal R_K / R_V per KV head (fp32, QR of a seeded
Gaussian) with the default clip ratios.

NOT FUSED YET: ``decode_attention`` rotates q, unpacks and dequantizes the whole INT2 history into fp32
(B, H, T, D) per call, and attends sink / history / window with the FP16 flash-decoding kernel in fp32.
The JSON records both byte counts: ``bytes.min`` (what a fused kernel must read: INT2 pages + metadata +
page table + FP16 sink / window + rotations + q / out; GB/s and % of copy bandwidth are taken on it, the
issue's target) and ``bytes.actual_est`` (adds the fp32 intermediate the current path writes and reads:
gathered pages, dequantized history written, permuted copy read + written, read by attention).
A shape whose FP16 K + V (the baselines) exceed 40% of the free GPU memory skips its baselines; one whose
fp32 transient (about 3 x B*H*T*D*4 bytes: K history held while V's is dequantized and permuted) exceeds
70% of the free memory skips OSCAR; both with the reason recorded.

Per shape: batch element 0 checked against a float64 attention over the cache's ``dequantize`` (original
frame) before timing: max |out - ref| / max |ref| <= 1e-2, |lse - ref| / max(1, |ref|) <= 1e-3; the
decode (validation off) timed with ``common.bench``; speedup vs torch SDPA FP16 (the faster of
``sdpa_fold`` / ``sdpa_gqa`` of ``bench_decode``) and vs kvq's FP16 decode on FP16 K / V of the same shape.

Also the fused quantize cost per token: ``append`` of one page of tokens (page_size tokens, B = 8, H_kv = 8)
into a cache whose window is full (so exactly page_size tokens leave the window, are clipped, quantized
and packed into one new page), and its two parts timed alone: rotate (``fp16(k R_K)``, ``fp16(v R_V)``) and
quantize (``oscar_quant.quantize_tokens`` on the rotated K and V); reported per token step (all B
sequences) and per (token, sequence).

    python3 benchmarks/bench_oscar.py --out /tmp/res [--quick] [--dry-run]
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

import common as C
from bench_decode import OUT_TOL, LSE_TOL, reference as ref_attention, sdpa_fold, sdpa_gqa

BATCHES, CONTEXTS = (1, 8, 32), (32768, 65536, 131072)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 8), (65536, 131072)
DRY_BATCHES, DRY_CONTEXTS = (1, 2), (100, 300)
H_Q, H_KV, D, T_Q = 32, 8, 128, 1
DRY_H_Q, DRY_H_KV, DRY_D = 4, 2, 32
MEM_FRACTION = 0.4                 # FP16 K + V of the baselines
FP32_MEM_FRACTION = 0.7            # OSCAR's fp32 transient
QUANT_B = 8


def config(T: int, dry: bool):
    from kvq.fast.triton import oscar
    kw = {"max_tokens": max(T, 1)}
    if dry:
        kw.update(sink=4, window=16, page_size=16, group_size=DRY_D)
    return dataclasses.replace(oscar.CONFIGS["OSCAR"], **kw)


def calibration(Hkv: int, Dh: int, seed: int = 0):
    """Random orthogonal R_K / R_V per KV head (fp32 (H_kv, D, D), QR of a seeded Gaussian), default clips."""
    from kvq.fast.triton import oscar
    g = torch.Generator().manual_seed(seed)

    def orth():
        Q, Rr = torch.linalg.qr(torch.randn((Hkv, Dh, Dh), generator=g, dtype=torch.float64))
        return (Q * torch.sign(torch.diagonal(Rr, dim1=-2, dim2=-1)).unsqueeze(-2)).float().numpy()

    return oscar.OSCARCalibration(R_K=np.ascontiguousarray(orth()), R_V=np.ascontiguousarray(orth()),
                                  clip_k=oscar.DEFAULT_CLIP_K, clip_v=oscar.DEFAULT_CLIP_V)


def build_cache(cfg, B, Hkv, Dh, T, device, seed=0):
    """A cache of T tokens per sequence with random contents (rotated frame), table and counters consistent."""
    from kvq.fast.triton import oscar
    g = torch.Generator(device=device).manual_seed(seed)
    st = oscar.init(cfg, B, Hkv, Dh)
    c = oscar.counts(cfg, T)
    npg = c["n_pages"]

    def rnd(t, lo, hi):                                  # uniform [lo, hi) into t's dtype, in place
        t.copy_(torch.rand(t.shape, generator=g, device=device) * (hi - lo) + lo)

    for codes in (st.k_codes, st.v_codes):
        codes.copy_(torch.randint(0, 256, codes.shape, generator=g, device=device, dtype=torch.uint8))
    qmax = 2 ** cfg.bits - 1
    for s, mn in ((st.k_scale, st.k_mn), (st.v_scale, st.v_mn)):   # clipped ranges ~ 2..5 per token group
        rnd(s, 2.0 / qmax, 5.0 / qmax)
        rnd(mn, -2.5, -1.0)
    for t in (st.sink_k, st.sink_v, st.win_k, st.win_v):
        t.copy_(torch.randn(t.shape, generator=g, device=device))
    if npg:
        ids = torch.arange(npg * B, dtype=torch.int32, device=device).view(npg, B).t()   # page-major, batch
        st.table[:, :npg] = ids
    st.length, st.next_page = T, npg * B
    return st


def _one(st, b):
    """The state of batch element b alone (per-sequence tensors sliced, the pools shared)."""
    return dataclasses.replace(st, sink_k=st.sink_k[b:b + 1], sink_v=st.sink_v[b:b + 1], win_k=st.win_k[b:b + 1],
                               win_v=st.win_v[b:b + 1], table=st.table[b:b + 1],
                               shape=(1,) + tuple(st.shape[1:]))


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def bytes_read(cfg, st, T, Hq) -> dict:
    """``min``: what a fused decode must move; ``actual_est``: plus the fp32 traffic of the current path."""
    from kvq.fast.triton import oscar
    B, H, Dh = st.shape
    c = oscar.counts(cfg, T)
    npg, nh = c["n_pages"], c["n_hist"]
    per_page = sum(_nbytes(t[0]) for t in (st.k_codes, st.k_scale, st.k_mn, st.v_codes, st.v_scale, st.v_mn))
    pages = B * npg * per_page
    table = B * npg * 4
    fp16_tok = c["n_sink"] + c["n_win"]
    sink_win = B * H * fp16_tok * Dh * 2 * 2
    rot = 2 * H * Dh * Dh * 4
    q_out = 2 * B * Hq * T_Q * Dh * 2
    total = pages + table + sink_win + rot + q_out
    # current path, per K and V: gather pages (read + write), unpack-dequantize (read pages, write fp32
    # B*H*npg*Pg*D), permute copy (read + write), attention reads the n_hist slice; sink / window: fp16
    # read, fp32 written (window: index_select copy first), fp32 read by attention
    Xp = B * H * npg * cfg.page_size * Dh * 4
    Xh = B * H * nh * Dh * 4
    fp32_hist = 2 * (3 * Xp + Xh)
    gather = 2 * pages
    sw_extra = B * H * fp16_tok * Dh * 2 * (4 + 4) + B * H * c["n_win"] * Dh * 2 * 2 * 2
    qo_extra = 2 * B * Hq * T_Q * Dh * 4 * 3
    actual = total + gather + fp32_hist + sw_extra + qo_extra
    return {"pages": pages, "table": table, "sink_window_fp16": sink_win, "rotations": rot, "q_out": q_out,
            "min": total, "fp32_history_traffic": fp32_hist, "gather": gather, "actual_est": actual,
            "n_pages": npg, "n_hist": nh, "fp16_tokens": fp16_tok, "fp32_transient_peak_est": 3 * Xp}


def check_one(cfg, calib, st, q, out, lse, scale) -> dict:
    """Batch element 0 against float64 attention over its dequantized cache (original frame)."""
    from kvq.fast.triton import oscar
    K, V = oscar.dequantize(cfg, calib, _one(st, 0))
    ro, rl = ref_attention(q[:1], K, V, scale)
    o = out[:1].double()
    res = {"out_max_rel_err": float((o - ro).abs().max() / ro.abs().max()),
           "lse_max_err": float(((lse[:1].double() - rl).abs() / rl.abs().clamp(min=1.0)).max())}
    res["ok"] = bool(torch.isfinite(o).all()) and res["out_max_rel_err"] <= OUT_TOL and res["lse_max_err"] <= LSE_TOL
    del K, V
    return res


def fp16_baselines(q, B, T, Hkv, Dh, scale, device, quick, deadline) -> dict:
    """sdpa_fold, sdpa_gqa and kvq's FP16 decode on random FP16 K / V of the shape (as bench_kivi_kitty)."""
    import kvq.fast as fast
    base = {}
    fp16_kv = 2 * B * Hkv * T * Dh * 2
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info()[0]
        if fp16_kv > MEM_FRACTION * free:
            return {"skipped": f"FP16 K+V {fp16_kv / 1e9:.1f} GB > {MEM_FRACTION:.0%} of free {free / 1e9:.1f} GB"}
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


def run_shape(B, T, Hq, Hkv, Dh, device, copy_gbps, quick, dry, deadline) -> dict:
    from kvq.fast.triton import oscar
    import kvq.fast as fast
    fast.set_validation(False)
    scale = 1.0 / math.sqrt(Dh)
    shape = {"B": B, "T": T, "H_q": Hq, "H_kv": Hkv, "D": Dh, "T_q": T_Q,
             "fp16_kv_bytes": 2 * B * Hkv * T * Dh * 2}
    gen = torch.Generator(device=device).manual_seed(B * 7919 + T)
    q = torch.randn((B, Hq, T_Q, Dh), generator=gen, device=device, dtype=torch.float16)
    shape["fp16"] = fp16_baselines(q, B, T, Hkv, Dh, scale, device, quick, deadline)
    row = {"ms": None, "valid": False, "history": "dequantized to fp32 per call (not fused)"}
    shape["oscar"] = row
    if deadline is not None and deadline.expired():
        row["skipped"] = "time budget exhausted"
        return shape
    try:
        cfg = config(T, dry)
        calib = calibration(Hkv, Dh)
        st = build_cache(cfg, B, Hkv, Dh, T, device, seed=B + T)
        nb = bytes_read(cfg, st, T, Hq)
        row["bytes"] = nb
        if torch.device(device).type == "cuda":
            free = torch.cuda.mem_get_info()[0]
            need = nb["fp32_transient_peak_est"]
            if need > FP32_MEM_FRACTION * free:
                row["skipped"] = (f"fp32 history transient ~{need / 1e9:.1f} GB > {FP32_MEM_FRACTION:.0%} of "
                                  f"free {free / 1e9:.1f} GB")
                del st
                C.free_cuda(device)
                return shape
        out, lse = oscar.decode_attention(cfg, calib, st, q, scale=scale)
        row["check"] = check_one(cfg, calib, st, q, out, lse, scale)
        row["valid"] = row["check"]["ok"]
        del out, lse
        C.free_cuda(device)
        copies = C.copies_for(nb["min"], device)
        states = [st] + [build_cache(cfg, B, Hkv, Dh, T, device, seed=B + T + i) for i in range(1, copies)]
        t = C.bench(lambda s: oscar.decode_attention(cfg, calib, s, q, scale=scale), [(s,) for s in states],
                    device=device, quick=quick)
        row.update(ms=t["ms"], timing=t, n_copies=copies, gbps=C.gbps(nb["min"], t["ms"]),
                   gbps_actual_est=C.gbps(nb["actual_est"], t["ms"]))
        row["pct_copy"] = C.pct(row["gbps"], copy_gbps)
        row["pct_copy_actual_est"] = C.pct(row["gbps_actual_est"], copy_gbps)
        row["floor_ms"] = nb["min"] / (copy_gbps * 1e9) * 1e3 if copy_gbps else None
        for bname in ("sdpa_best", "kvq_fp16"):
            bms = shape["fp16"].get(bname, {}).get("ms")
            row[f"speedup_vs_{bname}"] = (bms / t["ms"]) if bms and t["ms"] else None
        del states, st
    except Exception as e:
        row["error"] = C.err_str(e)
        row["valid"] = False
    C.free_cuda(device)
    return shape


def time_quantize(device, quick, dry, deadline) -> dict:
    """Append of one page of tokens (page_size, B = 8, H_kv = 8; dry: 2, 2) into a cache whose window is
    full, and its parts alone: rotate (K and V to fp16 in the rotated frame), quantize (fused clip + INT2 +
    pack of the rotated K and V). ms per call, per token step (/ page_size) and per (token, sequence)."""
    from kvq.fast.triton import oscar
    from kvq.fast.triton import oscar_quant as OQ
    from kvq.fast.triton.rotate import rotate
    import kvq.fast as fast
    fast.set_validation(False)
    B, H, Dh = (2, DRY_H_KV, DRY_D) if dry else (QUANT_B, H_KV, D)
    cfg0 = config(0, dry)
    n = cfg0.page_size
    T0 = cfg0.sink + cfg0.window                                  # window full: the next n tokens flush a page
    cfg = dataclasses.replace(cfg0, max_tokens=T0 + n)
    calib = calibration(H, Dh)
    gen = torch.Generator(device=device).manual_seed(5)
    k = torch.randn((B, H, n, Dh), generator=gen, device=device, dtype=torch.float16)
    v = torch.randn((B, H, n, Dh), generator=gen, device=device, dtype=torch.float16)
    RK = torch.from_numpy(np.asarray(calib.R_K)).to(device)
    RV = torch.from_numpy(np.asarray(calib.R_V)).to(device)
    k16, v16 = rotate(k, RK).to(torch.float16), rotate(v, RV).to(torch.float16)
    meta = cfg.meta_dtype
    st = build_cache(cfg, B, H, Dh, T0, device, seed=9)

    def do_append(k_, v_):                                        # counters reset: the same slots every call
        st.length, st.next_page = T0, 0
        oscar.append(cfg, calib, st, k_, v_)

    def do_rotate(k_, v_):
        return rotate(k_, RK).to(torch.float16), rotate(v_, RV).to(torch.float16)

    def do_quant(k_, v_):
        return (OQ.quantize_tokens(k_, calib.clip_k, cfg.group_size, cfg.bits, meta),
                OQ.quantize_tokens(v_, calib.clip_v, cfg.group_size, cfg.bits, meta))

    res = {"B": B, "H_kv": H, "D": Dh, "tokens": n, "G": cfg.group_size, "bits": cfg.bits,
           "note": "append = rotate (calibration copied host->device per call) + fused quantize + page / "
                   "window writes; rotate and quantize timed alone on the same tokens"}
    for name, fn, args in (("append", do_append, (k, v)), ("rotate", do_rotate, (k, v)),
                           ("quantize", do_quant, (k16, v16))):
        if deadline is not None and deadline.expired():
            res[name] = {"skipped": "time budget exhausted"}
            continue
        try:
            t = C.bench(fn, [args], device=device, quick=quick)
            res[name] = {"ms": t["ms"], "timing": t, "us_per_token_step": 1e3 * t["ms"] / n,
                         "us_per_token_seq": 1e3 * t["ms"] / (n * B)}
        except Exception as e:
            res[name] = {"error": C.err_str(e)}
    return res


def run(device, *, copy_gbps=None, quick=False, dry_run=False, deadline=None) -> dict:
    if dry_run:
        batches, contexts, Hq, Hkv, Dh = DRY_BATCHES, DRY_CONTEXTS, DRY_H_Q, DRY_H_KV, DRY_D
    elif quick:
        batches, contexts, Hq, Hkv, Dh = QUICK_BATCHES, QUICK_CONTEXTS, H_Q, H_KV, D
    else:
        batches, contexts, Hq, Hkv, Dh = BATCHES, CONTEXTS, H_Q, H_KV, D
    shapes = []
    for T in contexts:
        for B in batches:
            try:
                shapes.append(run_shape(B, T, Hq, Hkv, Dh, device, copy_gbps, quick, dry_run, deadline))
            except Exception as e:
                shapes.append({"B": B, "T": T, "error": C.err_str(e)})
                C.free_cuda(device)
    try:
        quant = time_quantize(device, quick, dry_run, deadline)
    except Exception as e:
        quant = {"error": C.err_str(e)}
    return {"copy_gbps": copy_gbps, "config": dataclasses.asdict(config(0, dry_run)),
            "fused": False,
            "history_path": "q rotated; INT2 history unpacked + dequantized to fp32 (B, H, T, D) and permuted "
                            "per call; sink / history / window attended by the FP16 flash-decoding kernel in "
                            "fp32; out rotated back",
            "targets": {"speedup_vs_sdpa_best_at_64k_plus": 2.5, "pct_copy": 70.0,
                        "paper_b1_step_attention_ms": {"fp16": 3.8, "oscar": 1.3}},
            "bytes_rule": "min: INT2 pages + metadata + page table + FP16 sink / window + rotations + q + out "
                          "(gbps / pct_copy); actual_est adds the fp32 history traffic of the unfused path",
            "out_tol": OUT_TOL, "lse_tol": LSE_TOL, "shapes": shapes, "quantize": quant}


def summary_lines(res: dict) -> list[str]:
    lines = [f"{'B':>3s} {'T':>7s} {'sdpa':>8s} {'kvq16':>8s} {'oscar':>9s} {'x sdpa':>7s} {'x kvq16':>7s} "
             f"{'%copy':>6s} {'%copy*':>6s} {'out err':>8s}"]
    ms = lambda r: f"{r['ms']:8.3f}" if r and r.get("ms") else f"{'-':>8s}"            # noqa: E731
    for s in res.get("shapes", []):
        if s.get("error"):
            lines.append(f"{s['B']:3d} {s['T']:7d}  {s['error'][:150]}")
            continue
        f16, r = s.get("fp16", {}), s.get("oscar", {})
        head = f"{s['B']:3d} {s['T']:7d} {ms(f16.get('sdpa_best'))} {ms(f16.get('kvq_fp16'))} "
        if r.get("ms"):
            sp, sk = r.get("speedup_vs_sdpa_best"), r.get("speedup_vs_kvq_fp16")
            err = r.get("check", {}).get("out_max_rel_err")
            lines.append(head + f"{r['ms']:8.3f}{'' if r.get('valid') else '!'} "
                         + (f"{sp:7.2f} " if sp else f"{'-':>7s} ") + (f"{sk:7.2f} " if sk else f"{'-':>7s} ")
                         + f"{r.get('pct_copy') or 0:5.1f}% {r.get('pct_copy_actual_est') or 0:5.1f}% "
                         + (f"{err:8.1e}" if err is not None else ""))
        else:
            lines.append(head + " " + (r.get("skipped") or r.get("error") or "-")[:150])
        if f16.get("skipped"):
            lines.append(f"        fp16 baselines: {f16['skipped']}")
    qt = res.get("quantize", {})
    if qt.get("error"):
        lines.append(f"  quantize: {qt['error'][:150]}")
    else:
        lines.append(f"  quantize per token (B={qt.get('B')}, H_kv={qt.get('H_kv')}, one page of {qt.get('tokens')} "
                     "tokens; us per token step / per (token, sequence)): " + ", ".join(
                         f"{n} {qt[n]['us_per_token_step']:.2f} / {qt[n]['us_per_token_seq']:.3f}"
                         if qt.get(n, {}).get("ms") else f"{n} {'err' if qt.get(n, {}).get('error') else 'skip'}"
                         for n in ("append", "rotate", "quantize")))
    lines.append("  (ms per call; x = speedup; %copy on the fused minimum bytes, %copy* on the unfused path's "
                 "estimated traffic; '!' = failed the check; history dequantized to fp32, not fused)")
    return lines


def main():
    C.standalone_main(__doc__, "oscar.json", run, summary_lines)


if __name__ == "__main__":
    main()
