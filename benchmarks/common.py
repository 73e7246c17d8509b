"""Shared helpers of the kvq benchmarks: timing, device / commit / date metadata, JSON output.

Timing method (DESIGN.md section 4, /work/.library/device/METHOD.md): CUDA events, median of many
timed rounds after a warm-up. L2 is defeated by ROTATION, not by flushing: the caller passes several
copies of the inputs, enough that the bytes touched between two uses of the same copy exceed 4x the L2
size (``copies_for``); inputs that alone exceed 4x L2 need one copy. Each round runs a burst of calls
(a multiple of the number of copies, about 2 ms of work) between two events; time per call = round time
/ calls. Every measurement is taken twice over:

* ``eager``: the calls launched from Python, so CPU launch overhead shows when kernels are short
  (``wall_ms_per_call``, host clock over all eager rounds, is a cross-check: work launched on a stream
  other than torch's current one escapes the events but not the host clock);
* ``graph``: the same burst captured once in a CUDA graph and replayed (GPU time, launch gaps removed).

The primary number ``ms`` is the graph median where capture worked, else the eager median; ``method``
says which. On the CPU (dry runs) a perf_counter takes the place of the events and there is no graph.

    from common import bench, copies_for
    t = bench(lambda x: x * 2, [(x,)], device=x.device)     # {'ms': ..., 'method': ..., ...}
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:                     # the device copy has no installed kvq package
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DEFAULT_L2_BYTES = 50 * 2**20                      # H100; the device properties say what is there


# ----------------------------------------------------------------------------------------------- errors

def err_str(e: BaseException, limit: int = 600) -> str:
    """One line for the JSON: exception type and message, and the innermost frame (file:line)."""
    msg = "".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " | ")
    tb = traceback.extract_tb(e.__traceback__)
    where = f" [at {Path(tb[-1].filename).name}:{tb[-1].lineno}]" if tb else ""
    return (msg[:limit] + where)


class Deadline:
    """A wall-clock budget shared by the benchmark sections, so that JSON is written before a timeout."""

    def __init__(self, seconds: float):
        self.t_end = time.monotonic() + seconds

    def left(self) -> float:
        return self.t_end - time.monotonic()

    def expired(self, reserve_s: float = 0.0) -> bool:
        return self.left() <= reserve_s


# ----------------------------------------------------------------------------------------------- timing

def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def l2_bytes(device) -> int:
    dev = torch.device(device)
    if dev.type != "cuda":
        return DEFAULT_L2_BYTES
    return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def copies_for(working_set_bytes: int, device, factor: int = 4, max_copies: int = 64) -> int:
    """Input copies to rotate so that one full rotation touches >= factor x L2 (1 if one copy already does)."""
    if torch.device(device).type != "cuda":
        return 1
    need = factor * l2_bytes(device)
    return int(min(max_copies, max(1, math.ceil(need / max(1, working_set_bytes)))))


def _median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _quantile(xs, p):
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(p * (len(s) - 1)))))]


def _summary(per_call_ms):
    med = _median(per_call_ms)
    return {"median_ms": med, "min_ms": min(per_call_ms), "max_ms": max(per_call_ms),
            "p10_ms": _quantile(per_call_ms, 0.1), "p90_ms": _quantile(per_call_ms, 0.9),
            "rel_spread": (_quantile(per_call_ms, 0.9) - _quantile(per_call_ms, 0.1)) / med if med > 0 else None,
            "rounds": len(per_call_ms)}


def _burst(fn, inputs, calls):
    n = len(inputs)
    for i in range(calls):
        fn(*inputs[i % n])


def _eager_rounds_cuda(fn, inputs, calls, rounds):
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rounds)]
    for start, end in events:
        start.record()
        _burst(fn, inputs, calls)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / calls for start, end in events]


def _graph_rounds_cuda(fn, inputs, calls, rounds):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                    # warm-up on a side stream, as torch's docs ask
        _burst(fn, inputs, len(inputs))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _burst(fn, inputs, calls)
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rounds)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    out = [start.elapsed_time(end) / calls for start, end in events]
    del graph
    return out


def bench(fn, inputs, *, device, quick: bool = False, graph: bool = True,
          target_round_ms: float = 2.0, max_calls: int = 256) -> dict:
    """Median time of ``fn(*args)`` per call, rotating over ``inputs`` (a list of argument tuples).

    Warm-up: one call per input (compilation, autotuning), then one eager burst to estimate the time.
    Returns ``ms`` (primary), ``method``, ``eager`` / ``graph`` summaries (median, min, max, p10, p90,
    rel_spread = (p90 - p10) / median), ``calls_per_round``, ``n_inputs`` and ``graph_error`` if capture
    failed. Exceptions from ``fn`` itself propagate to the caller.
    """
    n = len(inputs)
    dev = torch.device(device)
    rounds_eager, rounds_graph = (3, 7) if quick else (5, 15)
    if dev.type != "cuda":                                   # dry run: perf_counter, no graph
        _burst(fn, inputs, n)
        per = []
        for _ in range(2):
            t0 = time.perf_counter()
            _burst(fn, inputs, n)
            per.append((time.perf_counter() - t0) * 1e3 / n)
        s = _summary(per)
        return {"ms": s["median_ms"], "method": "cpu-perf_counter", "eager": s, "graph": None,
                "calls_per_round": n, "n_inputs": n}

    torch.cuda.synchronize()
    _burst(fn, inputs, n)                                     # warm-up: every input once
    torch.cuda.synchronize()
    t_est = _median(_eager_rounds_cuda(fn, inputs, n, 1))
    rotations = max(1, math.ceil(target_round_ms / max(t_est * n, 1e-4)))
    calls = n * max(1, min(rotations, max_calls // n))
    t0 = time.perf_counter()
    eager = _summary(_eager_rounds_cuda(fn, inputs, calls, rounds_eager))
    eager["wall_ms_per_call"] = (time.perf_counter() - t0) * 1e3 / (calls * rounds_eager)
    res = {"ms": eager["median_ms"], "method": "cuda-events-eager", "eager": eager, "graph": None,
           "calls_per_round": calls, "n_inputs": n}
    if graph:
        try:
            g = _summary(_graph_rounds_cuda(fn, inputs, calls, rounds_graph))
            res.update(ms=g["median_ms"], method="cuda-graph-replay", graph=g)
        except Exception as e:                                # e.g. a sync inside fn, a non-torch stream
            res["graph_error"] = err_str(e)
            try:
                torch.cuda.synchronize()
            except Exception as e2:
                res["graph_error"] += f"; then: {err_str(e2)}"
    return res


# ------------------------------------------------------------------------------- size-matched read ceiling

#: one pass over a buffer: 16-byte loads, XOR-folded (the fold is written only if it equals an argument
#: that never matches, so nothing is stored and the loads cannot be dropped)
_READ_SRC = r"""
extern "C" __global__ void read_pass(const uint4* __restrict__ p, long long n, unsigned never, unsigned* out) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const uint4 a = p[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == never) out[0] = acc;
}
"""


@functools.lru_cache(maxsize=None)
def _read_kernel():
    import cupy

    return cupy.RawModule(code=_READ_SRC).get_function("read_pass")


def read_ceiling(nbytes: int, device, quick: bool = False) -> dict | None:
    """The time of ONE kernel that only reads ``nbytes`` (16-byte loads, grid-stride, 256 threads a block;
    the faster of 4 and 16 blocks per SM), rotated over cold copies like the decode benchmarks and timed
    by ``bench`` (CUDA-graph replay): what any single kernel reading a decode step's bytes could reach at
    that size, launch and ramp included. None without CUDA or CuPy."""
    if torch.device(device).type != "cuda":
        return None
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        return None
    import numpy as np

    from kvq.fast.cupy import _loader as L
    dev = torch.device(device)
    fn = _read_kernel()
    n16 = max(1, -(-int(nbytes) // 16))
    copies = copies_for(16 * n16, device)
    bufs = [torch.randint(0, 2**31 - 1, (4 * n16,), dtype=torch.int32, device=dev) for _ in range(copies)]
    out = torch.zeros(1, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    best = None
    for per_sm in (4, 16):
        grid = max(1, min(sms * per_sm, -(-n16 // 256)))

        def one(buf, grid=grid):
            L.run(fn, (grid,), (256,), (buf, np.int64(n16), np.uint32(0xFFFFFFFF), out), dev)

        t = bench(one, [(b,) for b in bufs], device=device, quick=quick)
        if best is None or t["ms"] < best["ms"]:
            best = {"ms": t["ms"], "blocks_per_sm": per_sm, "grid": grid, "bytes": 16 * n16,
                    "n_copies": copies, "method": t["method"]}
    del bufs
    free_cuda(device)
    best["gbps"] = gbps(best["bytes"], best["ms"])
    return best


# ----------------------------------------------------------------------------------------------- metadata

def git_commit() -> str:
    """KVQ_COMMIT when set (the device copy: its .git, where there is one, may be stale), else HEAD's hash
    with '-dirty' when the tree has changes."""
    if os.environ.get("KVQ_COMMIT"):
        return os.environ["KVQ_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                                   text=True, timeout=10)
            return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception as e:                                    # not installed, or broken install
        return f"unavailable ({type(e).__name__})"


def device_info(device) -> dict:
    dev = torch.device(device)
    info = {"device_type": dev.type, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "triton": _version("triton"), "cupy": _version("cupy"), "python": platform.python_version(),
            "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(name=p.name, sm_count=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}", total_memory_bytes=int(p.total_memory),
                    l2_bytes=l2_bytes(dev))
    else:
        info.update(name=f"cpu ({platform.processor() or platform.machine()})")
    return info


def meta(device, argv=None) -> dict:
    """The header every result file carries: device, commit, date, command line."""
    return {"device": device_info(device), "commit": git_commit(), "date_utc": utc_now(),
            "argv": list(sys.argv if argv is None else argv)}


# ----------------------------------------------------------------------------------------------- output

def _clean(x):
    """JSON-safe: non-finite floats become null, tuples lists, unknown objects strings."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def write_json(out_dir, name: str, payload: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(_clean(payload), indent=1) + "\n")
    return path


