"""One decode step of a Llama-3.1-8B-shaped model with each cache: what a user of ``model(...)`` pays.

    kvq bench e2e --out e2e.json                                    # the default grid, on a CUDA GPU
    kvq bench e2e --shapes 8x32768 --caches StaticCache KIVI-K2V2:triton KIVI-K2V2:cupy
    kvq bench e2e --tiny --device cpu --shapes 1x64 --caches DynamicCache KIVI-K2V2:reference   # a smoke test
    python3 benchmarks/bench_e2e.py --out e2e.json                  # the same, from a checkout

The model has random fp16 weights (nothing to download): 32 layers, hidden 4096, 32 query / 8 KV heads of
dim 128, MLP 14336, vocabulary 128256 (``--tiny``: 2 layers of 4 / 2 heads of 64). Each cache is filled
through its own ``update`` with random keys and values (N(0, 1), fp16), layer by layer in chunks, to the
context; then one new token is decoded by ``model(input_ids, cache=cache)`` (``past_key_values=`` on
transformers without the new argument) with the model's
attention implementation set as a user of that cache would have it (``"kvq"`` for kvq caches, which
``make_cache`` sets; SDPA for transformers' caches). The step is timed by wall clock around the call with a
device synchronization on both sides (eager: Python included), median of ``--steps`` after ``--warmup``
(each step appends its token, so the context grows by one per step).

Caches: ``DynamicCache``, ``StaticCache`` (transformers' FP16 caches), ``quanto-2``, ``quanto-4``, ``HQQ-2``
(transformers' ``QuantizedCache``, where optimum-quanto / hqq are installed; residual 128), and kvq methods
as ``NAME:BACKEND`` (``KIVI-K2V2:triton``, ``BitDecoding-2:cupy``, ...; ``NAME`` alone is backend "auto").
OSCAR and AQUA-KV are timed with their "identity" calibrations (no calibration data: the same kernels and
bytes as a calibrated cache). Recorded per row: ms per step, tokens per second (batch / step), the cache's
bytes at rest (allocator growth from before the fill to after the warm-up steps; runs up to ``93fff11``
measured it right after the fill, which for AQUA-KV counts its filled tokens still waiting in fp16), the peak
extra memory during a step, and the card.
``--graph N`` adds the step's GPU time: the step captured once in a CUDA graph and replayed N times
(``graph_ms_per_step``; the same step at the same context, no Python in the way; a cache whose step cannot
be captured gets ``graph_status`` with the reason). ``--graphed N`` adds, for the kvq caches, N steps
through ``kvq.integrations.graphs`` (the model's step replayed from CUDA graphs, each layer's kvq work eager
between them: what ``graphs.generate`` runs; ``graphed_ms_per_step``, Python included). ``--max-batch`` adds, per cache, the largest batch that fits the card at that context (from the measured
bytes per sequence, confirmed by running a step at it) and its tokens per second. Rows that do not fit
are recorded as ``"oom"``; a transformers cache whose package is missing as ``"unavailable: ..."``; a row
that raises anything else as ``"failed: <error> [at file:line]"``, and the run goes on with the next row,
unless the failure took the CUDA context with it (an illegal memory access in a kernel): then the JSON's
``info["stopped"]`` says where, and the run ends with status 1.

On the CPU (``--device cpu``) the kvq caches run on the NumPy reference backend (``NAME:reference`` or
``NAME``); Triton only under ``TRITON_INTERPRET=1``, CuPy never. The default ``--caches`` on the CPU are
the reference-backend counterparts of the CUDA defaults.

Requests are checked before the model is built (:func:`validate`: device, shapes, cache names and
backends, ``--max-batch`` options, weights that fit in half the device's memory, ``--out`` writable); a
bad invocation ends in one line ``<prog>: error: <message>`` on stderr and exit status 2. The JSON (``--out``, rewritten after every row
so that a run cut short keeps what it measured) is ``{"info": {...}, "rows": [...]}``, what
``benchmarks/e2e_table.py`` reads.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time

from kvq.commands import CommandError, Parser, check_device, check_out_file, non_negative_float, \
    non_negative_int, positive_int, report

__all__ = ["DEFAULT_SHAPES", "DEFAULT_CACHES", "DEFAULT_CPU_CACHES", "TRANSFORMERS_CACHES", "llama_config",
           "build_model", "make", "fill", "step_fn", "step_tokens", "run_one", "device_alive", "graph_time",
           "graphed_time", "QUANTO_UNPACK_CODES", "quanto_batch_limit", "max_batch", "device_info", "parse_shape",
           "model_bytes", "check_cache_name", "add_arguments", "build_parser", "validate", "run", "execute", "main"]

DEFAULT_SHAPES = ["8x32768", "1x32768", "1x131072", "32x32768", "8x8192", "1x8192", "32x8192"]   # the headline first
DEFAULT_CACHES = ["DynamicCache", "StaticCache", "quanto-2", "quanto-4", "HQQ-2",
                  "KIVI-K2V2:triton", "KIVI-K2V2:cupy", "KIVI-K4V4:triton", "KIVI-K4V4:cupy",
                  "Kitty:triton", "Kitty:cupy", "OSCAR:triton", "OSCAR:cupy",
                  "BitDecoding-2:triton", "BitDecoding-2:cupy", "AQUA-KV:triton"]
#: the default ``--caches`` on the CPU: the kvq methods of DEFAULT_CACHES on the reference backend
DEFAULT_CPU_CACHES = list(dict.fromkeys(n.split(":")[0] + ":reference" if ":" in n else n for n in DEFAULT_CACHES))
#: transformers' caches by name (besides kvq's NAME[:BACKEND]); quantized ones as PACKAGE-BITS
TRANSFORMERS_CACHES = ("DynamicCache", "StaticCache")
QUANTIZED_BITS = {"quanto": (2, 4), "HQQ": (1, 2, 3, 4, 8)}      # what transformers' QuantizedCache accepts


# ---------------------------------------------------------------------------------------------------
# the model, the caches, one step


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
    """A LlamaForCausalLM with random weights on ``device`` (fp16 on a GPU, float32 on the CPU), SDPA."""
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
    """Put ``context`` random tokens into every layer of ``cache`` through its ``update``, each layer of a kvq
    cache that attends through kvq then told it was attended (``store.attended``), as the model's kvq
    attention does after each layer of a prefill: AQUA-KV commits there, so its tokens do not all wait in
    fp16 until the first step (which made its fill, not its cache, the memory limit)."""
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
            if getattr(cache, "attention", None) == "auto":
                cache.store.attended(layer)


def sync(device: str):
    import torch
    if device != "cpu":
        torch.cuda.synchronize()


def step_fn(model, cache, batch: int, context: int):
    """One decode step's call (a new token at position ``context + i`` for the i-th call)."""
    import torch

    from kvq.integrations.transformers import cache_argument
    dev = model.device
    # the token ids from a CPU generator: a failed capture of an earlier row (--graph) may leave the default
    # CUDA generator unusable ("Offset increment outside graph capture"), and every later row with it
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(batch)).to(dev)
    count = [0]
    arg = cache_argument(model)                  # "cache" on newer transformers 5, else "past_key_values"

    def step():
        p = context + count[0]
        count[0] += 1
        pos = torch.full((1,), p, device=dev, dtype=torch.long)
        with torch.no_grad():
            return model(input_ids=ids, **{arg: cache}, cache_position=pos,
                         position_ids=pos.expand(batch, 1), use_cache=True).logits
    return step


