"""One page flush per method, the single-kernel pool writers against the quantizers and copies.

``bench_kivi_kitty.time_flush`` per backend, with ``kvq.fast.caches.codecs.FUSED_FLUSH`` on, then off (the
path a backend without writers takes), ``--rounds`` times each, alternating; B = 8, H_kv = 8, G = 128,
D = 128. Writes ``flush_ab.json`` (ms per flush: one key page written into the pool and G values
quantized into their page slots; ``fused``: whether both writes took a single kernel).

    python3 lab/2026-11-23-flush-writers/flush_ab.py --out DIR [--backends triton,cupy] [--rounds 2] [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]                 # lab/<folder>/<this file> -> the repository
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]       # kvq, and the benchmark helpers it imports

import common as C  # noqa: E402
import bench_kivi_kitty as K  # noqa: E402


def run(device, backends, rounds: int, dry: bool) -> dict:
    from kvq.fast.caches import codecs as _codecs
    res = {"rounds": rounds, "backends": {}}
    for backend in backends:
        rows = {}
        for r in range(rounds):
            for fused in (True, False):
                _codecs.FUSED_FLUSH = fused
                try:
                    got = K.time_flush(device, False, dry, None, backend)
                finally:
                    _codecs.FUSED_FLUSH = True
                for method, row in got.items():
                    rows.setdefault(method, {"fused": [], "unfused": []})
                    rows[method]["fused" if fused else "unfused"].append(row)
        res["backends"][backend] = rows
    return res


def summary_lines(res: dict) -> list[str]:
    lines = []
    for backend, rows in res["backends"].items():
        for method, r in rows.items():
            def ms(rs, key="ms"):
                return " / ".join(f"{x[key]:.4f}" if key in x else x.get("error", "?")[:60] for x in rs)
            took = all(x.get("fused") for x in r["fused"])
            lines.append(f"{backend:7s} {method:10s} writers {ms(r['fused'])} ms "
                         f"({'one kernel each' if took else 'NOT single-kernel'}; keys {ms(r['fused'], 'keys_ms')}, "
                         f"values {ms(r['fused'], 'values_ms')}) | quantize + copies {ms(r['unfused'])} ms "
                         f"(keys {ms(r['unfused'], 'keys_ms')}, values {ms(r['unfused'], 'values_ms')})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--backends", default="triton,cupy")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU, Triton interpreter)")
    a = ap.parse_args()
    device = C.device_or_exit(a.dry_run, "flush_ab.py")
    C.write_result(a.out, "flush_ab.json", run(device, a.backends.split(","), a.rounds, a.dry_run), summary_lines,
                   device)


if __name__ == "__main__":
    main()
