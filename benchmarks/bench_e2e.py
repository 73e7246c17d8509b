"""One decode step of a Llama-3.1-8B-shaped model with each cache: what a user of ``model(...)`` pays.

    python3 benchmarks/bench_e2e.py --out e2e.json                       # the default grid, on a CUDA GPU
    python3 benchmarks/bench_e2e.py --shapes 8x32768 --caches StaticCache KIVI-K2V2:triton KIVI-K2V2:cupy
    python3 benchmarks/bench_e2e.py --tiny --device cpu --shapes 1x64    # a 2-layer model, for a smoke test

The model has random fp16 weights (nothing to download): 32 layers, hidden 4096, 32 query / 8 KV heads of
dim 128, MLP 14336, vocabulary 128256 (``--tiny``: 2 layers of 4 / 2 heads of 64). Each cache is filled
through its own ``update`` with random keys and values (N(0, 1), fp16), layer by layer in chunks, to the
context; then one new token is decoded by ``model(input_ids, past_key_values=cache)`` with the model's
attention implementation set as a user of that cache would have it (``"kvq"`` for kvq caches, which
``make_cache`` sets; SDPA for transformers' caches). The step is timed by wall clock around the call with a
device synchronization on both sides (eager: Python included), median of ``--steps`` after ``--warmup``
(each step appends its token, so the context grows by one per step).

Caches: ``DynamicCache``, ``StaticCache`` (transformers' FP16 caches), ``quanto-2``, ``quanto-4``, ``HQQ-2``
(transformers' ``QuantizedCache``, where optimum-quanto / hqq are installed; residual 128), and kvq methods
as ``NAME:BACKEND`` (``KIVI-K2V2:triton``, ``BitDecoding-2:cupy``, ...). OSCAR and AQUA-KV are timed with
their "identity" calibrations (no calibration data: the same kernels and bytes as a calibrated cache).
Recorded per row: ms per step, tokens per second (batch / step), the cache's bytes at rest (allocator
growth while filling), the peak extra memory during a step, and the card. ``--max-batch`` adds, per cache,
the largest batch that fits the card at that context (from the measured bytes per sequence, confirmed by
running a step at it) and its tokens per second. Rows that do not fit are recorded as ``"oom"``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time

DEFAULT_SHAPES = ["8x32768", "1x32768", "1x131072", "32x32768", "8x8192", "1x8192", "32x8192"]   # the headline first
DEFAULT_CACHES = ["DynamicCache", "StaticCache", "quanto-2", "quanto-4", "HQQ-2",
                  "KIVI-K2V2:triton", "KIVI-K2V2:cupy", "KIVI-K4V4:triton", "KIVI-K4V4:cupy",
                  "Kitty:triton", "Kitty:cupy", "OSCAR:triton", "OSCAR:cupy",
                  "BitDecoding-2:triton", "BitDecoding-2:cupy", "AQUA-KV:triton"]


def llama_config(tiny: bool, max_pos: int):
    from transformers import LlamaConfig
    if tiny:
        return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           max_position_embeddings=max_pos, rope_theta=500000.0)
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=max_pos, rope_theta=500000.0)


def build_model(tiny: bool, device: str, max_pos: int):
    import torch
    from transformers import LlamaForCausalLM
    config = llama_config(tiny, max_pos)
    config._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16 if device != "cpu" else torch.float32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def make(name: str, model, batch: int, context: int, extra: int):
    """The cache named ``name`` for ``model`` (capacity context + extra tokens where it has one)."""
    import transformers
    from kvq.integrations.transformers import make_cache
    model.set_attn_implementation("sdpa")
    cfg = model.config
    if name == "DynamicCache":
        return transformers.DynamicCache(config=cfg)
    if name == "StaticCache":
        try:
            return transformers.StaticCache(config=cfg, max_cache_len=context + extra)
        except TypeError:
            return transformers.StaticCache(config=cfg, max_batch_size=batch, max_cache_len=context + extra)
    if name.startswith(("quanto-", "HQQ-")):
        backend, bits = name.split("-")
        return transformers.QuantizedCache(backend=backend.lower(), config=cfg, nbits=int(bits), residual_length=128)
    method, _, backend = name.partition(":")
    from kvq.integrations import methods as M
    calib = "identity" if M.get_method(method).calibration else None
    return make_cache(method, model, backend=backend or "auto", calibration=calib, max_tokens=context + extra)


def fill(cache, model, batch: int, context: int, chunk: int, seed: int = 0):
    """Put ``context`` random tokens into every layer of ``cache`` through its ``update``."""
    import torch
    c = model.config
    H, D = c.num_key_value_heads, getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    dev, dt = model.device, model.dtype
    g = torch.Generator(device=dev).manual_seed(seed)
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        pos = torch.arange(start, start + n, device=dev)
        for layer in range(c.num_hidden_layers):
            k = torch.randn((batch, H, n, D), generator=g, device=dev, dtype=dt)
            v = torch.randn((batch, H, n, D), generator=g, device=dev, dtype=dt)
            cache.update(k, v, layer, {"cache_position": pos})


def sync(device: str):
    import torch
    if device != "cpu":
        torch.cuda.synchronize()


def step_fn(model, cache, batch: int, context: int):
    """One decode step's call (a new token at position ``context + i`` for the i-th call)."""
    import torch
    dev = model.device
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=dev)
    count = [0]

    def step():
        p = context + count[0]
        count[0] += 1
        pos = torch.full((1,), p, device=dev, dtype=torch.long)
        with torch.no_grad():
            return model(input_ids=ids, past_key_values=cache, cache_position=pos,
                         position_ids=pos.expand(batch, 1), use_cache=True).logits
    return step


