"""kvq's Python per layer of an eager decode step, this tree against another in ONE process, rounds
interleaved (A B A B ...), so that the host's drift between processes (``layer_host.py``'s runs differed by up
to 1.6x for the same tree) cancels.

    python3 lab/2026-11-30-layer-host/ab_layer.py --before .before_pkg --out $OUT/ab_layer.json

``--before``: a directory holding the other tree's kvq renamed ``kvq_before`` (every ``kvq.`` import and module
string rewritten; NOTE.md gives the command). The model, fill and step are ``layer_host.py``'s (32 layers of
the Llama-3.1-8B's attention shapes, 1 x 32K, validation off): one step = ``update`` + kvq's attention
function for one new token in every layer. Per cache name, one cache from each tree on the same model; then
``--rounds`` pairs of rounds of ``--calls`` steps, the two trees alternating (which goes first alternates
too). Host us per layer = the host clock per step until the loop returns / 32 (wall agrees: the GPU waits
on the host at batch 1).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CACHES = ["KIVI-K2V2:triton", "Kitty:triton", "OSCAR:triton", "BitDecoding-2:triton", "KIVI-K2V2:cupy"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--caches", nargs="+", default=CACHES)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=30, help="steps per round")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per tree")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke test)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    sys.path.insert(0, os.path.abspath(a.before))
    import torch
    from transformers import LlamaForCausalLM

    trees = {"after": "kvq", "before": "kvq_before"}
    mods = {t: (importlib.import_module(f"{p}.commands.bench_e2e"), importlib.import_module(f"{p}.integrations.attention"))
            for t, p in trees.items()}
    B0 = mods["after"][0]
    steps_total = 2 * a.calls * (a.rounds + 1) + 32
    cfg = B0.llama_config(False, a.T + steps_total + 64)
    cfg.intermediate_size, cfg.vocab_size = 256, 256
    if a.layers:
        cfg.num_hidden_layers = a.layers
    cfg._attn_implementation = "sdpa"
    dev = a.device
    torch.set_default_dtype(torch.float16)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    n_layers, D = cfg.num_hidden_layers, 128
    g = torch.Generator(device=dev).manual_seed(1)
    k1, v1 = (torch.randn((1, 8, 1, D), device=dev, dtype=torch.float16, generator=g) for _ in range(2))
    q1 = torch.randn((1, 32, 1, D), device=dev, dtype=torch.float16, generator=g)
    attn = [layer.self_attn for layer in model.model.layers]
    out = {"T": a.T, "steps_per_round": a.calls, "rounds": a.rounds, "layers": n_layers,
           "card": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "trees": {t: os.path.dirname(importlib.import_module(p).__file__) for t, p in trees.items()}, "rows": []}
    for name in a.caches:
        row = {"cache": name}
        try:
            steps = {}
            for t, (B, A) in mods.items():
                cache = B.make(name, model, 1, a.T, steps_total)
                B.fill(cache, model, 1, a.T, 4096)
                A.use_kvq_attention(model)
                pairs = list(zip(cache.layers, attn))
                fwd = A.kvq_attention_forward

                def step(pairs=pairs, fwd=fwd):
                    for layer, mod in pairs:
                        kk, vv = layer.update(k1, v1)
                        fwd(mod, q1, kk, vv, None, scaling=D ** -0.5)

                steps[t] = (step, cache)
            host = {t: [] for t in trees}
            wall = {t: [] for t in trees}
            for t in trees:                                   # warm-up: compiles, plans
                for _ in range(a.calls):
                    steps[t][0]()
            for r in range(a.rounds):
                order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                for t in order:
                    fn = steps[t][0]
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        fn()
                    t1 = time.perf_counter()
                    sync()
                    t2 = time.perf_counter()
                    host[t].append((t1 - t0) / a.calls / n_layers * 1e6)
                    wall[t].append((t2 - t0) / a.calls / n_layers * 1e6)
            for t in trees:
                row[t] = {"host_us_per_layer": statistics.median(host[t]), "wall_us_per_layer": statistics.median(wall[t]),
                          "host_rounds": host[t], "wall_rounds": wall[t]}
            row["after_over_before"] = row["after"]["host_us_per_layer"] / row["before"]["host_us_per_layer"]
        except Exception as e:                                # noqa: BLE001 (a row's failure is recorded)
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        out["rows"].append(row)
        print(json.dumps({"cache": name, **{t: round(row[t]["host_us_per_layer"], 1) for t in trees if t in row},
                          "ratio": round(row.get("after_over_before", float("nan")), 3), "error": row.get("error")}),
              flush=True)
        steps = None
        if dev == "cuda":
            torch.cuda.empty_cache()
        with open(a.out, "w") as f:                          # after every row: a timeout keeps the rows done
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