def run_one(model, name: str, batch: int, context: int, args) -> dict:
    """The row of cache ``name`` at ``batch`` x ``context``: filled, warmed up, ``args.steps`` steps timed."""
    import torch
    dev = args.device
    row = {"cache": name, "batch": batch, "context": context}
    gc.collect()
    if dev != "cpu":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
    cache = None
    try:
        graphed = getattr(args, "graphed", None) or 0
        cache = make(name, model, batch, context, step_tokens(args))
        fill(cache, model, batch, context, args.chunk)
        if ":" in name:                                      # kvq: the attention a kvq cache user runs
            from kvq.integrations.attention import use_kvq_attention
            use_kvq_attention(model)
        step = step_fn(model, cache, batch, context)
        for _ in range(args.warmup):
            step()
        sync(dev)
        if dev != "cpu":
            torch.cuda.reset_peak_memory_stats()
            at_rest = torch.cuda.memory_allocated()
            # at rest between steps, not right after the fill: AQUA-KV's filled tokens wait in fp16 until
            # the first step's attention commits them (Algorithm 4's order), four times its compressed bytes
            row["cache_bytes"] = at_rest - base
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
        if getattr(args, "graph", None):
            row.update(graph_time(step, args.graph))
        if graphed and ":" in name:
            row.update(graphed_time(model, cache, batch, graphed))
    except torch.cuda.OutOfMemoryError if dev != "cpu" else MemoryError:
        row["status"] = "oom"
    except ImportError as e:
        row["status"] = f"unavailable: {e}"
    except Exception as e:                                   # noqa: BLE001 - recorded in the row, the run goes on
        row["status"] = f"failed: {_err(e)}"                 # (run() stops if the device is lost with it)
    finally:
        step = cache = None                                  # the step's closure holds the cache too
        gc.collect()
        if dev != "cpu" and device_alive(dev):
            torch.cuda.empty_cache()
        model.set_attn_implementation("sdpa")
    row.setdefault("status", "ok")
    return row


