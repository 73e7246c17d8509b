"""``kvq bench quant|decode|e2e``: time kvq's kernels (and a model's decode step) from an installed package,
on the CPU or a CUDA GPU.

``quant``: quantize + pack and unpack + dequantize (``kvq.reference.packing`` on the CPU,
``kvq.fast.quantize_pack`` / ``unpack_dequantize`` on the GPU) of an fp16 tensor (B, H, T, D) in KIVI's
two layouts: values per token (groups of G channels, packed along channels) and keys per channel
(groups of G tokens, packed along tokens), at 2 and 4 bits. Bytes moved: the fp16 tensor + the packed
codes + scale + min (the minimum, each once; the same count both ways).

``decode``: one decode step (T_q = 1) of attention over a cache of T tokens per method: FP16
(``attention.decode_attention`` over the fp16 K / V), KIVI-K2V2, Kitty, OSCAR (identity calibration) and
BitDecoding-2 (BitDecoding-KC2) by default, each ``<module>.decode_attention`` of ``kvq.reference`` or
``kvq.fast.<backend>``, the cache filled by the method's own ``append``. Bytes moved: the cached tokens
in the method's state (``kvq.integrations.methods.bits_per_element``, "state" accounting: FP16 sink /
buffers / windows at 16 bits, quantized tokens at their payload + metadata) + q + out.

Times are medians over ``--repeats`` timed calls after ``--warmup`` calls: CUDA events around each call
on the GPU (synchronized; inputs rotated over copies that together exceed 4x the L2 cache where one
copy is smaller), ``time.perf_counter`` on the CPU. GB/s = bytes / median. The fast tier's input
validation is off while timing (production setting). On the CPU only the reference backend runs:
Triton's interpreter and CuPy are not benchmarks. Timings are measurements, never assertions.
Requests are checked before any tensor is allocated (:func:`validate`: device, shape, group size, methods,
``--out``, inputs that fit the device); one that cannot be served ends in one line and exit status 2.

    kvq bench quant                                    # CPU, NumPy reference, small shape (seconds)
    kvq bench decode --device cuda --backend cupy --shape 8,32,8,32768,128 --json
    kvq bench quant --device cuda --repeats 50 --out results/quant.json

``e2e``: one decode step of a Llama-3.1-8B-shaped model (random weights; ``--tiny``: 2 layers) through
``model(...)`` with each cache, transformers' and kvq's (:mod:`kvq.commands.bench_e2e`, also
``benchmarks/bench_e2e.py``; its own options and JSON, ``{"info", "rows"}``).

    kvq bench e2e --out e2e.json                       # the default grid, on a CUDA GPU
    kvq bench e2e --tiny --device cpu --shapes 1x64 --caches DynamicCache KIVI-K2V2:reference --steps 2
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np

from kvq.commands import emit

__all__ = ["DEFAULT_SHAPES", "DECODE_METHODS", "DEFAULT_DECODE_METHODS", "median", "bench_quant", "bench_decode",
           "environment", "git_commit", "build_parser", "validate", "main"]

#: default shapes per (command, device): quant (B, H, T, D); decode (B, H_q, H_kv, T, D)
DEFAULT_SHAPES = {
    ("quant", "cpu"): (1, 8, 2048, 128),
    ("quant", "cuda"): (8, 8, 16384, 128),
    ("decode", "cpu"): (1, 8, 2, 4096, 128),
    ("decode", "cuda"): (8, 32, 8, 32768, 128),
}
DEFAULT_REPEATS = {"cpu": 10, "cuda": 50}
#: the methods ``kvq bench decode`` can time (registry names of ``kvq.integrations.methods``)
DECODE_METHODS = ("FP16", "KIVI-K2V2", "KIVI-K2V2*", "KIVI-K4V4", "Kitty", "Kitty-Pro", "OSCAR", "BitDecoding-2",
                  "BitDecoding-4")
DEFAULT_DECODE_METHODS = ("FP16", "KIVI-K2V2", "Kitty", "OSCAR", "BitDecoding-2")
LAYOUTS = (("values_per_token", -1), ("keys_per_channel", 2))
FAST_BACKENDS = ("triton", "cupy")
CHECK_TOL = 1e-2            # max |o - o_ref| / max |o_ref| of a decode call against float64 over its cache


class BenchError(ValueError):
    """A request the benchmark cannot serve (device, backend, shape, method), with the reason."""


# ---------------------------------------------------------------------------------------------------
# environment


def git_commit() -> str | None:
    """``KVQ_COMMIT`` when set; else HEAD of the git checkout kvq is imported from (with "-dirty" when
    tracked files changed); None for an installed package outside a checkout."""
    if os.environ.get("KVQ_COMMIT"):
        return os.environ["KVQ_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}             # read-only: never refresh the index
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, env=env)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, env=env)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: str) -> dict:
    """Device name and properties, library versions, kvq version and commit, date."""
    import kvq

    info = {"kvq_version": kvq.__version__, "commit": git_commit(), "python": platform.python_version(),
            "numpy": np.__version__,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device == "cuda":
        import torch

        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["device"] = {"type": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}",
                          "sm_count": p.multi_processor_count, "total_memory_bytes": int(p.total_memory),
                          "l2_bytes": _l2_bytes()}
        info["torch"] = torch.__version__
        for mod in ("triton", "cupy"):
            try:
                info[mod] = importlib.import_module(mod).__version__
            except Exception as e:                              # not installed / broken: recorded, not fatal
                info[mod] = f"unavailable ({type(e).__name__})"
    else:
        info["device"] = {"type": "cpu", "name": platform.processor() or platform.machine(),
                          "cpu_count": os.cpu_count()}
    return info


def _l2_bytes() -> int:
    import torch

    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(p, "L2_cache_size", 0) or 50 * 2**20)


def _copies(nbytes: int, device: str, max_copies: int = 16) -> int:
    """Input copies to rotate over so that one call's inputs are not still in L2 from the last call."""
    if device != "cuda" or nbytes <= 0:
        return 1
    return int(min(max_copies, max(1, math.ceil(4 * _l2_bytes() / nbytes))))


