"""`kvq demo`: why keys are quantized per channel, in one table, on the CPU in seconds.

Builds a synthetic KV cache whose keys have a few high-magnitude channels (the outlier channels of the
Kitty paper, Fig. 2a; also KIVI's motivation), quantizes keys per-channel (groups along tokens) and
per-token (groups along channels) at 2 and 4 bits, values per-token, and prints the errors with the
bits per element each configuration costs. With a CUDA GPU it also runs the fast tier on the same
data and reports whether every stored bit matches the reference.

    python -m kvq demo
    kvq demo --tokens 1024 --seed 1
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvq.reference import attention, memory, metrics, packing


def synthetic_kv(batch=1, kv_heads=2, q_heads=8, tokens=512, head_dim=128, outliers=4, seed=0):
    """Queries, keys, values (fp16) with ``outliers`` key channels 10-20x larger than the rest."""
    for name, v, lo, hi in (("batch", batch, 1, None), ("kv_heads", kv_heads, 1, None), ("q_heads", q_heads, 1, None),
                            ("tokens", tokens, 1, None), ("head_dim", head_dim, 1, None),
                            ("outliers", outliers, 0, head_dim), ("seed", seed, 0, None)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v > hi):
            raise ValueError(f"{name} must be an int in [{lo}, {'inf' if hi is None else hi}], got {v!r}")
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((batch, kv_heads, tokens, head_dim)).astype(np.float32)
    chans = rng.choice(head_dim, size=outliers, replace=False)
    k[..., chans] *= rng.uniform(10, 20, size=outliers).astype(np.float32)
    k[..., chans] += rng.uniform(-8, 8, size=outliers).astype(np.float32)       # channel offsets too
    v = rng.standard_normal((batch, kv_heads, tokens, head_dim)).astype(np.float32)
    q = rng.standard_normal((batch, q_heads, 1, head_dim)).astype(np.float32)
    q[..., chans] *= 2.0
    return q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), np.sort(chans)


def _roundtrip(x, bits, group, axis):
    packed, scale, mn = packing.quantize_pack(x, bits, group, axis)
    return packing.unpack_dequantize(packed, scale, mn, bits, group, axis, out_dtype=np.float16)


CONFIGS = [
    # label, key axis (2 = tokens: per-channel; 3 = channels: per-token), bits
    ("K per-channel, V per-token", 2, 2),
    ("K per-token,   V per-token", 3, 2),
    ("K per-channel, V per-token", 2, 4),
    ("K per-token,   V per-token", 3, 4),
]


def run_reference(q, k, v, group=128):
    """Rows of (label, bits, K rel. MSE, V rel. MSE, logit MSE, attention KL, output rel. MSE, bits/elem)."""
    f64 = [a.astype(np.float64) for a in (q, k, v)]
    out_ref = attention.attention(*f64)
    rows = []
    for label, k_axis, bits in CONFIGS:
        k_hat = _roundtrip(k, bits, group, k_axis)
        v_hat = _roundtrip(v, bits, group, 3)
        kh, vh = k_hat.astype(np.float64), v_hat.astype(np.float64)
        out = attention.attention(f64[0], kh, vh)
        fmt = memory.CacheFormat(f"K{bits}V{bits}", k_bits=bits, v_bits=bits, group_size=group)
        rows.append((label, bits,
                     metrics.relative_mse(f64[1], kh), metrics.relative_mse(f64[2], vh),
                     metrics.logit_mse(f64[0], f64[1], kh), metrics.attention_kl(f64[0], f64[1], kh),
                     metrics.relative_mse(out_ref, out),
                     memory.bits_per_element(fmt, context=k.shape[2], accounting="paper")))
    return rows


def run_fast(k, v, group=128):
    """With a CUDA GPU: quantize+pack on every fast backend, compare every stored byte with the reference."""
    try:
        import torch
    except ImportError:
        return "fast tier: torch is not installed (pip install 'kvq-cache[fast]', or pip install -e '.[fast]' in a checkout); reference tier only"
    if not torch.cuda.is_available():
        return "fast tier: no CUDA GPU found; reference tier only (the parity tests cover Triton on the CPU interpreter)"
    import kvq.fast

    lines = [f"fast tier on {torch.cuda.get_device_name()}:"]
    for backend in kvq.fast.BACKENDS:
        try:
            same = True
            t0 = time.perf_counter()
            for x, axis in ((k, 2), (v, 3)):
                for bits in (2, 4):
                    ref = packing.quantize_pack(x, bits, group, axis)
                    got = kvq.fast.quantize_pack(torch.from_numpy(x).cuda(), bits, group, axis, backend=backend)
                    same &= all(np.array_equal(np.asarray(r).view(np.uint8),
                                               g.cpu().numpy().view(np.uint8)) for r, g in zip(ref, got))
            torch.cuda.synchronize()
            lines.append(f"  {backend:6s}: packed codes, scales and minima bit-identical to the reference: "
                         f"{'yes' if same else 'NO'} ({time.perf_counter() - t0:.2f} s incl. compilation)")
        except Exception as e:  # a missing backend (e.g. no cupy) is reported, not fatal
            lines.append(f"  {backend:6s}: unavailable ({type(e).__name__}: {e})")
    return "\n".join(lines)


HEAD_DIM = 128
#: the longest context the demo builds (it runs on the CPU in float64): 65,536 tokens, 512 groups
MAX_TOKENS = 1 << 16


def build_parser() -> argparse.ArgumentParser:
    """The ``kvq demo`` argument parser (numbers checked as they are parsed: one-line errors)."""
    from kvq.commands import Parser, int_in, non_negative_int

    p = Parser(prog="kvq demo", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int_in(1, MAX_TOKENS), default=512,
                   help=f"context length (a multiple of 128, at most {MAX_TOKENS})")
    p.add_argument("--outliers", type=int_in(0, HEAD_DIM, f" (the head has {HEAD_DIM} channels)"), default=4,
                   help=f"number of outlier key channels (0..{HEAD_DIM})")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed (a non-negative integer)")
    p.add_argument("--no-gpu", action="store_true", help="skip the fast tier even if a GPU is present")
    p.add_argument("--json", action="store_true", help="print the reference tier's table as JSON")
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.tokens % 128:
        p.error(f"--tokens must be a positive multiple of 128 (the group size), got {a.tokens}")
    q, k, v, chans = synthetic_kv(tokens=a.tokens, outliers=a.outliers, seed=a.seed)
    if a.json:
        import json
        keys = ("configuration", "bits", "k_rel_mse", "v_rel_mse", "logit_mse", "attention_kl", "output_rel_mse",
                "bits_per_element")
        print(json.dumps({"tokens": a.tokens, "outlier_channels": chans.tolist(),
                          "rows": [dict(zip(keys, r)) for r in run_reference(q, k, v)]}, indent=1))
        return 0
    print(f"kvq demo: synthetic cache, 1 x 2 KV heads x {a.tokens} tokens x 128 dims, 8 query heads; "
          f"outlier key channels {chans.tolist()}")
    print("quantization groups of 128; errors are relative MSE unless named; attention over the whole cache\n")
    hdr = f"{'configuration':28s} {'bits':>4s} {'K relMSE':>9s} {'V relMSE':>9s} {'QK^T MSE':>9s} " \
          f"{'attn KL':>9s} {'out relMSE':>10s} {'bits/elem':>9s}"
    print(hdr)
    print("-" * len(hdr))
    for label, bits, ek, ev, el, kl, eo, bpe in run_reference(q, k, v):
        print(f"{label:28s} {bits:4d} {ek:9.2e} {ev:9.2e} {el:9.2e} {kl:9.2e} {eo:10.2e} {bpe:9.2f}")
    print("\nPer-channel keys keep each outlier channel in its own groups, so its range does not swamp "
          "the other channels' steps.")
    if not a.no_gpu:
        print("\n" + run_fast(k, v))
    return 0
