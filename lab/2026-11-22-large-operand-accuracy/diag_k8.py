"""The lse error / bound of the caches that showed the CUDA-core page kernel's one-chain scores
(lab/2026-11-22-kivi-kitty-decode/results/h100-mixed-mma/diag_k8.log), per tail launch choice:
python lab/2026-11-22-large-operand-accuracy/diag_k8.py (GPU)."""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: kvq and tests.parity

import kvq.fast.cupy.kivi as FK  # noqa: E402
import kvq.fast.cupy.paged as FP  # noqa: E402
from kvq.reference import kivi as RK  # noqa: E402
from tests.parity.test_kivi_kitty_parity import CUDA, _kv, _truth_ref32  # noqa: E402
from tests.parity.tolerance import check_close  # noqa: E402


def main() -> None:
    for kbits, vbits, T in ((8, 4, 1100), (8, 2, 1100), (8, 4, 2100), (4, 4, 1100), (2, 2, 1100)):
        cfg = RK.KIVIConfig(kbits, vbits, **CUDA)
        B, H, D, ratio = 1, 4, 128, 4
        k, v = _kv(B, H, T, D, cfg.group_size, seed=T + B, start=cfg.sink, distinct=False)
        rs, fs = RK.init(cfg, B, H, D), FK.init(cfg, B, H, D)
        RK.append(cfg, rs, k, v)
        FK.append(cfg, fs, torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda())
        rng = np.random.default_rng(T + B)
        q = torch.from_numpy(rng.standard_normal((B, H * ratio, 1, D)).astype(np.float32)).half().cuda()
        (o64, l64), (o32, l32) = _truth_ref32(RK, cfg, rs, q)
        for t16, mm, tm in ((None, True, False), (True, False, False), (None, False, False), (None, True, True)):
            knobs = FP.Knobs(tail16=t16, mixed_mma=mm, tail_mma=tm)
            out, lse = FP.decode_attention(cfg, FK.KeyCodec, fs, q, knobs=knobs)     # FK.decode_attention's call
            try:
                r = check_close(lse, l64, l32, torch.float32, "lse")
            except AssertionError as e:
                print(f"K{kbits}V{vbits} T={T} tail16={t16} mixed_mma={mm} tail_mma={tm}: FAIL {e}", flush=True)
                continue
            print(f"K{kbits}V{vbits} T={T} tail16={t16} mixed_mma={mm} tail_mma={tm}: "
                  f"lse error / bound {r['err'] / r['bound']:.2f}", flush=True)


if __name__ == "__main__":
    main()
