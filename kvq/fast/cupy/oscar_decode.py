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
from dataclasses import dataclass, field

import numpy as np
import torch

from kvq.fast import common as C
from kvq.reference import oscar as RO

from . import _loader as L
from . import attention as A
from . import paged as PD
from . import plans as PL

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
    return PL.allow_smem(L.kernel(_SRC, f"oscar_decode_mma<{nr}>"), smem, device_index)


@dataclass(frozen=True)
class Knobs:
    """The launch knobs of ``decode`` (None: the automatic rule). Immutable and hashable (plans are cached
    per knobs); each rule and the H100 timings behind it: ``lab/2026-11-22-oscar-decode/KNOBS.md``."""

    tail_prec: int = 2                   # sink / window sums: 1 double, 2 four fp32 chains  KNOBS.md#tail_prec
    tail_first: bool | None = None       # the FP16 tail launched before the page kernel     KNOBS.md#tail_first
    merge_rotate: bool | None = None     # R_out applied in the merge's launch               KNOBS.md#merge_rotate
    #: the knobs this decode shares with the paged decode (side_stream; max_blocks_per_sm of the page
    #: kernel's split plan): ``lab/2026-11-22-kivi-kitty-decode/KNOBS.md``
    paged: PD.Knobs = field(default=PD.DEFAULT_KNOBS)

    def __post_init__(self):
        PL.check_choice("oscar_decode.Knobs", "tail_prec", self.tail_prec, (1, 2),
                        what=" (1 double, 2 four fp32 chains)")
        PL.check_optional_bool("oscar_decode.Knobs", "tail_first", self.tail_first)
        PL.check_optional_bool("oscar_decode.Knobs", "merge_rotate", self.merge_rotate)
        if not isinstance(self.paged, PD.Knobs):
            raise TypeError(f"oscar_decode.Knobs.paged must be a kvq.fast.cupy.paged.Knobs, got "
                            f"{type(self.paged).__name__}")


#: the defaults
DEFAULT_KNOBS = Knobs()


@dataclass(frozen=True)
class Plan:
    """Every launch decision of one ``decode`` call (``plan``): the FP16 tail's query tile ``tqt``, its
    query tiles, warps, keys per split and splits; the page kernel's warps, splits and pages per split;
    whether the tail runs on a side stream and launches first; whether the merge rotates (``one_launch``)."""

    tqt: int
    tqtiles: int
    tnw: int
    chunk: int
    nt: int
    nw: int
    n_split: int
    pps: int
    side: bool
    first: bool
    one_launch: bool


def plan(B: int, H: int, H_q: int, T_q: int, D: int, n_sink: int, n_win: int, n_pages: int, sms: int,
         slots: int, knobs: Knobs | None = None) -> Plan:
    """The launch plan of ``decode`` for a cache of ``n_sink`` + ``n_win`` FP16 tokens and ``n_pages`` pages,
    q (B, H_q, T_q, D), a device of ``sms`` SMs on which the page kernel holds ``slots`` blocks at once:
    arithmetic only (runs on the CPU), cached per arguments.

    The FP16 tokens: oscar_tail_attn (attn_split's body, natural units: the fp32 lse bound left no room for
    base-2 rounding here) over the sink and the window read in place as one sequence, one tile of keys
    per warp (it runs beside the page kernel: its latency counts). The page kernel: at most 2 blocks per SM
    while a split's B H blocks are fewer than the SMs (few_bases), else the paged decode's rule
    (``plans.fused_splits``; lab/2026-11-22-oscar-decode/KNOBS.md#page-splits)."""
    knobs = DEFAULT_KNOBS if knobs is None else knobs
    if not isinstance(knobs, Knobs):
        raise TypeError(f"knobs must be a kvq.fast.cupy.oscar_decode.Knobs or None, got {type(knobs).__name__}")
    return _plan(int(B), int(H), int(H_q), int(T_q), int(D), int(n_sink), int(n_win), int(n_pages), int(sms),
                 int(slots), knobs)


