"""The BitDecoding cache on torch tensors (``kvq.reference.bitdecoding``, Du et al. section V-B), shared by
both fast backends.

The state (:class:`BitDecodingTensorState`: the reference's fields as torch tensors, and the
configuration ``init`` made it with: every call first checks that it is given the same one), the routing
of an append (FP16 residual block of N_r tokens, pages packed when it fills, page ids allocated
page-major then batch) and the reading of the cache are written once here; a backend passes its kernels
as :class:`BitDecodingOps`: the Residual Kernel (``pack_keys`` / ``pack_values``), ``dequantize_page``,
its flash-decoding ``attention`` module and, where it has one, a fused tensor-core decode over the
packed pages (``fused_decode``; without it decode dequantizes the history pages first). The public,
documented functions are ``kvq.fast.triton.bitdecoding`` and ``kvq.fast.cupy.bitdecoding``.

    from kvq.fast.triton.bitdecoding import init, append, decode_attention    # (these call into here)

An append packs every page it completes in ONE ``pack_keys`` and ONE ``pack_values`` call: the page that
starts in the residual (its first rows) and the pages that come whole from the input, stacked as
(n_pages, B, H, N_r, D) in allocation order, so their words land in one contiguous slice of the pool.
The packed bytes are the reference's (the page kernels are bit-exact), so the state is too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import torch

from kvq.fast.caches import bitdecoding as B
from kvq.fast import common as C
from kvq.reference import bitdecoding as _R
from kvq.reference import state as RS
from kvq.reference.bitdecoding import P_N

F16 = torch.float16
I16 = torch.int16
U16 = torch.uint16


@dataclass(frozen=True)
class BitDecodingOps:
    """A backend's kernels for the BitDecoding cache."""

    name: str
    #: ``pack_keys(cfg, k)`` / ``pack_values(cfg, v)``: pages (..., N_r, D) -> (words, half2 params),
    #: the reference's bytes (the backend's ``bitdecoding.pack_keys`` / ``pack_values``)
    pack_keys: Callable
    pack_values: Callable
    #: ``dequantize_page(cfg, k_words, k_params, v_words, v_params) -> (K, V)`` fp16 (..., N_r, D), bit-exact
    dequantize_page: Callable
    #: the backend's attention module: ``decode_attention(q, segments, *, scale) -> (out, lse)``
    attention: ModuleType
    #: True where the cache may live on the CPU (Triton under ``TRITON_INTERPRET=1``)
    allow_cpu: Callable[[], bool]
    #: ``fused_decode(cfg, st, q, *, scale) -> (out, lse) or None``: attention of the checked query q
    #: (B, H_q, T_q, D; float16 / bfloat16 / float32, on the cache's device) over the packed pages (read
    #: through the page table) and the FP16 residual rows [0, length mod N_r), merged: out (B, H_q, T_q, D)
    #: in q's dtype, lse (B, H_q, T_q) float32. None (the function, or its result): this configuration is
    #: not one the fused kernel supports, and decode dequantizes the history pages and attends them with
    #: ``attention.decode_attention`` (the fallback)
    fused_decode: Callable | None = None




@dataclass
class BitDecodingTensorState(C.TensorFields):
    """The fast tier's BitDecoding cache: the fields of ``kvq.reference.bitdecoding.BitDecodingState`` as
    torch tensors on one device (same shapes, dtypes and meaning), plus the host counters."""

    res_k: torch.Tensor         # (B, H, N_r, D) fp16   residual block, rows [0, length mod N_r) valid
    res_v: torch.Tensor         # (B, H, N_r, D) fp16
    k_words: torch.Tensor       # (P, H, 8 W_n, D) uint16
    k_params: torch.Tensor      # (P, H, N_r / k_group, D, 2) or (P, H, N_r, D / k_group, 2) fp16 half2
    v_words: torch.Tensor       # (P, H, N_r, D / R) uint16
    v_params: torch.Tensor      # (P, H, N_r, D / v_group, 2) fp16 half2
    table: torch.Tensor         # (B, N) int32 page ids, -1 = none
    length: int = 0             # tokens appended to every sequence
    next_page: int = 0          # next free page of the pool
    shape: tuple = field(default=(0, 0, 0))   # (B, H, D)
    cfg: object = RS.cfg_field()              # the BitDecodingConfig init made the cache with

    @property
    def device(self) -> torch.device:
        return self.res_k.device


def check_state(cfg, st) -> None:
    """The first check of every call: ``st`` is a :class:`BitDecodingTensorState` (not the reference's
    NumPy ``BitDecodingState``) made by ``init`` with ``cfg`` (``kvq.reference.state.check_state``)."""
    RS.check_state(st, cfg, _R.BitDecodingConfig, BitDecodingTensorState)