def run_one(model, name: str, batch: int, context: int, args) -> dict:
    import torch
    dev = args.device
    row = {"cache": name, "batch": batch, "context": context}
    gc.collect()
    if dev != "cpu":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
    cache = None
    try:
        cache = make(name, model, batch, context, args.warmup + args.steps + 1)
        fill(cache, model, batch, context, args.chunk)
        if ":" in name:                                      # kvq: the attention a kvq cache user runs
            from kvq.integrations.attention import use_kvq_attention
            use_kvq_attention(model)
        sync(dev)
        if dev != "cpu":
            row["cache_bytes"] = torch.cuda.memory_allocated() - base
        step = step_fn(model, cache, batch, context)
        for _ in range(args.warmup):
            step()
        sync(dev)
        if dev != "cpu":
            torch.cuda.reset_peak_memory_stats()
            at_rest = torch.cuda.memory_allocated()
        times = []
        for _ in range(args.steps):
            sync(dev)
            t0 = time.perf_counter()
            step()
            sync(dev)
            times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        row.update(ms_per_step=ms, tokens_per_s=batch / ms * 1e3, steps=len(times),
                   ms_min=1e3 * min(times), ms_max=1e3 * max(times))
        if dev != "cpu":
            row["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - at_rest
        if hasattr(cache, "memory_bytes"):
            row["fused"] = bool(cache.fused)
            row["kvq_memory_bytes"] = int(cache.memory_bytes())
            row["kvq_allocated_bytes"] = int(cache.store.allocated_bytes())
    except torch.cuda.OutOfMemoryError if dev != "cpu" else MemoryError:
        row["status"] = "oom"
    except ImportError as e:
        row["status"] = f"unavailable: {e}"
    finally:
        del cache
        gc.collect()
        if dev != "cpu":
            torch.cuda.empty_cache()
        model.set_attn_implementation("sdpa")
    row.setdefault("status", "ok")
    return row


def max_batch(model, name: str, context: int, per_seq: float, args) -> dict:
    """The largest batch that fits at ``context``: estimated from bytes per sequence, confirmed by a step."""
    import torch
    free = torch.cuda.mem_get_info()[0] - args.margin_gib * 2 ** 30
    b = max(1, int(free // per_seq))
    for _ in range(4):
        row = run_one(model, name, b, context, args)
        if row["status"] == "ok":
            return dict(row, max_batch=True)
        b = max(1, int(b * 0.85))
    return dict(row, max_batch=True)


def device_info(device: str) -> dict:
    import torch
    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "commit": os.environ.get("KVQ_COMMIT") or _git_commit()}
    try:
        import transformers
        import triton
        info.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    if device != "cpu":
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), memory_gib=round(p.total_memory / 2 ** 30, 1))
    else:
        info["device"] = "cpu"
    return info


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_shape(s: str) -> tuple[int, int]:
    try:
        b, t = s.lower().split("x")
        b, t = int(b), int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {s!r} must be BATCHxCONTEXT, e.g. 8x32768") from None
    if b <= 0 or t <= 0:
        raise argparse.ArgumentTypeError(f"shape {s!r}: batch and context must be positive")
    return b, t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES])
    ap.add_argument("--caches", nargs="+", default=DEFAULT_CACHES)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=4096, help="tokens per update while filling")
    ap.add_argument("--max-batch", type=int, default=None, metavar="CONTEXT",
                    help="also find the largest batch that fits at this context, per cache")
    ap.add_argument("--max-batch-caches", nargs="+", default=None,
                    help="the caches to size with --max-batch (default: all of --caches)")
    ap.add_argument("--margin-gib", type=float, default=3.0, help="memory left free when sizing --max-batch")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    import torch
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    max_ctx = max(t for _, t in args.shapes) + args.warmup + args.steps + 8
    model = build_model(args.tiny, args.device, max(max_ctx, args.max_batch or 0) + 64)
    info = device_info(args.device)
    print(f"# {info}", flush=True)
    rows = []

    def save():
        if args.out:                                 # after every row: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump({"info": info, "rows": rows}, f, indent=1)

    for batch, context in args.shapes:
        for name in args.caches:
            row = run_one(model, name, batch, context, args)
            rows.append(row)
            save()
            print(_line(row), flush=True)
    if args.max_batch:
        for name in args.max_batch_caches or args.caches:
            per = [r for r in rows if r["cache"] == name and r["status"] == "ok" and "cache_bytes" in r]
            if not per:
                continue
            r = max(per, key=lambda r: r["context"])
            per_seq = (r["cache_bytes"] + r.get("peak_extra_bytes", 0)) / r["batch"] * args.max_batch / r["context"]
            row = max_batch(model, name, args.max_batch, per_seq, args)
            rows.append(row)
            save()
            print(_line(row), flush=True)
    return 0


def _line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['cache']:>22} {r['batch']:>3} x {r['context']:>6}: {r['status']}"
    gib = lambda k: f"{r[k] / 2 ** 30:6.2f}" if k in r else "     -"  # noqa: E731
    return (f"{r['cache']:>22} {r['batch']:>3} x {r['context']:>6}: {r['ms_per_step']:8.2f} ms  "
            f"{r['tokens_per_s']:8.1f} tok/s  cache {gib('cache_bytes')} GiB  step +{gib('peak_extra_bytes')} GiB"
            + ("  (max batch)" if r.get("max_batch") else ""))


if __name__ == "__main__":
    raise SystemExit(main())
