"""Does optimum-quanto's CUDA unpack fail once one tensor holds more than 2^31 codes? (issue 37, NOTE.md)

    python lab/2026-11-29-e2e-grid/quanto_probe.py --out $OUT/quanto_probe.json

The hypothesis, from optimum-quanto 0.2.7's ``unpack.cu``: ``unpack_2bit_kernel`` takes the packed byte
count as ``int n`` and writes ``output[i + n*3]``; ``unpack_4bit_kernel`` writes ``output[i + n]``. The
largest index is codes - 1, so the arithmetic stays in range up to 2^31 codes and overflows above. One
layer's keys at batch b x T tokens x 8 heads x 128 hold b * T * 1024 codes: at T = 32768 that is b * 2^25,
so batch 64 holds exactly 2^31 (in range) and batch 65 is over (and so is batch 64 once decode steps
have added tokens).

Each case runs in a subprocess of its own (an illegal memory access loses the CUDA context): a packed
uint8 tensor of ``codes / (8 / bits)`` bytes with a known pattern goes through ``torch.ops.quanto.unpack``
(the CUDA extension optimum-quanto builds on first use); the child reports whether the call raised, and
whether the output equals the pattern's unpacking, checked on the GPU in slices. The parent records each
case's outcome and which implementation ran.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CASES = [  # (bits, codes): just in range, then just over
    (2, 2 ** 31), (2, 2 ** 31 + 2 ** 22), (4, 2 ** 31), (4, 2 ** 31 + 2 ** 22),
]


def child(bits: int, codes: int) -> dict:
    import torch
    import optimum.quanto  # noqa: F401  (registers torch.ops.quanto.unpack and its CUDA implementation)

    per = 8 // bits
    n = codes // per
    # byte j = j mod 251 (a pattern with every bit position used); code k of byte j sits in bits [bits*k, ...)
    packed = (torch.arange(n, device="cuda", dtype=torch.int64) % 251).to(torch.uint8)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        out = torch.ops.quanto.unpack(packed, bits)
        torch.cuda.synchronize()
    except Exception as e:                                              # noqa: BLE001 - the outcome is the datum
        return {"raised": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                "seconds": time.perf_counter() - t0}
    secs = time.perf_counter() - t0
    from optimum.quanto.library.extensions import get_extension
    ext = get_extension("quanto_cuda")._lib is not None        # the CUDA extension was built and ran
    # quanto's layout: output[k * n + j] = code k of byte j (the planes one after another)
    bad = 0
    step = 1 << 26
    mask = (1 << bits) - 1
    for k in range(per):
        for j0 in range(0, n, step):
            j1 = min(n, j0 + step)
            want = (packed[j0:j1] >> (bits * k)) & mask
            bad += int((out[k * n + j0:k * n + j1] != want).sum())
    torch.cuda.synchronize()
    return {"raised": None, "wrong_codes": bad, "out_numel": out.numel(), "seconds": secs, "quanto_cuda_extension": ext}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", nargs=2, type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    import torch
    import optimum.quanto

    rows = []
    for bits, codes in CASES:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--out", args.out, "--child", str(bits), str(codes)],
                           capture_output=True, text=True, timeout=600)
        row = {"bits": bits, "codes": codes, "codes_over_2^31": codes - 2 ** 31, "returncode": p.returncode,
               "wall_s": time.perf_counter() - t0}
        last = [l for l in p.stdout.splitlines() if l.startswith("{")]
        if last:
            row.update(json.loads(last[-1]))
        else:
            row["stderr_tail"] = p.stderr[-1500:]
        print(row, flush=True)
        rows.append(row)
    info = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "optimum_quanto": getattr(optimum.quanto, "__version__", "?")}
    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
