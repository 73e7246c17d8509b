"""End-to-end decode throughput at a fixed GPU memory budget (the Kitty paper's Fig. 5, on the tiny LM).

For each method, generate ``--gen-len`` tokens after a ``--prompt-len`` prompt with batch 1, 2, 4, ...
(or ``--batches``) until the batch no longer fits the memory budget: a compressed cache leaves room for
a larger batch, and the larger batch for more tokens per second. The budget covers everything the
process allocates (model weights + cache + activations), measured with
``torch.cuda.max_memory_allocated``; by default it is also enforced with
``torch.cuda.set_per_process_memory_fraction``, so a batch over the budget raises
``torch.cuda.OutOfMemoryError``, which is caught (the memory is freed and the method stops raising its
batch). A batch whose peak exceeds the budget without raising is marked as not fitting too.

The cache is ``kvq.integrations.transformers.make_cache(method, model, backend=...)`` passed as
``past_key_values=`` to ``model.generate`` (greedy, exactly ``--gen-len`` new tokens: EOS is suppressed
until then). This measures the Hugging Face integration path: each layer's update appends the new
tokens to the compressed state and attends over the cache returned dequantized to the model's dtype;
the fused decode kernels alone are timed by ``bench_*.py``. Per (method, batch): one warm-up generate of
``--warmup-tokens`` tokens with a fresh cache, then the timed generate with another fresh cache
(synchronized wall time); tokens/s = batch x gen_len / time; peak memory; the compressed cache's bytes
(``cache.memory_bytes()``) and preallocated bytes.

Calibrations: OSCAR and AQUA-KV read files written by ``kvq calibrate`` from ``--calib DIR``
(``*oscar*.safetensors``, ``*aqua*.safetensors``; or ``--calib-oscar`` / ``--calib-aqua FILE``). Without a
file OSCAR runs with the identity calibration (noted) and AQUA-KV is skipped (noted).

    python3 benchmarks/throughput_tiny_lm.py --model runs/tiny-lm --budget-gib 8 --prompt-len 1024 \\
        --gen-len 128 --calib runs/calib --out benchmarks/results/throughput.json
    python3 benchmarks/throughput_tiny_lm.py --cpu-smoke --out /tmp/throughput.json    # CPU, seconds

``--cpu-smoke``: a randomly initialized 2-layer byte-level Llama (or ``--model`` on the CPU), the
reference backend, batches 1 and 2, a 136-token prompt (KIVI / Kitty quantize a page) and 4 new
tokens; no memory budget (CPU memory is not measured). It checks the pipeline, not the speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import glob
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:                     # the device copy has no installed kvq package
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

DEFAULT_METHODS = ("FP16", "KIVI-K2V2", "KIVI-K4V4", "Kitty", "BitDecoding-2", "BitDecoding-4", "OSCAR", "AQUA-KV")
SMOKE = {"prompt_len": 136, "gen_len": 4, "batches": [1, 2], "warmup_tokens": 2}
GIB = 2**30


# ----------------------------------------------------------------------------------------------- setup

def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (benchmarks/train_tiny_lm.py) or hub id; "
                   "required unless --cpu-smoke")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help=f"kvq method names (default: {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--budget-gib", type=float, default=16.0,
                   help="GPU memory budget for model + cache + activations, GiB (default 16)")
    p.add_argument("--no-enforce", action="store_true",
                   help="only measure the peak against the budget; do not cap the allocator at it")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per sequence (default 1024)")
    p.add_argument("--gen-len", type=int, default=None, help="generated tokens per sequence (default 128)")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="batch sizes to try in order, stopping at the first that does not fit "
                        "(default: 1, 2, 4, ... up to --max-batch)")
    p.add_argument("--max-batch", type=int, default=4096, help="largest batch of the default doubling (4096)")
    p.add_argument("--warmup-tokens", type=int, default=None, help="tokens of the warm-up generate (default 8)")
    p.add_argument("--calib", default=None, help="directory with kvq calibrate files (*oscar*.safetensors, "
                   "*aqua*.safetensors)")
    p.add_argument("--calib-oscar", default=None, help="OSCAR calibration file (overrides --calib)")
    p.add_argument("--calib-aqua", default=None, help="AQUA-KV calibration file, HIGGS backbone (overrides --calib)")
    p.add_argument("--backend", default=None, choices=("auto", "reference", "triton", "cupy"),
                   help="kvq backend of the caches (default auto: Triton on CUDA; reference in --cpu-smoke)")
    p.add_argument("--dtype", default="float16", help="model dtype on the GPU (default float16)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run of the whole pipeline (for tests)")
    p.add_argument("--seed", type=int, default=0, help="seed of the smoke model's weights (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        for k, v in SMOKE.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
    else:
        if args.model is None:
            p.error("--model is required (a directory from benchmarks/train_tiny_lm.py), unless --cpu-smoke")
        args.prompt_len = 1024 if args.prompt_len is None else args.prompt_len
        args.gen_len = 128 if args.gen_len is None else args.gen_len
        args.warmup_tokens = 8 if args.warmup_tokens is None else args.warmup_tokens
    for name in ("prompt_len", "gen_len", "warmup_tokens", "max_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.batches is not None and any(b < 1 for b in args.batches):
        p.error("--batches must be positive")
    if args.budget_gib <= 0:
        p.error("--budget-gib must be positive")
    return args


def git_commit() -> str:
    """KVQ_COMMIT when set, else ``git rev-parse HEAD`` of this checkout (read-only), else "unknown"."""
    if os.environ.get("KVQ_COMMIT"):
        return os.environ["KVQ_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
        return head.stdout.strip() if head.returncode == 0 and head.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def smoke_model(seed: int):
    """A randomly initialized 2-layer byte-level Llama (2 query / 1 KV heads of dim 64) and its tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    from kvq.integrations.models import ByteTokenizer, tiny_llama_config

    torch.manual_seed(seed)
    cfg = tiny_llama_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                            num_hidden_layers=2, intermediate_size=256, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval(), ByteTokenizer()