def device_alive(device: str) -> bool:
    """False when ``device`` (a CUDA device) no longer takes work: a kernel's illegal memory access leaves the
    process's CUDA context unusable, and every later call fails (such a run must stop). True on the CPU."""
    if device == "cpu":
        return True
    import torch
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:                                        # noqa: BLE001 - any error here means the context is lost
        return False


def graph_time(step, replays: int) -> dict:
    """The GPU time of one decode step: ``step`` captured once in a CUDA graph (after one warm-up call on a
    side stream, as torch asks) and replayed ``replays`` times between two CUDA events. The replays repeat
    the captured step (the same token at the same context; the cache's host counters advanced once, by the
    capture; transformers' StaticCache counts its length on the device, so its replays write the next
    positions, as a generation would), so this is the step's GPU work with no Python in the way. Returns
    ``graph_ms_per_step`` (mean over the replays), or ``graph_status`` with the reason the capture failed
    (a host synchronization or an allocation the step cannot make while captured, for example)."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out = {"graph_ms_per_step": start.elapsed_time(end) / replays, "graph_replays": replays}
        del graph
        return out
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:                                   # noqa: BLE001 - recorded in the row
        try:
            torch.cuda.synchronize()
        except Exception as e2:                              # noqa: BLE001
            return {"graph_status": f"failed: {_err(e)}; then: {_err(e2)}"}
        return {"graph_status": f"failed: {_err(e)}"}


def graphed_time(model, cache, batch: int, steps: int) -> dict:
    """What a user of ``kvq.integrations.graphs`` pays per decode step: the model's step replayed from CUDA
    graphs with each layer's kvq work run eagerly between them (``DecodeGraphs``), Python included. The
    first step (eager, then the capture) is timed apart (``graphed_setup_ms``); then ``steps`` steps, each
    timed by wall clock with a device synchronization on both sides, as the eager rows are
    (``graphed_ms_per_step``, median), and the same number back to back with one synchronization at the end,
    as a generation runs them (``graphed_ms_per_step_pipelined``, mean). Each step appends its token, as a
    generation does. A step that cannot be recorded gets ``graphed_status`` with the reason."""
    import torch

    from kvq.integrations.graphs import DecodeGraphs
    dev = model.device
    # the tokens from a CPU generator: an earlier failed capture (--graph) may leave the CUDA generator unusable
    tok = torch.randint(0, model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(1)).to(dev)
    try:
        dg = DecodeGraphs(model, cache)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dg.step(tok)
        torch.cuda.synchronize()
        setup = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dg.step(tok)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(steps):
            dg.step(tok)
        torch.cuda.synchronize()
        piped = (time.perf_counter() - t0) / steps
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:                                   # noqa: BLE001 - recorded in the row
        return {"graphed_status": f"failed: {_err(e)}"}
    ms = 1e3 * statistics.median(times)
    return {"graphed_ms_per_step": ms, "graphed_ms_per_step_pipelined": 1e3 * piped,
            "graphed_tokens_per_s": batch / piped, "graphed_setup_ms": 1e3 * setup, "graphed_steps": steps,
            "graphed_pieces": dg.n_graphs}


def _err(e: BaseException, limit: int = 300) -> str:
    """One line for the JSON: the exception's type and message, and its innermost frame (file:line)."""
    import traceback
    msg = "".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " | ")
    tb = traceback.extract_tb(e.__traceback__)
    return msg[:limit] + (f" [at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}]" if tb else "")


def step_tokens(args) -> int:
    """Tokens a row appends after the fill: room for every step (warm-up, timed, ``--graph``'s warm-up and
    captured step and its replays: a StaticCache counts its length on the device, so each replay writes the
    next position; ``--graphed``'s first step and its two rounds of steps)."""
    graph = getattr(args, "graph", None) or 0
    graphed = getattr(args, "graphed", None) or 0
    return args.warmup + args.steps + 1 + (graph + 2 if graph else 0) + (2 * graphed + 2 if graphed else 0)


