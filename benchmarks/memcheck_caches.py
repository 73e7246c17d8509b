"""Every fast cache's append and decode over edge-case lengths and rejected arguments, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 99 python3 benchmarks/memcheck_caches.py

For each method (KIVI-K2V2, KIVI-K4V4, Kitty, OSCAR, AQUA-KV, AQUA-KV-uniform, BitDecoding-2, BitDecoding-4)
and fast backend (triton, cupy), a ``KVStore`` of 2 layers takes tokens in uneven pieces (1, 7, 129, 3, 255,
1 ...) past every page, group, window and residual boundary, and after each piece every layer decodes one
query (``kvq.integrations.attention.decode``, the path a model takes) at g_q 1 and 4; each output is checked
against the reference backend's store fed the same tokens (relative error below 2e-2 in fp16). Then calls
that must be refused (another configuration of the same method, another method's state, wrong head dim,
batch or dtype, NaN, over-capacity) are made on the method modules directly, and the state is checked
unchanged. Prints one line per (method, backend) and a summary; exit 1 when any check failed (memcheck's
own errors come from compute-sanitizer, with --error-exitcode).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvq.integrations import methods as M  # noqa: E402
from kvq.integrations.attention import decode  # noqa: E402

SMALL = {
    "KIVI-K2V2": dict(group_size=32, residual=16),
    "KIVI-K4V4": dict(group_size=32, residual=16),
    "Kitty": dict(group_size=32, residual=16, sink=4),
    "OSCAR": dict(sink=4, window=16, page_size=32),
    "AQUA-KV": dict(sink=4, buffer=32),
    "AQUA-KV-uniform": dict(sink=4, buffer=32),
    "BitDecoding-2": dict(warps_n=1, k_group=64),
    "BitDecoding-4": dict(warps_n=1, k_group=32),
}
PIECES = [1, 7, 129, 3, 255, 1, 64, 2]
B, H, D, L = 2, 2, 128, 2


def snapshot(store):
    out = {}
    for l in range(store.n_layers):
        try:
            for n, a in store.state_arrays(l).items():
                out[(l, n)] = a.copy()
        except ValueError:
            pass
    out["len"] = [store.length(l) for l in range(store.n_layers)]
    return out


def same(a, b) -> bool:
    if a.keys() != b.keys():
        return False
    return all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)


def refused(fn) -> bool:
    try:
        fn()
    except (ValueError, TypeError, IndexError):
        return True
    return False


def run(name: str, backend: str, dev: str) -> tuple[int, int, list]:
    calib = "identity" if M.get_method(name).calibration else None
    kw = dict(n_layers=L, batch=B, kv_heads=H, head_dim=D, max_tokens=1024, calibration=calib, **SMALL[name])
    fast = M.KVStore(name, backend=backend, device=dev, **kw)
    ref = M.KVStore(name, backend="reference", **kw)
    g = torch.Generator(device=dev).manual_seed(0)
    checks, fails, notes = 0, 0, []
    for n in PIECES:
        for l in range(L):
            k = torch.randn((B, H, n, D), generator=g, device=dev).half()
            v = torch.randn((B, H, n, D), generator=g, device=dev).half()
            fast.append(l, k, v)
            ref.append(l, k.cpu(), v.cpu())
        for l in range(L):
            for g_q in (1, 4):
                q = torch.randn((B, H * g_q, 1, D), generator=g, device=dev).half()
                got = decode(fast, l, q).float().cpu()
                want = decode(ref, l, q.cpu().float()).float()
                err = float((got - want).norm() / want.norm())
                checks += 1
                if not err < 2e-2:
                    fails += 1
                    notes.append(f"len {fast.length(l)} layer {l} g_q {g_q}: rel err {err:.3g}")
        _sync(dev)
    # refused calls on the method modules: the state must not change
    fam = fast.spec.family
    before = snapshot(fast)
    mod, cfg = fast._mod, fast.cfg
    k = torch.randn((B, H, 5, D), device=dev).half()
    bad = []
    if fam == "aqua":
        st, P = fast._state, fast.calibration
        K = torch.stack([k] * L)
        other = dataclasses.replace(cfg, sink=cfg.sink + 1)
        bad += [lambda: mod.append(other, P, st, K, K), lambda: mod.append(cfg, P, st, K[..., :64], K[..., :64]),
                lambda: mod.append(cfg, P, st, K * float("nan"), K)]
    else:
        st = fast.state(0)
        other_fields = {"kivi": dict(group_size=64), "kitty": dict(group_size=64), "oscar": dict(page_size=64),
                        "bitdecoding": dict(warps_n=2)}[fam]
        other = dataclasses.replace(cfg, **other_fields)
        args = (cfg, fast.calibration[0]) if fam == "oscar" else (cfg,)
        oargs = (other, fast.calibration[0]) if fam == "oscar" else (other,)
        fname = "KIVI-K2V2" if fam != "kivi" else "Kitty"
        foreign = M.KVStore(fname, backend=backend, device=dev, n_layers=L, batch=B, kv_heads=H, head_dim=D,
                            max_tokens=1024, **SMALL[fname])
        bad += [lambda: mod.append(*oargs, st, k, k),
                lambda: mod.append(*args, foreign.state(0), k, k),
                lambda: mod.append(*args, st, k[..., :64], k[..., :64]),
                lambda: mod.append(*args, st, k[:1], k[:1]),
                lambda: mod.append(*args, st, k.double(), k.double()),
                lambda: mod.append(*args, st, k * float("nan"), k),
                lambda: mod.append(*args, st, torch.randn((B, H, 2048, D), device=dev).half(),
                                   torch.randn((B, H, 2048, D), device=dev).half()),
                lambda: mod.decode_attention(*oargs, st, torch.randn((B, H, 1, D), device=dev).half())]
    for i, fn in enumerate(bad):
        checks += 1
        ok = refused(fn)
        _sync(dev)
        if not ok or not same(before, snapshot(fast)):
            fails += 1
            notes.append(f"bad call {i}: {'accepted' if not ok else 'state changed'}")
    return checks, fails, notes


def _sync(dev: str) -> None:
    if dev != "cpu":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("methods", nargs="*", default=list(SMALL))
    ap.add_argument("--backends", nargs="+", default=["triton", "cupy"])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the Triton interpreter (a smoke test)")
    a = ap.parse_args(argv)
    total = failed = 0
    for name in a.methods:
        for backend in a.backends:
            try:
                c, f, notes = run(name, backend, a.device)
            except Exception:
                c, f, notes = 1, 1, [traceback.format_exc(limit=4)]
            total, failed = total + c, failed + f
            print(f"{name:>16} {backend:>6}: {c} checks, {f} failed" + "".join(f"\n    {n}" for n in notes),
                  flush=True)
    print(f"memcheck_caches: {total} checks, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