def prompt_ids(tokenizer, batch: int, prompt_len: int):
    """(batch, prompt_len) int64 ids of real text: held-out stdlib bytes for the byte-level tokenizer,
    English prose otherwise; row b is the b-th window of the stream (cycled when it runs out)."""
    import torch

    from kvq.integrations.models import ByteTokenizer

    n = batch * prompt_len
    if isinstance(tokenizer, ByteTokenizer):
        from kvq.integrations.text import byte_tokens

        stream = byte_tokens("eval", max_tokens=n)
    else:
        from kvq.integrations.text import english_texts

        stream = np.asarray(tokenizer(" ".join(english_texts(max(20000, 8 * n))), add_special_tokens=False)
                            ["input_ids"], dtype=np.int64)
    if stream.size == 0:
        raise RuntimeError("no prompt text found")
    return torch.from_numpy(np.resize(stream, n).reshape(batch, prompt_len).copy())


# ----------------------------------------------------------------------------------------------- calibrations

def _find(directory, kind: str):
    """The one ``*<kind>*.safetensors`` file in ``directory`` (None when there is none)."""
    if directory is None:
        return None
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--calib {directory!r} is not a directory")
    files = sorted(f for f in glob.glob(os.path.join(directory, f"*{kind}*.safetensors"))
                   if kind != "aqua" or "uniform" not in os.path.basename(f))
    if len(files) > 1:
        raise ValueError(f"--calib {directory!r} holds several {kind} files ({', '.join(map(os.path.basename, files))});"
                         f" name one with --calib-{kind}")
    return files[0] if files else None


def calibrations(args, methods, model) -> tuple:
    """(calibration per method, config overrides per method, sources, notes, methods to skip)."""
    from kvq import calibration
    from kvq.integrations.models import attention_geometry

    g = attention_geometry(model)
    expect = {k: g[k] for k in ("n_layers", "kv_heads", "head_dim")}
    cal, ovr, src, notes, skip = {}, {}, {}, [], []
    if "OSCAR" in methods:
        path = args.calib_oscar or _find(args.calib, "oscar")
        if path:
            cal["OSCAR"], meta = calibration.load_oscar(path, expect=expect)
            src["OSCAR"] = {"file": os.path.abspath(path), "checksum": meta["checksum"]}
        else:
            cal["OSCAR"] = "identity"
            src["OSCAR"] = "identity"
            notes.append("OSCAR: no calibration file (--calib / --calib-oscar): identity calibration (no rotation)")
    if "AQUA-KV" in methods:
        path = args.calib_aqua or _find(args.calib, "aqua")
        if path:
            P, cfg, meta = calibration.load_aqua(path, expect=expect)
            cal["AQUA-KV"] = P
            ovr["AQUA-KV"] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "max_tokens"}
            src["AQUA-KV"] = {"file": os.path.abspath(path), "checksum": meta["checksum"]}
        else:
            skip.append("AQUA-KV")
            notes.append("AQUA-KV: skipped, no calibration file (run `kvq calibrate aqua`, then --calib DIR or "
                         "--calib-aqua FILE)")
    return cal, ovr, src, notes, skip


