"""BitDecoding decode (issue 6's benchmark): the fused decode over the induced low-bit layout against FP16
decode and against the KIVI / Kitty fused Triton kernels, at batch {1, 8, 32} x context {8K, 32K, 128K} x
g_q {1, 4, 8} (H_kv = 8, H_q = 8 g_q, D = 128, T_q = 1, fp16 q), 2 and 4 bits (the paper's BitDecoding-KC2
and -KC4: channel-wise keys in groups of 128 tokens, per-token values; W_n = 4).

Rows per shape (``shapes[i]["rows"]``):
* ``BitDecoding-KC{2,4} [cupy]``: ``kvq.fast.cupy.bitdecoding_decode.decode``: the tensor-core kernel
  ``bd_decode`` (ldmatrix of the packed words, lop3 unpacking, mma.sync m16n8k16, cp.async, split-KV,
  cooperative softmax) + ``attention.cu``'s split kernel on the FP16 residual, one merge;
* ``BitDecoding-KC{2,4} [triton]``: ``kvq.fast.triton.bitdecoding_decode.decode`` (``tl.dot`` over the
  same layout), where that module exists;
* ``KIVI-K2V2``, ``Kitty``: ``kvq.fast.triton.{kivi,kitty}.decode_attention`` on caches built as in
  ``bench_kivi_kitty`` (its ``config`` / ``build_cache``);
* ``fp16``: torch SDPA two ways (``sdpa_best`` = the faster) and kvq's FP16 decode on FP16 K / V of the
  same shape (``baselines.fp16_decode_baselines``; skipped when FP16 K + V exceed 40% of free memory).

The BitDecoding cache is BUILT DIRECTLY on the GPU (random words, scales in [0.5, 2] / qmax, minima in
[-2, -0.5], pages in table order), with ``length = T - N_r / 2``: T / N_r - 1 packed pages and a
half-full FP16 residual, the mid-page state of a decode. Before timing, batch element 0 is checked
against a float64 attention over the pages dequantized by ``kvq.fast.cupy.bitdecoding.dequantize_page``
(bit-exact with the reference) and the residual (``baselines``' tolerances). Timings: medians of
CUDA-graph replays over cache copies beyond L2 (``common.bench``). ``bytes`` = words + params + residual +
q + out, each read once; ``pct_read_ceiling``: a read-only kernel over the same bytes.

    python3 benchmarks/bench_bitdecoding_decode.py --out /tmp/res [--quick] [--batches 8] [--contexts 131072]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
from types import SimpleNamespace

import torch

import common as C
import baselines as BL

BATCHES, CONTEXTS, GQS, BITS = (1, 8, 32), (8192, 32768, 131072), (1, 4, 8), (2, 4)
H_KV, D, T_Q = 8, 128, 1
MEM_FRACTION = 0.4


def build_state(cfg, B, T, device, seed=0):
    """A BitDecoding cache of length T - N_r / 2 with random contents (fields as the reference's state)."""
    g = torch.Generator(device=device).manual_seed(seed)
    L = T - cfg.n_r // 2
    NP, res = L // cfg.n_r, L % cfg.n_r
    qmax = 2 ** cfg.bits - 1
    P, Nr, R_ = B * NP, cfg.n_r, cfg.per_word

    def params(shape):
        s = torch.rand(shape, generator=g, device=device) * (1.5 / qmax) + 0.5 / qmax
        m = torch.rand(shape, generator=g, device=device) * 1.5 - 2.0
        return torch.stack([s, m], -1).half()

    def words(shape):
        return torch.randint(0, 1 << 16, shape, generator=g, device=device, dtype=torch.int32).to(torch.uint16)

    kp = (Nr // cfg.k_group, D) if cfg.k_mode == "channel" else (Nr, D // cfg.k_group)
    res_k = torch.zeros((B, H_KV, Nr, D), dtype=torch.float16, device=device)
    res_v = torch.zeros_like(res_k)
    res_k[:, :, :res] = torch.randn((B, H_KV, res, D), generator=g, device=device).half()
    res_v[:, :, :res] = torch.randn((B, H_KV, res, D), generator=g, device=device).half()
    table = torch.arange(P, dtype=torch.int32, device=device).view(B, NP) if NP else \
        torch.zeros((B, 0), dtype=torch.int32, device=device)
    return SimpleNamespace(res_k=res_k, res_v=res_v, k_words=words((P, H_KV, 8 * cfg.warps_n, D)),
                           k_params=params((P, H_KV, *kp)), v_words=words((P, H_KV, Nr, D // R_)),
                           v_params=params((P, H_KV, Nr, D // cfg.v_group)), table=table, length=L,
                           next_page=P, shape=(B, H_KV, D))


def bytes_read(st, q) -> int:
    """What the fused decode reads once: words, params, the residual's tokens, the table, q and out."""
    res = st.length % st.res_k.shape[2]
    pools = sum(t.numel() * t.element_size() for t in (st.k_words, st.k_params, st.v_words, st.v_params))
    return pools + 2 * st.res_k[:, :, :res].numel() * 2 + st.table.numel() * 4 + 2 * q.numel() * 2


def check(cfg, st, q, out, lse, scale) -> dict:
    """Batch element 0 against float64 attention over its dequantized pages and residual."""
    from kvq.fast.cupy import bitdecoding as F
    NP = st.length // cfg.n_r
    ids = st.table[0, :NP].long()
    gather = lambda w: w.view(torch.int16)[ids].view(torch.uint16)     # noqa: E731  (no uint16 indexing on CUDA)
    K, V = F.dequantize_page(cfg, gather(st.k_words), st.k_params[ids], gather(st.v_words), st.v_params[ids])
    K = K.permute(1, 0, 2, 3).reshape(1, H_KV, NP * cfg.n_r, D)
    V = V.permute(1, 0, 2, 3).reshape(1, H_KV, NP * cfg.n_r, D)
    res = st.length % cfg.n_r
    K = torch.cat([K, st.res_k[:1, :, :res]], 2)
    V = torch.cat([V, st.res_v[:1, :, :res]], 2)
    return BL.check_first(q, out, lse, K, V, scale)


def _bd_row(backend, cfg, B, T, q, scale, device, quick, base):
    mod = importlib.import_module(f"kvq.fast.{backend}.bitdecoding_decode")
    st = build_state(cfg, B, T, device, seed=B + T)
    row = {"backend": backend, "supported": bool(mod.supported(cfg, st, q))}
    if not row["supported"]:
        return row
    out, lse = mod.decode(cfg, st, q, scale=scale)
    row["check"] = check(cfg, st, q, out, lse, scale)
    nb = bytes_read(st, q)
    copies = C.copies_for(nb, device)
    states = [st] + [build_state(cfg, B, T, device, seed=B + T + i) for i in range(1, copies)]
    t = C.bench(lambda s: mod.decode(cfg, s, q, scale=scale), [(s,) for s in states], device=device, quick=quick)
    row.update(ms=t["ms"], timing=t, n_copies=copies, bytes=nb, gbps=C.gbps(nb, t["ms"]))
    if backend == "cupy":
        row["plan"] = dict(zip(("splits", "pages_per_split", "query_tiles", "m16"), mod.plan(cfg, st, q)))
    for bname in ("sdpa_best", "kvq_fp16"):
        bms = base.get(bname, {}).get("ms")
        row[f"speedup_vs_{bname}"] = bms / t["ms"] if bms and t["ms"] else None
    del states, st
    C.free_cuda(device)
    rc = C.read_ceiling(nb, device, quick)
    row["read_ceiling"] = rc
    row["pct_read_ceiling"] = 100.0 * rc["ms"] / t["ms"] if rc and t["ms"] else None
    return row


def _kivi_row(method, B, T, q, scale, device, quick, base):
    import bench_kivi_kitty as KK
    mod, cfg = KK.config(method, T, False, "triton")
    st = KK.build_cache(mod, cfg, B, H_KV, D, T, device, seed=B + T)
    out, lse = mod.decode_attention(cfg, st, q)
    row = {"backend": "triton", "check": KK.check_one(mod, cfg, st, q, out, lse, scale)}
    nb = KK.bytes_read(cfg, st, T, q.shape[1])["total"]
    copies = C.copies_for(nb, device)
    states = [st] + [KK.build_cache(mod, cfg, B, H_KV, D, T, device, seed=B + T + i) for i in range(1, copies)]
    t = C.bench(lambda s: mod.decode_attention(cfg, s, q, scale=scale), [(s,) for s in states], device=device,
                quick=quick)
    row.update(ms=t["ms"], timing=t, n_copies=copies, bytes=nb, gbps=C.gbps(nb, t["ms"]))
    for bname in ("sdpa_best", "kvq_fp16"):
        bms = base.get(bname, {}).get("ms")
        row[f"speedup_vs_{bname}"] = bms / t["ms"] if bms and t["ms"] else None
    del states, st
    C.free_cuda(device)
    return row


def run_shape(B, T, gq, device, quick, backends, others, deadline) -> dict:
    from kvq.reference import bitdecoding as R
    import kvq.fast as fast
    fast.set_validation(False)
    Hq = H_KV * gq
    scale = 1.0 / math.sqrt(D)
    shape = {"B": B, "T": T, "g_q": gq, "H_q": Hq, "H_kv": H_KV, "D": D, "T_q": T_Q, "rows": {}}
    gen = torch.Generator(device=device).manual_seed(B * 7919 + T + gq)
    q = torch.randn((B, Hq, T_Q, D), generator=gen, device=device, dtype=torch.float16)
    base = BL.fp16_decode_baselines(q, B, T, H_KV, D, scale, device, quick, deadline, MEM_FRACTION)
    shape["fp16"] = base
    cfgs = {b: dataclasses.replace(R.CONFIGS[f"BitDecoding-KC{b}"], max_tokens=T) for b in BITS}
    jobs = [(f"BitDecoding-KC{b} [{be}]", lambda b=b, be=be: _bd_row(be, cfgs[b], B, T, q, scale, device, quick, base))
            for b in BITS for be in backends]
    jobs += [(m, lambda m=m: _kivi_row(m, B, T, q, scale, device, quick, base)) for m in others]
    for name, job in jobs:
        if deadline is not None and deadline.expired():
            shape["rows"][name] = {"skipped": "time budget exhausted"}
            continue
        try:
            shape["rows"][name] = job()
        except Exception as e:
            shape["rows"][name] = {"error": C.err_str(e)}
        C.free_cuda(device)
    return shape


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    ap.add_argument("--gq", type=int, nargs="+", default=list(GQS))
    ap.add_argument("--backends", nargs="+", default=["cupy", "triton"])
    ap.add_argument("--others", nargs="*", default=["KIVI-K2V2", "Kitty"])
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--name", default="bitdecoding_decode")
    a = ap.parse_args(argv)
    deadline = C.Deadline(a.budget_s)
    shapes = []
    for T in a.contexts:
        for B in a.batches:
            for gq in a.gq:
                shapes.append(run_shape(B, T, gq, "cuda", a.quick, a.backends, a.others, deadline))
                s = shapes[-1]
                sd = s["fp16"].get("sdpa_best", {}).get("ms")
                line = f"B={B:2d} T={T:6d} gq={gq}  sdpa {sd if sd is None else f'{sd * 1e3:8.1f}'} us"
                for n, r in s["rows"].items():
                    ms = r.get("ms")
                    line += f" | {n} {'-' if ms is None else f'{ms * 1e3:.1f}'}"
                    if r.get("check") and not r["check"]["ok"]:
                        line += " CHECK-FAIL"
                    if r.get("error"):
                        line += f" ERR {r['error'][:80]}"
                print(line, flush=True)
    res = {"shapes": shapes, "meta": C.meta("cuda", argv)}
    print(C.write_json(a.out, a.name, res))


if __name__ == "__main__":
    main()
