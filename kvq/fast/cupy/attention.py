"""CuPy backend: FP16 / BF16 / FP32 flash-decoding in raw CUDA (``attention.cu``): attention of a few
query tokens over KV-cache segments, split along keys, merged by log-sum-exp.

Mirrors ``kvq.reference.attention`` (``partial_attention``, ``merge``, ``decode_attention``) within
numerics contract rule 7 (order-dependent reductions: fp32 accumulation, not bit-exact).

    out, lse = decode_attention(q, [(k_sink, v_sink), (k_recent, v_recent)])   # q (B, H_q, T_q, D)
    o, lse = partial_attention(q, k, v)
    o, lse = merge([(o1, lse1), (o2, lse2)])

Kernels: ``attn_split`` runs one block per (key split, kv head, batch, tile of QT query rows): it reads
its K / V chunk once for all G_q * T_q query rows of the kv head (GQA), 32 keys at a time per warp
through cp.async into shared memory, fp32 scores and online softmax (base 2, scale * log2(e) folded
into q), and writes an fp32 partial (o, lse). ``attn_merge`` (1-4 warps per row) combines the partials of
all splits of all segments and rounds once to q's dtype. Head dims 16, 32, 64, 128, 256 (fp32: up to
128).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from kvq.fast import common as C

from . import _loader as L

__all__ = ["partial_attention", "merge", "decode_attention"]

_SRC = "attention.cu"
LOG2E = 1.4426950408889634
_MAX_CHUNK = 4096        # keys per split at most (load balance over the SMs)
MERGE_WARPS = 4                     # attn_merge: warps per block (its launch bounds: 128 threads)
MERGE_CHUNK = 8                     # attn_merge: partials per chunk (CH), all loads of a chunk in flight together


# ----------------------------------------------------------------------------------------------------
# validation (the same rules and messages as the Triton backend)


def _check_d(D: int, dtype: torch.dtype) -> None:
    if not L.attn_supported(L.DT[dtype], D):
        raise ValueError(f"head dim D={D} is not supported by the CUDA decode kernel for {dtype}; it takes "
                         f"D in {L.ATTN_DIMS} (float32: up to 128); use the Triton backend or "
                         f"kvq.reference.attention for others")


def split_sizes(T: int, blocks_per_split: int, tile: int, sms: int, tiles_per_warp: int = 2):
    """(keys per split, number of splits): >= 4 blocks per SM in all, <= _MAX_CHUNK keys per split, and
    at least ``tiles_per_warp`` tiles of keys per warp (2 for a kernel on its own; the decode tails that
    run beside a fused kernel take 1: their latency, not their efficiency, counts); keys per split a
    multiple of 32."""
    want = max(-(-4 * sms // max(blocks_per_split, 1)), -(-T // _MAX_CHUNK))
    want = max(1, min(want, -(-T // (tiles_per_warp * tile))))
    chunk = -(-(-(-T // want)) // 32) * 32
    return chunk, -(-T // chunk)


def _kv_operand(t: torch.Tensor) -> torch.Tensor:
    """k or v as the kernel reads it: last dim contiguous, 16-byte aligned rows (cp.async); copies
    otherwise."""
    el = 16 // t.element_size()
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
        s % el == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    if ok:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=None)
def split_kernel(dt: int, D: int, QT: int, nw: int, qdt: int | None = None, precise: bool = False,
                  sums: int | None = None):
    """attn_split for these template values; with ``qdt`` (the queries' dtype code, when it is not the
    keys'): attention.cu's PRECISE = ``precise`` (double accumulators, natural units; else float
    accumulators in base 2) and, with ``sums``, its SD (how each score is summed: 1 in double, 2 as four
    fp32 fma chains; fp32 data with half-precision q, the paged decode's gathered tail). Asks for the
    largest shared-memory carveout, so that six blocks of ~37 KiB static shared memory fit on an SM (one
    wave for B=32, H_kv=8, 4K keys)."""
    if qdt is None:
        name = f"attn_split<{dt}, {D}, {QT}, {nw}>"
    else:
        name = f"attn_split<{dt}, {D}, {QT}, {nw}, {int(precise)}, {qdt}{'' if sums is None else f', {sums}'}>"
    return max_carveout(L.kernel(_SRC, name))


def max_carveout(fn):
    """``fn`` asking for the largest shared-memory carveout (older CuPy: the driver's choice stays)."""
    try:
        fn.preferred_shared_memory_carveout = 100
    except (AttributeError, RuntimeError):
        pass
    return fn


def merge_warps_per_row(S: int) -> int:
    """attn_merge's warps per row for S partials: one per chunk of MERGE_CHUNK partials, 1, 2 or 4 (H100,
    8 x 32K KIVI-K2V2, about 13 partials a row: the merge 7.2 -> 2.9 us at one warp per row; at batch 1, 36
    partials a row, one warp took 4.3 us)."""
    return 1 if S <= MERGE_CHUNK else 2 if S <= 2 * MERGE_CHUNK else 4


def _merge_geometry(rows: int, S: int, D: int) -> tuple:
    """(dims per lane, warps per row, grid) of attn_merge over S partials of ``rows`` rows of D dims."""
    ndl, wpr = L.merge_dims_per_lane(D), merge_warps_per_row(S)
    blocks = -(-rows // (MERGE_WARPS // wpr))
    if blocks > 2 ** 31 - 1:
        raise ValueError(f"{rows} query rows exceed the merge kernel's grid (2^31 - 1 blocks)")
    return ndl, wpr, (blocks, -(-D // (32 * ndl)))


def merge_launch(o_part, lse_part, out, lse, rows: int, S: int, D: int) -> None:
    """o_part (S, rows, D) fp32, lse_part (S, rows) fp32 -> out (rows, D) in out's dtype, lse (rows,):
    attention.cu attn_merge, blocks of 4 warps, ``merge_warps_per_row(S)`` warps per row, lane l holding
    dims 32 i + l of the block's 32 x ``L.merge_dims_per_lane(D)`` dims (more blocks along the grid's y for
    D > 256)."""
    ndl, wpr, grid = _merge_geometry(rows, S, D)
    fn = L.kernel(_SRC, f"attn_merge<{L.DT[out.dtype]}, {ndl}>")
    L.run(fn, grid, (32 * MERGE_WARPS,),
          (o_part, lse_part, out, lse, np.int64(rows), np.int32(D), np.int32(S), np.int32(wpr)), out.device)


def merge_prepared(rows: int, S: int, D: int, out_dtype: torch.dtype, slots: tuple) -> "L.Prepared":
    """:func:`merge_launch` planned once: a ``_loader.Prepared`` attn_merge whose (o_part, lse_part, out,
    lse) are the ``slots`` (four ``_loader.Slot`` of the caller's per-call values)."""
    ndl, wpr, grid = _merge_geometry(rows, S, D)
    fn = L.kernel(_SRC, f"attn_merge<{L.DT[out_dtype]}, {ndl}>")
    return L.Prepared(fn, grid, (32 * MERGE_WARPS,),
                      (*slots, np.int64(rows), np.int32(D), np.int32(S), np.int32(wpr)),
                      types={s.index: torch.Tensor for s in slots})


# ----------------------------------------------------------------------------------------------------
# public API


def decode_attention(q, segments, *, scale=None):
    """Mirrors `kvq.reference.attention.decode_attention`: attention of q over KV segments, every key visible.

    Args:
        q: (B, H_q, T_q, D) float16 / bfloat16 / float32 CUDA tensor (any strides).
        segments: non-empty list of ``(k, v)``, each (B, H_kv, T_i, D) in q's dtype (any strides; a
            copy is made unless the last dim is contiguous and rows are 16-byte aligned; T_i may be 0).
    Returns:
        ``(o, lse)``: o (B, H_q, T_q, D) in q's dtype (the reference returns float32), lse (B, H_q, T_q)
        float32, natural log.
    Differences: torch tensors on a CUDA device; D in {16, 32, 64, 128, 256} (float32: up to 128);
    the result is rounded once to q's dtype; inputs are not checked for NaN / inf (a full read of the
    cache); float64 is refused.
    """
    segments = list(segments)
    if not segments:
        raise ValueError("decode_attention needs at least one (k, v) segment; got an empty list")
    for i, seg in enumerate(segments):
        if not isinstance(seg, (tuple, list)) or len(seg) != 2:
            raise ValueError(f"segment {i} must be a pair (k, v); got {type(seg).__name__}")
        try:
            C.check_qkv(q, seg[0], seg[1])
        except (ValueError, TypeError) as err:
            raise type(err)(f"segment {i}: {err}") from err
    B, H_q, T_q, D = q.shape
    H_kv = segments[0][0].shape[1]
    for i, (k, _) in enumerate(segments):
        if k.shape[1] != H_kv:
            raise ValueError(f"segment {i}: has H_kv={k.shape[1]}, segment 0 has H_kv={H_kv}")
    _check_d(D, q.dtype)
    if B > 65535 or H_kv > 65535:
        raise ValueError(f"B={B} and H_kv={H_kv} must be at most 65535 (CUDA grid limits)")
    sc = C.softmax_scale(scale, D)
    dev = q.device
    out = torch.empty((B, H_q, T_q, D), dtype=q.dtype, device=dev)
    lse = torch.empty((B, H_q, T_q), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse
    plan, S = split_plan(q, segments)
    if S == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    rows = B * H_q * T_q
    o_part = torch.empty((S, B, H_q, T_q, D), dtype=torch.float32, device=dev)
    lse_part = torch.empty((S, B, H_q, T_q), dtype=torch.float32, device=dev)
    split_launch(q, plan, o_part, lse_part, sc)
    merge_launch(o_part, lse_part, out, lse, rows, S, D)
    return out, lse


def split_plan(q, segments, s0: int = 0):
    """attn_split's launches for q over the non-empty (k, v) segments (checked by the caller: in q's dtype,
    or fp16 segments for fp32 q, see :func:`split_launch`), their partials numbered from slot s0:
    ``(plan, end slot)``, one ``(k, v, T, keys per split, splits, first slot)`` per segment (an empty
    segment contributes nothing: lse = -inf)."""
    B, H_q, T_q, D = q.shape
    H_kv = segments[0][0].shape[1]
    G_q = H_q // H_kv
    qtiles = -(-(G_q * T_q) // (4 if G_q * T_q <= 4 else 8))
    nw = L.attn_warps(L.DT[segments[0][0].dtype], D)
    sms = L.sm_count(L.device_index(q.device))
    plan, S = [], s0
    for k, v in segments:
        T = k.shape[2]
        if T == 0:
            continue
        chunk, n = split_sizes(T, B * H_kv * qtiles, 32 * nw, sms)
        plan.append((k, v, T, chunk, n, S))
        S += n
    return plan, S


def split_launch(q, plan, o_part, lse_part, sc: float, stream: int | None = None) -> None:
    """Launch attn_split for every segment of ``split_plan``'s plan: fp32 partials (natural-log lse) into
    o_part (S, B, H_q, T_q, D) / lse_part (S, B, H_q, T_q) (or (S, rows, D) / (S, rows)) at the plan's
    slots; softmax scale ``sc``. Segments in q's dtype, or fp16 segments for fp32 q: then the kernel of
    OSCAR's FP16 segments (double sums, natural units: its lse carries no base-2 rounding)."""
    B, H_q, T_q, D = q.shape
    dt = L.DT[plan[0][0].dtype]
    H_kv = plan[0][0].shape[1]
    QT = 4 if (H_q // H_kv) * T_q <= 4 else 8
    qtiles = -(-((H_q // H_kv) * T_q) // QT)
    nw = L.attn_warps(dt, D)
    qq = q if q.stride(-1) == 1 else q.contiguous()
    mixed = q.dtype != plan[0][0].dtype
    if mixed and not (q.dtype == torch.float32 and plan[0][0].dtype == torch.float16):
        raise ValueError(f"split_launch takes segments in q's dtype or fp16 segments for fp32 q; got q "
                         f"{q.dtype}, segments {plan[0][0].dtype}")
    fn = split_kernel(dt, D, QT, nw, L.DT[torch.float32], precise=True) if mixed else split_kernel(dt, D, QT, nw)
    qk_scale = np.float32(sc if q.dtype == torch.float32 else sc * LOG2E)     # attn_split: fp32 in natural units
    for k, v, T, chunk, n, s0 in plan:
        kk, vv = _kv_operand(k), _kv_operand(v)
        L.run(fn, (n * qtiles, H_kv, B), (32 * nw,),
              (qq, kk, vv, o_part, lse_part,
               *(np.int64(s) for s in qq.stride()[:3]), *(np.int64(s) for s in kk.stride()[:3]),
               *(np.int64(s) for s in vv.stride()[:3]),
               np.int32(B), np.int32(H_q), np.int32(H_kv), np.int32(T_q), np.int64(T), np.int64(chunk),
               np.int32(n), np.int32(s0), qk_scale), q.device, stream=stream)


def partial_attention(q, k, v, *, scale=None):
    """Mirrors `kvq.reference.attention.partial_attention`: attention over one segment, with its lse.

    Returns ``(o, lse)``: o (B, H_q, T_q, D) in q's dtype (the reference returns float32), lse
    (B, H_q, T_q) float32, natural log; an empty segment gives o = 0, lse = -inf. Same kernels and
    differences as :func:`decode_attention`.
    """
    return decode_attention(q, [(k, v)], scale=scale)


def merge(partials):
    """Mirrors `kvq.reference.attention.merge`: combine ``(o_i, lse_i)`` over disjoint key segments.

    ``m = max_i lse_i``, ``w_i = exp(lse_i - m)``, ``o = sum_i w_i o_i / sum_i w_i``,
    ``lse = m + log(sum_i w_i)``; rows where every lse is -inf give o = 0, lse = -inf.
    Differences: torch CUDA tensors; o comes back in the dtype of the partial o's (the reference
    returns float32), lse float32; the partials' lse are checked for NaN / +inf only while
    ``kvq.fast.validation`` is on, and their o is not checked for NaN / inf.
    """
    os_, lses = C.check_partials(partials)
    shape = tuple(os_[0].shape)
    D = shape[-1]
    rows = math.prod(shape[:-1])
    dev = os_[0].device
    out = torch.empty(shape, dtype=os_[0].dtype, device=dev)
    lse = torch.empty(shape[:-1], dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse
    o_part = torch.stack([o.reshape(rows, D).float() for o in os_]).contiguous()       # (S, rows, D)
    lse_part = torch.stack([ls.reshape(rows).float() for ls in lses]).contiguous()     # (S, rows)
    merge_launch(o_part, lse_part, out, lse, rows, len(os_), D)
    return out, lse
