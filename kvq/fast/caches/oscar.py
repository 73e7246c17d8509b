"""The OSCAR cache on torch tensors (``kvq.reference.oscar``, section 4), shared by both fast backends.

The state (:class:`OSCARTensorState`: the reference's fields as torch tensors, all in the rotated frame,
and the configuration ``init`` made it with: every call first checks that it is given the same one, and
a calibration that fits, so no kernel writes at another configuration's offsets), the token routing
(sink, window ring, pages allocated page-major then batch) and the reading of the cache are written once
here; a backend passes its kernels as :class:`OscarOps`: the fixed-order rotation (the reference's
operations in its order, so the same bits), the fused clip + INT2 + pack (``oscar_quant``),
``packing.unpack_dequantize``, ``attention.decode_attention`` and, where it has one, a fused decode over
the packed pages (``fused_decode``; without it decode dequantizes the history first) and a fused append
(``fused_append``: one kernel per append for K and one for V; without it, or outside its configurations,
or with ``FUSED_APPEND = False``, the unfused path of rotate + quantize kernels and torch writes, which
gives the same bits). The public, documented functions are ``kvq.fast.triton.oscar`` and
``kvq.fast.cupy.oscar``.

    from kvq.fast.triton.oscar import init, append, decode_attention      # (these call into here)
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, NamedTuple

import numpy as np
import torch

from kvq.fast import common as C
from kvq.reference import numerics as nx
from kvq.reference import oscar as RO
from kvq.reference import state as RS

F16 = torch.float16


@dataclass(frozen=True)
class OscarOps:
    """A backend's kernels for the OSCAR cache."""

    name: str
    rotate: Callable
    oscar_quant: ModuleType
    packing: ModuleType
    attention: ModuleType
    allow_cpu: Callable[[], bool]
    #: ``rotate_heads(x, R, out_dtype) -> x R`` for the query-side tensors (q, and the output rotated
    #: back; R: the calibration's fp32 values): float64 sums rounded to fp32, then to out_dtype, in one launch
    #: (``kvq.fast.cupy.oscar_decode.rotate_heads``, ``kvq.fast.triton.oscar_decode.rotate_heads``)
    rotate_heads: Callable
    #: ``fused_decode(cfg, state, q_rot, *, scale, precise, out_dtype, R_out) -> (out, lse)``: attention of
    #: the rotated fp32 query over the packed history pages and the FP16 sink and window, merged
    #: (``kvq.fast.triton.oscar_decode.decode``, ``kvq.fast.cupy.oscar.fused_decode``); ``precise``: q is
    #: float32 (an fp32 output); out in the rotated frame (``R_out`` None) or rotated back by ``R_out``
    #: (R_V^T as ``rotate_heads`` takes it; the CuPy merge does it in its own launch), in ``out_dtype``
    #: (the fp32 result rounded once), lse fp32; None: the history is dequantized, then attended
    fused_decode: Callable | None = None
    #: the fused append (``kvq.fast.triton.oscar_append``, ``kvq.fast.cupy.oscar_append``): a module with
    #: ``supported(cfg, D) -> bool`` and ``append(cfg, st, kv, x, R, clip, plan)``, ONE launch per append
    #: for K (kv = 0) and one for V: rotate, fp16, sink / window ring / clip + quantize + pack into the
    #: page slots, old window tokens leaving included; None: always the unfused path. ``append`` takes x
    #: (B, H, n, D) float16 / float32 (any strides), R fp32 (D, D) or (H, D, D) on x's device, the
    #: :class:`AppendPlan` (the page table already holds the pages it opens); the caller has validated
    #: everything (shapes, finiteness, that fp16(x R) is finite)
    fused_append: ModuleType | None = None




