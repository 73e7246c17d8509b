"""OSCAR decode: kvq.fast.<backend>.oscar.decode_attention (fused INT2) against FP16 decode (issue 4's benchmark).

Rows per backend (``KVQ_BENCH_BACKENDS``, default "triton,cupy", as ``bench_kivi_kitty``): the Triton row of a
shape is keyed ``oscar``, the CuPy one ``oscar [cupy]``; a backend that cannot run (no CuPy, no GPU) records
its error in its row. Shapes: batch {1, 8, 32} x context {32768, 65536, 131072}; Qwen3-8B-like heads
H_q = 32, H_kv = 8, D = 128, T_q = 1, fp16 q; the OSCAR configuration (sink 64, window 256, G 128, page 128,
INT2, fp16 metadata; ``max_tokens`` raised to the context). The cache is BUILT DIRECTLY (random packed INT2
pages, scale / min, page table, FP16 sink and window in the rotated frame; counters set to the context
length), not appended token by token; the calibration is a random orthogonal R_K / R_V per KV head (fp32,
QR of a seeded Gaussian) with the default clip ratios.

What is timed: the whole ``decode_attention`` call: q rotated by R_K, the fused decode, the output rotated
back by R_V^T; and (``rv_folded``) the same call with ``rotate_back=False``, the decode of a model whose W_O
has R_V^T folded in (``kvq.reference.oscar.fold_value_rotation``, the paper's deployment: the output is
left in R_V's frame). The fused decode reads the packed pages in place (never dequantized to memory):

* ``triton``: ``kvq.fast.triton.oscar_decode``, one page kernel over the INT2 pages (unpack + dequantize in
  registers, online softmax, split along the sequence), the FP16 sink + window through the FP16 partial
  kernel, one log-sum-exp merge;
* ``cupy``: the tensor-core kernel ``oscar_decode_mma`` (``kvq.fast.cupy.oscar_decode``) beside
  ``attention.cu``'s split kernel for the FP16 sink + window, one merge. It takes fp16 / bf16 q, 2-bit, G = D
  = 128, pages of 128, fp16 metadata, <= 8 query rows per KV head (the benchmark's full shapes); elsewhere
  the backend dequantizes the history to fp32 first: the row's ``fused`` is False then.

Bytes: ``bytes.min`` is what the fused kernels read, each once: the INT2 pages + their metadata + the page
table + the FP16 sink / window + the two rotations + q / out; GB/s, % of copy bandwidth and ``floor_ms``
are taken on it (the issue's target). Not counted: the small fp32 intermediates of the call (rotated q,
per-split partials, the fp32 output before the rotation back; on Triton the sink + window passed to its
partial kernel as an fp32 copy), and the calibration's host -> device copy per call (the rotations are host
data; that copy also makes CUDA-graph capture fail, ``timing.method`` / ``graph_error`` say which timing
was taken).

Per shape and backend: batch element 0 checked against a float64 attention over the cache's
``dequantize`` (original frame) before timing: max |out - ref| / max |ref| <= 1e-2,
|lse - ref| / max(1, |ref|) <= 1e-3; the decode (validation off) timed with ``common.bench``; speedup vs
torch SDPA FP16 (the faster of ``sdpa_fold`` / ``sdpa_gqa`` of ``baselines``) and vs kvq's FP16 decode on
FP16 K / V of the same shape (``baselines.fp16_decode_baselines``, once per shape; skipped when FP16 K + V
exceed 40% of the free GPU memory).

Also per backend (``quantize``, ``quantize [cupy]``): the fused quantize cost per token: ``append`` of one
page of tokens (page_size tokens, B = 8, H_kv = 8) into a cache whose window is full (so exactly page_size
tokens leave the window, are clipped, quantized and packed into one new page), and its two parts timed
alone: rotate (``fp16(k R_K)``, ``fp16(v R_V)``, the backend's ``rotate.rotate``) and quantize (the
backend's ``oscar_quant.quantize_tokens`` on the rotated K and V); reported per token step (all B
sequences) and per (token, sequence). ``append`` takes the default path: the fused append (one kernel for K
and one for V: ``oscar_append``; ``fused_append`` says whether it applies), ``append_unfused`` the unfused
one (rotate + quantize + torch writes); ``decode_step`` / ``decode_step_unfused`` append one token per
sequence to the full window (launches dominate there).

    python3 benchmarks/bench_oscar.py --out /tmp/res [--quick] [--dry-run]
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys

import numpy as np
import torch

import common as C
import baselines as BL
from bench_kivi_kitty import BACKENDS, row_name

BATCHES, CONTEXTS = (1, 8, 32), (32768, 65536, 131072)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 8), (65536, 131072)
DRY_BATCHES, DRY_CONTEXTS = (1, 2), (100, 300)
H_Q, H_KV, D, T_Q = 32, 8, 128, 1
DRY_H_Q, DRY_H_KV, DRY_D = 4, 2, 32
MEM_FRACTION = 0.4                 # FP16 K + V of the baselines
QUANT_B = 8


def _mod(backend: str, name: str = "oscar"):
    """``kvq.fast.<backend>.<name>`` (``oscar``, ``oscar_quant``, ``oscar_decode``, ``rotate``)."""
    return importlib.import_module(f"kvq.fast.{backend}.{name}")


def config(oscar, T: int, dry: bool):
    """The OSCAR configuration of ``oscar.CONFIGS`` (a backend's module, or ``kvq.reference.oscar``)."""
    kw = {"max_tokens": max(T, 1)}
    if dry:
        kw.update(sink=4, window=16, page_size=16, group_size=DRY_D)
    return dataclasses.replace(oscar.CONFIGS["OSCAR"], **kw)


def calibration(oscar, Hkv: int, Dh: int, seed: int = 0):
    """Random orthogonal R_K / R_V per KV head (fp32 (H_kv, D, D), QR of a seeded Gaussian), default clips."""
    g = torch.Generator().manual_seed(seed)

    def orth():
        Q, Rr = torch.linalg.qr(torch.randn((Hkv, Dh, Dh), generator=g, dtype=torch.float64))
        return (Q * torch.sign(torch.diagonal(Rr, dim1=-2, dim2=-1)).unsqueeze(-2)).float().numpy()

    return oscar.OSCARCalibration(R_K=np.ascontiguousarray(orth()), R_V=np.ascontiguousarray(orth()),
                                  clip_k=oscar.DEFAULT_CLIP_K, clip_v=oscar.DEFAULT_CLIP_V)


def build_cache(oscar, cfg, B, Hkv, Dh, T, device, seed=0):
    """A cache of T tokens per sequence with random contents (rotated frame), table and counters consistent."""
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


def bytes_read(oscar, cfg, st, T, Hq) -> dict:
    """``min``: what the fused decode reads, each once: INT2 pages + metadata, page table, FP16 sink /
    window, the two rotations, q and out."""
    B, H, Dh = st.shape
    c = oscar.counts(cfg, T)
    npg = c["n_pages"]
    per_page = sum(_nbytes(t[0]) for t in (st.k_codes, st.k_scale, st.k_mn, st.v_codes, st.v_scale, st.v_mn))
    pages = B * npg * per_page
    table = B * npg * 4
    fp16_tok = c["n_sink"] + c["n_win"]
    sink_win = B * H * fp16_tok * Dh * 2 * 2
    rot = 2 * H * Dh * Dh * 4
    q_out = 2 * B * Hq * T_Q * Dh * 2
    return {"pages": pages, "table": table, "sink_window_fp16": sink_win, "rotations": rot, "q_out": q_out,
            "min": pages + table + sink_win + rot + q_out, "n_pages": npg, "n_hist": c["n_hist"],
            "fp16_tokens": fp16_tok}


def fused_applies(backend: str, cfg, st, q) -> bool:
    """Whether the backend's fused decode takes this cache and fp16 query (the CuPy kernel's
    ``oscar_decode.supported``; the Triton page kernel takes every cache)."""
    supported = getattr(_mod(backend, "oscar_decode"), "supported", None)
    return True if supported is None else bool(supported(cfg, st, q.float()))   # (the rotated q is fp32)


def check_one(oscar, cfg, calib, st, q, out, lse, scale) -> dict:
    """Batch element 0 against float64 attention over its dequantized cache (original frame)."""
    K, V = oscar.dequantize(cfg, calib, _one(st, 0))
    res = BL.check_first(q, out, lse, K, V, scale)
    del K, V
    return res


def run_backend(backend, shape, q, scale, device, copy_gbps, quick, dry, deadline) -> dict:
    """The OSCAR row of one backend at one shape (``shape``: B, T, H_q, H_kv, D and the FP16 baselines)."""
    B, T, Hq, Hkv, Dh = (shape[k] for k in ("B", "T", "H_q", "H_kv", "D"))
    row = {"ms": None, "valid": False, "backend": backend}
    if deadline is not None and deadline.expired():
        row["skipped"] = "time budget exhausted"
        return row
    try:
        oscar = _mod(backend)
        cfg = config(oscar, T, dry)
        calib = calibration(oscar, Hkv, Dh)
        st = build_cache(oscar, cfg, B, Hkv, Dh, T, device, seed=B + T)
        row["fused"] = fused_applies(backend, cfg, st, q)
        row["history"] = (f"packed INT2 pages read by the fused kernel (kvq.fast.{backend}.oscar_decode)"
                          if row["fused"] else "dequantized to fp32 per call (outside oscar_decode.supported)")
        nb = bytes_read(oscar, cfg, st, T, Hq)
        row["bytes"] = nb
        out, lse = oscar.decode_attention(cfg, calib, st, q, scale=scale)
        row["check"] = check_one(oscar, cfg, calib, st, q, out, lse, scale)
        row["valid"] = row["check"]["ok"]
        del out, lse
        C.free_cuda(device)
        copies = C.copies_for(nb["min"], device)
        states = [st] + [build_cache(oscar, cfg, B, Hkv, Dh, T, device, seed=B + T + i) for i in range(1, copies)]
        t = C.bench(lambda s: oscar.decode_attention(cfg, calib, s, q, scale=scale), [(s,) for s in states],
                    device=device, quick=quick)
        row.update(ms=t["ms"], timing=t, n_copies=copies, gbps=C.gbps(nb["min"], t["ms"]))
        row["pct_copy"] = C.pct(row["gbps"], copy_gbps)
        row["floor_ms"] = nb["min"] / (copy_gbps * 1e9) * 1e3 if copy_gbps else None
        # the same decode for a W_O with R_V^T folded in (reference.oscar.fold_value_rotation): the output
        # stays in R_V's frame, no rotation back (rotate_back=False)
        tf = C.bench(lambda s: oscar.decode_attention(cfg, calib, s, q, scale=scale, rotate_back=False),
                     [(s,) for s in states], device=device, quick=quick)
        row["rv_folded"] = {"ms": tf["ms"], "timing": tf}
        for bname in ("sdpa_best", "kvq_fp16"):
            bms = shape["fp16"].get(bname, {}).get("ms")
            row[f"speedup_vs_{bname}"] = (bms / t["ms"]) if bms and t["ms"] else None
            row["rv_folded"][f"speedup_vs_{bname}"] = (bms / tf["ms"]) if bms and tf["ms"] else None
        del states, st
        C.free_cuda(device)
        # one kernel that only reads the same bytes, timed the same way: the best any kernel could do
        rc = C.read_ceiling(nb["min"], device, quick) if backend == "cupy" else None
        row["read_ceiling"] = rc
        row["pct_read_ceiling"] = 100.0 * rc["ms"] / t["ms"] if rc and t["ms"] else None
    except Exception as e:
        row["error"] = C.err_str(e)
        row["valid"] = False
    C.free_cuda(device)
    return row


def run_shape(B, T, Hq, Hkv, Dh, device, copy_gbps, quick, dry, deadline) -> dict:
    import kvq.fast as fast
    fast.set_validation(False)
    scale = 1.0 / math.sqrt(Dh)
    shape = {"B": B, "T": T, "H_q": Hq, "H_kv": Hkv, "D": Dh, "T_q": T_Q,
             "fp16_kv_bytes": 2 * B * Hkv * T * Dh * 2}
    gen = torch.Generator(device=device).manual_seed(B * 7919 + T)
    q = torch.randn((B, Hq, T_Q, Dh), generator=gen, device=device, dtype=torch.float16)
    shape["fp16"] = BL.fp16_decode_baselines(q, B, T, Hkv, Dh, scale, device, quick, deadline, MEM_FRACTION)
    for backend in BACKENDS:
        shape[row_name("oscar", backend)] = run_backend(backend, shape, q, scale, device, copy_gbps, quick, dry,
                                                        deadline)
    return shape


def time_quantize(backend, device, quick, dry, deadline) -> dict:
    """Append of one page of tokens (page_size, B = 8, H_kv = 8; dry: 2, 2) into a cache whose window is
    full, and its parts alone: rotate (K and V to fp16 in the rotated frame), quantize (fused clip + INT2 +
    pack of the rotated K and V), with the backend's ``oscar``, ``rotate`` and ``oscar_quant``. ``append`` is
    the default path (the fused append kernel, ``oscar_append``, where it supports the configuration),
    ``append_unfused`` the unfused one (``kvq.fast.caches.oscar.unfused_append``); ``decode_step`` /
    ``decode_step_unfused``: one token per sequence appended to the full window (the token leaving it is
    quantized into a new page). ms per call, per token step (/ tokens) and per (token, sequence)."""
    import kvq.fast as fast
    from kvq.fast.caches import oscar as O
    oscar, OQ, rotate = _mod(backend), _mod(backend, "oscar_quant"), _mod(backend, "rotate").rotate
    OA = _mod(backend, "oscar_append")
    fast.set_validation(False)
    B, H, Dh = (2, DRY_H_KV, DRY_D) if dry else (QUANT_B, H_KV, D)
    cfg0 = config(oscar, 0, dry)
    n = cfg0.page_size
    T0 = cfg0.sink + cfg0.window                                  # window full: the next n tokens flush a page
    cfg = dataclasses.replace(cfg0, max_tokens=T0 + n)
    calib = calibration(oscar, H, Dh)
    gen = torch.Generator(device=device).manual_seed(5)
    k = torch.randn((B, H, n, Dh), generator=gen, device=device, dtype=torch.float16)
    v = torch.randn((B, H, n, Dh), generator=gen, device=device, dtype=torch.float16)
    RK = torch.from_numpy(np.asarray(calib.R_K)).to(device)
    RV = torch.from_numpy(np.asarray(calib.R_V)).to(device)
    meta = cfg.meta_dtype
    st = build_cache(oscar, cfg, B, H, Dh, T0, device, seed=9)

    def do_append(k_, v_):                                        # counters reset: the same slots every call
        st.length, st.next_page = T0, 0
        oscar.append(cfg, calib, st, k_, v_)

    def do_append_unfused(k_, v_):
        with O.unfused_append():
            do_append(k_, v_)

    def do_rotate(k_, v_):
        return rotate(k_, RK).to(torch.float16), rotate(v_, RV).to(torch.float16)

    def do_quant(k_, v_):
        return (OQ.quantize_tokens(k_, calib.clip_k, cfg.group_size, cfg.bits, meta),
                OQ.quantize_tokens(v_, calib.clip_v, cfg.group_size, cfg.bits, meta))

    rotated = do_rotate(k, v)
    k1, v1 = k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
    res = {"backend": backend, "B": B, "H_kv": H, "D": Dh, "tokens": n, "G": cfg.group_size, "bits": cfg.bits,
           "fused_append": bool(OA.supported(cfg, Dh)),
           "note": "append = the default path: ONE fused kernel for K and one for V (rotate, fp16, sink / "
                   "window / clip + quantize + pack into the pages; oscar_append) where fused_append, else "
                   "the unfused path; append_unfused = rotate + fused quantize + torch page / window writes; "
                   "rotate and quantize timed alone on the same tokens; decode_step[_unfused] = 1 token per "
                   "sequence into the full window (tokens = 1)"}
    rows = (("append", do_append, (k, v), n), ("append_unfused", do_append_unfused, (k, v), n),
            ("rotate", do_rotate, (k, v), n), ("quantize", do_quant, rotated, n),
            ("decode_step", do_append, (k1, v1), 1), ("decode_step_unfused", do_append_unfused, (k1, v1), 1))
    for name, fn, args, tokens in rows:
        if deadline is not None and deadline.expired():
            res[name] = {"skipped": "time budget exhausted"}
            continue
        try:
            t = C.bench(fn, [args], device=device, quick=quick)
            res[name] = {"ms": t["ms"], "timing": t, "tokens": tokens, "us_per_token_step": 1e3 * t["ms"] / tokens,
                         "us_per_token_seq": 1e3 * t["ms"] / (tokens * B)}
        except Exception as e:
            res[name] = {"error": C.err_str(e)}
    return res


def run(device, *, copy_gbps=None, quick=False, dry_run=False, deadline=None) -> dict:
    from kvq.reference import oscar as RO
    batches, contexts, Hq, Hkv, Dh = C.shape_sizes(sys.modules[__name__], quick, dry_run)
    shapes = C.run_shapes(lambda B, T: run_shape(B, T, Hq, Hkv, Dh, device, copy_gbps, quick, dry_run, deadline),
                          batches, contexts, device)
    res = {"copy_gbps": copy_gbps, "config": dataclasses.asdict(config(RO, 0, dry_run)), "backends": list(BACKENDS),
           "fused": True,
           "history_path": {
               "triton": "q rotated; kvq.fast.triton.oscar_decode: page kernel over the packed INT2 pages "
                         "(dequantized in registers), FP16 sink + window by the FP16 partial kernel, "
                         "log-sum-exp merge; out rotated back",
               "cupy": "q rotated; kvq.fast.cupy.oscar_decode: tensor-core kernel oscar_decode_mma over the "
                       "packed INT2 pages, FP16 sink + window by attention.cu's split kernel, log-sum-exp "
                       "merge; out rotated back (outside oscar_decode.supported: history dequantized to fp32 "
                       "first, the row's fused = false)"},
           "targets": {"speedup_vs_sdpa_best_at_64k_plus": 2.5, "pct_copy": 70.0,
                       "paper_b1_step_attention_ms": {"fp16": 3.8, "oscar": 1.3}},
           "bytes_rule": "min: what the fused kernels read, once: INT2 pages + metadata + page table + FP16 "
                         "sink / window + rotations + q + out (gbps / pct_copy / floor_ms)",
           "out_tol": BL.OUT_TOL, "lse_tol": BL.LSE_TOL, "shapes": shapes}
    for backend in BACKENDS:
        try:
            res[row_name("quantize", backend)] = time_quantize(backend, device, quick, dry_run, deadline)
        except Exception as e:
            res[row_name("quantize", backend)] = {"backend": backend, "error": C.err_str(e)}
    return res


def _folded(r) -> str:
    """The R_V-folded columns of a summary line: ms and speedup over SDPA, or dashes (older results)."""
    if not r or not r.get("ms"):
        return f"{'-':>8s} {'-':>7s}"
    sp = r.get("speedup_vs_sdpa_best")
    return f"{r['ms']:8.3f} " + (f"{sp:7.2f}" if sp else f"{'-':>7s}")


def summary_lines(res: dict) -> list[str]:
    lines = [f"{'B':>3s} {'T':>7s} {'sdpa':>8s} {'kvq16':>8s} {'backend':>7s} {'oscar':>9s} {'x sdpa':>7s} "
             f"{'x kvq16':>7s} {'%copy':>6s} {'out err':>8s} {'R_V fold':>8s} {'x sdpa':>7s}"]
    ms = lambda r: f"{r['ms']:8.3f}" if r and r.get("ms") else f"{'-':>8s}"            # noqa: E731
    backends = res.get("backends", ["triton"])
    for s in res.get("shapes", []):
        if s.get("error"):
            lines.append(f"{s['B']:3d} {s['T']:7d}  {s['error'][:150]}")
            continue
        f16 = s.get("fp16", {})
        head = f"{s['B']:3d} {s['T']:7d} {ms(f16.get('sdpa_best'))} {ms(f16.get('kvq_fp16'))} "
        for b in backends:
            r = s.get(row_name("oscar", b), {})
            if r.get("ms"):
                sp, sk = r.get("speedup_vs_sdpa_best"), r.get("speedup_vs_kvq_fp16")
                err = r.get("check", {}).get("out_max_rel_err")
                mark = ("" if r.get("valid") else "!") + ("" if r.get("fused", True) else "~")
                lines.append(head + f"{b:>7s} {r['ms']:8.3f}{mark:<1s} "
                             + (f"{sp:7.2f} " if sp else f"{'-':>7s} ") + (f"{sk:7.2f} " if sk else f"{'-':>7s} ")
                             + f"{r.get('pct_copy') or 0:5.1f}% " + (f"{err:8.1e} " if err is not None else f"{'-':>8s} ")
                             + _folded(r.get("rv_folded")))
            else:
                lines.append(head + f"{b:>7s} " + (r.get("skipped") or r.get("error") or "-")[:150])
        if f16.get("skipped"):
            lines.append(f"        fp16 baselines: {f16['skipped']}")
    for b in backends:
        qt = res.get(row_name("quantize", b), {})
        if qt.get("error"):
            lines.append(f"  quantize [{b}]: {qt['error'][:150]}")
            continue
        lines.append(f"  quantize [{b}] per token (B={qt.get('B')}, H_kv={qt.get('H_kv')}, one page of "
                     f"{qt.get('tokens')} tokens; us per token step / per (token, sequence)): " + ", ".join(
                         f"{n} {qt[n]['us_per_token_step']:.2f} / {qt[n]['us_per_token_seq']:.3f}"
                         if qt.get(n, {}).get("ms") else f"{n} {'err' if qt.get(n, {}).get('error') else 'skip'}"
                         for n in ("append", "append_unfused", "rotate", "quantize", "decode_step",
                                   "decode_step_unfused")))
    lines.append("  (ms per call of the fused decode; x = speedup; %copy on bytes.min, what the fused kernels "
                 "read; '!' = failed the check; '~' = history dequantized, not fused; R_V fold = the call with "
                 "rotate_back=False, for a W_O with R_V^T folded in)")
    return lines


def main():
    BL.standalone_main(__doc__, "oscar.json", run, summary_lines)


if __name__ == "__main__":
    main()
