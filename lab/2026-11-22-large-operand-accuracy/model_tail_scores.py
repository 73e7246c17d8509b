"""NumPy model (CPU) of the large-operand lse error that the tensor-core KIVI decode's FP16 tail adds:
the tail kernels (``paged_tail_attn`` / ``paged_tail16_attn`` / ``attn_split``, half-precision q) sum
each score q . k over the head dim as one chain of fp32 fmas, q pre-scaled by fp32(scale * log2 e);
with |q_d k_d scale| ~ 40 and |score| ~ 1e3 that chain's roundings reach several fp32 ulps, where the
fp32 reference (NumPy's blocked sums) stays near one. The model takes the page tokens' scores exact
and emulates only the tail's chain, on the caches of ``accuracy_large_operands.py``; it prints, per
cache, the resulting lse error over the tolerance rule's bound (above 1 misses the rule), next to the
same with the tail's sums in float64 (rounded once to fp32, what the kernels do since `6afc161`) and with
four interleaved fp32 fma chains (channels d = j mod 4) added pairwise at the end: a cheaper candidate,
fp32 arithmetic with no conversions to float64.

    python lab/2026-11-22-large-operand-accuracy/model_tail_scores.py          # a few minutes on the CPU

Two more modes model ``paged_tail_mma`` (the fp16 tail rows on the tensor cores, fp16 q exact in the
fragments, s = S * fp32(scale log2 e)): the rows whose key and value are both fp16 through
mma.m16n8k16 k-steps of 16 channels with ``model_mma_scores.tc_add``'s truncating accumulation, either
one accumulator chained over the 8 k-steps or each k-step from zero and the 8 sums added pairwise in
fp32 (the kernel); the mixed rows keep the four fp32 chains. Worst ratios (CPU, 2026-11-22): chained
1.83 (K2) / 1.70 (K4), pairwise 0.26 / 0.28.

Measured on the H100 for these caches (``results/h100-31017f8/accuracy.txt`` here): worst
K2V2 1.71, K4V4 1.16; this model alone gives 1.63 and 1.11 for the same caches. The model's worst
ratios (CPU, 2026-11-22): one chain 1.63 (K2) / 1.11 (K4), float64 0.16 / 0.18, four chains 0.21 / 0.21.
"""

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]                 # lab/<folder>/<this file> -> the repository
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]       # kvq, and the benchmark helpers it imports
sys.path.insert(0, str(Path(__file__).resolve().parent))  # model_mma_scores, beside this file

from accuracy_large_operands import large_case  # noqa: E402
from kvq.fast.caches import paged as _paged  # noqa: E402
from kvq.reference import kivi as RK  # noqa: E402

LOG2E = 1.4426950408889634


MODES = ("one fp32 fma chain", "float64 sums", "four fp32 fma chains",
         "tensor cores, k-steps chained", "tensor cores, k-step sums pairwise")


def _chains(qs, kk, n):
    """fp32 fma chains over d = j mod n of qs . kk rows, added pairwise (float32 results)."""
    accs = []
    for j in range(n):
        acc = np.zeros(kk.shape[0], np.float32)
        for d in range(j, kk.shape[1], n):
            acc = (acc.astype(np.float64) + qs[d] * kk[:, d]).astype(np.float32)
        accs.append(acc)
    while len(accs) > 1:                                              # pairwise fp32 adds
        accs = [(accs[i].astype(np.float64) + accs[i + 1]).astype(np.float32) for i in range(0, len(accs), 2)]
    return accs[0]


def _tensor_cores(q16, k16, pairwise: bool):
    """sum_d q16[d] k16[:, d] by mma k-steps of 16 channels (exact products, truncating accumulation)."""
    from model_mma_scores import f32, tc_add
    n = k16.shape[1] // 16
    if not pairwise:
        acc = np.zeros(k16.shape[0])
        for i in range(n):
            acc = tc_add(acc, q16[None, 16 * i:16 * i + 16] * k16[:, 16 * i:16 * i + 16])
        return acc
    sums = [tc_add(np.zeros(k16.shape[0]), q16[None, 16 * i:16 * i + 16] * k16[:, 16 * i:16 * i + 16])
            for i in range(n)]
    while len(sums) > 1:
        sums = [f32(sums[i] + sums[i + 1]) for i in range(0, len(sums), 2)]
    return sums[0]


def ratios(kb: int, seed: int, T: int) -> tuple:
    """lse error / bound for one cache, per tail summation of MODES."""
    cfg, rs, _, _, q = large_case(kb, kb, seed, T)
    B, H, D = rs.shape
    q64 = q.astype(np.float64)
    _, l64 = RK.decode_attention(cfg, rs, q64, scale=1e-5)
    _, l32 = RK.decode_attention(cfg, rs, q.astype(np.float32), scale=1e-5)
    K, _ = RK.dequantize(cfg, rs)
    c = _paged.counts(cfg, T)
    NF = min(c["n_kpages"] * cfg.group_size, c["n_vq"])           # tail rows: tokens [NF, T)
    F0 = max(c["n_kpages"] * cfg.group_size, c["n_vq"])           # fp16 rows (key and value): [F0, T)
    qk = np.float32(1e-5 * LOG2E)
    out = []
    for mode in MODES:
        lse = np.zeros((B, 2 * H))
        for b in range(B):
            for h in range(2 * H):
                kk = K[b, h // 2].astype(np.float64)
                s2 = kk @ q64[b, h, 0] * (1e-5 * LOG2E)               # exact, base 2
                qs = (q[b, h, 0].astype(np.float32) * qk).astype(np.float64)
                if mode == MODES[1]:                                  # float64 sums, one rounding
                    s2[NF:] = (kk[NF:] @ qs).astype(np.float32)
                elif mode in MODES[3:]:                               # fp16 rows on the tensor cores
                    s2[NF:F0] = _chains(qs, kk[NF:F0], 4)
                    S = _tensor_cores(q64[b, h, 0], kk[F0:], mode == MODES[4])
                    s2[F0:] = (S * np.float64(qk)).astype(np.float32)
                else:                                                 # fp32 fma chains over d = j mod n
                    s2[NF:] = _chains(qs, kk[NF:], 1 if mode == MODES[0] else 4)
                m = s2.max()
                lse[b, h] = (m + np.log2(np.exp2(s2 - m).sum())) / LOG2E
        bound = 2 * np.abs(l32 - l64).max() + np.spacing(np.float32(np.abs(l64).max()))
        out.append(float(np.abs(lse - l64.reshape(B, 2 * H)).max() / bound))
    return tuple(out)


def main() -> None:
    for kb in (2, 4):
        r = [ratios(kb, s, T) for s in range(4) for T in (1500, 2348)]
        for k, mode in enumerate(MODES):
            print(f"K{kb}, tail as {mode}: lse error / bound per cache {[round(x[k], 2) for x in r]} "
                  f"(max {max(x[k] for x in r):.2f})", flush=True)


if __name__ == "__main__":
    main()