# ---------------------------------------------------------------------------------------------------
# timing


def median(xs) -> float:
    """The median of a non-empty sequence of numbers."""
    s = sorted(xs)
    n = len(s)
    return float(s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)


def time_calls(fn, n_inputs: int, *, device: str, repeats: int, warmup: int) -> list:
    """Per-call milliseconds of ``fn(i)`` (i = call index modulo ``n_inputs``): CUDA events after a
    synchronize on the GPU, ``perf_counter`` on the CPU; ``warmup`` untimed calls first."""
    for i in range(warmup):
        fn(i % n_inputs)
    out = []
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        for i in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i % n_inputs)
            end.record()
            end.synchronize()
            out.append(float(start.elapsed_time(end)))
        return out
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i % n_inputs)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _stats(ms: list, nbytes: int) -> dict:
    med = median(ms)
    return {"median_ms": med, "min_ms": float(min(ms)), "max_ms": float(max(ms)), "repeats": len(ms),
            "bytes": int(nbytes), "gb_per_s": nbytes / (med * 1e-3) / 1e9 if med > 0 else None}


def _nbytes(*arrays) -> int:
    total = 0
    for a in arrays:
        total += int(a.nbytes) if hasattr(a, "nbytes") else int(a.numel() * a.element_size())
    return total


def _bar(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="case", disable=not progress, file=sys.stderr)


# ---------------------------------------------------------------------------------------------------
# quant


def _random_fp16(shape, device: str, seed: int):
    """A standard-normal fp16 array (CPU: NumPy) or tensor (CUDA) of ``shape``."""
    if device == "cuda":
        import torch

        g = torch.Generator(device="cuda").manual_seed(seed)
        return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).half()
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(np.float16)


