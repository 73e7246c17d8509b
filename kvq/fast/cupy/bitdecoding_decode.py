"""CuPy BitDecoding fused decode: the tensor-core kernel ``bd_decode`` of ``bitdecoding_decode.cu`` over the
packed pages (the paper's Packing Kernel: ``ldmatrix`` of the induced layout, ``lop3`` unpacking,
dequantization in the registers, ``mma.sync.m16n8k16``, ``cp.async`` of the pages and their half2 params,
split-KV, the query transformation, the cooperative softmax of Algorithm 1), the FP16 residual attended
beside it by ``attention.cu``'s split kernel, all partials merged by log-sum-exp (``attn_merge``).

    out, lse = decode(cfg, state, q)       # q: (B, H_q, T_q, D) fp16; state: a BitDecodingTensorState

``supported`` says which caches and queries it takes: fp16 q, D = 128, values with one group per token
(v_group = D), keys channel-wise with k_group a multiple of a warp's 8 R tokens (the paper's
BitDecoding-KC2 / KC4) or tensor-wise with k_group = D (KT2 / KT4), W_n in 1, 2, 4, 8. The cache's
``decode_attention`` dequantizes the pages and attends them otherwise.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvq.fast import common as C
from kvq.reference import bitdecoding as _R

from . import _loader as L
from . import attention as A
from . import plans as PL

_SRC = "bitdecoding_decode.cu"
LOG2E = 1.4426950408889634
HEAD_DIM = 128
QT = 16                       # query rows per block (bd_decode's m16 tile)


def supported(cfg, st, q) -> bool:
    """Whether ``bd_decode`` takes this cache and query (else the history is dequantized, then attended)."""
    B, H, D = st.shape
    tw = 8 * cfg.per_word
    keys = cfg.k_group % tw == 0 if cfg.k_mode == "channel" else cfg.k_group == D
    n_qt = -(-(q.shape[1] // H) * q.shape[2] // QT)
    return (q.dtype == torch.float16 and D == HEAD_DIM and cfg.v_group == D and keys
            and cfg.warps_n in L.BITDECODING_WARPS and B <= 65535 and H * n_qt <= 65535)


def stages(nw: int) -> int:
    """Pages in flight per warp (bitdecoding_decode.cu BdShape::STAGES)."""
    return 3 if nw <= 4 else 2


def smem_bytes(cfg) -> int:
    """Dynamic shared memory of bd_decode (bitdecoding_decode.cu BdSlot): per warp and stage its key words
    (8 rows of 2 D + 16 bytes), value words (8 R rows of 2 D / R + 16 bytes), key params (KC: a group row of
    D half2; KT: its tokens') and value params (its tokens')."""
    R, D, nw = cfg.per_word, HEAD_DIM, cfg.warps_n
    tw = 8 * R
    slot = 8 * (2 * D + 16) + tw * (2 * D // R + 16) + (4 * D if cfg.k_mode == "channel" else 4 * tw) + 4 * tw
    return nw * stages(nw) * slot


@functools.lru_cache(maxsize=None)
def _kernel(bits: int, chan: bool, nw: int, m16: bool, smem: int, device_index: int):
    return PL.allow_smem(L.kernel(_SRC, L.bd_decode_name(bits, chan, nw, m16)), smem, device_index)


def plan(cfg, st, q):
    """``(splits, pages per split, query tiles, m16)`` of bd_decode for this cache and query: the paged
    decode's makespan model (``plans.n_splits``) over the kernel's resident blocks, every page costing
    the same for the block (its warps share it)."""
    B, H, D = st.shape
    M = (q.shape[1] // H) * q.shape[2]
    n_qt, m16 = -(-M // QT), M > 8
    NP = st.length // cfg.n_r
    if NP == 0:
        return 0, 0, n_qt, m16
    dev = L.device_index(q.device)
    smem = smem_bytes(cfg)
    fn = _kernel(cfg.bits, cfg.k_mode == "channel", cfg.warps_n, m16, smem, dev)
    slots = PL.resident_slots(fn, 32 * cfg.warps_n, smem, dev)
    n_split, pps = PL.n_splits(NP, B * H * n_qt, 1, slots)
    return n_split, pps, n_qt, m16


def decode(cfg, st, q, *, scale=None):
    """Attention of fp16 q (B, H_q, T_q, D) over the whole cache: ``(out fp16, lse fp32)`` (natural log).

    The packed pages through ``bd_decode`` (partials 0 .. splits - 1), the residual's L mod N_r FP16 tokens
    through ``attention.split_launch`` with q in fp32 (the next partials), one ``attn_merge``. The caller (the cache's
    ``decode_attention``) has checked q and the state; requires ``supported(cfg, st, q)``."""
    B, H, D = st.shape
    _, H_q, T_q, _ = q.shape
    sc = C.softmax_scale(scale, D)
    dev = q.device
    dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
    n_p, res = _R.partition(st.length, cfg.n_r)
    NP = n_p // cfg.n_r
    n_split, pps, n_qt, m16 = plan(cfg, st, q)
    qq = q if q.stride(-1) == 1 else q.contiguous()
    # the residual's FP16 tokens with q in fp32 (exact): attn_split's double sums in natural units, whose lse
    # meets the tolerance rule where the fp16 kernel's base-2 lse missed it by an ulp or two at |lse| ~ 5
    q32 = qq.float() if res else None
    tail, S = A.split_plan(q32, [(st.res_k[:, :, :res], st.res_v[:, :, :res])], s0=n_split) if res else ([], n_split)
    rows = B * H_q * T_q
    o_part = torch.empty((S, rows, D), dtype=torch.float32, device=dev)
    lse_part = torch.empty((S, rows), dtype=torch.float32, device=dev)
    if n_split:
        smem = smem_bytes(cfg)
        fn = _kernel(cfg.bits, cfg.k_mode == "channel", cfg.warps_n, m16, smem, dev_index)
        L.run(fn, (n_split, H * n_qt, B), (32 * cfg.warps_n,),
              (qq, *(np.int64(s) for s in qq.stride()[:3]), st.k_words, st.k_params, st.v_words, st.v_params,
               st.table, np.int32(st.table.shape[1]), np.int32(NP), np.int32(pps), np.int32(cfg.k_group),
               o_part, lse_part, np.int32(B), np.int32(H_q), np.int32(H), np.int32(T_q), np.int32(n_qt),
               np.float32(sc), np.float32(sc * LOG2E)), dev, shared_mem=smem)
    if tail:
        A.split_launch(q32, tail, o_part, lse_part, sc)
    out = torch.empty((B, H_q, T_q, D), dtype=q.dtype, device=dev)
    lse = torch.empty((B, H_q, T_q), dtype=torch.float32, device=dev)
    A.merge_launch(o_part, lse_part, out, lse, rows, S, D)
    return out, lse
