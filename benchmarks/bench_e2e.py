"""One decode step of a Llama-3.1-8B-shaped model with each cache: what a user of ``model(...)`` pays.

    python3 benchmarks/bench_e2e.py --out e2e.json                       # the default grid, on a CUDA GPU
    python3 benchmarks/bench_e2e.py --shapes 8x32768 --caches StaticCache KIVI-K2V2:triton KIVI-K2V2:cupy
    python3 benchmarks/bench_e2e.py --tiny --device cpu --shapes 1x64    # a 2-layer model, for a smoke test

The benchmark lives in the package, ``kvq.commands.bench_e2e`` (``kvq bench e2e`` from an installed kvq;
its docstring says what is measured and how). This script runs it from a checkout (the checkout's kvq
first on the path) with the same options and the same JSON (``--out``; ``benchmarks/e2e_table.py``
turns it into the README's table); its messages name it ``bench_e2e.py``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvq.commands.bench_e2e import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(prog=None))
