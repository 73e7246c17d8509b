"""Kitty's channel sensitivity (paper section 3.2, Fig. 2b) on torch tensors, for either fast backend.

For each key channel c: quantize channel c alone (``bits``, per channel over groups of tokens), put it
back among the exact keys, and measure the mean squared change of the attention scores
``softmax(q k^T * scale)`` (eq. 1) per query head. The quantization runs in the backend's bit-exact
kernels (``Ops.quant``: the quantized keys equal the reference's bit for bit); scores and means are
order-dependent reductions (contract rule 7) in torch.

    from kvq.fast.caches.sensitivity import channel_sensitivity
    mse = channel_sensitivity(paged.OPS, q, k, group_size=128)     # (H_q, D) float64, paged: the backend's

How: quantizing channel c moves every score of query i by ``delta_ij = scale * q_ic * (k_hat_jc - k_jc)``
and no other term, so the perturbed probabilities are ``p'_j = p_j exp(delta_j - Delta)`` with
``Delta = log sum_j p_j exp(delta_j)`` (a log-sum-exp). One score matrix per block of query rows
serves every channel: a channel costs O(T_q T) elementwise work, not the reference's (T_q, T, D)
product per channel. The change ``p'_j - p_j = p_j expm1(delta_j - Delta)`` is computed directly, not
as the difference of two softmaxes (which cancels). Everything after the quantization is float64,
like the reference's truth (its inputs are exact in float64): this is an analysis, and float64
keeps it far inside the tolerance rule on every device. Blocks of query rows and channels keep each
temporary near ``BUDGET`` elements.
"""

from __future__ import annotations

import torch

from kvq.fast import common as C
from kvq.fast.caches.codecs import Ops
from kvq.reference.kitty import check_sensitivity_args

F64 = torch.float64
#: q dtypes taken (the reference takes float64 q too)
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: elements per (B, H_q, rows, channels, T) float64 temporary: blocks of query rows and channels fit it
BUDGET = 1 << 22
#: ``x`` below it: ``p expm1(x)``; above: ``p exp(x) - p`` (no cancellation there, no overflow of expm1)
_SPLIT = 0.5


def check_args(q, k, causal: bool, *, allow_cpu: bool) -> None:
    """Tensors, dtypes and devices of q and k, then the reference's shape rules (same messages)."""
    C.check_float(k, "k", allow_cpu=allow_cpu)
    C.check_tensor(q, "q", allow_cpu=allow_cpu)
    if q.dtype not in Q_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; channel_sensitivity takes float16 / bfloat16 / float32 / "
                        f"float64 queries")
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device; got {q.device} and {k.device}")
    check_sensitivity_args(tuple(q.shape), tuple(k.shape), bool(causal))


def quantized_keys(ops: Ops, k, bits: int, G: int) -> torch.Tensor:
    """k (B, H_kv, T, D) with every channel quantized per channel over groups of G tokens, fp32: the
    backend's quantize and dequantize kernels, bit-identical to the reference's."""
    codes, s, m = ops.quant.quantize(k, bits, G, axis=2, meta_dtype="float16")
    return ops.quant.dequantize(codes, s, m, G, axis=2, out_dtype="float32")


def _dp(logp, p, x):
    """``p' - p`` for ``p' = p exp(x)`` (``logp = log p``), accurate relative to ``|p' - p|``."""
    small = x < _SPLIT
    return torch.where(small, p * torch.expm1(torch.where(small, x, 0.0)), torch.exp(logp + x) - p)


def channel_sensitivity(ops: Ops, q, k, *, bits: int = 2, group_size=None, causal: bool = True,
                        scale=None) -> torch.Tensor:
    """Per query head and key channel, the attention-score MSE with that channel quantized: (H_q, D)
    float64 on k's device. Validates like the reference (its shape rules and messages)."""
    check_args(q, k, causal, allow_cpu=ops.allow_cpu())
    if C.validation_enabled():
        C.check_finite(k, "k")
    B, H, T, D = k.shape
    T_q, g = q.shape[2], q.shape[1] // H
    k_hat = quantized_keys(ops, k, bits, T if group_size is None else group_size)   # (B, H, T, D) fp32
    if C.validation_enabled() and not bool(torch.isfinite(q).all()):
        raise ValueError(f"q contains non-finite values ({int(torch.isnan(q).sum())} NaN, "
                         f"{int(torch.isinf(q).sum())} inf)")
    sm = C.softmax_scale(scale, D)
    k64 = k.to(F64)                                                                 # exact
    dk_t = (k_hat.to(F64) - k64).transpose(-1, -2).reshape(B, H, 1, 1, D, T)        # exact differences
    qs = (q.to(F64) * sm).reshape(B, H, g, T_q, D)                                  # (B, H, g, T_q, D)
    per_row = B * H * g * T
    rows = max(1, min(T_q, BUDGET // per_row))
    chans = max(1, min(D, BUDGET // (per_row * rows)))
    acc = torch.zeros((B, H, g, D), dtype=F64, device=k.device)
    kpos = torch.arange(T, device=k.device)
    for i0 in range(0, T_q, rows):
        qb = qs[:, :, :, i0:i0 + rows]                                              # (B, H, g, r, D)
        s = torch.matmul(qb, k64.unsqueeze(2).transpose(-1, -2))                    # (B, H, g, r, T)
        if causal:                                                                  # bottom-right aligned
            qpos = T - T_q + torch.arange(i0, i0 + qb.shape[3], device=k.device)
            s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
        logp = (s - torch.logsumexp(s, dim=-1, keepdim=True)).unsqueeze(-2)         # (B, H, g, r, 1, T)
        p = torch.exp(logp)                                                         # 0 where hidden
        visible = logp != float("-inf")                                             # NaN counts as visible
        for c0 in range(0, D, chans):
            delta = qb[..., c0:c0 + chans].unsqueeze(-1) * dk_t[..., c0:c0 + chans, :]   # (B, H, g, r, c, T)
            big = torch.logsumexp(logp + delta, dim=-1, keepdim=True)               # Delta (B, H, g, r, c, 1)
            diff = _dp(logp, p, delta - big)                                        # p' - p
            # a row whose visible scores do not move at all (channel quantized exactly, q_ic = 0) has
            # p' = p exactly, as in the reference; its Delta is 0 only up to rounding
            diff = torch.where(((delta != 0) & visible).any(dim=-1, keepdim=True), diff, 0.0)
            acc[..., c0:c0 + chans] += diff.square().sum(dim=(-1, -3))
    return (acc.sum(dim=0) / float(B * T_q * T)).reshape(H * g, D)