def _check_quant(shape, group_size) -> None:
    """BenchError unless ``group_size`` is a positive int dividing D and T of ``shape`` (B, H, T, D)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise BenchError(f"--group-size must be a positive integer, got {group_size!r}")
    B, H, T, D = shape
    for name, n in (("D (channels)", D), ("T (tokens)", T)):
        if n % group_size:
            raise BenchError(f"--group-size {group_size} must divide {name} = {n} of --shape {B},{H},{T},{D}")


def _check_decode(shape, methods) -> None:
    """BenchError unless H_q is a multiple of H_kv in ``shape`` (B, H_q, H_kv, T, D) and every method is one
    ``kvq bench decode`` can time."""
    B, Hq, Hkv, T, D = shape
    if Hq % Hkv:
        raise BenchError(f"H_q = {Hq} must be a multiple of H_kv = {Hkv} (grouped-query attention)")
    bad = [m for m in methods if m not in DECODE_METHODS]
    if bad:
        raise BenchError(f"kvq bench decode cannot time {', '.join(map(repr, bad))}; methods: "
                         f"{', '.join(DECODE_METHODS)} (AQUA-KV predicts across layers: time it with a model, "
                         f"benchmarks/throughput_tiny_lm.py)")


def bench_quant(shape, *, device: str = "cpu", backend: str = "reference", bits=(2, 4), group_size: int = 128,
                repeats: int = 10, warmup: int = 2, progress: bool = True) -> list:
    """Rows {op, layout, axis, group_size, bits, median_ms, ..., bytes, gb_per_s} for quantize_pack and
    unpack_dequantize of an fp16 (B, H, T, D) tensor in each KIVI layout at each bit width."""
    _check_quant(shape, group_size)
    B, H, T, D = shape
    if backend == "reference":
        from kvq.reference import packing as P

        def qp(x, b, axis):
            return P.quantize_pack(x, b, group_size, axis)

        def ud(p, s, m, b, axis):
            return P.unpack_dequantize(p, s, m, b, group_size, axis)
    else:
        import kvq.fast as F

        def qp(x, b, axis):
            return F.quantize_pack(x, b, group_size, axis, backend=backend)

        def ud(p, s, m, b, axis):
            return F.unpack_dequantize(p, s, m, b, group_size, axis, backend=backend)

    n = _copies(B * H * T * D * 2, device)
    xs = [_random_fp16(shape, device, seed) for seed in range(n)]
    rows = []
    with _bar(len(LAYOUTS) * len(bits) * 2, "bench quant", progress) as bar:
        for layout, axis in LAYOUTS:
            for b in bits:
                packed = [qp(x, b, axis) for x in xs]                              # also checks the request
                nbytes = _nbytes(xs[0], *packed[0])
                ms = time_calls(lambda i: qp(xs[i], b, axis), n, device=device, repeats=repeats, warmup=warmup)
                rows.append({"op": "quantize_pack", "layout": layout, "axis": axis, "group_size": group_size,
                             "bits": b, **_stats(ms, nbytes)})
                bar.update()
                ms = time_calls(lambda i: ud(*packed[i], b, axis), n, device=device, repeats=repeats,
                                warmup=warmup)
                rows.append({"op": "unpack_dequantize", "layout": layout, "axis": axis, "group_size": group_size,
                             "bits": b, **_stats(ms, nbytes)})
                bar.update()
    return rows


# ---------------------------------------------------------------------------------------------------
# decode


def _module(family_module: str, backend: str):
    if backend == "reference":
        return importlib.import_module(f"kvq.reference.{family_module}")
    return importlib.import_module(f"kvq.fast.{backend}.{family_module}")


def _exact_attention(q, k, v) -> np.ndarray:
    """float64 attention of batch element 0 (GQA: query head h reads KV head h // (H_q / H_kv)): (H_q, T_q, D).
    Only element 0 is converted, so the check stays cheap at GPU sizes."""
    q, k, v = (_to_numpy(a[:1]).astype(np.float64) for a in (q, k, v))
    Hq, Hkv = q.shape[1], k.shape[1]
    kk, vv = np.repeat(k, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)
    s = q @ kk.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return ((p / p.sum(axis=-1, keepdims=True)) @ vv)[0]


def _to_numpy(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    return a.detach().float().cpu().numpy()


def _decode_row(name: str, q, k, v, *, device: str, backend: str, repeats: int, warmup: int) -> dict:
    """Build ``name``'s cache over k, v (copies rotated on the GPU when one is smaller than 4x L2), check
    one decode call against float64 over the cache's contents, then time it."""
    from kvq.integrations import methods as M
    from kvq.reference import oscar as reference_oscar

    B, Hkv, T, D = k.shape
    spec = M.get_method(name)
    if spec.family == "fp16":
        attn = _module("attention", backend)
        bpe = 16.0
        n = _copies(_nbytes(k, v), device, max_copies=8)
        kvs = [(k, v)] + [(k.clone(), v.clone()) for _ in range(n - 1)]

        def call(i):
            return attn.decode_attention(q, [kvs[i]])
        K_hat, V_hat = k, v
    else:
        try:
            cfg = M.configure(name, head_dim=D, max_tokens=T, kv_heads=Hkv)
        except ValueError as e:
            raise BenchError(str(e)) from None
        mod = _module(spec.module, backend)
        extra = (reference_oscar.identity_calibration(D),) if spec.family == "oscar" else ()
        bpe = M.bits_per_element(name, cfg, context=T, head_dim=D, kv_heads=Hkv, n_layers=1, accounting="state")
        n = _copies(int(bpe * 2 * B * Hkv * T * D / 8), device, max_copies=8)
        states = []
        for _ in range(n):
            st = mod.init(cfg, B, Hkv, D)
            mod.append(cfg, *extra, st, k, v)
            states.append(st)

        def call(i):
            return mod.decode_attention(cfg, *extra, states[i], q)
        K_hat, V_hat = mod.dequantize(cfg, *extra, states[0])                      # (B, H_kv, T, D)
    out, _ = call(0)
    ref = _exact_attention(q, K_hat, V_hat)                                        # (H_q, 1, D) float64
    o = _to_numpy(out[:1]).astype(np.float64)[0]
    err = float(np.abs(o - ref).max() / np.abs(ref).max()) if np.all(np.isfinite(o)) else float("inf")
    del K_hat, V_hat
    nbytes = int(round(bpe * 2 * B * Hkv * T * D / 8)) + _nbytes(q, out)
    ms = time_calls(call, n, device=device, repeats=repeats, warmup=warmup)
    return {"method": name, "family": spec.family, "bits_per_element": float(bpe), **_stats(ms, nbytes),
            "copies": n, "check_rel_err": err, "valid": bool(err <= CHECK_TOL),
            "calibration": "identity" if spec.family == "oscar" else None}


def bench_decode(shape, *, device: str = "cpu", backend: str = "reference", methods=DEFAULT_DECODE_METHODS,
                 repeats: int = 10, warmup: int = 2, progress: bool = True) -> list:
    """Rows {method, family, bits_per_element, median_ms, ..., bytes, gb_per_s, speedup_vs_fp16, check_rel_err,
    valid} for one decode step of each method over a cache of T tokens (B, H_q, H_kv, T, D = ``shape``).

    Before timing, the call's output on batch element 0 is checked against float64 attention over what
    the cache holds (the method's ``dequantize``; FP16: the K / V themselves): ``check_rel_err`` =
    max |o - o_ref| / max |o_ref|, ``valid`` when it is at most ``CHECK_TOL`` (1e-2)."""
    _check_decode(shape, methods)
    B, Hq, Hkv, T, D = shape
    q = _random_fp16((B, Hq, 1, D), device, 100)
    k = _random_fp16((B, Hkv, T, D), device, 101)
    v = _random_fp16((B, Hkv, T, D), device, 102)
    rows, fp16_ms = [], None
    with _bar(len(methods), "bench decode", progress) as bar:
        for name in methods:
            bar.set_postfix_str(name)
            rows.append(_decode_row(name, q, k, v, device=device, backend=backend, repeats=repeats, warmup=warmup))
            if rows[-1]["family"] == "fp16":
                fp16_ms = rows[-1]["median_ms"]
            bar.update()
            if device == "cuda":
                import torch

                torch.cuda.empty_cache()
    for row in rows:
        row["speedup_vs_fp16"] = fp16_ms / row["median_ms"] if fp16_ms and row["median_ms"] > 0 else None
    return rows


# ---------------------------------------------------------------------------------------------------
# command line


def _parse_shape(text: str, n: int, what: str) -> tuple:
    try:
        vals = tuple(int(t) for t in text.replace("x", ",").split(",") if t.strip())
    except ValueError:
        vals = ()
    if len(vals) != n or any(v <= 0 for v in vals):
        raise BenchError(f"--shape {text!r}: {what} needs {n} positive integers separated by commas")
    return vals


def build_parser() -> argparse.ArgumentParser:
    """The ``kvq bench`` argument parser (subcommands ``quant``, ``decode`` and ``e2e``)."""
    from kvq.commands import Parser, bench_e2e, non_negative_int, positive_int

    p = Parser(prog="kvq bench", description="Time kvq's quantize / pack and decode-attention "
               "kernels on the CPU (NumPy reference) or a CUDA GPU (Triton / CuPy), and a model's decode step "
               "with each cache (e2e).")
    sub = p.add_subparsers(dest="what", required=True, metavar="{quant,decode,e2e}")

    def common(sp, shape_help):
        sp.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to run (default cpu)")
        sp.add_argument("--backend", default=None, choices=("reference",) + FAST_BACKENDS,
                        help="reference (NumPy, CPU only) | triton | cupy (CUDA only); default: reference on "
                             "the CPU, triton on CUDA")
        sp.add_argument("--shape", default=None, help=shape_help)
        sp.add_argument("--repeats", type=positive_int, default=None,
                        help="timed calls per case (default 10 CPU, 50 CUDA)")
        sp.add_argument("--warmup", type=non_negative_int, default=2, help="untimed calls first (default 2)")
        sp.add_argument("--json", action="store_true", help="print the result as JSON")
        sp.add_argument("--out", default=None, help="also write the JSON result to this file")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")

    sq = sub.add_parser("quant", help="quantize+pack and unpack+dequantize in KIVI's two layouts")
    common(sq, "B,H,T,D (default 1,8,2048,128 on the CPU, 8,8,16384,128 on CUDA)")
    sq.add_argument("--bits", type=int, nargs="+", default=[2, 4], choices=(2, 4, 8),
                    help="bit widths (default 2 4)")
    sq.add_argument("--group-size", type=positive_int, default=128,
                    help="group size: channels per value group, tokens per key group (default 128)")
    sd = sub.add_parser("decode", help="one decode step of attention over each method's cache")
    common(sd, "B,H_q,H_kv,T,D (default 1,8,2,4096,128 on the CPU, 8,32,8,32768,128 on CUDA)")
    sd.add_argument("--methods", nargs="+", default=list(DEFAULT_DECODE_METHODS), metavar="METHOD",
                    help=f"methods (default {' '.join(DEFAULT_DECODE_METHODS)}; any of {' '.join(DECODE_METHODS)})")
    se = sub.add_parser("e2e", help="one decode step of a Llama-shaped model through model(...) with each cache",
                        description=bench_e2e.__doc__.split("\n")[0])
    bench_e2e.add_arguments(se)
    return p


def _check_device(device: str, backend: str) -> None:
    if device == "cpu" and backend != "reference":
        raise BenchError(f"--backend {backend} needs --device cuda: on the CPU only the NumPy reference backend "
                         f"is benchmarked (Triton's CPU interpreter, TRITON_INTERPRET=1, checks correctness; its "
                         f"timings mean nothing)")
    if device == "cuda":
        if backend == "reference":
            raise BenchError("--backend reference is NumPy and runs on the CPU: use --device cpu, or --backend "
                             "triton / cupy on CUDA")
        try:
            import torch
        except ImportError:
            raise BenchError("--device cuda needs torch (pip install 'kvq-cache[fast]', or pip install -e '.[fast]' in a checkout)") from None
        if not torch.cuda.is_available():
            raise BenchError("--device cuda: torch sees no CUDA GPU on this machine (use --device cpu)")
        try:
            importlib.import_module(backend)
        except ImportError:
            raise BenchError(f"--backend {backend}: the {backend} package is not installed") from None


def _print_table(res: dict) -> None:
    env = res["environment"]
    print(f"kvq bench {res['command']}: {env['device']['name']} ({res['device']}), backend {res['backend']}, "
          f"shape {res['shape']}, median of {res['repeats']}; kvq {env['kvq_version']} commit {env['commit']}")
    if res["command"] == "quant":
        print(f"{'op':18s} {'layout':17s} {'bits':>4s} {'ms':>10s} {'MB':>9s} {'GB/s':>8s}")
        for r in res["rows"]:
            print(f"{r['op']:18s} {r['layout']:17s} {r['bits']:4d} {r['median_ms']:10.4f} {r['bytes'] / 1e6:9.2f} "
                  f"{r['gb_per_s']:8.3g}")
    else:
        print(f"{'method':14s} {'bits/el':>7s} {'ms':>10s} {'MB':>9s} {'GB/s':>8s} {'vs FP16':>8s} {'check':>14s}")
        for r in res["rows"]:
            sp = "" if r["speedup_vs_fp16"] is None else f"{r['speedup_vs_fp16']:7.2f}x"
            ok = f"{'ok' if r['valid'] else 'FAILED'} {r['check_rel_err']:.1e}"
            print(f"{r['method']:14s} {r['bits_per_element']:7.3f} {r['median_ms']:10.4f} {r['bytes'] / 1e6:9.2f} "
                  f"{r['gb_per_s']:8.3g} {sp:>8s} {ok:>14s}")


def _device_memory(device: str) -> int | None:
    """Bytes of memory of ``device`` (the GPU's, or the machine's RAM); None when unknown."""
    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def validate(args) -> tuple:
    """``(backend, shape, repeats)`` of the parsed arguments, every check done before any work: device and
    backend, the shape, group size / heads / methods, ``--out`` writable, and inputs that fit: the fp16
    tensors of one case (quant: x; decode: q, k, v) may take at most a quarter of the device's memory
    (copies, packed codes, the reference's float32 temporaries and the caches need the rest). BenchError."""
    from kvq.commands import CommandError, check_out_file

    backend = args.backend or ("reference" if args.device == "cpu" else "triton")
    _check_device(args.device, backend)
    n = 4 if args.what == "quant" else 5
    shape = (_parse_shape(args.shape, n, f"kvq bench {args.what} (" + ("B,H,T,D" if n == 4 else "B,H_q,H_kv,T,D") + ")")
             if args.shape else DEFAULT_SHAPES[args.what, args.device])
    repeats = DEFAULT_REPEATS[args.device] if args.repeats is None else args.repeats
    if repeats < 1 or args.warmup < 0:
        raise BenchError(f"--repeats must be >= 1 and --warmup >= 0; got {repeats}, {args.warmup}")
    if args.what == "quant":
        _check_quant(shape, args.group_size)
        elems = math.prod(shape)
    else:
        _check_decode(shape, tuple(dict.fromkeys(args.methods)))
        B, Hq, Hkv, T, D = shape
        elems = B * Hq * D + 2 * B * Hkv * T * D
    mem = _device_memory(args.device)
    if mem is not None and 2 * elems > mem // 4:
        raise BenchError(f"--shape {','.join(map(str, shape))}: its fp16 inputs take {2 * elems / 2**30:.3g} GiB, "
                         f"more than a quarter of the {mem / 2**30:.3g} GiB of this {args.device} device")
    try:
        check_out_file(args.out)
    except CommandError as e:
        raise BenchError(str(e)) from None
    return backend, shape, repeats


def run(args) -> dict:
    """Run the parsed command; returns the JSON-ready result."""
    backend, shape, repeats = validate(args)
    validation = None
    if backend != "reference":
        import kvq.fast as F

        validation = F.validation_enabled()
        F.set_validation(False)
    try:
        kw = dict(device=args.device, backend=backend, repeats=repeats, warmup=args.warmup, progress=not args.quiet)
        if args.what == "quant":
            rows = bench_quant(shape, bits=tuple(args.bits), group_size=args.group_size, **kw)
        else:
            rows = bench_decode(shape, methods=tuple(dict.fromkeys(args.methods)), **kw)
    finally:
        if validation is not None:
            F.set_validation(validation)
    return {"command": args.what, "device": args.device, "backend": backend, "shape": list(shape),
            "shape_axes": "B,H,T,D" if args.what == "quant" else "B,H_q,H_kv,T,D", "repeats": repeats,
            "warmup": args.warmup, "timer": "cuda_events" if args.device == "cuda" else "perf_counter",
            "environment": environment(args.device), "rows": rows}


def main(argv=None) -> int:
    """``kvq bench quant|decode|e2e [options]``; returns the exit status (2 for a request it cannot serve)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:                                 # --help (0) or a usage error (2)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if args.what == "e2e":                                  # its own checks, run and JSON (kvq.commands.bench_e2e)
        from kvq.commands import bench_e2e

        return bench_e2e.execute(args, "kvq bench e2e")
    try:
        res = run(args)
    except BenchError as e:
        print(f"kvq bench {args.what}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, RuntimeError, ImportError) as e:
        print(f"kvq bench {args.what}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    res["argv"] = argv
    emit(res, out=args.out, as_json=args.json, printer=_print_table)
    return 0


if __name__ == "__main__":
    from kvq.cli import main as _cli

    raise SystemExit(_cli(["bench", *sys.argv[1:]]))
