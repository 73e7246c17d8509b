"""The AQUA-KV cache over all layers on torch tensors (``kvq.reference.aqua_cache``, AQUA-KV §3.3 and
Algorithm 4), shared by both fast backends.

The state (:class:`AquaTensorState`: the fields of the reference's ``AquaState`` as torch tensors, and
the configuration ``init`` made it with: every call first checks that it is given the same one and
predictors that fit it), the token routing (sink, recent buffer, every full buffer compressed as one
chunk, layer 0 first, each layer predicted from the reconstruction of the layer before, keys pre-RoPE by
default) and the reading of the cache (Algorithm 3 per layer over the whole history, RoPE,
flash-decoding over sink, history and buffer) are written once here, on the per-layer code of
``aqua.py`` and a backend's :class:`kvq.fast.caches.aqua.AquaOps`.

    from kvq.fast.triton import aqua_cache                      # (these call into here)
    st = aqua_cache.init(cfg, 28, batch=1, kv_heads=8, head_dim=128); aqua_cache.append(cfg, P, st, K, V)

Numerics. Sinks, buffers, layer-0 codes and counters are the reference's bit for bit after the same
appends; RoPE and its inverse are the reference's elementwise fp32 operations with the same host tables;
every chunk is encoded on its own (the same shapes whatever the history), so streaming equals bulk bit
for bit; residual codes of layers >= 1 and the reconstructions follow rule 7 (``aqua.py``).
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from kvq.fast import common as C
from kvq.fast.caches.aqua import decode_checked, encode_checked, check_backbone, to_tokens
from kvq.fast.caches.oscar import dtype_name
from kvq.reference import aqua_cache as RAC
from kvq.reference import state as RS
from kvq.reference.aqua import AquaConfig
from kvq.reference.model import rope_tables

F16 = torch.float16
_NP_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16, np.dtype(np.uint32): torch.uint32,
             np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32}


# ---------------------------------------------------------------------------------------------------
# RoPE: the reference's elementwise operations with its host tables (cached on the device)


_ROPE: dict = {}
_ROPE_ROUND = 4096


def _rope_tables(theta: float, D: int, t0: int, n: int, device, capacity: int = 0) -> tuple:
    """(cos, sin) (n, D) fp32 of positions t0 .. t0 + n - 1: ``model.rope_tables`` (float64, rounded once),
    computed on the host for positions 0 .. m - 1 and kept on the device (a table's row depends on its
    position only, so a slice equals the reference's table of those positions). ``capacity``: the cache's
    ``max_tokens``; the table is made for at least that many positions, so that it is not copied to the
    device again (a synchronizing copy) at a decode step within the cache's capacity."""
    key = (float(theta), int(D), str(device))
    have = _ROPE.get(key)
    need = max(t0 + n, int(capacity))
    if have is None or have[0].shape[0] < need:
        m = -(-need // _ROPE_ROUND) * _ROPE_ROUND
        cos, sin = rope_tables(np.arange(m), D, theta)
        have = (torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device))
        _ROPE[key] = have
    return have[0][t0:t0 + n], have[1][t0:t0 + n]


def rope(x, cos, sin, inverse: bool) -> torch.Tensor:
    """``model.apply_rope`` on fp32 x (..., T, D): ``x*cos -/+ rotate_half(x)*sin``, each op rounded once.

    Bit for bit the reference's operations, in three passes over x instead of its five (a decode step
    rotates every layer's whole history: ``lab/2026-11-29-e2e-grid/NOTE.md``): with x = [x1, x2] and
    rotate_half(x) = [-x2, x1], the first half of ``rotate_half(x)*sin`` is ``-(x2*sin1)``, and
    ``a + (-b)`` is ``a - b`` exactly (IEEE negation is exact), so ``x*cos + rotate_half(x)*sin`` is
    ``[x1*cos1 - x2*sin1, x2*cos2 + x1*sin2]`` with the same roundings, and the inverse swaps the signs."""
    h = x.shape[-1] // 2
    out = x * cos
    s = torch.empty_like(out)
    torch.mul(x[..., h:], sin[..., :h], out=s[..., :h])
    torch.mul(x[..., :h], sin[..., h:], out=s[..., h:])
    lo, hi = (out[..., :h].add_, out[..., h:].sub_) if inverse else (out[..., :h].sub_, out[..., h:].add_)
    lo(s[..., :h])
    hi(s[..., h:])
    return out


# ---------------------------------------------------------------------------------------------------
# the cache state


@dataclass
class AquaTensorState:
    """The fast tier's AQUA-KV cache: the fields of ``kvq.reference.aqua_cache.AquaState`` as torch tensors
    on one device (same shapes, dtypes and meaning), plus the host counters. L layers, B batch, H KV heads,
    D head dim, S sink, R buffer, C chunks, F = H * D."""

    sink_k: torch.Tensor        # (L, B, H, S, D) fp16, post-RoPE
    sink_v: torch.Tensor        # (L, B, H, S, D) fp16
    buf_k: torch.Tensor         # (L, B, H, R, D) fp16, post-RoPE; unused slots are zero
    buf_v: torch.Tensor         # (L, B, H, R, D) fp16
    first_k: dict               # code name -> (B, C, R, ...) layer 0
    first_v: dict
    res_k: dict                 # code name -> (L - 1, B, C, R, ...) residual codes of layers 1..L-1
    res_v: dict
    length: int = 0
    shape: tuple = field(default=(0, 0, 0, 0))   # (L, B, H, D)
    cfg: object = RS.cfg_field()                 # the AquaConfig init made the cache with

    @property
    def device(self) -> torch.device:
        return self.sink_k.device

    # every tensor by name, code tensors as "first_k.<name>" ...: the reference's own method (the same keys)
    arrays = RAC.AquaState.arrays

    def copy(self) -> "AquaTensorState":
        return dataclasses.replace(
            self, sink_k=self.sink_k.clone(), sink_v=self.sink_v.clone(), buf_k=self.buf_k.clone(),
            buf_v=self.buf_v.clone(), **{g: {n: a.clone() for n, a in getattr(self, g).items()}
                                         for g in ("first_k", "first_v", "res_k", "res_v")})


def _empty_codes(bb, lead: tuple, R: int, F: int, device) -> dict:
    """Zero tensors shaped like the backbone's codes of R token vectors (the reference's probe of one)."""
    probe = bb.encode(np.zeros((1, 1, F), np.float32))
    return {n: torch.zeros(lead + (R,) + a.shape[2:], dtype=_NP_TORCH[a.dtype], device=device)
            for n, a in probe.items()}


def init(ops, cfg, n_layers: int, batch: int, kv_heads: int, head_dim: int, *, device=None) -> AquaTensorState:
    """An empty cache for ``batch`` sequences of up to ``cfg.max_tokens`` tokens, every tensor preallocated,
    on ``device`` (None: the backend's default, ``kvq.fast.common.cache_device``); the state records ``cfg``."""
    RAC.check_cfg(cfg)
    RS.check_dims(n_layers=n_layers, batch=batch, kv_heads=kv_heads, head_dim=head_dim)
    L, B, H, D, S, R = int(n_layers), int(batch), int(kv_heads), int(head_dim), cfg.sink, cfg.buffer
    if cfg.pre_rope and D % 2:
        raise ValueError(f"head_dim={D} must be even for RoPE")
    check_backbone(cfg.backbone, "backbone")
    check_backbone(cfg.first_layer, "first_layer")
    RAC.check_cfg(cfg, H * D)
    F, Cn = H * D, max(cfg.max_tokens - S, 0) // R
    dev = C.cache_device(ops, device)
    z = lambda T: torch.zeros((L, B, H, T, D), dtype=F16, device=dev)             # noqa: E731
    return AquaTensorState(z(S), z(S), z(R), z(R), _empty_codes(cfg.first_layer, (B, Cn), R, F, dev),
                           _empty_codes(cfg.first_layer, (B, Cn), R, F, dev),
                           _empty_codes(cfg.backbone, (L - 1, B, Cn), R, F, dev),
                           _empty_codes(cfg.backbone, (L - 1, B, Cn), R, F, dev), shape=(L, B, H, D), cfg=cfg)


_CHECKED: "collections.OrderedDict" = collections.OrderedDict()


def check_call(cfg, P, st) -> None:
    """The first checks of every call on a cache: ``st`` is an :class:`AquaTensorState` made by ``init`` with
    ``cfg``, and P fits it (``kvq.reference.aqua_cache.check_predictors``; remembered for the last few
    (P, cfg, shape) by identity, so a decode step's per-layer calls check the predictors once)."""
    RS.check_state(st, cfg, AquaConfig, AquaTensorState)
    L, _, H, D = st.shape
    key = (id(P), id(cfg), L, H * D)
    hit = _CHECKED.get(key)
    if hit is not None and hit[0] is P and hit[1] is cfg:
        _CHECKED.move_to_end(key)
        return
    RAC.check_predictors(cfg, P, L, H * D)
    _CHECKED[key] = (P, cfg)
    while len(_CHECKED) > 8:
        _CHECKED.popitem(last=False)


def _check_append(ops, cfg, P, st: AquaTensorState, K, V):
    """The reference's checks, in its order and with its messages; returns K, V as fp16 tensors."""
    check_call(cfg, P, st)
    L, B, H, D = st.shape
    out = []
    for name, x in (("K", K), ("V", V)):
        C.check_tensor(x, name, allow_cpu=ops.allow_cpu())
        if x.dtype not in (torch.float16, torch.float32):
            raise TypeError(f"{name} has dtype {dtype_name(x.dtype)}; append takes float16 or float32")
        if x.dim() != 5 or tuple(x.shape[:3]) != (L, B, H) or x.shape[4] != D:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; this cache takes (L={L}, B={B}, H_kv={H}, "
                             f"T_new, D={D})")
        if x.device != st.device:
            raise ValueError(f"{name} is on {x.device}; the cache is on {st.device}")
        C.check_finite(x, name)
        x16 = x.to(F16)
        if C.validation_enabled() and x16.numel() and not bool(torch.isfinite(x16).all()):
            raise ValueError(f"{name} overflows float16 (|x| > 65504); the FP16 buffers cannot hold it")
        out.append(x16)
    if out[0].shape != out[1].shape:
        raise ValueError(f"K and V must have the same shape, got {tuple(out[0].shape)} and {tuple(out[1].shape)}")
    n = out[0].shape[3]
    if st.length + n > cfg.max_tokens:
        raise ValueError(f"appending {n} tokens to {st.length} exceeds the capacity max_tokens={cfg.max_tokens}")
    return out


def _encode_chunk(ops, cfg, P, st: AquaTensorState, k16, v16, c: int) -> list:
    """Algorithm 2 on chunk c, layer 0 first: k16, v16 (L, B, H, R, D) fp16 -> [(Kq, Vq)] per layer."""
    L, B, H, D = st.shape
    if cfg.pre_rope:
        cos, sin = _rope_tables(cfg.rope_theta, D, cfg.sink + c * cfg.buffer, cfg.buffer, st.device, cfg.max_tokens)
    K_hat = V_hat = None
    out = []
    for l in range(L):
        k = k16[l].float()
        if cfg.pre_rope:
            k = rope(k, cos, sin, inverse=True)
        Kq, Vq, K_hat, V_hat = encode_checked(ops, cfg, P, l, to_tokens(k), to_tokens(v16[l].float()), K_hat, V_hat)
        out.append((Kq, Vq))
    return out


def append(ops, cfg, P, state: AquaTensorState, K, V) -> AquaTensorState:
    """Route (L, B, H, T_new, D) tokens as the reference: sink while it has room, then the buffer; every full
    buffer is compressed as one chunk (each chunk on its own, so streaming equals bulk). Validation and
    every chunk's encoding come before any write, so bad input leaves the state unchanged."""
    K16, V16 = _check_append(ops, cfg, P, state, K, V)
    st, S, R = state, cfg.sink, cfg.buffer
    n, T0 = K16.shape[3], st.length
    if n == 0:
        return st
    _, c0, b0 = RAC.counts(cfg, T0)
    s = max(0, min(S - T0, n))                                       # new tokens that go to the sink
    m = b0 + n - s                                                   # post-sink tokens not in a chunk yet
    full = m // R
    chunks = []
    if full:
        seq_k = torch.cat([st.buf_k[:, :, :, :b0], K16[:, :, :, s:]], dim=3)     # (L, B, H, m, D) in order
        seq_v = torch.cat([st.buf_v[:, :, :, :b0], V16[:, :, :, s:]], dim=3)
        chunks = [_encode_chunk(ops, cfg, P, st, seq_k[:, :, :, i * R:(i + 1) * R], seq_v[:, :, :, i * R:(i + 1) * R],
                                c0 + i) for i in range(full)]
    if s:                                                            # commit: sink
        st.sink_k[:, :, :, T0:T0 + s] = K16[:, :, :, :s]
        st.sink_v[:, :, :, T0:T0 + s] = V16[:, :, :, :s]
    for i, layers in enumerate(chunks):                              # chunk codes
        for l, (Kq, Vq) in enumerate(layers):
            for dst, codes in (((st.first_k, Kq), (st.first_v, Vq)) if l == 0 else ((st.res_k, Kq), (st.res_v, Vq))):
                for name, a in codes.items():
                    (dst[name][:, c0 + i] if l == 0 else dst[name][l - 1, :, c0 + i]).copy_(a)
    if full:                                                         # the buffer: what is left after the chunks
        left = m - full * R
        st.buf_k.zero_()
        st.buf_v.zero_()
        st.buf_k[:, :, :, :left] = seq_k[:, :, :, full * R:]
        st.buf_v[:, :, :, :left] = seq_v[:, :, :, full * R:]
    elif n > s:
        st.buf_k[:, :, :, b0:m] = K16[:, :, :, s:]
        st.buf_v[:, :, :, b0:m] = V16[:, :, :, s:]
    st.length = T0 + n
    return st


# ---------------------------------------------------------------------------------------------------
# reading the cache: Algorithm 3 per layer over all chunks, segments, attention


def _check_layer(l, L: int) -> int:
    if isinstance(l, bool) or not isinstance(l, (int, np.integer)) or not 0 <= l < L:
        raise ValueError(f"layer index {l!r} is outside [0, {L})")
    return int(l)


def _layer_codes(st: AquaTensorState, l: int, n: int) -> tuple:
    """Layer l's codes of the first n chunks as (B, n * R, ...) tensors (Kq, Vq)."""
    B = st.shape[1]
    out = []
    for group in ((st.first_k, st.first_v) if l == 0 else (st.res_k, st.res_v)):
        d = {}
        for name, a in group.items():
            x = a[:, :n] if l == 0 else a[l - 1, :, :n]                 # (B, n, R, ...)
            d[name] = x.reshape((B, n * x.shape[2]) + tuple(x.shape[3:]))
        out.append(d)
    return tuple(out)


def decode_layer(ops, cfg, P, st: AquaTensorState, l: int, prev=None) -> tuple:
    """Layer l's reconstructed history (Algorithm 3 over every chunk at once): ``(K_hat, V_hat)`` token
    vectors (B, n_chunks * R, F) fp32, keys pre-RoPE when ``cfg.pre_rope``. ``prev``: layer l-1's result
    (decoded from layer 0 up when None)."""
    check_call(cfg, P, st)
    L, B, H, D = st.shape
    l = _check_layer(l, L)
    F = H * D
    _, n, _ = RAC.counts(cfg, st.length)
    if n == 0:
        return tuple(torch.zeros((B, 0, F), dtype=torch.float32, device=st.device) for _ in range(2))
    if l and prev is None:
        for j in range(l):
            prev = decode_layer(ops, cfg, P, st, j, prev)
    if l:
        want = (B, n * cfg.buffer, F)
        if len(prev) != 2 or any(tuple(p.shape) != want for p in prev):
            raise ValueError(f"prev must be layer {l - 1}'s (K_hat, V_hat), each of shape {want}")
    Kq, Vq = _layer_codes(st, l, n)
    return decode_checked(ops, cfg, P, l, Kq, Vq, F, *(prev if l else (None, None)))


def segments(cfg, st: AquaTensorState, l: int, hat) -> list:
    """Layer l's cache as three (K, V) fp32 segments (B, H, T_i, D), keys post-RoPE: sink, history, buffer."""
    L, B, H, D = st.shape
    n_sink, n, n_buf = RAC.counts(cfg, st.length)
    K_hat, V_hat = hat
    k = K_hat.reshape(B, -1, H, D).transpose(1, 2)                          # (B, H, n * R, D), a view
    if cfg.pre_rope and k.shape[2]:
        k = rope(k, *_rope_tables(cfg.rope_theta, D, cfg.sink, k.shape[2], st.device, cfg.max_tokens), inverse=False)
    return [(st.sink_k[l, :, :, :n_sink].float(), st.sink_v[l, :, :, :n_sink].float()),
            (k, V_hat.reshape(B, -1, H, D).transpose(1, 2)),
            (st.buf_k[l, :, :, :n_buf].float(), st.buf_v[l, :, :, :n_buf].float())]


def dequantize(ops, cfg, P, st: AquaTensorState) -> list:
    """``[(K_l, V_l)]`` fp32 (B, H, T, D), keys post-RoPE: sink, decoded chunks, buffer, per layer."""
    check_call(cfg, P, st)
    out, hat = [], None
    for l in range(st.shape[0]):
        hat = decode_layer(ops, cfg, P, st, l, hat)
        segs = segments(cfg, st, l, hat)
        out.append(tuple(torch.cat([s[i] for s in segs], dim=2) for i in (0, 1)))
    return out


def decode_attention(ops, cfg, P, st: AquaTensorState, l: int, q, hat=None, *, scale=None):
    """``(out, lse)`` of q (B, H_q, T_q, D) over layer l's cache: the history reconstructed (``hat``, or
    :func:`decode_layer` when None), RoPE'd, and the sink, history and buffer attended in fp32 by the
    backend's flash-decoding kernel (one log-sum-exp merge); out in q's dtype."""
    check_call(cfg, P, st)
    L, B, H, D = st.shape
    C.check_decode_q(q, (B, H, D), st.device, st.length, allow_cpu=ops.allow_cpu())
    l = _check_layer(l, L)
    if hat is None:
        hat = decode_layer(ops, cfg, P, st, l)
    want = (B, RAC.counts(cfg, st.length)[1] * cfg.buffer, H * D)
    if len(hat) != 2 or any(tuple(h.shape) != want for h in hat):
        raise ValueError(f"hat must be layer {l}'s (K_hat, V_hat) from decode_layer, each of shape {want}")
    out, lse = ops.attention.decode_attention(q.float(), segments(cfg, st, l, hat), scale=scale)
    return out.to(q.dtype), lse


def bits_per_value(cfg, n_layers: int, F: int):
    """Mirrors `kvq.reference.aqua_cache.bits_per_value`: the same Fraction (host arithmetic; no difference)."""
    return RAC.bits_per_value(cfg, n_layers, F)


def state_bytes(st: AquaTensorState) -> int:
    """Mirrors `kvq.reference.aqua_cache.state_bytes`: bytes of every tensor of the state (the same count:
    the same shapes and dtypes). Differences: takes an :class:`AquaTensorState`."""
    if not isinstance(st, AquaTensorState):
        raise TypeError(f"st must be an AquaTensorState (an AQUA-KV cache made by init), got {type(st).__name__}")
    return int(sum(a.numel() * a.element_size() for a in st.arrays().values()))