@functools.lru_cache(maxsize=1024)
def _plan(B, H, H_q, T_q, D, n_sink, n_win, n_pages, sms, slots, knobs) -> Plan:
    """plan's cached body (every argument given, so that one key names one call shape)."""
    M = (H_q // H) * T_q
    tqt = 4 if M <= 4 else 8
    tqtiles = -(-M // tqt)
    tnw = L.attn_warps(L.DT[torch.float16], D)
    NT = n_sink + n_win
    chunk, nt = A.split_sizes(NT, B * H * tqtiles, 32 * tnw, sms, tiles_per_warp=1) if NT else (0, 0)
    nw = PD.MMA_MAX_WARPS
    n_split = pps = 0
    if n_pages:
        n_split, pps = PL.fused_splits(n_pages, B * H, nw, slots, sms, few_bases=True,
                                       max_blocks_per_sm=knobs.paged.max_blocks_per_sm)
    first = knobs.tail_first if knobs.tail_first is not None else B * H * tqtiles >= sms
    rows = B * H_q * T_q
    one_launch = knobs.merge_rotate if knobs.merge_rotate is not None else rows * (D // 32) <= sms
    return Plan(tqt, tqtiles, tnw, chunk, nt, nw, n_split, pps, bool(nt and n_pages and knobs.paged.side_stream),
                bool(first), bool(one_launch))


@functools.lru_cache(maxsize=None)
def _tail_kernel(qt: int, nw: int, prec: int):
    if prec not in (1, 2):
        raise ValueError(f"oscar_decode.Knobs.tail_prec = {prec!r}: 1 (double) or 2 (four fp32 chains)")
    return A.max_carveout(L.kernel(_SRC, f"oscar_tail_attn<{qt}, {nw}, {prec}>"))


def decode(cfg, st, q_rot, *, scale=None, out_dtype=torch.float32, R_out=None, knobs: Knobs | None = None):
    """Attention of the rotated fp32 query over the whole cache: ``(out, lse fp32)``, out in ``out_dtype``
    (float32, or a half type: rounded once). ``R_out`` None: out in the rotated frame (the merge writes
    it); else out times ``R_out`` (as :func:`rotate_heads` takes it: the caller's R_V^T), the same bits
    either way as the merge to fp32 and then ``rotate_heads``: in the merge's launch
    (``oscar_merge_rotate``, whose D / 32 blocks per query row each merge the row) while those blocks
    are at most one per SM (batch 1 at 32 query heads), else by the merge and then ``rotate_heads``: the
    redundant merges' reads are free only while the launch is latency-bound (H100, OSCAR steps, ms, one
    launch / two: 1 x 64K 0.0374 / 0.0402; 8 x 64K 0.1615 / 0.1589, 32 x 32K 0.3273 / 0.3213; 32 x 128K
    1.022 / 1.040, within its run-to-run spread). Requires ``supported(cfg, st, q_rot)``. ``knobs``: the
    launch knobs (None: the defaults); every decision is ``plan``'s."""
    knobs = DEFAULT_KNOBS if knobs is None else knobs
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
    n1, NT = c["n_sink"], c["n_sink"] + c["n_win"]
    slots = 0
    if NP:
        nw = PD.MMA_MAX_WARPS
        smem = smem_bytes(nw)
        fn = _kernel(nr, smem, dev_index)
        slots = PL.resident_slots(fn, 32 * nw, smem, dev_index)
    p = plan(B, H, H_q, T_q, D, c["n_sink"], c["n_win"], NP, sms, slots, knobs)
    tqt, tqtiles, tnw, chunk, nt, n_split, pps = p.tqt, p.tqtiles, p.tnw, p.chunk, p.nt, p.n_split, p.pps
    S_TOTAL = n_split + nt
    rows = B * H_q * T_q
    o_part = torch.empty((S_TOTAL, rows, D), dtype=torch.float32, device=dev)
    lse_part = torch.empty((S_TOTAL, rows), dtype=torch.float32, device=dev)
    main = L.raw_stream(dev_index)                 # raw handles: the launches name their stream
    side = PL.side_stream(dev_index).cuda_stream if p.side else main
    tail_fn = _tail_kernel(tqt, tnw, knobs.tail_prec) if nt else None

    def launch_tail():
        sk, sv, wk, wv = st.sink_k, st.sink_v, st.win_k, st.win_v
        L.run_planned(tail_fn, (nt * tqtiles, H, B), (32 * tnw,), _TAIL_KINDS,
                      (qq.data_ptr(), sk.data_ptr(), sv.data_ptr(), wk.data_ptr(), wv.data_ptr(), sk.stride(0),
                       sk.stride(1), wk.stride(0), wk.stride(1), D, n1, o_part.data_ptr(), lse_part.data_ptr(),
                       *qq.stride()[:3], B, H_q, H, T_q, NT, chunk, nt, n_split, sc), dev_index,
                      stream=side)                                           # natural units

    def launch_pages():
        L.run_planned(fn, (n_split, H, B), (32 * nw,), _PAGES_KINDS,
                      (qq.data_ptr(), *qq.stride()[:3], st.k_codes.data_ptr(), st.k_scale.data_ptr(),
                       st.k_mn.data_ptr(), st.v_codes.data_ptr(), st.v_scale.data_ptr(), st.v_mn.data_ptr(),
                       st.table.data_ptr(), st.table.shape[1], o_part.data_ptr(), lse_part.data_ptr(), B, H_q, H,
                       T_q, NH, NP, pps, n_split, sc * LOG2E), dev_index, shared_mem=smem, stream=main)

    if side != main:
        L.stream_wait(side, main, dev_index)       # fork before either launch: they run side by side
    launches = [(nt, launch_tail), (n_split, launch_pages)]
    for needed, launch in (launches if p.first else launches[::-1]):
        if needed:
            launch()
    if side != main:
        L.stream_wait(main, side, dev_index)
    lse = torch.empty((B, H_q, T_q), dtype=torch.float32, device=dev)
    one_launch = p.one_launch
    if R3 is not None and not one_launch:
        # more rows: the redundant merges would read the partials D / 32 times over; merge, then rotate
        o32 = torch.empty((B, H_q, T_q, D), dtype=torch.float32, device=dev)
        A.merge_launch(o_part, lse_part, o32, lse, rows, S_TOTAL, D)
        return rotate_heads(o32, R3, out_dtype), lse
    out = torch.empty((B, H_q, T_q, D), dtype=out_dtype, device=dev)
    if R3 is None:
        A.merge_launch(o_part, lse_part, out, lse, rows, S_TOTAL, D)
    else:
        # one wave of merge-rotate blocks (each merges its row again: free while the launch is latency-bound)
        L.run_planned(L.kernel(_SRC, f"oscar_merge_rotate<{L.DT[out_dtype]}, {rt}>"), (rows, D // 32),
                      (32, _ROT_SLICES), _MERGE_ROTATE_KINDS,
                      (o_part.data_ptr(), lse_part.data_ptr(), R3.data_ptr(), out.data_ptr(), lse.data_ptr(), rows,
                       S_TOTAL, A.merge_warps_per_row(S_TOTAL), H_q, T_q, R3.shape[0]), dev_index, stream=main)
    return out, lse


#: the kernels' argument types (``_loader.planned``: each launch packed by its own packer), oscar_decode.cu's order
_T, _I32, _I64, _F32 = torch.Tensor, np.int32, np.int64, np.float32
_TAIL_KINDS = (_T,) * 5 + (_I64,) * 6 + (_T, _T) + (_I64,) * 3 + (_I32,) * 4 + (_I64, _I64, _I32, _I32, _F32)
_PAGES_KINDS = (_T,) + (_I64,) * 3 + (_T,) * 7 + (_I32, _T, _T) + (_I32,) * 8 + (_F32,)
_MERGE_ROTATE_KINDS = (_T,) * 5 + (_I64,) + (_I32,) * 5
_ROTATE_KINDS = (_T,) * 3 + (_I32,) * 4 + (_I64,) * 4

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
    rotations; the Triton kernel is ``kvq.fast.triton.oscar_decode.rotate_heads``)."""
    B, Hq, T, D = x.shape
    R3, rt = _heads_R(R, x)
    out = torch.empty((B, Hq, T, D), dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    fn = L.kernel(_SRC, f"rotate_heads_f64<{L.DT[x.dtype]}, {L.DT[out_dtype]}, {rt}>")
    dev = L.device_index(x.device)
    L.run_planned(fn, (B * Hq * T, (D + 31) // 32), (32, _ROT_SLICES), _ROTATE_KINDS,
                  (x.data_ptr(), R3.data_ptr(), out.data_ptr(), Hq, T, R3.shape[0], D, *x.stride()), dev)
    return out