# ----------------------------------------------------------------------------------------------- measuring

def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _is_oom(e: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(e, (oom, torch.cuda.OutOfMemoryError)) or "out of memory" in str(e).lower()


def run_one(model, tokenizer, method: str, batch: int, args, device, calibration=None, overrides=None) -> dict:
    """One (method, batch) point: warm-up, then the timed generate. Returns the row; OOM is reported in
    it (``fits`` False, ``error`` "out of memory"), never raised."""
    import torch

    from kvq.integrations.transformers import make_cache

    row = {"method": method, "batch": batch, "fits": False, "tokens_per_s": None, "wall_s": None,
           "generated_tokens": None, "peak_mem_gib": None, "cache_bytes": None, "cache_allocated_bytes": None,
           "error": None}
    total = args.prompt_len + args.gen_len
    kw = dict(backend=args.backend, max_tokens=total, **(overrides or {}))
    if calibration is not None:
        kw["calibration"] = calibration
    gen = dict(do_sample=False, pad_token_id=_pad_id(tokenizer), eos_token_id=_eos_id(tokenizer))
    cache = out = ids = None
    try:
        ids = prompt_ids(tokenizer, batch, args.prompt_len).to(device)
        mask = torch.ones_like(ids)
        _free(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        cache = make_cache(method, model, **kw)                                    # warm-up
        model.generate(ids, attention_mask=mask, max_new_tokens=args.warmup_tokens,
                       min_new_tokens=args.warmup_tokens, past_key_values=cache, **gen)
        cache = None
        _free(device)
        cache = make_cache(method, model, **kw)                                    # timed
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.gen_len, min_new_tokens=args.gen_len,
                             past_key_values=cache, **gen)
        _sync(device)
        wall = time.perf_counter() - t0
        n_new = int(out.shape[1] - ids.shape[1])
        row.update(wall_s=wall, generated_tokens=n_new, tokens_per_s=batch * n_new / wall,
                   cache_bytes=int(cache.memory_bytes()),
                   cache_allocated_bytes=int(cache.store.allocated_bytes()) if cache.store is not None else None)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            row["peak_mem_gib"] = peak / GIB
            row["fits"] = peak <= args.budget_gib * GIB
            if not row["fits"]:
                row["error"] = f"peak {peak / GIB:.2f} GiB is over the {args.budget_gib:g} GiB budget"
        else:
            row["fits"] = True
        if n_new != args.gen_len:
            row["error"] = f"generated {n_new} tokens, expected {args.gen_len}"
    except Exception as e:                       # OOM: reported in the row; anything else too, with its type
        row["fits"] = False
        row["error"] = "out of memory" if _is_oom(e) else f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        row["oom"] = _is_oom(e)
    finally:
        del cache, out, ids
        _free(device)
    return row


def _pad_id(tokenizer):
    for name in ("pad_token_id", "eos_token_id", "sep_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None:
            return int(v)
    return 0


def _eos_id(tokenizer):
    v = getattr(tokenizer, "eos_token_id", None)
    return None if v is None else int(v)


def batch_sizes(args) -> list:
    """The batches to try: ``--batches`` or 1, 2, 4, ... up to ``--max-batch``."""
    if args.batches:
        return list(args.batches)
    out, b = [], 1
    while b <= args.max_batch:
        out.append(b)
        b *= 2
    return out


# ----------------------------------------------------------------------------------------------- main

def _print_table(res: dict) -> None:
    budget = "no memory budget" if res["budget_gib"] is None else f"a {res['budget_gib']:g} GiB budget"
    print(f"throughput at {budget} on {res['device_name']} ({res['device']}), "
          f"backend {res['backend']}, prompt {res['prompt_len']} + {res['gen_len']} new tokens; commit {res['commit']}")
    print(f"{'method':15s} {'batch':>6s} {'fits':>5s} {'tokens/s':>10s} {'wall s':>8s} {'peak GiB':>9s} "
          f"{'cache MiB':>10s}  note")
    for r in res["rows"]:
        def f(x, fmt):
            return "-" if x is None else format(x, fmt)
        print(f"{r['method']:15s} {r['batch']:6d} {str(r['fits']):>5s} {f(r['tokens_per_s'], '10.1f')} "
              f"{f(r['wall_s'], '8.2f')} {f(r['peak_mem_gib'], '9.2f')} "
              f"{f(None if r['cache_bytes'] is None else r['cache_bytes'] / 2**20, '10.2f')}  {r['error'] or ''}")
    print("\nbest per method (largest batch that fits):")
    for m, s in res["summary"].items():
        print(f"  {m:15s} batch {s['max_batch']}: {s['tokens_per_s']:.1f} tokens/s" if s["max_batch"]
              else f"  {m:15s} no batch fits")
    for n in res["notes"]:
        print(f"note: {n}")


def main(argv=None) -> dict:
    """Run the benchmark; returns (and writes with ``--out``) the result dict."""
    args = parse_args(argv)
    import torch
    import transformers

    import kvq
    from kvq.integrations.methods import METHODS
    from kvq.integrations.models import attention_geometry, load_model

    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"throughput_tiny_lm: unknown method {', '.join(unknown)}; known: {', '.join(METHODS)}")
    methods = list(dict.fromkeys(args.methods))
    notes = []
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.backend = args.backend or "reference"
        if args.model:
            model, tok = load_model(args.model, device="cpu", dtype="float32")
        else:
            model, tok = smoke_model(args.seed)
        notes.append("cpu smoke: CPU memory is not measured; no budget applies")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("throughput_tiny_lm: no CUDA GPU; run with --cpu-smoke on a CPU-only machine")
        device = torch.device("cuda", torch.cuda.current_device())     # an index: the memory fraction needs one
        args.backend = args.backend or "auto"
        model, tok = load_model(args.model, device="cuda", dtype=args.dtype)
        total = torch.cuda.get_device_properties(device).total_memory
        if args.budget_gib * GIB > total:
            raise SystemExit(f"throughput_tiny_lm: --budget-gib {args.budget_gib:g} exceeds the GPU's "
                             f"{total / GIB:.1f} GiB")
        if not args.no_enforce:
            torch.cuda.set_per_process_memory_fraction(args.budget_gib * GIB / total, device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda" and model_bytes > args.budget_gib * GIB:
        raise SystemExit(f"throughput_tiny_lm: the model alone takes {model_bytes / GIB:.2f} GiB, over the budget")
    cal, ovr, src, cal_notes, skip = calibrations(args, methods, model)
    notes += cal_notes

    from tqdm.auto import tqdm

    batches = batch_sizes(args)
    rows = []
    todo = [m for m in methods if m not in skip]
    bar = tqdm(total=len(todo) * len(batches), desc="throughput", unit="run", disable=args.quiet, file=sys.stderr)
    for m in todo:
        for b in batches:
            bar.set_postfix_str(f"{m} B={b}")
            row = run_one(model, tok, m, b, args, device, cal.get(m), ovr.get(m))
            rows.append(row)
            if args.quiet:                       # one line per point, so a log cut short still holds them
                print(json.dumps({k: row.get(k) for k in ("method", "batch", "fits", "tokens_per_s", "peak_gib")}),
                      flush=True)
            bar.update()
            if not row["fits"]:                  # does not fit (or failed): stop raising this method's batch
                bar.update(len(batches) - batches.index(b) - 1)
                break
    bar.close()
    summary = {}
    for m in todo:
        fit = [r for r in rows if r["method"] == m and r["fits"]]
        best = max(fit, key=lambda r: r["batch"]) if fit else None
        summary[m] = {"max_batch": best["batch"] if best else None,
                      "tokens_per_s": best["tokens_per_s"] if best else None,
                      "best_tokens_per_s": max((r["tokens_per_s"] for r in fit), default=None)}
    res = {
        "benchmark": "throughput_tiny_lm", "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else (platform.processor() or platform.machine() or "cpu"),
        "torch": torch.__version__, "transformers": transformers.__version__, "kvq_version": kvq.__version__,
        "commit": git_commit(), "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model or "random 2-layer byte-level Llama (cpu smoke)",
        "model_geometry": attention_geometry(model), "model_dtype": str(next(model.parameters()).dtype),
        "model_bytes": int(model_bytes), "budget_gib": None if args.cpu_smoke else args.budget_gib,
        "budget_enforced": device.type == "cuda" and not args.no_enforce, "backend": args.backend,
        "prompt_len": args.prompt_len, "gen_len": args.gen_len, "warmup_tokens": args.warmup_tokens,
        "batches": batches, "methods": methods, "skipped": skip, "calibrations": src, "notes": notes,
        "rows": rows, "summary": summary, "argv": list(sys.argv if argv is None else argv),
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if not args.quiet:
        _print_table(res)
    return res


if __name__ == "__main__":
    main()
