"""Where a generate step goes with a kvq HF cache: torch.profiler over ``model.generate`` on the tiny LM.

    python3 benchmarks/profile_hf_cache.py --model /tmp/kvq-tiny-lm --methods DynamicCache FP16 KIVI-K2V2 --batch 8

Prints the wall time per new token and the top operators by self CPU and self CUDA time for each cache
("DynamicCache" is transformers' own, the baseline a user compares against).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--methods", nargs="+", default=["DynamicCache", "FP16", "KIVI-K2V2"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--rows", type=int, default=12)
    a = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    from kvq.integrations.models import load_model
    from kvq.integrations.transformers import make_cache

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = load_model(a.model, device=dev, dtype="float16" if dev == "cuda" else "float32")
    ids = torch.randint(0, 256, (a.batch, a.prompt_len), device=dev)
    gen = dict(do_sample=False, max_new_tokens=a.gen_len, min_new_tokens=a.gen_len, pad_token_id=0)

    def cache(m):
        return DynamicCache() if m == "DynamicCache" else make_cache(m, model, max_tokens=a.prompt_len + a.gen_len)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    for m in a.methods:
        model.generate(ids, past_key_values=cache(m), **gen)                     # warm-up
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, past_key_values=cache(m), **gen)
        if dev == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        with profile(activities=acts) as prof:
            model.generate(ids, past_key_values=cache(m), **gen)
            if dev == "cuda":
                torch.cuda.synchronize()
        print(f"=== {m}: {wall:.3f} s for {a.gen_len} tokens x batch {a.batch} (prefill {a.prompt_len} included)")
        key = "self_cuda_time_total" if dev == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
        if dev == "cuda":
            print(prof.key_averages().table(sort_by=key, row_limit=a.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
