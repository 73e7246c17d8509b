"""CuPy decode over the paged streaming cache shared by ``kivi`` and ``kitty`` (``kvq.reference.paged``).

The state, its routing and its quantize+pack steps are ``kvq.fast.caches.paged`` (shared with the Triton
backend), run here with the bit-exact CuPy kernels (``OPS``); this module adds the decode kernels of
``paged.cu``.

    st = init(cfg, codec, batch=8, kv_heads=8, head_dim=128)       # on the current CUDA device
    append(cfg, codec, st, k, v)                                    # k, v: (B, H_kv, T_new, D) fp16
    out, lse = decode_attention(cfg, codec, st, q)                  # one fused kernel for the bulk

decode_attention: the tokens ``[S, S + NF)`` whose key AND value are both quantized (NF = min(key
pages * G, quantized values); key page j and value page j cover the same tokens) run through ONE
fused kernel (``paged_decode``): each warp copies a page (packed codes + metadata) into shared memory
with cp.async (the next page in flight), unpacks and dequantizes it in registers (bit-exact
``code * scale + mn``) and does flash-decoding with an fp32 online softmax on the CUDA cores. The few
other tokens (sink, key Q-buffer, value window / Q-buffer, mixed tokens: at most S + G + R + G) form
the tail, read in place beside the fused kernel (side streams) through ``attention.cu``'s split-kernel
body: ``paged_tail_attn`` (fp32 tiles: fp16 rows widened, the mixed tokens' page rows dequantized
bit-exactly) and, from one tail query tile per SM on, ``paged_tail16_attn`` for the rows whose key and
value are both fp16 (fp16 tiles by cp.async); float32 q (and ``Knobs(fused_tail=False)``) gathers
the tail first (``paged_gather_tail``) into one fp32 segment for ``attention.cu``'s split kernel. All
partials are merged by its log-sum-exp merge kernel.
The fused kernel takes G = 128, D in {64, 128}, fp16 metadata and value groups of a multiple of 4
channels; other configurations dequantize the cache and run the FP16-baseline kernels in fp32.
fp16 q with 2- or 4-bit keys and values (one value group per token, D = 128, <= 8 query rows per KV
head) takes the tensor-core kernel ``paged_decode_mma2``; float32 q is the precise path: every token is
gathered into the fp32 segment (double accumulators in ``attn_split``), none goes through a fused kernel.

Every choice above is a rule of ``decode_plan`` (planned once per configuration, shape, length, dtype,
device and ``Knobs``); ``Knobs`` are the frozen launch knobs a tuning run passes (``knobs=``), each pointing
to the lab note that measured its default; the device arithmetic (occupancy, the split-KV makespan model,
device limits, side streams) is ``kvq.fast.cupy.plans``, shared with the OSCAR and BitDecoding decodes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvq.fast import common as C
from kvq.fast.caches import paged as _paged
from kvq.fast.caches.codecs import Ops
from kvq.fast.caches.paged import (PagedState, append, counts, dequantize_cache, init,  # noqa: F401
                             max_pages, meta_dtype, quantize_values, segment_bounds)

from . import _flush as W
from . import _loader as L
from . import attention as A
from . import packing as P
from . import plans as PL
from . import quant as Q

#: the bit-exact CuPy kernels the shared paged cache (``kvq.fast.caches.paged``) quantizes and packs with, and
#: its single-kernel pool writers (``flush.cu``: key pages and evicted values straight into the pool, and a decode
#: token's whole append)
OPS = Ops("cupy", Q, P, lambda: False, key_flush=W.flush_key_pages, value_evict=W.evict_values,
          token_append=W.append_token)

_SRC = "paged.cu"
LOG2E = 1.4426950408889634
G_FUSED = 128
_SMEM_LIMIT = 200 * 1024            # dynamic shared memory a block may ask for (H100: 227 KiB)
_GATHER_THREADS = 256
GATHER_TOK, GATHER_MAXD = 16, 256  # paged.cu: tail tokens per gather block, head dims it takes
MMA_MAX_WARPS = 4                   # paged.cu KVQ_MMA_MAXW
MMA_BITS = (2, 4)                   # key / value code bits of paged_decode_mma2


@dataclass(frozen=True)
class Knobs:
    """The launch knobs of ``decode_attention`` (None: the automatic rule). Immutable and hashable: a
    decode plan is cached per knobs. Each field's rule and the H100 timings behind its default are in
    ``lab/2026-11-22-kivi-kitty-decode/KNOBS.md`` (the section of the field's name); a bad value is a
    ValueError here, before any launch."""

    num_warps: int | None = None          # fused kernel's warps per block (<= 4)            KNOBS.md#num_warps
    waves: float | None = None            # target fused blocks per SM (None: makespan model) KNOBS.md#waves
    mma: bool = True                      # tensor-core page kernel where it applies          KNOBS.md#mma
    side_stream: bool = True              # the tail beside the fused kernel on side streams  KNOBS.md#side_stream
    fused_tail: bool = True               # half-precision q reads the tail in place          KNOBS.md#fused_tail
    tail_tiles: int = 1                   # at least this many 32-key tiles per tail warp     KNOBS.md#tail_tiles
    tail_first: bool = False              # the tail launched before the fused kernel         KNOBS.md#tail_first
    tail16: bool | None = None            # fp16 tail rows as fp16 tiles, apart              KNOBS.md#tail16
    tail_warps: int | None = None         # paged_tail_attn's warps per block                 KNOBS.md#tail_warps
    tail16_warps: int | None = None       # paged_tail16_attn's warps per block               KNOBS.md#tail16_warps
    max_blocks_per_sm: int | None = None  # fused split count planned on at most this many    KNOBS.md#max_blocks_per_sm
    tail_sums: int = 2                    # FP16 tail's score sums: 2 four fp32 chains, 1 f64 KNOBS.md#tail_sums
    tail_mma: bool | None = None          # fp16 tail rows on the tensor cores                KNOBS.md#tail_mma
    tail_mma_warps: int | None = None     # paged_tail_mma's warps per block                  KNOBS.md#tail_mma_warps
    mixed_mma: bool | None = None         # mixed tail rows on the tensor cores               KNOBS.md#mixed_mma

    def __post_init__(self):
        o = "paged.Knobs"
        PL.check_positive(o, "num_warps", self.num_warps, optional=True)     # (more than 4: 4)
        PL.check_positive(o, "waves", self.waves, optional=True, number=True)
        for name in ("mma", "side_stream", "fused_tail", "tail_first"):
            PL.check_bool(o, name, getattr(self, name))
        PL.check_positive(o, "tail_tiles", self.tail_tiles)
        for name in ("tail16", "tail_mma", "mixed_mma"):
            PL.check_optional_bool(o, name, getattr(self, name))
        for name in ("tail_warps", "tail16_warps", "tail_mma_warps"):
            PL.check_choice(o, name, getattr(self, name), L.PAGED_TAIL_WARPS, optional=True,
                            what=": the tail kernels are built for these warp counts")
        PL.check_positive(o, "max_blocks_per_sm", self.max_blocks_per_sm, optional=True)
        PL.check_choice(o, "tail_sums", self.tail_sums, L.TAIL_SUMS,
                        what=" (1 float64 sums, 2 four fp32 fma chains)")


#: the defaults
DEFAULT_KNOBS = Knobs()


def _buf_bytes(D: int, k_bits: int, v_bits: int, kitty: bool, ngv: int, db: int) -> int:
    """Bytes of one page buffer (paged.cu PageBuf::bytes, the same formula)."""
    G = G_FUSED
    gb = G * k_bits // 8
    n = D * gb + 2 * D * 2 + (D if kitty else 0) + G * (D * v_bits // 8) + 2 * G * ngv * 2
    return n + (db * gb if kitty else 0)


def _smem_bytes(D: int, QT: int, nw: int, buf: int) -> int:
    return QT * D * 4 + nw * (G_FUSED * QT * 4 + 2 * buf)


def fused_ok(cfg, D: int) -> bool:
    """Whether the fused kernel takes this configuration (else decode dequantizes the whole cache)."""
    Gv = cfg.v_group(D)
    return (cfg.group_size == G_FUSED and D in L.PAGED_DIMS and Gv % 4 == 0
            and meta_dtype(cfg) == torch.float16)


@functools.lru_cache(maxsize=None)
def _decode_kernel(D: int, k_bits: int, v_bits: int, kitty: bool, QT: int, smem: int, device_index: int):
    """paged_decode for these template values, allowed ``smem`` bytes of dynamic shared memory (the
    attributes are per device: set with that device current)."""
    return PL.allow_smem(L.kernel(_SRC, L.paged_decode_name(D, k_bits, v_bits, kitty, QT)), smem, device_index)


@functools.lru_cache(maxsize=None)
def _mma_kernel(kitty: bool, nr: int, k_bits: int, v_bits: int, smem: int, device_index: int):
    """paged_decode_mma2<kitty, nr, k_bits, v_bits> (nr = 4 or 8 query rows), allowed ``smem`` bytes of
    dynamic shared memory on that device."""
    return PL.allow_smem(L.kernel(_SRC, L.mma2_name(kitty, nr, k_bits, v_bits)), smem, device_index)


def _mma2_smem(kitty: bool, db: int, nw: int, k_bits: int = 2, v_bits: int = 2) -> int:
    """Dynamic shared memory of paged_decode_mma2: the queries (8 x 128: fp32, and fp16 hi and lo) and per
    warp a key slot (codes, scale, mn; Kitty: idx and high plane) and a value slot (codes, scale, mn)."""
    D, G = 128, G_FUSED
    kslot = D * 16 * k_bits + 4 * D + ((D + db * 32) if kitty else 0)
    vslot = G * 16 * v_bits + 4 * G
    return 8 * D * 8 + nw * (kslot + vslot)


def _aligned(*ts) -> bool:
    """Whether every tensor is contiguous with a 16-byte aligned start (the fused kernels' cp.async)."""
    for t in ts:
        if t.data_ptr() & 15 or not t.is_contiguous():
            return False
    return True


def _tail_warp_bytes(D: int, fp16: bool = False) -> int:
    """One warp's tiles in paged_tail_attn (fp32) or paged_tail16_attn (fp16): _loader.attn_warp_bytes."""
    return L.attn_warp_bytes(L.DT[torch.float16 if fp16 else torch.float32], D)


@functools.lru_cache(maxsize=None)
def _tail_kernel(D: int, QT: int, q_dt: int, fp16: bool, nw: int, device_index: int, sums: int):
    """paged_tail16_attn (fp16) or paged_tail_attn with nw warps and score sums ``sums`` (L.TAIL_SUMS),
    allowed the dynamic shared memory of their tiles on that device (set once, not per decode)."""
    return PL.allow_smem(L.kernel(_SRC, L.paged_tail_name(D, QT, q_dt, fp16, nw, sums)),
                       nw * _tail_warp_bytes(D, fp16), device_index)


def _tail_sums(knobs: Knobs = DEFAULT_KNOBS) -> int:
    """``knobs.tail_sums``: one of L.TAIL_SUMS (1 float64, 2 four fp32 fma chains; checked by Knobs)."""
    return knobs.tail_sums


@functools.lru_cache(maxsize=None)
def _tail_mma_kernel(nw: int, device_index: int):
    """paged_tail_mma with nw warps, allowed the dynamic shared memory of its tiles on that device."""
    return PL.allow_smem(L.kernel(_SRC, L.paged_tail_mma_name(nw)), nw * L.tail_mma_warp_bytes(), device_index)


#: _tail_mma_ok: the automatic rule takes the tensor-core tail where its fp16 rows are at least this
#: fraction (1 / TAIL_MMA_SHARE) of the tokens the fused kernel reads (or there is no fused kernel)
TAIL_MMA_SHARE = 64
#: ... or, where the fp16 rows hold a sink (Kitty's S = 32) and the tail's blocks fill a quarter of the SMs
#: but not all of them, at least 1 / TAIL_MMA_SINK_SHARE of the fused tokens: the sink rows then leave
#: the mixed-row kernel, which is the step's critical path there (H100, Kitty 8 x 8K at T = 8224: mixed
#: rows 0.2 -> 40.4 us beside a 28.5 us page kernel; with the sink on the tensor cores the step is 39.3 us,
#: not 43.4; lab/2026-11-23-phase-sweep/results/h100-fd9acd6-tail-rule)
TAIL_MMA_SINK_SHARE = 256


def _tail_mma_ok(q, D: int, in_place: bool, fp16_rows: int, fused_rows: int, blocks: int, sms: int,
                 sink_rows: int = 0, knobs: Knobs = DEFAULT_KNOBS) -> bool:
    """Whether decode puts the fp16 tail rows on the tensor cores: ``knobs.tail_mma`` True / False, or None
    (auto): fp16 q, D = 128, the tail read in place, the tail's (sequence, kv head, query tile) ``blocks``
    at least a quarter of the ``sms`` (H100, Kitty 1 x 8K: 0.023 ms with it, 0.020 without: at batch 1
    the step is a few latencies long and the extra launch adds one), and fp16 rows >= fused rows /
    TAIL_MMA_SHARE, or, with ``sink_rows`` among them and fewer blocks than SMs, fp16 rows >= fused rows /
    TAIL_MMA_SINK_SHARE (H100, phase means over T = 8192 + {0, 32, 64, 96}: Kitty 8 x 8K 43.8 -> 42.4 us;
    32 x 8K, whose blocks fill the SMs, 117.0 -> 119.8 us with it, so not there)."""
    want = knobs.tail_mma
    able = in_place and q.dtype == torch.float16 and D == 128 and fp16_rows > 0
    share = TAIL_MMA_SINK_SHARE if sink_rows > 0 and blocks < sms else TAIL_MMA_SHARE
    auto = fp16_rows * share >= fused_rows and 4 * blocks >= sms
    return able and (want or (want is None and auto))


@functools.lru_cache(maxsize=None)
def _mixed_mma_kernel(nw: int, device_index: int):
    """paged_mixed_mma with nw warps, allowed the dynamic shared memory of its tiles on that device."""
    return PL.allow_smem(L.kernel(_SRC, L.paged_mixed_mma_name(nw)), nw * L.mixed_mma_warp_bytes(), device_index)


def _mixed_mma_ok(q, D: int, in_place: bool, key_page_rows: int, value_page_rows: int,
                  costly_launch: bool = False, knobs: Knobs = DEFAULT_KNOBS) -> bool:
    """Whether decode puts the mixed tail rows on the tensor cores (paged_mixed_mma): ``knobs.mixed_mma``
    True where it applies, False never, None (auto) where it applies unless ``costly_launch``: the tail's
    fp16 rows would then take a launch of their own beside a long fused grid, where they otherwise share
    one with the mixed rows (H100, Kitty 1 x 128K, ms with / without: 0.0551 / 0.0497; at 1 x 32K, whose
    fused grid is short, 0.0255 / 0.0263). It applies to fp16 q, D = 128, the tail read in place, and
    mixed rows that all have their key in a page and their value in fp16: the key pages reach past the
    quantized values (``key_page_rows`` > ``value_page_rows``: KIVI's and Kitty's value window or Q-buffer
    beside full key pages), unless ``knobs.tail16 = False`` keeps every tail row in one paged_tail_attn
    launch."""
    want = knobs.mixed_mma
    able = (in_place and q.dtype == torch.float16 and D == 128 and key_page_rows > value_page_rows
            and knobs.tail16 is not False)
    return able and (want is True or (want is None and not costly_launch))


def _tail_mma_warps(device_index: int, fused_per_sm: int = 0, knobs: Knobs = DEFAULT_KNOBS) -> int:
    """Warps per block of paged_tail_mma: ``knobs.tail_mma_warps`` (one of _loader.PAGED_TAIL_WARPS) or, None,
    4, or 2 beside a fused grid of at most two blocks per SM (``fused_per_sm``, 0: no fused kernel), whose
    SMs also take a mixed-row block (``_tail_warps``'s ``other``); at most what one block may hold."""
    want = knobs.tail_mma_warps
    if want is None:
        want = 2 if 0 < fused_per_sm <= 2 else 4
    optin = PL.smem_optin(device_index)
    fits = [n for n in L.PAGED_TAIL_WARPS if n * L.tail_mma_warp_bytes() <= optin and n <= want]
    return max(fits) if fits else 1


#: _tail_warps: a fused grid of at most two blocks per SM (the small-grid plan) whose warps take at most
#: this many pages is short enough that a tail waiting for SM room would lengthen the step
SHORT_PAGES_PER_WARP = 2


def _tail_warps(D: int, device_index: int, fused_block: int = 0, fp16: bool = False, tail_static=None,
                fused_per_sm: int = 2, fused_resident: int = 2, fused_pages_per_warp: int = 0, other: int = 0,
                warp_bytes: int = 0, knobs: Knobs = DEFAULT_KNOBS) -> int:
    """Warps per block of paged_tail_attn, or with ``fp16`` of paged_tail16_attn (one warp always fits:
    33 / 16.5 KiB of fp32 / fp16 tiles at D = 128).

    ``knobs.tail_warps`` (``knobs.tail16_warps``) = n: the most of _loader.PAGED_TAIL_WARPS up to n
    whose tiles one block may hold on the device. None (auto): of those, the most whose block fits in an
    SM's shared memory beside the ``fused_per_sm`` fused blocks the launch puts on an SM, where the tail
    would otherwise wait for them: the fused kernel holds at most two blocks per SM all along
    (``fused_resident``, its resource limit: KIVI-K4V4), or its grid is small (at most two per SM) and short
    (at most SHORT_PAGES_PER_WARP pages per warp: batch 1 at 32K); else the most warps (larger tail blocks
    are the faster where the tail's blocks find room: on full grids, or in the free slots of a longer small
    grid). ``fused_block``: the fused kernel's shared memory per block, dynamic plus static (0: no fused
    kernel); ``tail_static(n)``: the n-warp tail kernel's static shared memory (None: 0); every block also
    costs the driver's reserve (plans.device_limits). ``other``: the dynamic shared memory of a paged_tail_mma
    block that shares the SMs (0: none); beside a fused grid of at most two blocks per SM the tail block
    must fit next to both (H100, Kitty 8 x 8K with the tensor-core tail: 0.0446 ms at 2 warps, 0.0499 at
    4). ``warp_bytes``: one warp's dynamic shared memory where the kernel is not paged_tail_attn /
    paged_tail16_attn (paged_mixed_mma: _loader.mixed_mma_warp_bytes; 0: theirs). H100 (profile_fused, Kitty,
    tail warps 2 / 4, ms): 1 x 32K
    0.0298 / 0.0351 (a 4-warp tail, 140.4 KiB, does not fit beside two 49.4 KiB Kitty blocks), 1 x 128K
    0.0611 / 0.0589, 8 x 8K 0.0580 / 0.0519, 8 x 32K 0.118 / 0.110, 32 x 32K 0.365 / 0.352; KIVI-K4V4 8 x
    32K 0.120 / 0.129 (2 blocks per SM all along)."""
    want = knobs.tail16_warps if fp16 else knobs.tail_warps
    beside = bool(fused_block) and want is None and fused_per_sm <= 2 and (
        fused_resident <= 2 or fused_pages_per_warp <= SHORT_PAGES_PER_WARP or other > 0)
    optin = PL.smem_optin(device_index)
    if beside:
        _, shm, _, reserved = PL.device_limits(device_index)
    for n in sorted((n for n in L.PAGED_TAIL_WARPS if n > 1 and n <= (want or n)), reverse=True):
        tb = n * (warp_bytes or _tail_warp_bytes(D, fp16))
        if tb > optin:
            continue
        if not beside:
            return n
        tail = tb + (tail_static(n) if tail_static is not None else 0) + reserved + (other + reserved if other else 0)
        if shm - tail >= fused_per_sm * (fused_block + reserved):
            return n
    return 1


def _check_tail_dims(G: int, D: int) -> None:
    """The tail kernels' page size and head dims (ValueError otherwise)."""
    if G != G_FUSED or D > GATHER_MAXD or _GATHER_THREADS % D:
        raise ValueError(f"group_size={G}, head_dim={D}: the tail takes G = {G_FUSED} and a head dim "
                         f"that divides {_GATHER_THREADS}")


def _tail_ints(cfg, H: int, D: int, c: dict, NF: int, n_table: int, db: int, scale_f32: bool) -> tuple:
    """paged.cu's TailRows integers (KVQ_TAIL_INTS) for counts ``c``, ``NF`` fused tokens, page tables of
    ``n_table`` entries, ``db`` boosted channels and fp32 (or fp16) key metadata."""
    return tuple(np.int32(x) for x in (
        H, cfg.sink, c["n_sink"], NF, c["n_kpages"] * cfg.group_size, c["n_vq"], c["n_vbuf"], max(cfg.residual, 1),
        n_table, D // cfg.v_group(D), db, int(scale_f32)))


def _tail_rows(cfg, codec, st: PagedState, NF: int, kp: dict | None = None):
    """(NT, pointer arguments, int arguments) of paged.cu's TailRows (KVQ_TAIL_PARAMS, KVQ_TAIL_INTS): the
    tail's rows are the sink, then the post-sink tokens [NF, T - S) in token order."""
    B, H, D = st.shape
    c = counts(cfg, st.length)
    NT = c["n_sink"] + (c["post"] - NF)
    _check_tail_dims(cfg.group_size, D)
    kp = kp if kp is not None else codec.kernel_arrays(cfg, st)
    ptrs = (st.sink_k, st.sink_v, st.k_buf, st.v_buf, st.v_win, kp["codes"], kp["high"], kp["idx"], kp["scale"],
            kp["mn"], st.v_codes, st.v_scale, st.v_mn, st.k_table, st.v_table)
    ints = _tail_ints(cfg, H, D, c, NF, st.k_table.shape[1], kp["d_boost"], kp["scale"].dtype == torch.float32)
    return NT, ptrs, ints


def gather_tail(cfg, codec, st: PagedState, NF: int):
    """K, V fp32 (B, H, NT, D) of the tokens outside the fused range: the sink, then post-sink tokens
    [NF, T - S) in token order (one kernel; bit-exact with the reference's dequantize)."""
    B, H, D = st.shape
    kp = codec.kernel_arrays(cfg, st)
    NT, ptrs, ints = _tail_rows(cfg, codec, st, NF, kp)
    ok = torch.empty((B, H, NT, D), dtype=torch.float32, device=st.device)
    ov = torch.empty_like(ok)
    if NT == 0:
        return ok, ov
    fn = L.kernel(_SRC, L.gather_tail_name(kp["bits"], cfg.v_bits, bool(kp["kitty"])))
    L.run(fn, (-(-NT // GATHER_TOK), H, B), (_GATHER_THREADS,),
          (*ptrs, ok, ov, np.int32(B), np.int32(NT), np.int32(D), *ints), st.device)
    return ok, ov


def _plan(D: int, k_bits: int, v_bits: int, kitty: bool, ngv: int, db: int, QT: int, mma: bool = False,
          knobs: Knobs = DEFAULT_KNOBS):
    """(warps per block, dynamic shared memory bytes) of the fused kernel (``mma``: paged_decode_mma2)."""
    buf = _buf_bytes(D, k_bits, v_bits, kitty, ngv, db)
    smem = (lambda nw: _mma2_smem(kitty, db, nw, k_bits, v_bits)) if mma else (lambda nw: _smem_bytes(D, QT, nw, buf))
    nw = knobs.num_warps or 4
    nw = max(1, min(MMA_MAX_WARPS if mma else 4, nw))
    while nw > 1 and smem(nw) > _SMEM_LIMIT:
        nw -= 1
    return nw, smem(nw)


def mma_ok(cfg, kp: dict, q, D: int, M: int, knobs: Knobs = DEFAULT_KNOBS) -> bool:
    """Whether decode takes the tensor-core kernel (paged_decode_mma2): fp16 q, D = 128, 2- or 4-bit key
    codes (KIVI-K2 / K4, or Kitty's planes) and values, one value group per token, at most 8 query rows
    per KV head (``knobs.mma``: False never)."""
    return (knobs.mma and q.dtype == torch.float16 and D == 128 and kp["bits"] in MMA_BITS
            and cfg.v_bits in MMA_BITS and cfg.v_group(D) == D and M <= 8)


# ---------------------------------------------------------------------------------------------------
# decode: a launch plan per (configuration, shape, length, dtype, device), then its launches

# the per-call values of a plan's launches (``_loader.Slot`` indices): q, its strides, the two softmax scales
# (base 2 and natural), the partials, the output, then the state's tensors
(_Q, _QS0, _QS1, _QS2, _QK2, _QK, _O_PART, _LSE_PART, _OUT, _LSE, _K_CODES, _K_HIGH, _K_IDX, _K_SCALE, _K_MN,
 _V_CODES, _V_SCALE, _V_MN, _K_TABLE, _V_TABLE, _SINK_K, _SINK_V, _K_BUF, _V_BUF, _V_WIN) = range(25)
_SLOT_TYPES = {**{i: torch.Tensor for i in range(25)}, _QS0: np.int64, _QS1: np.int64, _QS2: np.int64,
               _QK2: np.float32, _QK: np.float32}
_S = L.Slot
#: paged.cu's TailRows pointers (KVQ_TAIL_PARAMS), as slots
_TAIL_PTRS = tuple(_S(i) for i in (_SINK_K, _SINK_V, _K_BUF, _V_BUF, _V_WIN, _K_CODES, _K_HIGH, _K_IDX, _K_SCALE,
                                   _K_MN, _V_CODES, _V_SCALE, _V_MN, _K_TABLE, _V_TABLE))
#: decode plans kept (least recently used dropped): a model step attends every layer at one length, so its
#: layers share one plan, and a generation moves on by one token per step
PLAN_CACHE_SIZE = 256


@dataclass(frozen=True)
class _Gather:
    """The precise path's tail (float32 q, or ``Knobs(fused_tail=False)``): paged_gather_tail copies the
    tail into fp32 at each call, then attention.cu's split kernel reads the copy."""

    NF: int
    fn: object
    grid: tuple
    block: int
    side: object          # the side torch stream, or None: the caller's stream
    dims: tuple           # B, H_q, H, T_q
    common: tuple         # rows, keys per split, splits, first split
    precise: bool


@dataclass(frozen=True)
class DecodePlan:
    """Every launch of one decode call, planned once (``decode_plan``): ``fallback`` (the configuration is
    not the fused kernel's: dequantize and attend), else ``launches`` ((raw side stream or None for the
    caller's stream, ``_loader.Prepared`` or ``_Gather``) in launch order), ``sides`` (the side streams to
    fork from and join back into the caller's stream), ``n_partials`` x ``rows`` fp32 partials, ``merge``."""

    fallback: bool
    launches: tuple = ()
    sides: tuple = ()
    n_partials: int = 0
    rows: int = 0
    merge: object = None
    device_index: int = 0


class _QMeta:
    """What the planning rules read of q (its dtype): a plan outlives the call's tensors."""

    __slots__ = ("dtype",)

    def __init__(self, dtype):
        self.dtype = dtype


def decode_plan(cfg, codec, st: PagedState, q, kp: dict | None = None, knobs: Knobs | None = None) -> DecodePlan:
    """The launch plan of ``decode_attention(cfg, codec, st, q, knobs=knobs)``: computed once per
    (configuration, codec, cache shape and length, q's dtype and query shape, device, knobs) and reused (an
    LRU of PLAN_CACHE_SIZE plans); it holds kernels, grids, shared memory and every integer argument, and the
    call fills in the tensors' addresses, q's strides and the scale. ``kp``: the codec's kernel arrays of
    ``st``, where the caller has them; ``knobs``: a ``Knobs`` (None: the defaults)."""
    knobs = _knobs(knobs)
    kp = codec.kernel_arrays(cfg, st) if kp is None else kp
    dev = q.device
    aligned = _aligned(kp["codes"], kp["high"], kp["idx"], kp["scale"], kp["mn"], st.v_codes, st.v_scale, st.v_mn)
    return _decode_plan(cfg, st.shape, st.length, q.dtype, q.shape[1], q.shape[2],
                        dev.index if dev.index is not None else torch.cuda.current_device(),
                        kp["bits"], bool(kp["kitty"]), int(kp["d_boost"]), kp["scale"].dtype == torch.float32,
                        int(st.k_table.shape[1]), aligned, knobs)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _decode_plan(cfg, shape, T, q_dtype, H_q, T_q, dev_index, k_bits, kitty, db, scale_f32, n_table, aligned,
                 knobs: Knobs) -> DecodePlan:
    """decode_plan's cached body: a function of its arguments only (the device's limits are read through
    ``plans``, once per device; the kernels' attributes once per kernel)."""
    B, H, D = shape
    if not (fused_ok(cfg, D) and aligned):
        return DecodePlan(True, device_index=dev_index)
    q = _QMeta(q_dtype)
    kp = {"bits": k_bits, "kitty": kitty, "d_boost": db}
    c = counts(cfg, T)
    G = cfg.group_size
    # float32 q is the precise path: every token goes through the fp32 segment kernel (double
    # accumulators, natural-log softmax), none through the fused 2-bit kernel
    NF = 0 if q_dtype == torch.float32 else min(c["n_kpages"] * G, c["n_vq"])
    NP = -(-NF // G)
    G_q = H_q // H
    M = G_q * T_q
    QT = 4 if M <= 4 else 8
    qtiles = -(-M // QT)
    sms = L.sm_count(dev_index)
    ngv = D // cfg.v_group(D)
    mma = mma_ok(cfg, kp, q, D, M, knobs)
    nr = 4 if M <= 4 else 8                           # the tensor-core kernel's query rows
    if mma:
        QT, qtiles = 8, 1
    # fused splits: by the makespan model at the kernel's occupancy (or about knobs.waves blocks
    # per SM), each warp at least one page
    n_split = pps = nw = smem = per_sm = resident = fused_block = 0
    fn = None
    if NP:
        nw, smem = _plan(D, k_bits, cfg.v_bits, kitty, ngv, db, QT, mma, knobs)
        fn = (_mma_kernel(kitty, nr, k_bits, cfg.v_bits, smem, dev_index) if mma
              else _decode_kernel(D, k_bits, cfg.v_bits, kitty, QT, smem, dev_index))
        slots = PL.resident_slots(fn, 32 * nw, smem, dev_index)
        if knobs.waves is None:
            n_split, pps = PL.fused_splits(NP, B * H * qtiles, nw, slots, sms,
                                           max_blocks_per_sm=knobs.max_blocks_per_sm)
        else:
            want = max(1, -(-int(knobs.waves * sms) // (B * H * qtiles)))
            pps = -(-NP // min(want, NP))
            pps = -(-pps // nw) * nw                  # whole pages for every warp of a block
            n_split = -(-NP // pps)
        # the fused blocks an SM may hold and holds in this launch, and their shared memory each
        # (_tail_warps: whether the tail fits beside them)
        resident = slots // sms
        per_sm = min(resident, -(-(n_split * qtiles * H * B) // sms))
        fused_block = smem + L.static_smem(fn)
    # the rest (the tail): sink + tokens [S + NF, T), on a side stream beside the fused kernel. Half-
    # precision q reads it in place: the rows whose key and value are both fp16 as fp16 tiles
    # (paged_tail16_attn), the mixed rows [NS, NS + n_mixed) (a key or a value from a page) as fp32 tiles
    # (paged_tail_attn); knobs.tail16 = False: every tail row through paged_tail_attn. float32 q (the
    # precise path: double accumulators, natural units) and knobs.fused_tail = False gather the tail
    # into one fp32 segment (paged_gather_tail) for attention.cu's split kernel.
    NT = c["n_sink"] + c["post"] - NF
    precise = q_dtype == torch.float32
    in_place = not precise and knobs.fused_tail
    tqt = 4 if M <= 4 else 8                          # the tail's own query tile (attention.cu's QT)
    tqtiles = -(-M // tqt)
    n_mixed = max(c["n_kpages"] * G, c["n_vq"]) - NF
    sums = _tail_sums(knobs)
    if not in_place:
        parts = [("gather", NT, 0)]
    else:
        tmma = _tail_mma_ok(q, D, in_place, NT - n_mixed, NF, B * H * -(-M // 8), sms, c["n_sink"], knobs)
        split16 = knobs.tail16 if knobs.tail16 is not None else B * H * tqtiles >= sms
        # paged_mixed_mma: the fp16 rows then launch apart, which costs where they would share the mixed
        # rows' launch beside a long fused grid
        costly = NT > n_mixed and not (tmma or split16) and NP and pps // nw > SHORT_PAGES_PER_WARP
        page_keys = _mixed_mma_ok(q, D, in_place, c["n_kpages"] * G, c["n_vq"], bool(costly), knobs)
        mixed = "mixed_mma" if n_mixed and page_keys else "mixed"
        if tmma:
            parts = [("mma", NT - n_mixed, 0), (mixed, n_mixed, c["n_sink"])]
        elif mixed == "mixed_mma" or split16:
            parts = [("fp16", NT - n_mixed, 0), (mixed, n_mixed, c["n_sink"])]
        else:
            parts = [("mixed", NT, 0)]

    def tail_warps(kind):
        if kind == "gather":
            return L.attn_warps(L.DT[torch.float32], D)
        if kind == "mma":
            return _tail_mma_warps(dev_index, per_sm, knobs)
        f16 = kind == "fp16"
        mm = kind == "mixed_mma"
        other = (_tail_mma_warps(dev_index, per_sm, knobs) * L.tail_mma_warp_bytes()
                 if any(p[0] == "mma" and p[1] > 0 for p in parts) else 0)
        static = ((lambda n: L.static_smem(_mixed_mma_kernel(n, dev_index))) if mm else
                  (lambda n: L.static_smem(_tail_kernel(D, tqt, L.DT[q_dtype], f16, n, dev_index, sums))))
        return _tail_warps(D, dev_index, fused_block, f16, static, per_sm, resident, pps // nw if NP else 0, other,
                           L.mixed_mma_warp_bytes() if mm else 0, knobs)

    # query tiles of each kind's kernel: attention.cu's QT rows, paged_tail_mma's 8
    qtiles_of = {"mma": -(-M // 8), "mixed_mma": -(-M // 8)}
    # (kind, rows, first tail row or skipped rows, warps per block, keys per split, splits)
    parts = [(kind, rows, u, nw_t, *A.split_sizes(rows, B * H * qtiles_of.get(kind, tqtiles), 32 * nw_t, sms,
                                              knobs.tail_tiles))
             for kind, rows, u in parts if rows > 0 for nw_t in (tail_warps(kind),)]
    nt = sum(p[-1] for p in parts)
    S_TOTAL = n_split + nt
    rows = B * H_q * T_q
    # the tail's parts each on their own side stream (side by side with the fused kernel and each other)
    side_objs = [PL.side_stream(dev_index, k) if n_split and knobs.side_stream else None
                 for k in range(len(parts))]

    ints = _tail_ints(cfg, H, D, c, NF, n_table, db, scale_f32)           # paged.cu's TailRows integers
    if in_place and nt:
        _check_tail_dims(G, D)
    qs = (_S(_QS0), _S(_QS1), _S(_QS2))
    dims = (np.int32(B), np.int32(H_q))
    tail = []
    split0 = n_split
    for side_obj, (kind, n_rows, u, nw_t, chunk, n) in zip(side_objs, parts):
        side = None if side_obj is None else side_obj.cuda_stream
        grid = (n * qtiles_of.get(kind, tqtiles), H, B)
        if kind == "gather":
            fn_t = (A.split_kernel(L.DT[torch.float32], D, tqt, nw_t) if precise else
                    A.split_kernel(L.DT[torch.float32], D, tqt, nw_t, L.DT[q_dtype], sums=sums))
            tail.append((side, _Gather(NF, fn_t, grid, 32 * nw_t, side_obj, (B, H_q, H, T_q),
                                       (n_rows, chunk, n, split0), precise)))
            split0 += n
            continue
        common = (np.int64(n_rows), np.int64(chunk), np.int32(n), np.int32(split0), _S(_QK2))
        parts_o = (_S(_O_PART), _S(_LSE_PART))
        if kind == "mma":
            fn_t, sm = _tail_mma_kernel(nw_t, dev_index), nw_t * L.tail_mma_warp_bytes()
            args = (_S(_Q), *_TAIL_PTRS, np.int32(c["n_sink"]), np.int32(n_mixed), *parts_o, *qs, *dims,
                    np.int32(T_q), *common, *ints)
        elif kind == "mixed_mma":
            fn_t, sm = _mixed_mma_kernel(nw_t, dev_index), nw_t * L.mixed_mma_warp_bytes()
            args = (_S(_Q), *_TAIL_PTRS, np.int32(k_bits), np.int32(kitty), np.int32(u), *parts_o, *qs, *dims,
                    np.int32(T_q), *common, *ints)
        else:
            f16 = kind == "fp16"
            fn_t, sm = _tail_kernel(D, tqt, L.DT[q_dtype], f16, nw_t, dev_index, sums), nw_t * _tail_warp_bytes(D, f16)
            where = ((np.int32(c["n_sink"]), np.int32(n_mixed)) if f16 else
                     (np.int32(k_bits), np.int32(cfg.v_bits), np.int32(kitty), np.int32(u)))
            args = (_S(_Q), *_TAIL_PTRS, *where, *parts_o, *qs, *dims, np.int32(T_q), *common, *ints)
        tail.append((side, L.Prepared(fn_t, grid, (32 * nw_t,), args, sm, _SLOT_TYPES)))   # dynamic: the tiles
        split0 += n

    fused = []
    if n_split:
        args = (_S(_Q), np.int32(L.DT[q_dtype]), *qs, _S(_K_CODES), _S(_K_HIGH), _S(_K_IDX), _S(_K_SCALE),
                _S(_K_MN), _S(_V_CODES), _S(_V_SCALE), _S(_V_MN), _S(_K_TABLE), _S(_V_TABLE), np.int32(n_table),
                _S(_O_PART), _S(_LSE_PART), np.int32(B), np.int32(H_q), np.int32(H), np.int32(T_q), np.int32(NF),
                np.int32(NP), np.int32(pps), np.int32(n_split), np.int32(db), np.int32(ngv), _S(_QK2))
        fused = [(None, L.Prepared(fn, (n_split * qtiles, H, B), (32 * nw,), args, smem, _SLOT_TYPES))]
    # the tail's blocks first (they take SM slots before the fused grid fills them: the latency of a
    # small step) or the fused grid first (knobs.tail_first = False: its makespan model sees every slot)
    launches = tail + fused if knobs.tail_first else fused + tail
    sides = tuple(sorted({side for side, _ in tail if side is not None}))
    merge = A.merge_prepared(rows, S_TOTAL, D, q_dtype, (_S(_O_PART), _S(_LSE_PART), _S(_OUT), _S(_LSE)))
    return DecodePlan(False, tuple(launches), sides, S_TOTAL, rows, merge, dev_index)


def _knobs(knobs) -> Knobs:
    """``knobs``, or the defaults for None; TypeError for anything but a ``Knobs``."""
    if knobs is None:
        return DEFAULT_KNOBS
    if not isinstance(knobs, Knobs):
        raise TypeError(f"knobs must be a kvq.fast.cupy.paged.Knobs or None, got {type(knobs).__name__}")
    return knobs


def decode_attention(cfg, codec, st: PagedState, q, *, scale=None, knobs: Knobs | None = None):
    """Attention of q (B, H_q, T_q, D) over the cache: ``(out in q's dtype, lse fp32)``, by the cached
    launch plan of this call's shape (``decode_plan``); ``knobs``: its launch knobs (None: the defaults)."""
    knobs = _knobs(knobs)
    _paged.check_q(codec, st, q)
    B, H, D = st.shape
    sc = C.softmax_scale(scale, D)
    dev = q.device
    out = torch.empty(tuple(q.shape), dtype=q.dtype, device=dev)
    lse = torch.empty(tuple(q.shape[:3]), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse
    if B > 65535 or H > 65535:
        raise ValueError(f"B={B} and H_kv={H} must be at most 65535 (CUDA grid limits)")
    kp = codec.kernel_arrays(cfg, st)
    plan = decode_plan(cfg, codec, st, q, kp, knobs)
    if plan.fallback:
        K, V = dequantize_cache(cfg, codec, st)
        o, ls = A.decode_attention(q.float(), [(K, V)], scale=sc)
        return o.to(q.dtype), ls
    dev_index = plan.device_index
    qf = q if q.stride(-1) == 1 else q.contiguous()   # the kernels read q rows with a unit last stride
    # the fp32 partials, o (n_partials, rows, D) then lse (n_partials, rows), in one allocation: the kernels
    # take addresses
    n_o = plan.n_partials * plan.rows * D
    parts = torch.empty(n_o + plan.n_partials * plan.rows, dtype=torch.float32, device=dev)
    o_part = parts.data_ptr()
    s0, s1, s2 = qf.stride()[:3]
    # the slots' values (_Q ... _V_WIN): tensors as their device addresses, taken once per call
    values = (qf.data_ptr(), s0, s1, s2, sc * LOG2E, sc, o_part, o_part + 4 * n_o, out.data_ptr(), lse.data_ptr(),
              *(t.data_ptr() for t in (kp["codes"], kp["high"], kp["idx"], kp["scale"], kp["mn"], st.v_codes,
                                       st.v_scale, st.v_mn, st.k_table, st.v_table, st.sink_k, st.sink_v, st.k_buf,
                                       st.v_buf, st.v_win)))
    main = L.raw_stream(dev_index)
    with L.on_device(dev_index):
        for k, side in enumerate(plan.sides):
            L.stream_wait(side, main, dev_index, k)       # fork before any launch: they run side by side
        for side, launch in plan.launches:
            if isinstance(launch, _Gather):
                _gather_launch(launch, cfg, codec, st, qf, values, dev)
            else:
                launch.launch(values, dev_index, main if side is None else side)
        for k, side in enumerate(plan.sides):
            L.stream_wait(main, side, dev_index, k)       # the tail's partials are written
        plan.merge.launch(values, dev_index, main)
    del parts                                             # (freed after the merge, in stream order)
    return out, lse


def _gather_launch(g: _Gather, cfg, codec, st: PagedState, qf, values, dev) -> None:
    """The precise path's tail: gather it into fp32, then attention.cu's split kernel over the copy. The
    gather allocates its copy on the side stream, so that the allocator orders its reuse after the
    attention that reads it."""
    with torch.cuda.stream(g.side if g.side is not None else torch.cuda.current_stream(dev)):
        tk, tv = gather_tail(cfg, codec, st, g.NF)
        B, H_q, H, T_q = g.dims
        n_rows, chunk, n, split0 = g.common
        sc = values[_QK] if g.precise else values[_QK2]
        L.run(g.fn, g.grid, (g.block,),
              (qf, tk, tv, values[_O_PART], values[_LSE_PART], *(np.int64(s) for s in qf.stride()[:3]),
               *(np.int64(s) for s in tk.stride()[:3]), *(np.int64(s) for s in tv.stride()[:3]), np.int32(B),
               np.int32(H_q), np.int32(H), np.int32(T_q), np.int64(n_rows), np.int64(chunk), np.int32(n),
               np.int32(split0), np.float32(sc)), dev)
