"""NumPy model (CPU) of the CuPy tensor-core KIVI decode's score arithmetic (``paged_decode_mma2``,
KIVI-K2V2, the fused pages) with the large operands of ``accuracy_large_operands.py``: the largest
|score - exact q . k_hat * scale| (log2 units) of the kernel's arithmetic (q~ as fp16 hi + lo, B = q~ *
scale_k by the fp16 two-product, codes . B and the bias q~ . mn_k on the tensor cores, then
s = (S_hi + 2^-11 S_lo) max|q| 2^ek + bias), with the tensor cores' fp32 accumulation modelled as
align-to-the-largest-exponent and truncate per MMA (as Fasi et al. 2021 measured on earlier GPUs), or
as round-to-nearest fp32 adds; and the same with centered codes (code - 1.5 on the tensor cores, the
bias q . (mn + 1.5 scale) as one fp32 dot product).

    python lab/2026-11-22-large-operand-accuracy/model_mma_scores.py          # a few minutes on the CPU

It shows where the large-operand lse error comes from: codes . B and the bias q . mn are two large sums
of opposite sign (min-max groups put mn near -|range|), so their rounding is amplified by the
cancellation, whatever the accumulation mode; centered codes shrink both sums.
"""
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]                 # lab/<folder>/<this file> -> the repository
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]       # kvq, and the benchmark helpers it imports

from accuracy_large_operands import large_case  # noqa: E402
from kvq.reference.packing import unpack  # noqa: E402

def f16(x): return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)
def f32(x): return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)

def tc_add(acc, terms, trunc=True):
    """acc (...,) + sum of terms (..., n): one MMA's fp32 accumulation."""
    if not trunc:
        out = acc.copy()
        for i in range(terms.shape[-1]): out = f32(out + terms[..., i])
        return out
    vals = np.concatenate([acc[..., None], terms], -1)
    m = np.abs(vals).max(-1, keepdims=True)
    e = np.floor(np.log2(np.where(m > 0, m, 1.0)))
    ulp = 2.0 ** (e - 23)
    s = (np.trunc(vals / ulp) * ulp).sum(-1)
    m2 = np.abs(s); e2 = np.floor(np.log2(np.where(m2 > 0, m2, 1.0))); u2 = 2.0 ** (e2 - 23)
    return np.trunc(s / u2) * u2

def chain(A, Bv, trunc, K=16):
    """sum_c A[..., c] * Bv[..., c] over k-steps of K channels."""
    acc = np.zeros(A.shape[:-1])
    for k0 in range(0, A.shape[-1], K):
        acc = tc_add(acc, A[..., k0:k0 + K] * Bv[..., k0:k0 + K], trunc)
    return acc

def model(seed, T=1500, center=False, trunc=True):
    cfg, rs, _, _, q = large_case(2, 2, seed, T)
    B, H, D = rs.shape
    q = q.astype(np.float64)
    qk = float(np.float32(1e-5 * 1.4426950408889634))
    errs, mags = [], []
    for b in range(B):
        for h in range(H):
            for j in range(T // 128 - 1):            # full key pages whose values are quantized too
                pid = rs.k_table[b, j]
                if pid < 0: continue
                codes = unpack(rs.k_pool["codes"][pid, h], 2, axis=-1)[:, :128].astype(np.float64)   # (D, G)
                sc = rs.k_pool["scale"][pid, h].astype(np.float64); mn = rs.k_pool["mn"][pid, h].astype(np.float64)
                khat = f32(f32(codes * sc[:, None]) + mn[:, None])                                # (D, G)
                for r in range(2):
                    qr = q[b, 2 * h + r, 0]
                    sq = f32(qr * qk)
                    qmax = np.abs(sq).max(); qt = f32(sq / qmax)
                    qh = f16(qt); ql = f16((qt - qh) * 2048)
                    ek = int(np.floor(np.log2(np.abs(sc).max()))) + 1
                    s_ = f16(sc * 2.0 ** -ek)
                    hi = f16(qh * s_); lo = f16((qh * s_ - hi) * 2048 + ql * s_)
                    A = (codes - 1.5 if center else codes).T                                        # (G, D)
                    Sh = chain(A, np.broadcast_to(hi, A.shape), trunc)
                    Sl = chain(A, np.broadcast_to(lo, A.shape), trunc)
                    rsc = qmax * 2.0 ** ek
                    if center:
                        mnc = mn + 1.5 * sc
                        bias = f32((sq * mnc).sum())                     # fp32 dot on CUDA cores (ideal)
                    else:
                        em = int(np.floor(np.log2(np.abs(mn).max()))) + 1
                        am = f16(mn * 2.0 ** -em)
                        Sb = chain(am[None, :], qh[None, :], trunc)[0]; SbL = chain(am[None, :], ql[None, :], trunc)[0]
                        bias = f32(f32(Sb + SbL / 2048) * qmax * 2.0 ** em)
                    s = f32(f32(Sl * (rsc / 2048)) + f32(Sh * rsc + bias))
                    true = (qr @ khat) * qk
                    errs.append(np.abs(s - true).max()); mags.append(np.abs(true).max())
    return max(errs), max(mags)

def main() -> None:
    cases = ((False, False, "uncentered, fp32 round-to-nearest accumulation"),
             (False, True, "uncentered, truncating tensor-core accumulation (the kernel's arithmetic)"),
             (True, True, "centered codes (code - 1.5), truncating accumulation"))
    for center, trunc, name in cases:
        r = [model(s, center=center, trunc=trunc) for s in range(2)]
        print(f"{name}: max score error {max(e for e, _ in r):.3g} at |score| <= {max(m for _, m in r):.4g} "
              f"(fp32 ulp there {np.spacing(np.float32(max(m for _, m in r))):.3g})", flush=True)


if __name__ == "__main__":
    main()
