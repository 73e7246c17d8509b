"""CuPy fused INT2 decode over the OSCAR cache (``kvq.reference.oscar`` section 4): the tensor-core
kernel ``oscar_decode_mma`` of ``oscar_decode.cu`` over the packed history pages, the FP16 sink and
window attended in one launch by ``oscar_tail_attn`` (``attention.cu``'s split-kernel body) straight
from their fp16 buffers (beside the fused kernel, on a second stream), all partials merged by
log-sum-exp.

    out, lse = decode(cfg, state, q_rot, scale=None)      # q_rot: (B, H_q, T_q, D) fp32, the rotated query

It takes 2-bit codes, D = 128, one quantization group per token (G = 128), pages of 128 tokens, fp16
metadata and at most 8 query rows per KV head (``supported``); ``kvq.fast.cupy.oscar`` falls back to
dequantizing the history otherwise, and for float32 queries (the precise path: here the key scores are
exact integer sums on the s8 tensor cores, of the codes and q / max|q_row| rounded to 2^-30, rounded once
to fp32, but probabilities times value scales are rounded once to fp16).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvq.fast import _common as C
from kvq.reference import oscar as RO

from . import _loader as L
from . import attention as A
from . import paged as PD

_SRC = "oscar_decode.cu"
LOG2E = 1.4426950408889634
PAGE = 128                          # tokens per page (OSCARConfig.page_size) the kernel takes
HEAD_DIM = 128


def supported(cfg, st, q_rot) -> bool:
    """Whether the fused kernel takes this cache and query (else the history is dequantized)."""
    B, H, D = st.shape
    M = (q_rot.shape[1] // H) * q_rot.shape[2]
    return (cfg.bits == 2 and D == HEAD_DIM and cfg.group_size == D and cfg.page_size == PAGE
            and st.k_scale.dtype == torch.float16 and M <= 8 and q_rot.dtype == torch.float32
            and B <= 65535 and H <= 65535)


def smem_bytes(nw: int) -> int:
    """Dynamic shared memory of oscar_decode_mma: the queries (8 x 128 fp32) and per warp a key slot and a
    value slot (codes 128 x 32 bytes, scale and mn 128 fp16 each)."""
    return 8 * HEAD_DIM * 4 + nw * 2 * (PAGE * 32 + 4 * PAGE)


@functools.lru_cache(maxsize=None)
def _kernel(nr: int, smem: int, device_index: int):
    return PD._allow_smem(L.kernel(_SRC, f"oscar_decode_mma<{nr}>"), smem, device_index)


#: launch knobs of ``decode`` for tuning runs. tail_prec: the FP16 sink / window kernel's arithmetic (both
#: in natural-log units): 1 double sums and accumulators, 2 (the default) four fp32 fma chains per score
#: and fp32 accumulators (H100, R_V folded, ms, 1 / 2, tail launched first: 1 x 32K 0.0346 / 0.0342,
#: 1 x 64K 0.0498 / 0.0475, 1 x 128K 0.0665 / 0.0630, 8 x 64K 0.1624 / 0.1574); tail_first: that kernel
#: launched on its side stream before the page kernel (True) or after it (False); None (auto): first
#: where the tail has at least one block per SM (B H_kv query tiles >= SMs), else after: the page grid
#: then holds every slot, and the tail's blocks take the slots its first blocks free (H100, ms, first /
#: after: 1 x 32K 0.0324 / 0.0287, 1 x 128K 0.0617 / 0.0585, 8 x 32K 0.0994 / 0.0957, 8 x 64K 0.1576 /
#: 0.1571, but 32 x 64K 0.5325 / 0.5456; 1 x 64K 0.0462 / 0.0465). Both kernels sharing the SMs cost:
#: alone (one stream) the tail takes 11 us at 1 x 64K, the page kernel 31 us (see benchmarks/results);
#: merge_rotate: the output rotated back in the merge's launch (True), by the merge and then
#: rotate_heads (False), or None (auto): in the merge's launch while its blocks are at most one per SM
#: (see decode)
TUNE = {"tail_prec": 2, "tail_first": None, "merge_rotate": None}


@functools.lru_cache(maxsize=None)
def _tail_kernel(qt: int, nw: int, prec: int):
    if prec not in (1, 2):
        raise ValueError(f"oscar_decode.TUNE['tail_prec'] = {prec!r}: 1 (double) or 2 (four fp32 chains)")
    return A.max_carveout(L.kernel(_SRC, f"oscar_tail_attn<{qt}, {nw}, {prec}>"))


def decode(cfg, st, q_rot, *, scale=None, out_dtype=torch.float32, R_out=None):
    """Attention of the rotated fp32 query over the whole cache: ``(out, lse fp32)``, out in ``out_dtype``
    (float32, or a half type: rounded once). ``R_out`` None: out in the rotated frame (the merge writes
    it); else out times ``R_out`` (as :func:`rotate_heads` takes it: the caller's R_V^T), the same bits
    either way as the merge to fp32 and then ``rotate_heads``: in the merge's launch
    (``oscar_merge_rotate``, whose D / 32 blocks per query row each merge the row) while those blocks
    are at most one per SM (batch 1 at 32 query heads), else by the merge and then ``rotate_heads``: the
    redundant merges' reads are free only while the launch is latency-bound (H100, OSCAR steps, ms, one
    launch / two: 1 x 64K 0.0374 / 0.0402; 8 x 64K 0.1615 / 0.1589, 32 x 32K 0.3273 / 0.3213; 32 x 128K
    1.022 / 1.040, within its run-to-run spread). Requires ``supported(cfg, st, q_rot)``."""
    B, H, D = st.shape
    _, H_q, T_q, _ = q_rot.shape
    R3, rt = _heads_R(R_out, q_rot) if R_out is not None else (None, None)
    sc = C.softmax_scale(scale, D)
    dev = q_rot.device
    dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
    sms = L.sm_count(dev_index)
    c = RO.counts(cfg, st.length)
    NH, NP = c["n_hist"], c["n_pages"]
    M = (H_q // H) * T_q
    nr = 4 if M <= 4 else 8
    qq = q_rot if q_rot.stride(-1) == 1 else q_rot.contiguous()
    # the FP16 tokens: oscar_tail_attn (attn_split's body: fp16 K / V, fp32 q, natural units: the fp32
    # lse bound left no room for base-2 rounding here; TUNE["tail_prec"]: double or four-chain fp32 sums)
    # over the sink and the window (ring slots in any order: attention does not depend on it) read in
    # place as one sequence, one tile of keys per warp (it runs beside the fused kernel: its latency counts)
    tqt = 4 if M <= 4 else 8
    tqtiles = -(-M // tqt)
    tnw = L.attn_warps(L.DT[torch.float16], D)
    n1, NT = c["n_sink"], c["n_sink"] + c["n_win"]
    chunk, nt = A._splits(NT, B * H * tqtiles, 32 * tnw, sms, tiles_per_warp=1) if NT else (0, 0)
    side_ok = bool(nt and NP and PD.TUNE["side_stream"])
    n_split = pps = 0
    if NP:
        nw = PD.MMA_MAX_WARPS
        smem = smem_bytes(nw)
        fn = _kernel(nr, smem, dev_index)
        slots = PD.resident_slots(fn, 32 * nw, smem, dev_index)
        # at most 2 blocks per SM while a split's B H blocks are fewer than the SMs (few_bases), else the
        # paged decode's rule (up to 8 pages per warp at full occupancy: 2 blocks per SM): the tail's blocks
        # then find room beside the page grid at once, and fewer blocks mean fewer prologues and partials
        # (H100, R_V folded, ms, auto (3 blocks per SM) / 2: 8 x 32K 0.0842 / 0.0798, 8 x 64K 0.1362 / 0.1302,
        # 8 x 128K 0.2337 / 0.2322; but 32 x 32K, 256 blocks a split, 0.2770 / 0.3388, kept at 3; batch 1
        # already at 2: 2 / 3 blocks per SM 1 x 64K 0.0343 / 0.0353, 1 x 128K 0.0475 / 0.0496;
        # lab/2026-11-22-oscar-decode/results/h100-oscar-plan)
        n_split, pps = PD._fused_splits(NP, B * H, nw, slots, sms, few_bases=True)
    S_TOTAL = n_split + nt
    rows = B * H_q * T_q
    o_part = torch.empty((S_TOTAL, rows, D), dtype=torch.float32, device=dev)
    lse_part = torch.empty((S_TOTAL, rows), dtype=torch.float32, device=dev)
    main = L.raw_stream(dev_index)                 # raw handles: the launches name their stream
    side = PD._side_stream(dev_index).cuda_stream if side_ok else main
    tail_fn = _tail_kernel(tqt, tnw, TUNE["tail_prec"]) if nt else None   # (a bad knob raises before any launch)

    def launch_tail():
        sk, sv, wk, wv = st.sink_k, st.sink_v, st.win_k, st.win_v
        L.run(tail_fn, (nt * tqtiles, H, B), (32 * tnw,),
              (qq, sk, sv, wk, wv, np.int64(sk.stride(0)), np.int64(sk.stride(1)), np.int64(wk.stride(0)),
               np.int64(wk.stride(1)), np.int64(D), np.int64(n1), o_part, lse_part,
               *(np.int64(s) for s in qq.stride()[:3]), np.int32(B), np.int32(H_q), np.int32(H),
               np.int32(T_q), np.int64(NT), np.int64(chunk), np.int32(nt), np.int32(n_split),
               np.float32(sc)), dev, stream=side)                       # natural units

    def launch_pages():
        L.run(fn, (n_split, H, B), (32 * nw,),
              (qq, *(np.int64(s) for s in qq.stride()[:3]), st.k_codes, st.k_scale, st.k_mn, st.v_codes,
               st.v_scale, st.v_mn, st.table, np.int32(st.table.shape[1]), o_part, lse_part,
               np.int32(B), np.int32(H_q), np.int32(H), np.int32(T_q), np.int32(NH), np.int32(NP),
               np.int32(pps), np.int32(n_split), np.float32(sc * LOG2E)), dev, shared_mem=smem, stream=main)

    if side != main:
        L.stream_wait(side, main, dev_index)       # fork before either launch: they run side by side
    first = TUNE["tail_first"]
    if first is None:
        first = B * H * tqtiles >= sms
    launches = [(nt, launch_tail), (n_split, launch_pages)]
    for needed, launch in (launches if first else launches[::-1]):
        if needed:
            launch()
    if side != main:
        L.stream_wait(main, side, dev_index)
    lse = torch.empty((B, H_q, T_q), dtype=torch.float32, device=dev)
    one_launch = TUNE["merge_rotate"] if TUNE["merge_rotate"] is not None else rows * (D // 32) <= sms
    if R3 is not None and not one_launch:
        # more rows: the redundant merges would read the partials D / 32 times over; merge, then rotate
        o32 = torch.empty((B, H_q, T_q, D), dtype=torch.float32, device=dev)
        A._merge_launch(o_part, lse_part, o32, lse, rows, S_TOTAL, D)
        return rotate_heads(o32, R3, out_dtype), lse
    out = torch.empty((B, H_q, T_q, D), dtype=out_dtype, device=dev)
    if R3 is None:
        A._merge_launch(o_part, lse_part, out, lse, rows, S_TOTAL, D)
    else:
        # one wave of merge-rotate blocks (each merges its row again: free while the launch is latency-bound)
        L.run(L.kernel(_SRC, f"oscar_merge_rotate<{L.DT[out_dtype]}, {rt}>"), (rows, D // 32), (32, _ROT_SLICES),
              (o_part, lse_part, R3, out, lse, np.int64(rows), np.int32(S_TOTAL),
               np.int32(A.merge_warps_per_row(S_TOTAL)), np.int32(H_q), np.int32(T_q), np.int32(R3.shape[0])), dev)
    return out, lse


_ROT_SLICES = 8          # oscar_decode.cu RS_SLICES: partial sums per output channel of rotate_heads_f64


def _heads_R(R: torch.Tensor, x: torch.Tensor) -> tuple:
    """(R as a contiguous (H_R, D, D), its kernel type name) for the rows of x (B, H_q, T, D); ValueError
    unless R is float64 or float32 (D, D) or (H_R, D, D) with H_q % H_R == 0 and D <= 256."""
    Hq, D = x.shape[1], x.shape[3]
    R3 = R if R.dim() == 3 else R.unsqueeze(0)
    if (R3.dtype not in (torch.float64, torch.float32) or R3.shape[1:] != (D, D) or Hq % R3.shape[0]
            or D > 256):
        raise ValueError(f"rotate_heads takes float64 or float32 R (D, D) or (H_R, D, D) with H_q % H_R == 0 "
                         f"and D <= 256; got R {tuple(R.shape)} {R.dtype} for x {tuple(x.shape)}")
    return R3.contiguous(), "double" if R3.dtype == torch.float64 else "float"


def rotate_heads(x: torch.Tensor, R: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x R`` for a query-side tensor x (B, H_q, T, D): head h times ``R[h // (H_q / H_R)]`` (R float64
    or float32 (D, D) or (H_R, D, D) on x's device; float32 is read as float64: the sums of its values
    in float64, half the bytes to read: the decode passes the fp32 calibration so), float64 sums rounded
    to fp32 and then to ``out_dtype``: one launch of ``rotate_heads_f64`` (the decode's q and output
    rotations; the torch form is ``kvq.fast._oscar._rotate_heads``, the same sums in a library order)."""
    B, Hq, T, D = x.shape
    R3, rt = _heads_R(R, x)
    out = torch.empty((B, Hq, T, D), dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    fn = L.kernel(_SRC, f"rotate_heads_f64<{L.DT[x.dtype]}, {L.DT[out_dtype]}, {rt}>")
    L.run(fn, (B * Hq * T, (D + 31) // 32), (32, _ROT_SLICES),
          (x, R3, out, np.int32(Hq), np.int32(T), np.int32(R3.shape[0]), np.int32(D),
           *(np.int64(s) for s in x.stride())), x.device)
    return out
