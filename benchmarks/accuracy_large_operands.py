"""How close the CuPy tensor-core KIVI decode (``paged_decode_mma2``) comes to the tolerance rule's bound
with large operands (keys and values scaled to |x| <= 3e4, |q| ~ 300, softmax scale 1e-5: |lse| ~ 1e3).

    python benchmarks/accuracy_large_operands.py          # on the device (CUDA, CuPy)

For each of K2V2, K4V4, K4V2, K2V4 (group 128, window 128, B = 2, H_kv = 4, GQA 2, D = 128; and K2V2 /
K4V4 with an FP16 sink of 32 tokens) and 8 random caches (4 seeds x T in {1500, 2348}) it prints max and
mean of (lse error) / (bound), for each way the FP16 tail computes its scores: its fp16 rows on the tensor
cores (``paged.Knobs.tail_mma`` True; the automatic rule takes them at batch >= 8 only, these caches have
batch 2) or not, and the CUDA-core rows' sums
(``paged.Knobs.tail_sums``: 2 four fp32 fma chains, 1 float64), where error =
max |lse - lse_float64| and bound = 2 x the float32 reference's error + one float32 step at the
magnitude (contract rule 7, ``tests/parity/tolerance.py``); a ratio above 1 misses the rule.
"""

import numpy as np
import torch

import kvq.fast.cupy.kivi as FK
from kvq.reference import kivi as RK

CUDA = dict(group_size=128, residual=128, max_tokens=4096)


def large_case(kb: int, vb: int, seed: int, T: int, qs: float = 300.0, sink: int = 0):
    """(cfg, reference state, k, v, q) of one cache: B = 2, H_kv = 4, GQA 2, D = 128, an FP16 sink of
    ``sink`` tokens; keys and values fp16 scaled to |x| <= 3e4, q fp16 (B, 8, 1, D) of scale qs (also
    ``model_tail_scores.py``'s caches)."""
    cfg = RK.KIVIConfig(kb, vb, sink=sink, **CUDA)
    B, H, D = 2, 4, 128
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k = (k * np.float32(3e4 / np.abs(k).max())).astype(np.float16)
    v = (v * np.float32(3e4 / np.abs(v).max())).astype(np.float16)
    rs = RK.init(cfg, B, H, D)
    RK.append(cfg, rs, k, v)
    q = (rng.standard_normal((B, 2 * H, 1, D)).astype(np.float32) * qs).astype(np.float16)
    return cfg, rs, k, v, q


def ratio(kb: int, vb: int, seed: int, T: int, qs: float = 300.0, sink: int = 0, knobs=None) -> float:
    """The CuPy KIVI decode's lse error over its tolerance bound on one large-operand cache, with the
    decode's launch knobs ``knobs`` (a ``kvq.fast.cupy.paged.Knobs``; None: the defaults)."""
    from kvq.fast.cupy import paged

    cfg, rs, k, v, qn = large_case(kb, vb, seed, T, qs, sink)
    fs = FK.init(cfg, *rs.shape)
    FK.append(cfg, fs, torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda())
    q = torch.from_numpy(qn).cuda()
    _, lse = paged.decode_attention(cfg, FK.KeyCodec, fs, q, scale=1e-5, knobs=knobs)   # FK.decode_attention's call
    _, l64 = RK.decode_attention(cfg, rs, q.cpu().double().numpy(), scale=1e-5)
    _, l32 = RK.decode_attention(cfg, rs, q.cpu().float().numpy(), scale=1e-5)
    err = np.abs(lse.cpu().double().numpy() - l64).max()
    ref = np.abs(l32 - l64).max()
    return float(err / (2 * ref + np.spacing(np.float32(np.abs(l64).max()))))


def main() -> None:
    from kvq.fast.cupy import paged

    for tmma, sums in ((True, 2), (False, 2), (False, 1)):   # tensor-core fp16 rows; four fp32 chains / float64
        knobs = paged.Knobs(tail_mma=tmma, tail_sums=sums)
        for kb, vb, sink in ((2, 2, 0), (4, 4, 0), (4, 2, 0), (2, 4, 0), (2, 2, 32), (4, 4, 32)):
            rs = [ratio(kb, vb, s, T, sink=sink, knobs=knobs) for s in range(4) for T in (1500, 2348)]
            print(f"K{kb}V{vb}{'*' if sink else ''}, tail_mma={tmma}, tail_sums={sums}: lse error / bound over "
                  f"{len(rs)} caches: max {max(rs):.2f} mean {np.mean(rs):.2f}", flush=True)


if __name__ == "__main__":
    main()