def init(ops: BitDecodingOps, cfg, batch: int, kv_heads: int, head_dim: int, *, device=None) -> BitDecodingTensorState:
    """An empty cache with the residual and the page pool preallocated (zeros; the table -1), on ``device``
    (None: the backend's default, ``kvq.fast.common.cache_device``); the state records ``cfg``. The
    reference's checks and messages."""
    B.check_cfg(cfg)
    RS.check_dims(batch=batch, kv_heads=kv_heads, head_dim=head_dim)
    cfg.check_head_dim(head_dim)
    Bt, H, D, Nr, R = int(batch), int(kv_heads), int(head_dim), cfg.n_r, cfg.per_word
    N = cfg.max_tokens // Nr
    P = Bt * N
    kp = (Nr // cfg.k_group, D) if cfg.k_mode == "channel" else (Nr, D // cfg.k_group)
    dev = C.cache_device(ops, device)
    z = lambda *s, dt=F16: torch.zeros(s, dtype=dt, device=dev)                    # noqa: E731
    return BitDecodingTensorState(z(Bt, H, Nr, D), z(Bt, H, Nr, D), z(P, H, P_N * cfg.warps_n, D, dt=U16),
                                  z(P, H, *kp, 2), z(P, H, Nr, D // R, dt=U16), z(P, H, Nr, D // cfg.v_group, 2),
                                  torch.full((Bt, N), -1, dtype=torch.int32, device=dev), shape=(Bt, H, D),
                                  cfg=cfg)


def _check_append(ops: BitDecodingOps, cfg, st: BitDecodingTensorState, k, v):
    """The reference's ``_check_append`` in its order (per tensor: dtype, shape, finite, fp16 overflow;
    then k / v shapes, capacity), plus the device; returns k, v rounded to fp16 (nothing is written)."""
    Bt, H, D = st.shape
    out = []
    for name, x in (("k", k), ("v", v)):
        C.check_tensor(x, name, allow_cpu=ops.allow_cpu())
        if x.dtype not in (torch.float16, torch.float32):
            raise TypeError(f"{name} has dtype {B.dtype_name(x.dtype)}; append takes float16 or float32")
        if x.dim() != 4 or x.shape[0] != Bt or x.shape[1] != H or x.shape[3] != D:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; this cache takes (B={Bt}, H_kv={H}, T_new, D={D})")
        if x.device != st.device:
            raise ValueError(f"{name} is on {x.device}; the cache is on {st.device}")
        C.check_finite(x, name)
        x16 = x.to(F16)
        if x.dtype != F16 and C.validation_enabled() and x16.numel() and not bool(torch.isfinite(x16).all()):
            raise ValueError(f"{name} overflows float16 (|x| > 65504); the FP16 residual cannot hold it")
        out.append(x16)
    if out[0].shape != out[1].shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(out[0].shape)} and {tuple(out[1].shape)}")
    if st.length + out[0].shape[2] > cfg.max_tokens:
        raise ValueError(f"appending {out[0].shape[2]} tokens to {st.length} exceeds the capacity "
                         f"max_tokens={cfg.max_tokens}")
    return out


def _stack_pages(x16: torch.Tensor, res: torch.Tensor, r: int, head: int, n_in: int, Nr: int) -> torch.Tensor:
    """The pages an append completes, (n_pages, B, H, N_r, D) fp16 in allocation order: first (when
    ``head``) the page that starts in the residual (its rows [0, r), then the first ``head`` new tokens),
    then ``n_in`` pages whole from the input."""
    Bt, H, _, D = x16.shape
    first = 1 if head else 0
    pages = torch.empty((first + n_in, Bt, H, Nr, D), dtype=F16, device=x16.device)
    if head:
        pages[0, :, :, :r] = res[:, :, :r]
        pages[0, :, :, r:] = x16[:, :, :head]
    if n_in:
        pages[first:] = x16[:, :, head:head + n_in * Nr].reshape(Bt, H, n_in, Nr, D).permute(2, 0, 1, 3, 4)
    return pages


def append(ops: BitDecodingOps, cfg, state: BitDecodingTensorState, k, v) -> BitDecodingTensorState:
    """Append (B, H_kv, T_new, D) tokens (rounded to fp16) as the reference: they fill the residual block;
    every N_r-token page they complete is packed (one pack_keys / pack_values call for all of them) into
    the next pool pages (page-major, then batch: page j of sequence b gets ``next_page + j B + b``) and
    the residual keeps the last ``length mod N_r`` tokens, zero beyond. Validation and packing come
    before any write, so bad input leaves the state unchanged."""
    check_state(cfg, state)
    k16, v16 = _check_append(ops, cfg, state, k, v)
    st, Nr = state, cfg.n_r
    Bt, H, D = st.shape
    n = k16.shape[2]
    if n == 0:
        return st
    T0 = st.length
    r = T0 % Nr
    if r + n < Nr:                                            # no page completes: residual rows [r, r + n)
        st.res_k[:, :, r:r + n] = k16
        st.res_v[:, :, r:r + n] = v16
        st.length = T0 + n
        return st
    head = Nr - r if r else 0                                 # new tokens that complete the residual's page
    n_in = (n - head) // Nr                                   # pages whole from the input
    rem = n - head - n_in * Nr                                # tokens left in the residual
    n_pages = (1 if head else 0) + n_in
    # quantize and pack every completed page (before any write)
    kw, kp = ops.pack_keys(cfg, _stack_pages(k16, st.res_k, r, head, n_in, Nr))
    vw, vp = ops.pack_values(cfg, _stack_pages(v16, st.res_v, r, head, n_in, Nr))
    # pool pages [p0, p1): page j of the append, sequence b -> p0 + j B + b (the reference's order)
    p0, p1, j0 = st.next_page, st.next_page + n_pages * Bt, T0 // Nr
    flat = lambda a: a.reshape(n_pages * Bt, *a.shape[2:])                          # noqa: E731
    st.k_words.view(I16)[p0:p1] = flat(kw).view(I16)
    st.k_params[p0:p1] = flat(kp)
    st.v_words.view(I16)[p0:p1] = flat(vw).view(I16)
    st.v_params[p0:p1] = flat(vp)
    ids = torch.arange(p0, p1, dtype=torch.int32, device=st.device).view(n_pages, Bt).t()
    st.table[:, j0:j0 + n_pages] = ids
    for res, x16 in ((st.res_k, k16), (st.res_v, v16)):       # the residual: the last rem tokens, then zeros
        res[:, :, :rem] = x16[:, :, n - rem:]
        res[:, :, rem:] = 0
    st.next_page = p1
    st.length = T0 + n
    return st


def history(ops: BitDecodingOps, cfg, st: BitDecodingTensorState):
    """The packed pages of every sequence dequantized (``ops.dequantize_page``, gathered through the
    page table): (K, V) fp16 (B, H, N_p, D) in token order."""
    Bt, H, D = st.shape
    n_p, _ = _R.partition(st.length, cfg.n_r)
    npg = n_p // cfg.n_r
    if not npg:
        return tuple(torch.zeros((Bt, H, 0, D), dtype=F16, device=st.device) for _ in range(2))
    ids = st.table[:, :npg].reshape(-1).long()                                      # (B npg,) b-major
    take = lambda a: a.index_select(0, ids)                                         # noqa: E731
    K, V = ops.dequantize_page(cfg, take(st.k_words.view(I16)).view(U16), take(st.k_params),
                               take(st.v_words.view(I16)).view(U16), take(st.v_params))  # (B npg, H, N_r, D)
    return tuple(x.view(Bt, npg, H, cfg.n_r, D).transpose(1, 2).reshape(Bt, H, n_p, D) for x in (K, V))


def residual(cfg, st: BitDecodingTensorState):
    """The FP16 residual rows [0, length mod N_r): (K, V) fp16 (B, H, res_len, D) views."""
    _, res = _R.partition(st.length, cfg.n_r)
    return st.res_k[:, :, :res], st.res_v[:, :, :res]


def dequantize(ops: BitDecodingOps, cfg, state: BitDecodingTensorState):
    """(K, V) fp32 (B, H_kv, T, D) in token order: the pages dequantized to fp16, then the residual."""
    check_state(cfg, state)
    if state.length == 0:
        raise ValueError("the cache is empty")
    hist, res = history(ops, cfg, state), residual(cfg, state)
    return tuple(torch.cat([hist[i], res[i]], dim=2).float() for i in (0, 1))


def decode_attention(ops: BitDecodingOps, cfg, state: BitDecodingTensorState, q, *, scale=None):
    """The reference's checks on q; then ``ops.fused_decode`` where the backend has one and it takes
    this configuration; else the fallback: the history pages dequantized (fp16) and the residual rows,
    attended as segments by ``ops.attention.decode_attention`` (fp16 q: fp16 segments; bf16 / fp32 q:
    in fp32, the fp16 values exact there, out rounded to q's dtype). Returns (out in q's dtype, lse fp32)."""
    check_state(cfg, state)
    C.check_decode_q(q, state.shape, state.device, state.length, allow_cpu=ops.allow_cpu())
    if ops.fused_decode is not None:
        got = ops.fused_decode(cfg, state, q, scale=scale)
        if got is not None:
            return got
    segs = [seg for seg in (history(ops, cfg, state), residual(cfg, state)) if seg[0].shape[2]]
    if q.dtype == F16:
        return ops.attention.decode_attention(q, segs, scale=scale)
    out, lse = ops.attention.decode_attention(q.float(), [(a.float(), b.float()) for a, b in segs], scale=scale)
    return out.to(q.dtype), lse