@dataclass
class OSCARTensorState(C.TensorFields):
    """The fast tier's OSCAR cache: the fields of ``kvq.reference.oscar.OSCARState`` as torch tensors on
    one device (same shapes, dtypes and meaning, all in the rotated frame), plus the host counters."""

    sink_k: torch.Tensor        # (B, H, S0, D) fp16
    sink_v: torch.Tensor        # (B, H, S0, D) fp16
    win_k: torch.Tensor         # (B, H, W, D) fp16, ring: post-sink token p in slot p % W
    win_v: torch.Tensor         # (B, H, W, D) fp16
    k_codes: torch.Tensor       # (P, H, Pg, D * bits / 8) uint8, packed along channels
    k_scale: torch.Tensor       # (P, H, Pg, D / G) meta dtype
    k_mn: torch.Tensor          # (P, H, Pg, D / G)
    v_codes: torch.Tensor       # (P, H, Pg, D * bits / 8) uint8
    v_scale: torch.Tensor       # (P, H, Pg, D / G)
    v_mn: torch.Tensor          # (P, H, Pg, D / G)
    table: torch.Tensor         # (B, N) int32 page ids, -1 = none
    length: int = 0
    next_page: int = 0
    shape: tuple = field(default=(0, 0, 0))   # (B, H, D)
    cfg: object = RS.cfg_field()              # the OSCARConfig init made the cache with

    @property
    def device(self) -> torch.device:
        return self.sink_k.device


def check_state(cfg, st) -> None:
    """The first check of every call: ``st`` is an :class:`OSCARTensorState` made by ``init`` with ``cfg``."""
    RS.check_state(st, cfg, RO.OSCARConfig, OSCARTensorState)


