"""AQUA-KV: encode / decode throughput per layer, the predictors' cost, and decode attention (issue 5's benchmark).

Configuration: the paper's defaults (HIGGS d=2 n=16 g=1024 residuals, 2 bits; first layer HIGGS d=2 n=256,
4 bits; sink 4, buffer 128, keys pre-RoPE); Llama-3-8B-like heads H_q = 32, H_kv = 8, D = 128 (F = 1024
values per token); fp16 q, T_q = 1. Predictors are random (ridge-shaped: W ~ N(0, 1/F_in) fp32, intercept
N(0, 0.1)): the cost of a product does not depend on the values. Caches are BUILT DIRECTLY with L = 2
layers (layer 0 and one residual layer; every later layer costs the same as layer 1): random HIGGS indices
and scales, FP16 sink / buffer, counters set to the context length, not appended token by token. Rows per
backend (``KVQ_BENCH_BACKENDS``, default "triton,cupy").

Sections (all times: ``common.bench``, median, CUDA graphs where capture works):

* ``encode``: ``aqua.encode`` of one chunk (buffer = 128 tokens x B = 8 sequences, all F values) for layer 0
  (no predictor) and a residual layer (both products, residuals, HIGGS quantizer, fused reconstruction);
  tokens/s = B * 128 / time.
* ``decode``: ``aqua_cache.decode_layer`` of layer 0 and layer 1 over a history of T = 32K tokens (B = 1):
  tokens/s; and the fused kernel alone (``aqua.reconstruct`` with the product and intercept) against the
  unfused path (``higgs.dequantize``, then ``+ (y + bias)`` in torch) on the same codes.
* ``predictor``: FLOPs per token (2 F_in F_out per matrix: keys F x F, values 2F x F) and the time per
  token of the two products alone (layer 1 over the decode history), against the bytes per token and layer
  the cache saves relative to FP16 (``bits_per_value`` accounting, the paper's 2.02 bits; and the bytes
  this implementation stores, one HIGGS index per byte): FLOPs per saved byte, and the time to read the
  saved bytes at the measured copy bandwidth (what the products must undercut to pay off in a
  memory-bound decode).
* ``attention``: per (B, T) in {1, 8} x {32K, 64K, 128K}: ``step`` = ``decode_layer(1, hat_0)`` +
  ``decode_attention(1, q, hat_1)`` (the per-layer cost of a decode step, Algorithm 4: layer 0's
  reconstruction held from the step before), and ``attention`` alone (hat given); FP16 baselines on K / V of
  the shape (``baselines.fp16_decode_baselines``: SDPA fold / gqa and kvq's FP16 decode). Batch element 0 of
  ``attention`` is checked against float64 attention over the reconstructed segments (``baselines``'
  tolerances). Bytes: ``stored`` (layer 1's codes + FP16 sink / buffer + q / out: what the cache holds) and
  ``actual_est`` (the traffic of this unfused path: the previous layer's fp32 reconstruction read by the
  products, the products, the fp32 reconstruction written, RoPE'd keys, attention's fp32 reads); GB/s and %
  copy on both. A shape whose fp32 transient (about 12 B T F 4 bytes) exceeds 70% of the free memory is
  skipped, with the reason.

    python3 benchmarks/bench_aqua.py --out /tmp/res [--quick] [--dry-run]
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys

import numpy as np
import torch

import common as C
import baselines as BL

BATCHES, CONTEXTS = (1, 8), (32768, 65536, 131072)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 8), (65536, 131072)
DRY_BATCHES, DRY_CONTEXTS = (1, 2), (100, 300)
H_Q, H_KV, D, T_Q, L = 32, 8, 128, 1, 2
DRY_H_Q, DRY_H_KV, DRY_D = 4, 2, 32
ENC_B, DEC_T, DRY_DEC_T = 8, 32768, 200
FP32_MEM_FRACTION = 0.7
MEM_FRACTION = 0.4


def backends() -> tuple:
    return tuple(b for b in os.environ.get("KVQ_BENCH_BACKENDS", "triton,cupy").split(",") if b)


def _mods(backend: str):
    return (importlib.import_module(f"kvq.fast.{backend}.aqua"), importlib.import_module(f"kvq.fast.{backend}.aqua_cache"))


def config(T: int, dry: bool):
    from kvq.reference import aqua as RA
    from kvq.reference import higgs as RG
    g = 64 if dry else 1024
    return RA.AquaConfig(backbone=RA.Higgs(RG.HiggsConfig(2, 16, group_size=g)),
                         first_layer=RA.Higgs(RG.HiggsConfig(2, 256, group_size=g)), sink=4,
                         buffer=16 if dry else 128, max_tokens=max(T, 1))


def predictors(F: int, seed: int = 0):
    """Random L-layer predictors (ridge-shaped fp32 weights and intercepts; index 0 is None)."""
    from kvq.reference import aqua as RA
    rng = np.random.default_rng(seed)
    p = lambda n_in: RA.Predictor(((rng.standard_normal((n_in, F)) / math.sqrt(n_in)).astype(np.float32),),   # noqa: E731
                                  (0.1 * rng.standard_normal(F)).astype(np.float32))
    return RA.AquaPredictors((None,) + tuple(p(F) for _ in range(L - 1)), (None,) + tuple(p(2 * F) for _ in range(L - 1)))


def build_cache(FC, cfg, B, Hkv, Dh, T, device, seed=0):
    """A cache of T tokens per sequence with random codes (valid indices, scales ~ U(0.3, 1)), FP16 sink /
    buffer N(0, 1); counters set."""
    g = torch.Generator(device=device).manual_seed(seed)
    st = FC.init(cfg, L, B, Hkv, Dh)
    for grp, bb in (("first_k", cfg.first_layer), ("first_v", cfg.first_layer), ("res_k", cfg.backbone),
                    ("res_v", cfg.backbone)):
        codes = getattr(st, grp)
        codes["idx"].copy_(torch.randint(0, bb.cfg.n, codes["idx"].shape, generator=g, device=device,
                                         dtype=torch.int32).to(codes["idx"].dtype))
        codes["scale"].copy_(torch.rand(codes["scale"].shape, generator=g, device=device) * 0.7 + 0.3)
    for t in (st.sink_k, st.sink_v, st.buf_k, st.buf_v):
        t.copy_(torch.randn(t.shape, generator=g, device=device))
    st.length = T
    return st


def _ms_row(t, n_tokens, **extra) -> dict:
    return {"ms": t["ms"], "timing": t, "tokens_per_s": n_tokens / (t["ms"] * 1e-3) if t["ms"] else None, **extra}


def _timed(rows: dict, name: str, fn, inputs, n_tokens, device, quick, deadline, **extra) -> None:
    """rows[name] = the timing of fn over inputs (or the reason it has none)."""
    if deadline is not None and deadline.expired():
        rows[name] = {"skipped": "time budget exhausted"}
        return
    try:
        rows[name] = _ms_row(C.bench(fn, inputs, device=device, quick=quick), n_tokens, **extra)
    except Exception as e:
        rows[name] = {"error": C.err_str(e)}
        C.free_cuda(device)


def time_encode(backend, device, quick, dry, deadline) -> dict:
    FA, _ = _mods(backend)
    Hkv, Dh = (DRY_H_KV, DRY_D) if dry else (H_KV, D)
    cfg, F = config(0, dry), Hkv * Dh
    P = predictors(F)
    B, R = (2 if dry else ENC_B), cfg.buffer
    g = torch.Generator(device=device).manual_seed(3)
    K, V, Kp, Vp = (torch.randn((B, R, F), generator=g, device=device) for _ in range(4))
    rows = {"B": B, "tokens": B * R, "F": F}
    for l in range(L):
        _timed(rows, f"layer{l}", lambda k, v: FA.encode(cfg, P, l, k, v, Kp, Vp), [(K, V)], B * R, device, quick,
               deadline)
    return rows


def time_decode(backend, device, quick, dry, deadline) -> dict:
    """decode_layer of layers 0 and 1, the fused kernel vs unfused, the predictor products alone."""
    from kvq.fast.caches import aqua as _A
    FA, FC = _mods(backend)
    HG = importlib.import_module(f"kvq.fast.{backend}.higgs")
    Hkv, Dh = (DRY_H_KV, DRY_D) if dry else (H_KV, D)
    T = DRY_DEC_T if dry else DEC_T
    cfg, F = config(T, dry), Hkv * Dh
    P = predictors(F)
    st = build_cache(FC, cfg, 1, Hkv, Dh, T, device, seed=11)
    hat0 = FC.decode_layer(cfg, P, st, 0)
    hat1 = FC.decode_layer(cfg, P, st, 1, hat0)
    n = hat0[0].shape[1]
    rows = {"T": T, "history_tokens": n, "F": F}
    _timed(rows, "layer0", lambda s: FC.decode_layer(cfg, P, s, 0), [(st,)], n, device, quick, deadline)
    _timed(rows, "layer1", lambda s: FC.decode_layer(cfg, P, s, 1, hat0), [(st,)], n, device, quick, deadline)
    fk, fv = _A.weights(P, st.device)[0][1], _A.weights(P, st.device)[1][1]
    Kq = {k: a[0, :, :n // cfg.buffer].reshape((1, n) + tuple(a.shape[4:])).contiguous()    # layer 1's key codes
          for k, a in st.res_k.items()}
    y = _A.predict(fk, [hat0[0]])
    bb = cfg.backbone

    def unfused(q, y_):
        return HG.dequantize(bb.cfg, q["idx"], q["scale"], F) + (y_ + fk.bias)

    _timed(rows, "fused_kernel", lambda q, y_: FA.reconstruct(bb, q, F, y_, fk.bias), [(Kq, y)], n, device, quick,
           deadline)
    _timed(rows, "unfused", unfused, [(Kq, y)], n, device, quick, deadline)
    _timed(rows, "products", lambda: (_A.predict(fk, [hat0[0]]), _A.predict(fv, [hat0[1], hat1[0]])), [()], n,
           device, quick, deadline)
    f, u = rows.get("fused_kernel", {}).get("ms"), rows.get("unfused", {}).get("ms")
    rows["fused_speedup"] = (u / f) if f and u else None
    return rows                                              # the caller frees the tensors (free_cuda)


def predictor_cost(decode_rows: dict, F: int, cfg, copy_gbps) -> dict:
    """FLOPs and time per token of layer 1's products against the bytes per token and layer saved vs FP16."""
    flops = 2 * F * F + 2 * (2 * F) * F                                   # keys F x F, values 2F x F
    fp16 = 2 * F * 2                                                      # K + V, fp16
    bpv = float(cfg.backbone.bits_per_value(F))
    g, d = cfg.backbone.cfg.group_size, cfg.backbone.cfg.d
    stored = 2 * (F // d + 2 * (-(-F // g)))                              # one index per byte + fp16 scales
    ms, n = decode_rows.get("products", {}).get("ms"), decode_rows.get("history_tokens")
    us = 1e3 * ms / n if ms and n else None
    out = {"flops_per_token": flops, "predictor_us_per_token": us,
           "predictor_tflops": (flops / (us * 1e-6) / 1e12) if us else None,
           "fp16_bytes_per_token": fp16, "aqua_bytes_per_token_accounted": 2 * F * bpv / 8,
           "aqua_bytes_per_token_stored": stored}
    for kind in ("accounted", "stored"):
        saved = fp16 - out[f"aqua_bytes_per_token_{kind}"]
        out[f"saved_bytes_per_token_{kind}"] = saved
        out[f"flops_per_saved_byte_{kind}"] = flops / saved
        out[f"read_saved_bytes_us_{kind}"] = (saved / (copy_gbps * 1e9) * 1e6) if copy_gbps else None
    return out


def bytes_moved(cfg, st, T, Hq, F) -> dict:
    B = st.shape[1]
    n_sink, n_chunks, n_buf = (min(T, cfg.sink),) + divmod(max(T - cfg.sink, 0), cfg.buffer)
    n = n_chunks * cfg.buffer
    codes = sum(a[0, :, :n_chunks].numel() * a.element_size() for grp in (st.res_k, st.res_v) for a in grp.values())
    fp16 = B * (n_sink + n_buf) * F * 2 * 2
    qo = 2 * B * Hq * T_Q * (F // st.shape[2]) * 2
    X = B * n * F * 4                                                     # one fp32 (B, n, F) tensor
    actual = codes + fp16 + qo + 2 * X + X + 2 * X + 2 * X + 2 * X + 2 * X   # prev read, y w+r (K, V), out, RoPE, attn
    return {"stored": codes + fp16 + qo, "codes": codes, "fp16_sink_buffer": fp16, "actual_est": actual,
            "fp32_transient_peak_est": 12 * X, "history_tokens": n}


def check_one(cfg, st, hat, q, out, lse, scale) -> dict:
    """Batch element 0 against float64 attention over its reconstructed segments."""
    from kvq.fast.caches import aqua_cache as _aqua_cache
    segs = _aqua_cache.segments(cfg, st, 1, hat)
    K, V = (torch.cat([s[i][:1] for s in segs], dim=2) for i in (0, 1))
    return BL.check_first(q, out, lse, K, V, scale)


def measure_backend(backend, cfg, P, q, B, T, Hq, Hkv, Dh, scale, base, device, copy_gbps, quick, deadline) -> dict:
    """One backend's AQUA-KV rows of a shape (the tensors are freed on return)."""
    row = {"ms": None, "valid": False}
    _, FC = _mods(backend)
    st = build_cache(FC, cfg, B, Hkv, Dh, T, device, seed=B + T)
    nb = bytes_moved(cfg, st, T, Hq, Hkv * Dh)
    row["bytes"] = nb
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info()[0]
        if nb["fp32_transient_peak_est"] > FP32_MEM_FRACTION * free:
            row["skipped"] = (f"fp32 transient ~{nb['fp32_transient_peak_est'] / 1e9:.1f} GB > "
                              f"{FP32_MEM_FRACTION:.0%} of free {free / 1e9:.1f} GB")
            return row
    hat0 = FC.decode_layer(cfg, P, st, 0)
    hat1 = FC.decode_layer(cfg, P, st, 1, hat0)
    out, lse = FC.decode_attention(cfg, P, st, 1, q, hat1, scale=scale)
    row["check"] = check_one(cfg, st, hat1, q, out, lse, scale)
    row["valid"] = row["check"]["ok"]
    out = lse = None
    t = C.bench(lambda: FC.decode_attention(cfg, P, st, 1, q, FC.decode_layer(cfg, P, st, 1, hat0), scale=scale),
                [()], device=device, quick=quick)
    row.update(ms=t["ms"], timing=t, gbps_stored=C.gbps(nb["stored"], t["ms"]),
               gbps_actual_est=C.gbps(nb["actual_est"], t["ms"]))
    row["pct_copy_stored"] = C.pct(row["gbps_stored"], copy_gbps)
    row["pct_copy_actual_est"] = C.pct(row["gbps_actual_est"], copy_gbps)
    for bname in ("sdpa_best", "kvq_fp16"):
        bms = base.get(bname, {}).get("ms")
        row[f"speedup_vs_{bname}"] = (bms / t["ms"]) if bms and t["ms"] else None
    att = {}
    _timed(att, "attention", lambda: FC.decode_attention(cfg, P, st, 1, q, hat1, scale=scale), [()], B * T, device,
           quick, deadline)
    row["attention_only"] = att["attention"]
    return row


def run_shape(B, T, Hq, Hkv, Dh, device, copy_gbps, quick, dry, deadline) -> dict:
    import kvq.fast as fast
    fast.set_validation(False)
    scale = 1.0 / math.sqrt(Dh)
    shape = {"B": B, "T": T, "H_q": Hq, "H_kv": Hkv, "D": Dh, "T_q": T_Q, "fp16_kv_bytes": 2 * B * Hkv * T * Dh * 2,
             "aqua": {}}
    gen = torch.Generator(device=device).manual_seed(B * 7919 + T)
    q = torch.randn((B, Hq, T_Q, Dh), generator=gen, device=device, dtype=torch.float16)
    shape["fp16"] = BL.fp16_decode_baselines(q, B, T, Hkv, Dh, scale, device, quick, deadline, MEM_FRACTION)
    cfg, P = config(T, dry), predictors(Hkv * Dh)
    for backend in backends():
        if deadline is not None and deadline.expired():
            shape["aqua"][backend] = {"ms": None, "valid": False, "skipped": "time budget exhausted"}
            continue
        try:
            shape["aqua"][backend] = measure_backend(backend, cfg, P, q, B, T, Hq, Hkv, Dh, scale, shape["fp16"],
                                                     device, copy_gbps, quick, deadline)
        except Exception as e:
            shape["aqua"][backend] = {"ms": None, "valid": False, "error": C.err_str(e)}
        C.free_cuda(device)
    return shape


def run(device, *, copy_gbps=None, quick=False, dry_run=False, deadline=None) -> dict:
    batches, contexts, Hq, Hkv, Dh = C.shape_sizes(sys.modules[__name__], quick, dry_run)
    per_backend = {}
    for backend in backends():
        r = per_backend[backend] = {}
        for name, fn in (("encode", time_encode), ("decode", time_decode)):
            try:
                r[name] = fn(backend, device, quick, dry_run, deadline)
            except Exception as e:
                r[name] = {"error": C.err_str(e)}
            C.free_cuda(device)
        cfg = config(0, dry_run)
        r["predictor"] = predictor_cost(r["decode"], Hkv * Dh, cfg, copy_gbps)
    shapes = C.run_shapes(lambda B, T: run_shape(B, T, Hq, Hkv, Dh, device, copy_gbps, quick, dry_run, deadline),
                          batches, contexts, device)
    return {"copy_gbps": copy_gbps, "config": dataclasses.asdict(config(0, dry_run)), "layers_built": L,
            "fused": "lookup + scale + inverse Hadamard + (y + bias) in one kernel; products by torch (fp32); "
                     "history reconstructed to fp32 per call, RoPE by torch, attention by kvq's flash-decoding "
                     "kernel in fp32",
            "out_tol": BL.OUT_TOL, "lse_tol": BL.LSE_TOL, "backends": per_backend, "shapes": shapes}


def summary_lines(res: dict) -> list[str]:
    lines = []
    for b, r in res.get("backends", {}).items():
        enc, dec, pr = r.get("encode", {}), r.get("decode", {}), r.get("predictor", {})
        errs = [f"{n}: {r[n]['error'][:120]}" for n in ("encode", "decode") if r.get(n, {}).get("error")]
        if errs:
            lines.append(f"[{b}] " + "; ".join(errs))
            continue
        tps = lambda x: f"{x['tokens_per_s'] / 1e6:.2f}M tok/s" if x and x.get("tokens_per_s") else (   # noqa: E731
            "err" if x and x.get("error") else "-")
        lines.append(f"[{b}] encode l0 {tps(enc.get('layer0'))}, l1 {tps(enc.get('layer1'))}; decode l0 "
                     f"{tps(dec.get('layer0'))}, l1 {tps(dec.get('layer1'))}; "
                     f"fused x{dec.get('fused_speedup') or 0:.2f} "
                     f"vs unfused; predictor {pr.get('predictor_us_per_token') or 0:.4f} us/token "
                     f"({pr.get('flops_per_token', 0) / 1e6:.1f} MFLOP) vs reading the saved "
                     f"{pr.get('saved_bytes_per_token_accounted', 0):.0f} B: "
                     f"{pr.get('read_saved_bytes_us_accounted') or 0:.4f} us")
    lines.append(f"{'B':>3s} {'T':>7s} {'sdpa':>8s} {'kvq16':>8s} "
                 + " ".join(f"{b + ' step':>12s} {'attn':>8s} {'x sdpa':>6s}" for b in backends()))
    ms = lambda r: f"{r['ms']:8.3f}" if r and r.get("ms") else f"{'-':>8s}"            # noqa: E731
    for s in res.get("shapes", []):
        if s.get("error"):
            lines.append(f"{s['B']:3d} {s['T']:7d}  {s['error'][:150]}")
            continue
        f16 = s.get("fp16", {})
        cells = []
        for b in backends():
            r = s.get("aqua", {}).get(b, {})
            sp = r.get("speedup_vs_sdpa_best")
            cells.append(f"{ms(r):>11s}{'' if r.get('valid') else '!'} {ms(r.get('attention_only'))} "
                         + (f"{sp:6.2f}" if sp else f"{'-':>6s}"))
        lines.append(f"{s['B']:3d} {s['T']:7d} {ms(f16.get('sdpa_best'))} {ms(f16.get('kvq_fp16'))} " + " ".join(cells))
        for b in backends():
            r = s.get("aqua", {}).get(b, {})
            if r.get("error") or r.get("skipped"):
                lines.append(f"        {b}: {(r.get('error') or r.get('skipped'))[:150]}")
    lines.append("  (ms per call; step = decode_layer + decode_attention of one layer; '!' = failed the check or "
                 "no result; history reconstructed to fp32 per call)")
    return lines


def main():
    BL.standalone_main(__doc__, "aqua.json", run, summary_lines)


if __name__ == "__main__":
    main()