#: codes one tensor may hold in optimum-quanto's CUDA unpack: its kernels index with 32-bit ``int``, and past
#: 2^31 codes the 2-bit one writes wrong codes and strays (lab/2026-11-29-e2e-grid/NOTE.md, measured)
QUANTO_UNPACK_CODES = 2 ** 31


def quanto_batch_limit(tokens: int, kv_heads: int, head_dim: int) -> int:
    """The largest batch whose layer keys of ``tokens`` tokens stay within :data:`QUANTO_UNPACK_CODES` codes
    (transformers' QuantizedCache re-quantizes a layer's whole key tensor; 0 when not even one fits)."""
    return QUANTO_UNPACK_CODES // (tokens * kv_heads * head_dim)


def max_batch(model, name: str, context: int, per_seq: float, args) -> dict:
    """The largest batch that fits at ``context``: estimated from bytes per sequence, confirmed by a step.
    quanto caches are capped where optimum-quanto's unpack would overflow (:func:`quanto_batch_limit` over
    the row's whole length; the row's ``capped`` says so), since past it they corrupt memory, not run out."""
    import torch
    gc.collect()
    torch.cuda.empty_cache()                                 # what torch holds of earlier rows is free too
    free = torch.cuda.mem_get_info()[0] - args.margin_gib * 2 ** 30
    b = max(1, int(free // per_seq))
    capped = None
    if name.startswith("quanto-"):
        c = model.config
        limit = quanto_batch_limit(context + step_tokens(args), c.num_key_value_heads,
                                   getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        if limit < b:
            b, capped = limit, (f"at most {limit}: optimum-quanto's CUDA unpack indexes with 32-bit int and "
                                f"corrupts memory past 2^31 codes in one tensor (a layer's keys)")
        if b < 1:
            return {"cache": name, "batch": 0, "context": context, "status": f"failed: {capped}",
                    "max_batch": True, "capped": capped}
    for _ in range(4):
        row = run_one(model, name, b, context, args)
        if capped:
            row["capped"] = capped
        if row["status"] != "oom":                           # it fits, or it failed otherwise (recorded as is)
            return dict(row, max_batch=True)
        b = max(1, int(b * 0.85))
    return dict(row, max_batch=True)


def device_info(device: str) -> dict:
    """The JSON's ``info``: date, torch / transformers / triton versions, commit, the card (or "cpu")."""
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
    """The short HEAD of the git checkout kvq is imported from; "unknown" outside one (an installed kvq)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(root, ".git")):
        return "unknown"
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=root, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------------------------------------------
# command line


def parse_shape(s: str) -> tuple[int, int]:
    """``BATCHxCONTEXT`` (e.g. ``8x32768``) as ``(batch, context)``, both positive (an argparse type)."""
    try:
        b, t = s.lower().split("x")
        b, t = int(b), int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {s!r} must be BATCHxCONTEXT, e.g. 8x32768") from None
    if b <= 0 or t <= 0:
        raise argparse.ArgumentTypeError(f"shape {s!r}: batch and context must be positive")
    return b, t


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark's options on ``ap`` (shared by ``kvq bench e2e`` and ``benchmarks/bench_e2e.py``)."""
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES],
                    metavar="BATCHxCONTEXT", help=f"the shapes (default {' '.join(DEFAULT_SHAPES)})")
    ap.add_argument("--caches", nargs="+", default=None, metavar="CACHE",
                    help="DynamicCache, StaticCache, quanto-2, quanto-4, HQQ-N, or a kvq method as NAME[:BACKEND] "
                         "(backend auto, reference, triton or cupy); default: "
                         f"{' '.join(DEFAULT_CACHES)} (on the CPU, the kvq ones on the reference backend)")
    ap.add_argument("--device", default=None, help="cuda (default when available), cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    ap.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--steps", type=positive_int, default=6, help="timed steps, the median is recorded (default 6)")
    ap.add_argument("--chunk", type=positive_int, default=4096, help="tokens per update while filling")
    ap.add_argument("--max-batch", type=positive_int, default=None, metavar="CONTEXT",
                    help="also find the largest batch that fits at this context, per cache (CUDA only)")
    ap.add_argument("--max-batch-caches", nargs="+", default=None, metavar="CACHE",
                    help="the caches to size with --max-batch (default: all of --caches)")
    ap.add_argument("--margin-gib", type=non_negative_float, default=3.0,
                    help="memory left free when sizing --max-batch")
    ap.add_argument("--graph", type=positive_int, default=None, metavar="REPLAYS",
                    help="also time the step's GPU work: capture one decode step in a CUDA graph and replay it "
                         "REPLAYS times (the same step at the same context; CUDA only)")
    ap.add_argument("--graphed", type=positive_int, default=None, metavar="STEPS",
                    help="also time STEPS decode steps of each kvq cache through kvq.integrations.graphs (the "
                         "model's step replayed from CUDA graphs, kvq's work eager between them; CUDA only)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    return ap


def build_parser(prog: str | None = "kvq bench e2e") -> Parser:
    """The benchmark's parser (``prog`` None: the script's name, as argparse has it)."""
    return add_arguments(Parser(prog=prog, description=__doc__.split("\n")[0]))


def model_bytes(tiny: bool, device: str) -> int:
    """Bytes of :func:`build_model`'s weights (fp16 on a GPU, float32 on the CPU), from the config."""
    c = llama_config(tiny, 1)
    h, D, L = c.hidden_size, c.head_dim, c.num_hidden_layers
    per_layer = (2 * c.num_attention_heads * D * h + 2 * c.num_key_value_heads * D * h + 3 * h * c.intermediate_size
                 + 2 * h)
    params = 2 * c.vocab_size * h + L * per_layer + h              # untied embedding and head, final norm
    return params * (4 if device == "cpu" else 2)


def _device_memory(device: str) -> int | None:
    """Bytes of memory of ``device`` (the card's, or the machine's RAM); None when unknown."""
    if device != "cpu":
        import torch

        index = torch.device(device).index
        return int(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
                   .total_memory)
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_cache_name(name: str, device: str, option: str = "--caches", prog: str = "kvq bench e2e") -> None:
    """CommandError unless ``name`` is a cache this benchmark can build and run on ``device``: one of
    ``TRANSFORMERS_CACHES``, ``quanto-{2,4}`` / ``HQQ-{1,2,3,4,8}``, or ``METHOD[:BACKEND]`` with a kvq
    method and backend (on the CPU: the reference, or Triton under its interpreter; CuPy needs CUDA).
    A transformers quantized cache whose package is missing is not refused: its row says "unavailable"."""
    if name in TRANSFORMERS_CACHES:
        return
    m = re.fullmatch(r"(quanto|HQQ)-(\d+)", name)
    if m:
        bits = QUANTIZED_BITS[m.group(1)]
        if int(m.group(2)) not in bits:
            raise CommandError(f"{option} {name!r}: {m.group(1)} takes {', '.join(map(str, bits))} bits", prog)
        return
    from kvq.integrations import methods as M

    method, colon, backend = name.partition(":")
    if method not in M.METHODS:
        raise CommandError(f"{option} {name!r}: unknown cache; expected {', '.join(TRANSFORMERS_CACHES)}, "
                           f"quanto-N, HQQ-N or a kvq method as NAME[:BACKEND] (methods: {', '.join(M.METHODS)})",
                           prog)
    if colon and backend not in M.BACKENDS:
        raise CommandError(f"{option} {name!r}: unknown backend {backend!r}; expected one of "
                           f"{', '.join(M.BACKENDS)}", prog)
    if device != "cpu":
        return
    if backend == "cupy":
        raise CommandError(f"{option} {name!r}: the cupy backend needs a CUDA device (on the CPU use "
                           f"{method}:reference)", prog)
    if backend == "triton":
        from kvq.fast import triton_interpreting
        if not triton_interpreting():
            raise CommandError(f"{option} {name!r}: the triton backend needs a CUDA device, or Triton's CPU "
                               f"interpreter (TRITON_INTERPRET=1); on the CPU use {method}:reference", prog)


def validate(args, prog: str = "kvq bench e2e") -> None:
    """Every check of the parsed ``args`` before any work; resolves ``args.device`` (cuda when torch sees a
    GPU, else cpu) and ``args.caches`` (the defaults for that device). CommandError."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        raise CommandError(f"needs torch and transformers ({e}); pip install 'kvq[fast,hf]'", prog) from None
    check_device(args.device, "--device", prog)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    caches = args.caches if args.caches is not None else (DEFAULT_CPU_CACHES if device == "cpu" else DEFAULT_CACHES)
    for name in caches:
        check_cache_name(name, device, "--caches", prog)
    if args.max_batch is None:
        if args.max_batch_caches is not None:
            raise CommandError("--max-batch-caches: needs --max-batch CONTEXT (the context to size the batch at)",
                               prog)
    else:
        if device == "cpu":
            raise CommandError("--max-batch: sizes the batch to a CUDA card's free memory; needs --device cuda",
                               prog)
        unknown = [n for n in args.max_batch_caches or () if n not in caches]
        if unknown:
            raise CommandError(f"--max-batch-caches {' '.join(unknown)}: not among --caches (each is sized from "
                               f"its measured rows)", prog)
    if args.graph is not None and device == "cpu":
        raise CommandError("--graph: times a CUDA-graph replay of the step; needs --device cuda", prog)
    if getattr(args, "graphed", None) is not None and device == "cpu":
        raise CommandError("--graphed: replays the step from CUDA graphs; needs --device cuda", prog)
    weights, mem = model_bytes(args.tiny, device), _device_memory(device)
    if mem is not None and 2 * weights > mem:
        raise CommandError(f"--device {device}: the{' tiny' if args.tiny else ''} model's weights take "
                           f"{weights / 2 ** 30:.3g} GiB ({'float32' if device == 'cpu' else 'fp16'}), more than "
                           f"half of the {mem / 2 ** 30:.3g} GiB of this device"
                           + ("" if args.tiny else "; use --tiny for a 2-layer model"), prog)
    check_out_file(args.out, "--out", prog)
    args.device, args.caches = device, list(caches)


def run(args) -> int:
    """Build the model, time every (shape, cache), then the --max-batch rows; print a line per row and
    rewrite ``args.out`` after each. ``args`` as :func:`validate` left them. Returns 0, or 1 when a failed
    row took the device with it (``info["stopped"]``)."""
    max_ctx = max(t for _, t in args.shapes) + args.warmup + args.steps + 8
    model = build_model(args.tiny, args.device, max(max_ctx, args.max_batch or 0) + 64)
    info = device_info(args.device)
    print(f"# {info}", flush=True)
    rows = []

    def save():
        if args.out:                                 # after every row: a run cut short keeps what it measured
            folder = os.path.dirname(os.path.abspath(args.out))
            os.makedirs(folder, exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"info": info, "rows": rows}, f, indent=1)

    def lost(row) -> bool:
        """After a failed row: True (and the run's ``info["stopped"]`` set) when the device is lost with it."""
        if not row["status"].startswith("failed") or device_alive(args.device):
            return False
        info["stopped"] = (f"the CUDA context was lost at {row['cache']} {row['batch']} x {row['context']} "
                           f"({row['status']}); the rows after it were not run")
        save()
        print(f"# {info['stopped']}", flush=True)
        return True

    for batch, context in args.shapes:
        for name in args.caches:
            row = run_one(model, name, batch, context, args)
            rows.append(row)
            save()
            print(_line(row), flush=True)
            if lost(row):
                return 1
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
            if lost(row):
                return 1
    return 0


def execute(args, prog: str = "kvq bench e2e") -> int:
    """Validate then run the parsed ``args``; a bad invocation: one line on stderr, status 2."""
    try:
        validate(args, prog)
    except CommandError as e:
        return report(e)
    return run(args)


def main(argv=None, prog: str | None = "kvq bench e2e") -> int:
    """``kvq bench e2e [options]`` (``prog`` None: the script's name); returns the exit status (0, or 2
    for a bad invocation)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:                                 # --help (0) or a usage error (2)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    return execute(args, parser.prog)


def _line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['cache']:>22} {r['batch']:>3} x {r['context']:>6}: {r['status']}"
    gib = lambda k: f"{r[k] / 2 ** 30:6.2f}" if k in r else "     -"  # noqa: E731
    return (f"{r['cache']:>22} {r['batch']:>3} x {r['context']:>6}: {r['ms_per_step']:8.2f} ms  "
            f"{r['tokens_per_s']:8.1f} tok/s  cache {gib('cache_bytes')} GiB  step +{gib('peak_extra_bytes')} GiB"
            + (f"  graph {r['graph_ms_per_step']:7.2f} ms" if "graph_ms_per_step" in r else "")
            + (f"  graph {r['graph_status']}" if "graph_status" in r else "")
            + ("  (max batch)" if r.get("max_batch") else ""))


if __name__ == "__main__":
    raise SystemExit(main())