def init(ops: "OscarOps", cfg, batch: int, kv_heads: int, head_dim: int, *, device=None) -> OSCARTensorState:
    """An empty cache, every buffer and the page pool preallocated, on ``device`` (None: the backend's
    default, ``kvq.fast.common.cache_device``); the state records ``cfg``."""
    RO.check_cfg(cfg)
    RS.check_dims(batch=batch, kv_heads=kv_heads, head_dim=head_dim)
    cfg.check_head_dim(head_dim)
    B, H, D, Pg = int(batch), int(kv_heads), int(head_dim), cfg.page_size
    N = -(-max(cfg.max_tokens - cfg.sink - cfg.window, 0) // Pg)
    meta = C.torch_dtype(nx.dtype_name(cfg.meta_dtype))
    dev = C.cache_device(ops, device)
    z = lambda *s, dt=F16: torch.zeros(s, dtype=dt, device=dev)                    # noqa: E731
    cb, mg = D * cfg.bits // 8, D // cfg.group_size
    return OSCARTensorState(z(B, H, cfg.sink, D), z(B, H, cfg.sink, D), z(B, H, cfg.window, D),
                            z(B, H, cfg.window, D), z(B * N, H, Pg, cb, dt=torch.uint8), z(B * N, H, Pg, mg, dt=meta),
                            z(B * N, H, Pg, mg, dt=meta), z(B * N, H, Pg, cb, dt=torch.uint8),
                            z(B * N, H, Pg, mg, dt=meta), z(B * N, H, Pg, mg, dt=meta),
                            torch.full((B, N), -1, dtype=torch.int32, device=dev), shape=(B, H, D), cfg=cfg)



_ROT_CACHE: dict = {}


def _rot(R, dev: torch.device, transpose: bool = False) -> torch.Tensor:
    """A calibration rotation (NumPy fp32 (D, D) / (H, D, D)) on the device as fp32, optionally R^T.

    Copied to the device once per array object, device and transpose, and kept as long as that array
    lives: decode and append then make no host-to-device copy (a synchronizing one, from pageable memory),
    so they can be captured in a CUDA graph. A model's step visits every layer's rotations in turn; a
    bounded cache smaller than that would miss each of them at every step. A calibration's arrays are
    treated as immutable (as the calibration is): modifying one in place after its first use is not seen."""
    def make():
        A = np.swapaxes(np.asarray(R), -1, -2) if transpose else np.asarray(R)
        # a copy (torch.tensor), never a view of R: a cached view would keep R, and its entry, alive
        return torch.tensor(np.ascontiguousarray(A, dtype=np.float32)).to(dev)

    return _per_array(_ROT_CACHE, (str(dev), bool(transpose)), R, make)


def _per_array(cache: dict, key, R, make):
    """``make()`` cached under ``key`` for the array object R, for as long as R lives: ``cache`` maps
    ``id(R)`` to (a weak reference to R, {key: value}), and the reference's callback drops the entry when R
    is freed, so its id cannot be taken by another array while the entry is there."""
    entry = cache.get(id(R))
    if entry is None or entry[0]() is not R:
        rid = id(R)
        try:
            ref = weakref.ref(R, lambda _ref, rid=rid: cache.pop(rid, None))
        except TypeError:                               # an array type without weak references: not cached
            return make()
        entry = (ref, {})
        cache[rid] = entry
    values = entry[1]
    if key not in values:
        values[key] = make()
    return values[key]


class Rotations(NamedTuple):
    """A calibration's rotations on one device, fp32 (``_rot``): what an append (R_K, R_V, as the
    calibration holds them: (D, D) or (H, D, D)) and a decode (R_K and R_V^T as contiguous (H_R, D, D), the
    form ``rotate_heads`` and the fused decodes read) take."""

    R_K: torch.Tensor
    R_V: torch.Tensor
    R_K3: torch.Tensor
    R_Vt3: torch.Tensor


_CALIB_CACHE: dict = {}


def _rotations(calib, dev: torch.device) -> Rotations:
    """:class:`Rotations` of ``calib`` on ``dev``, made once per calibration object and device (its tensors are
    ``_rot``'s, copied once per array) and kept as long as the calibration lives: an append and a decode look
    them up once, not per rotation."""
    def make():
        three = lambda R: R if R.dim() == 3 else R.unsqueeze(0)                      # noqa: E731
        RK, RV = _rot(calib.R_K, dev), _rot(calib.R_V, dev)
        return Rotations(RK, RV, three(RK).contiguous(), three(_rot(calib.R_V, dev, True)).contiguous())

    return _per_array(_CALIB_CACHE, dev, calib, make)


def _decode_rotations(calib, dev: torch.device, rotate_back: bool = True):
    """(R_K, R_V^T or None) on ``dev`` as :func:`decode_attention` takes them: fp32 (H_R, D, D), the
    calibration's values as they are (the backend's ``rotate_heads`` sums in float64)."""
    r = _rotations(calib, dev)
    return r.R_K3, (r.R_Vt3 if rotate_back else None)


def _rotate16(ops, x, R: torch.Tensor, name: str) -> torch.Tensor:
    """fp16(x R) as the reference's ``_rotate16``; overflow raises (while validation is on)."""
    y = ops.rotate(x, R).to(F16)
    if C.validation_enabled() and y.numel() and not bool(torch.isfinite(y).all()):
        raise ValueError(f"{name} R overflows float16 (|x| > 65504); the FP16 buffers cannot hold it")
    return y


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _check_append(ops, cfg, calib, st: OSCARTensorState, k, v) -> None:
    """The reference's ``_check_append`` up to (not including) the rotation: the same errors in its order."""
    check_state(cfg, st)
    B, H, D = st.shape
    C.check_kv_append(k, v, st.shape, st.device, st.length, cfg.max_tokens, allow_cpu=ops.allow_cpu())
    RO.check_calib(calib, H, D)


#: the fused append (``OscarOps.fused_append``) where the backend has one and supports the configuration;
#: False forces the unfused path everywhere (rotate, oscar_quant.quantize_tokens, torch writes): the two
#: give the same bits (tests compare them). :func:`unfused_append` is the context-manager form.
FUSED_APPEND = True


@contextlib.contextmanager
def unfused_append():
    """Within the block, ``append`` takes the unfused path (for tests and benchmarks)."""
    global FUSED_APPEND
    old, FUSED_APPEND = FUSED_APPEND, False
    try:
        yield
    finally:
        FUSED_APPEND = old


_NORM_CACHE: dict = {}

#: relative slack of the rotation bound (:func:`_rotation_fits`): covers the fp32 rounding of the
#: fixed-order rotation (at most D * 2**-24 relative to sum |x_i R_ij| <= |x| |R_j|) and of the fp32 norm
FIT_SLACK = 1e-3


def _max_col_norm(R) -> float:
    """max_j |R[..., :, j]|_2 of a calibration rotation (float64, host), cached per array object."""
    return _per_array(_NORM_CACHE, "norm", R,
                      lambda: float(np.linalg.norm(np.asarray(R, dtype=np.float64), axis=-2).max()))


def _rotation_fits(k, v, calib) -> bool:
    """True when fp16(k R_K) and fp16(v R_V) are provably finite: ``|(x R)_j| <= |x|_2 |R_j|_2``
    (Cauchy-Schwarz) with FIT_SLACK for the fp32 rounding, below 65504 (the largest fp16). One host sync
    (both maxima together). False (a large token) sends the append down the unfused path, which rotates
    first and raises where fp16 really overflows, as the reference."""
    nk, nv = torch.stack([torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).amax()
                          for x in (k, v)]).tolist()
    lim = 65504.0 / (1.0 + FIT_SLACK)
    return nk * _max_col_norm(calib.R_K) < lim and nv * _max_col_norm(calib.R_V) < lim


