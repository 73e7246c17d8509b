"""What does one layer of an eager decode step cost a user in kvq's Python on the GPU: the cache's ``update``
plus kvq's attention function for one token, in every layer of a step? (issue 37, item 3)

    python3 lab/2026-11-30-layer-host/layer_host.py --out $OUT/layer-after.json
    python3 lab/2026-11-30-layer-host/layer_host.py --kvq .before --out ...     # another tree's kvq

A model with the Llama-3.1-8B's layers and attention shapes (32 layers, 32 query / 8 KV heads of 128, fp16;
a small MLP and vocabulary, which this never calls), each cache made and filled as ``kvq bench e2e`` does
(``bench_e2e.make`` / ``fill``: B x T random tokens through ``update``), validation off (make_cache's default on
CUDA). Then ``--calls`` steps in a row, each: for every layer, ``layer.update(k, v)`` and
``kvq_attention_forward`` of one new token, as the model's attention layers call them (so the 32 layers of a
step decode at one length, and the next step at the next: the plans' reuse is a model's). Host us per layer =
the host clock per step until the loop returns (before the synchronization) / 32; wall us = until the GPU is
done. Medians of ``--rounds`` rounds, every round kept; torch SDPA over an FP16 cache of one layer's shape,
timed per call in the same process, is the host's own speed (for comparing processes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CACHES = ["KIVI-K2V2:triton", "Kitty:triton", "OSCAR:triton", "BitDecoding-2:triton", "KIVI-K2V2:cupy"]


def rounds(fn, calls: int, n: int, sync):
    """(host us per call, wall us per call) of ``n`` rounds of ``calls`` calls."""
    host, wall = [], []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return host, wall


def profile(step, n: int, sync, path: str) -> None:
    """``n`` steps under cProfile; the 45 functions with the most own time, then the most cumulative, to ``path``."""
    import cProfile
    import io
    import pstats
    sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    sync()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(45)
    with open(path, "w") as f:
        f.write(buf.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvq", default=None, help="import kvq from this directory (e.g. .before)")
    ap.add_argument("--caches", nargs="+", default=CACHES)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=40, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cuda; cpu for a smoke test (Triton under TRITON_INTERPRET=1)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke test)")
    ap.add_argument("--profile", type=int, default=0, help="then this many steps under cProfile, per cache: the "
                    "functions by own time to <out>.<cache>.prof.txt")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    if a.kvq:
        sys.path.insert(0, os.path.abspath(a.kvq))
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    import kvq
    from kvq.commands import bench_e2e as B
    from kvq.integrations import attention as A

    cfg = B.llama_config(False, a.T + 4 * a.calls * a.rounds + 64)
    cfg.intermediate_size, cfg.vocab_size = 256, 256
    if a.layers:
        cfg.num_hidden_layers = a.layers
    n_layers = cfg.num_hidden_layers
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.float16)
    dev = a.device
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    Bn, T, H, Hq, D = a.B, a.T, 8, 32, 128
    g = torch.Generator(device=dev).manual_seed(1)
    k1 = torch.randn((Bn, H, 1, D), device=dev, dtype=torch.float16, generator=g)
    v1 = torch.randn((Bn, H, 1, D), device=dev, dtype=torch.float16, generator=g)
    q1 = torch.randn((Bn, Hq, 1, D), device=dev, dtype=torch.float16, generator=g)
    Kf = torch.randn((Bn, H, T, D), device=dev, dtype=torch.float16, generator=g)
    sdpa = lambda: F.scaled_dot_product_attention(q1, Kf, Kf, enable_gqa=True)  # noqa: E731
    out = {"kvq": os.path.dirname(kvq.__file__), "B": Bn, "T": T, "steps": a.calls, "rounds": a.rounds,
           "layers": n_layers,
           "card": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "rows": []}
    h, w = rounds(sdpa, 200, 2, sync)
    h, w = rounds(sdpa, 200, a.rounds, sync)
    out["sdpa"] = {"host_us": statistics.median(h), "wall_us": statistics.median(w), "host_rounds": h}
    print(json.dumps({"sdpa_host_us": round(out["sdpa"]["host_us"], 1)}), flush=True)
    mods = [layer.self_attn for layer in model.model.layers]
    for name in a.caches:
        try:
            cache = B.make(name, model, Bn, T, 4 * a.calls * a.rounds + 32)
            B.fill(cache, model, Bn, T, 4096)
            A.use_kvq_attention(model)
            pairs = list(zip(cache.layers, mods))

            def step():
                for layer, mod in pairs:
                    kk, vv = layer.update(k1, v1)
                    A.kvq_attention_forward(mod, q1, kk, vv, None, scaling=D ** -0.5)

            rounds(step, a.calls, 1, sync)                    # warm-up: compiles, plans
            h, w = rounds(step, a.calls, a.rounds, sync)
            h, w = [x / n_layers for x in h], [x / n_layers for x in w]
            row = {"cache": name, "host_us_per_layer": statistics.median(h),
                   "wall_us_per_layer": statistics.median(w), "host_rounds": h, "wall_rounds": w}
            if a.profile:
                profile(step, a.profile, sync, f"{a.out}.{name.replace(':', '-')}.prof.txt")
        except Exception as e:                                # noqa: BLE001 (a row's failure is recorded)
            row = {"cache": name, "error": f"{type(e).__name__}: {e}"[:400]}
        out["rows"].append(row)
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                          if not k.endswith("rounds")}), flush=True)
        cache = None
        if dev == "cuda":
            torch.cuda.empty_cache()
        with open(a.out, "w") as f:                          # after every row: a timeout keeps the rows done
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