def gbps(nbytes: int, ms: float | None):
    return None if not ms else nbytes / (ms * 1e-3) / 1e9


def pct(gb_s, copy_gbps):
    return None if not gb_s or not copy_gbps else 100.0 * gb_s / copy_gbps


def free_cuda(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def shape_sizes(mod, quick: bool, dry: bool) -> tuple:
    """``(batches, contexts, H_q, H_kv, D)`` of a decode benchmark module: its ``DRY_*`` sizes for a dry run,
    ``QUICK_BATCHES`` / ``QUICK_CONTEXTS`` with the full heads for ``--quick``, else ``BATCHES`` / ``CONTEXTS``."""
    if dry:
        return mod.DRY_BATCHES, mod.DRY_CONTEXTS, mod.DRY_H_Q, mod.DRY_H_KV, mod.DRY_D
    if quick:
        return mod.QUICK_BATCHES, mod.QUICK_CONTEXTS, mod.H_Q, mod.H_KV, mod.D
    return mod.BATCHES, mod.CONTEXTS, mod.H_Q, mod.H_KV, mod.D


def run_shapes(run_shape, batches, contexts, device) -> list:
    """``run_shape(B, T)`` for every context and batch, in that order; an exception becomes the shape's
    ``error`` (and the CUDA cache is emptied) instead of ending the benchmark."""
    shapes = []
    for T in contexts:
        for B in batches:
            try:
                shapes.append(run_shape(B, T))
            except Exception as e:
                shapes.append({"B": B, "T": T, "error": err_str(e)})
                free_cuda(device)
    return shapes


def device_or_exit(dry_run: bool, script: str) -> str:
    """"cuda" when there is a GPU; else "cpu" for a ``--dry-run``, else exit with a message."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not dry_run:
        sys.exit(f"{script} needs a GPU (or --dry-run)")
    return device


def write_result(out_dir, json_name: str, res: dict, summary_lines, device) -> None:
    """``res`` with its meta (device, commit, argv) as ``json_name`` under out_dir; prints the summary."""
    res["meta"] = meta(device, sys.argv)
    path = write_json(out_dir, json_name, res)
    print("\n".join(summary_lines(res)))
    print("wrote", path)