def _open_pages(st: OSCARTensorState, cfg, first: int, e: int) -> None:
    """Allocate the pages that post-sink positions [first, first + e) open (page-major, then batch, as
    the reference): host arithmetic and one write into the page table."""
    if not e:
        return
    B, Pg = st.shape[0], cfg.page_size
    pg0, pg1 = -(-first // Pg), (first + e - 1) // Pg + 1                # pages opened: [pg0, pg1)
    if pg1 > pg0:
        ids = st.next_page + torch.arange((pg1 - pg0) * B, dtype=torch.int32, device=st.device).view(pg1 - pg0, B).t()
        st.table[:, pg0:pg1] = ids
        st.next_page += (pg1 - pg0) * B


@dataclass(frozen=True)
class AppendPlan:
    """Where an append's tokens go (host arithmetic on the counters before it; ``kvq.reference.oscar.append``'s
    routing): ``T0`` tokens cached, ``n`` new; the first ``n_s`` new ones fill the sink; the others follow
    the ``n_old`` tokens of the window as sequence index ``i = n_old + (idx - n_s)``; the oldest ``e`` of
    that sequence leave the window into page position ``first + i`` (post-sink index; ``first``: the
    window's oldest before the append), the rest end in ring slot ``(first + i) % W``."""

    T0: int
    n: int
    n_s: int
    n_old: int
    first: int
    e: int


def kv_fields(st: OSCARTensorState, kv: int) -> tuple:
    """(sink, window, codes, scale, mn) of the state's K (kv = 0) or V (kv = 1): what a fused append
    writes."""
    return ((st.sink_k, st.win_k, st.k_codes, st.k_scale, st.k_mn) if kv == 0 else
            (st.sink_v, st.win_v, st.v_codes, st.v_scale, st.v_mn))


@dataclass(frozen=True)
class FusedOperands:
    """What a backend's fused append kernel takes besides x, R and the plan (:func:`fused_operands`)."""

    fields: tuple               # (sink, window, codes, scale, mn) of K or V: :func:`kv_fields`
    quantile: tuple             # (lo, hi, frac): the clip quantile's order statistics (C.quantile_index)
    r_stride: int               # elements between the heads' rotations: D * D for (H, D, D), else 0


def fused_operands(st: OSCARTensorState, kv: int, R: torch.Tensor, clip: float) -> FusedOperands:
    """The state fields, clip quantile and rotation stride of a fused append of K (kv = 0) or V (kv = 1)."""
    D = st.shape[2]
    return FusedOperands(kv_fields(st, kv), _quantile_index(D, float(clip)), D * D if R.dim() == 3 else 0)


#: ``C.quantile_index`` per (head dim, clip ratio): a calibration's clip is one number per layer, so an
#: append looks its order statistics up instead of computing them (a few us of NumPy scalars) every step
_quantile_index = functools.lru_cache(maxsize=1024)(C.quantile_index)


def plan_append(cfg, T0: int, n: int) -> AppendPlan:
    """The :class:`AppendPlan` of appending n tokens to a cache holding T0 (``RO.counts`` arithmetic)."""
    c0 = RO.counts(cfg, T0)
    n_s = max(0, min(cfg.sink - T0, n))
    m = c0["n_win"] + n - n_s
    return AppendPlan(T0, n, n_s, c0["n_win"], c0["n_hist"], m - min(m, cfg.window))


def _use_fused(ops, cfg, calib, st: OSCARTensorState, k, v) -> bool:
    fa = ops.fused_append
    if not FUSED_APPEND or fa is None or not fa.supported(cfg, st.shape[2]):
        return False
    return not C.validation_enabled() or _rotation_fits(k, v, calib)


def append(ops: "OscarOps", cfg, calib, state: OSCARTensorState, k, v) -> OSCARTensorState:
    """Route (B, H_kv, T_new, D) tokens as the reference: rotate, sink, window ring, clip + quantize + pack
    the tokens leaving the window into their page slots (pages page-major, then batch). Validation comes
    before any write, so bad input leaves the state unchanged.

    The fused path (``ops.fused_append``, where supported and FUSED_APPEND): one kernel for K and one
    for V after the page-table write; while validation is on it runs only when the rotation provably
    stays in fp16 range (:func:`_rotation_fits`), else the unfused path runs (and raises on a real
    overflow). The unfused path: the fixed-order rotation, the window ring gathered in order, the fused
    quantizer on the tokens leaving, then torch writes; the same bits."""
    _check_append(ops, cfg, calib, state, k, v)
    st = state
    n = k.shape[2]
    if n == 0:
        return st
    dev = st.device
    RK, RV = _rotations(calib, dev)[:2]              # the decode's too: a decode step then copies nothing there
    if _use_fused(ops, cfg, calib, st, k, v):
        plan = plan_append(cfg, st.length, n)
        _open_pages(st, cfg, plan.first, plan.e)
        ops.fused_append.append(cfg, st, 0, k, RK, calib.clip_k, plan)
        ops.fused_append.append(cfg, st, 1, v, RV, calib.clip_v, plan)
        st.length = plan.T0 + n
        return st
    return _append_unfused(ops, cfg, calib, st, _rotate16(ops, k, RK, "k"), _rotate16(ops, v, RV, "v"))


def _append_unfused(ops, cfg, calib, st: OSCARTensorState, k16, v16) -> OSCARTensorState:
    """The unfused append of the rotated fp16 tokens k16, v16 (B, H, n, D): quantization before any write."""
    W, Pg = cfg.window, cfg.page_size
    B = st.shape[0]
    T0, n = st.length, k16.shape[2]
    dev = st.device
    p = plan_append(cfg, T0, n)
    n_s, first, e = p.n_s, p.first, p.e                       # first: post-sink index of the window's oldest
    if p.n_old:
        order = torch.arange(first, first + p.n_old, device=dev) % W
        ks = torch.cat([st.win_k.index_select(2, order), k16[:, :, n_s:]], dim=2)   # (B, H, m, D) in order
        vs = torch.cat([st.win_v.index_select(2, order), v16[:, :, n_s:]], dim=2)
    else:
        ks, vs = k16[:, :, n_s:], v16[:, :, n_s:]
    m = ks.shape[2]                                           # the oldest e of the m leave the window
    if e:                                                     # QuantizeAndWrite (before any write)
        meta = nx.dtype_name(cfg.meta_dtype)
        kq = ops.oscar_quant.quantize_tokens(ks[:, :, :e], calib.clip_k, cfg.group_size, cfg.bits, meta)
        vq = ops.oscar_quant.quantize_tokens(vs[:, :, :e], calib.clip_v, cfg.group_size, cfg.bits, meta)
    if n_s:                                                   # 1. sink
        st.sink_k[:, :, T0:T0 + n_s] = k16[:, :, :n_s]
        st.sink_v[:, :, T0:T0 + n_s] = v16[:, :, :n_s]
    if m > e:                                                 # 2. window ring
        slots = torch.arange(first + e, first + m, device=dev) % W
        st.win_k[:, :, slots] = ks[:, :, e:]
        st.win_v[:, :, slots] = vs[:, :, e:]
    if e:                                                     # 3. pages
        _open_pages(st, cfg, first, e)
        pos = torch.arange(first, first + e, device=dev)
        pid = st.table[:, pos // Pg].long()                                # (B, e)
        sl = (pos % Pg).view(1, e).expand(B, e)
        for dst, src in zip((st.k_codes, st.k_scale, st.k_mn, st.v_codes, st.v_scale, st.v_mn), kq + vq):
            dst[pid, :, sl] = src.transpose(1, 2)                         # (B, e, H, ...)
    st.length = T0 + n
    return st


def segments(ops: "OscarOps", cfg, st: OSCARTensorState):
    """The cache in the rotated frame as three (K, V) fp32 segments (B, H, T_i, D): sink, history, recent.
    The history is unpacked and dequantized by one kernel per K / V (bit-exact, fp32)."""
    B, H, D = st.shape
    c = RO.counts(cfg, st.length)
    dev = st.device
    ns, nh, npg = c["n_sink"], c["n_hist"], c["n_pages"]
    sink = (st.sink_k[:, :, :ns].float(), st.sink_v[:, :, :ns].float())
    if npg:
        ids = st.table[:, :npg].long()                                     # (B, n)
        hist = []
        for codes, s, mn in ((st.k_codes, st.k_scale, st.k_mn), (st.v_codes, st.v_scale, st.v_mn)):
            x = ops.packing.unpack_dequantize(codes[ids], s[ids], mn[ids], cfg.bits, cfg.group_size, axis=-1,
                                  out_dtype="float32")                     # (B, n, H, Pg, D)
            hist.append(x.permute(0, 2, 1, 3, 4).reshape(B, H, npg * cfg.page_size, D)[:, :, :nh])
        hist = tuple(hist)
    else:
        hist = tuple(torch.zeros((B, H, 0, D), dtype=torch.float32, device=dev) for _ in range(2))
    if c["n_win"]:
        order = torch.arange(nh, c["post"], device=dev) % cfg.window
        win = (st.win_k.index_select(2, order).float(), st.win_v.index_select(2, order).float())
    else:
        win = tuple(torch.zeros((B, H, 0, D), dtype=torch.float32, device=dev) for _ in range(2))
    return [sink, hist, win]


def dequantize(ops: "OscarOps", cfg, calib, state: OSCARTensorState, *, rotated: bool = False):
    """(K, V) fp32 in token order: the rotated frame, or rotated back by the fixed-order kernel."""
    check_state(cfg, state)
    RO.check_calib(calib, *state.shape[1:])
    if state.length == 0:
        raise ValueError("the cache is empty")
    segs = segments(ops, cfg, state)
    K, V = (torch.cat([s[i] for s in segs], dim=2) for i in (0, 1))
    if rotated:
        return K, V
    dev = state.device
    return ops.rotate(K, _rot(calib.R_K, dev, True)), ops.rotate(V, _rot(calib.R_V, dev, True))


def decode_attention(ops: "OscarOps", cfg, calib, state: OSCARTensorState, q, *, scale=None,
                     rotate_back: bool = True):
    """q rotated by R_K (``ops.rotate_heads``); the backend's fused decode over the
    packed pages and the FP16 segment, or (without one) the three segments, history dequantized to fp32,
    attended by its FP16-baseline kernel in fp32; the output rotated back by R_V^T unless
    ``rotate_back=False``."""
    check_state(cfg, state)
    B, H, D = state.shape
    C.check_decode_q(q, state.shape, state.device, state.length, allow_cpu=ops.allow_cpu())
    RO.check_calib(calib, H, D)
    dev = state.device
    rot = ops.rotate_heads
    R_q, R_out = _decode_rotations(calib, dev, rotate_back)                    # R_K, R_V^T
    qr = rot(q, R_q, torch.float32)                                            # (B, H_q, T_q, D) fp32
    if ops.fused_decode is not None:
        return ops.fused_decode(cfg, state, qr, scale=scale, precise=q.dtype == torch.float32,
                                out_dtype=q.dtype, R_out=R_out)
    out, lse = ops.attention.decode_attention(qr, segments(ops, cfg, state), scale=scale)
    return (out.to(q.dtype) if R_out is None else rot(out, R_out, q.dtype)), lse


def identity_calibration(head_dim: int, clip_k: float = 1.0, clip_v: float = 1.0) -> RO.OSCARCalibration:
    """Mirrors `kvq.reference.oscar.identity_calibration`: the reference's calibration object itself.

    Differences: none (a calibration is host data, NumPy fp32 rotations; the cache functions copy
    them to the cache's device).
    """
    return RO.identity_calibration(head_dim, clip_k, clip_v)


def counts(cfg: RO.OSCARConfig, T: int) -> dict:
    """Mirrors `kvq.reference.oscar.counts`: where T tokens live (host arithmetic, the reference's)."""
    return RO.counts(cfg, T)
