"""The paged streaming cache of ``kvq.reference.paged`` on torch tensors, shared by both fast backends.

The state holds the same fields as ``kvq.reference.paged.PagedState`` (torch tensors on the device,
preallocated; the counters ``length`` / ``k_next`` / ``v_next`` on the host; ``cfg``, the configuration
``init`` made it with), so parity is stated field by field: after the same appends every tensor is
bit-identical to the reference's array. Every operation first checks that the configuration it is
given is the state's (:func:`check_state`), so no kernel writes at another configuration's offsets.

append routes tokens exactly as the reference (sink, key Q-buffer flushed into pages, value window
ring buffer, evicted values quantized per token into page slots (KIVI) or through the value Q-buffer
(Kitty)); page ids are assigned in the reference's order (page-major, then batch), so the pools and
page tables are identical too. The quantize+pack kernels are the backend's (``codec.ops``: the
bit-exact ``quant`` / ``packing`` modules of ``kvq.fast.triton`` or ``kvq.fast.cupy``); the routing is
torch indexing. The decode kernels live in each backend's ``paged`` module.

    codec = KIVICodec(TRITON_OPS)                            # kvq.fast.caches.codecs
    st = init(cfg, codec, batch=8, kv_heads=8, head_dim=128)
    append(cfg, codec, st, k, v)                             # k, v: (B, H_kv, T_new, D) fp16
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvq.fast.caches import codecs as _codecs
from kvq.fast import common as C
from kvq.reference import numerics as nx
from kvq.reference import paged as RP
from kvq.reference import state as RS

F16 = torch.float16

counts = RP.counts
max_pages = RP.max_pages
segment_bounds = RP.segment_bounds


@dataclass
class PagedState:
    """The fast tier's cache state: the fields of ``kvq.reference.paged.PagedState`` as torch tensors
    on one device (``k_pool``: name -> tensor), plus the host counters."""

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    k_buf: torch.Tensor
    v_win: torch.Tensor
    v_buf: torch.Tensor
    k_pool: dict
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_mn: torch.Tensor
    k_table: torch.Tensor
    v_table: torch.Tensor
    length: int = 0
    k_next: int = 0
    v_next: int = 0
    shape: tuple = field(default=(0, 0, 0))
    cfg: object = RS.cfg_field()          # the configuration init made the cache with

    @property
    def device(self) -> torch.device:
        return self.sink_k.device

    def arrays(self) -> dict:
        """Every tensor of the state by name (key-pool tensors as ``k_pool.<name>``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        out.update({f"k_pool.{n}": a for n, a in self.k_pool.items()})
        return out

    def copy(self) -> "PagedState":
        new = dataclasses.replace(self, k_pool={n: a.clone() for n, a in self.k_pool.items()})
        for n, a in self.arrays().items():
            if not n.startswith("k_pool."):
                setattr(new, n, a.clone())
        return new


def meta_dtype(cfg) -> torch.dtype:
    return C.torch_dtype(nx.dtype_name(cfg.meta_dtype))


def check_state(cfg, codec, st) -> None:
    """The first check of every operation: ``st`` is this tier's ``PagedState``, made by ``init`` with a
    configuration of the codec's class equal to ``cfg`` (``kvq.reference.state.check_state``)."""
    RS.check_state(st, cfg, codec.config, PagedState)


def init(cfg, codec, batch: int, kv_heads: int, head_dim: int, *, device=None) -> PagedState:
    """An empty cache, every buffer and the page pool preallocated, on ``device`` (None: the current CUDA
    device, or the CPU under the Triton interpreter; ``kvq.fast.common.cache_device``); the state
    records ``cfg``."""
    RP.check_cfg(cfg, codec)
    RS.check_dims(batch=batch, kv_heads=kv_heads, head_dim=head_dim)
    cfg.check_head_dim(head_dim)
    B, H, D, G = int(batch), int(kv_heads), int(head_dim), cfg.group_size
    N = max_pages(cfg)
    Pn = B * N
    meta = meta_dtype(cfg)
    Gv = cfg.v_group(D)
    dev = C.cache_device(codec.ops, device)
    z = lambda *s, dt=F16: torch.zeros(s, dtype=dt, device=dev)                          # noqa: E731
    return PagedState(
        sink_k=z(B, H, cfg.sink, D), sink_v=z(B, H, cfg.sink, D), k_buf=z(B, H, G, D),
        v_win=z(B, H, cfg.residual, D), v_buf=z(B, H, G if cfg.v_qbuffer else 0, D),
        k_pool=codec.empty_pool(cfg, Pn, H, D, dev),
        v_codes=z(Pn, H, G, D * cfg.v_bits // 8, dt=torch.uint8),
        v_scale=z(Pn, H, G, D // Gv, dt=meta), v_mn=z(Pn, H, G, D // Gv, dt=meta),
        k_table=torch.full((B, N), -1, dtype=torch.int32, device=dev),
        v_table=torch.full((B, N), -1, dtype=torch.int32, device=dev), shape=(B, H, D), cfg=cfg)


# ---------------------------------------------------------------------------------------------------
# append


def _check_append(cfg, codec, st: PagedState, k, v):
    check_state(cfg, codec, st)
    C.check_kv_append(k, v, st.shape, st.device, st.length, cfg.max_tokens, allow_cpu=codec.ops.allow_cpu(),
                      dtype_rule="float16 (or float32, rounded to the FP16 buffers)")
    return _to_fp16(k, v)


def _to_fp16(k, v):
    """k, v as float16, refusing fp16 overflow while validation is on."""
    k16 = k if k.dtype is F16 else k.to(F16)
    v16 = v if v.dtype is F16 else v.to(F16)
    if C.validation_enabled() and k.shape[2] and not (bool(torch.isfinite(k16).all())
                                                       and bool(torch.isfinite(v16).all())):
        raise ValueError("k or v overflows float16 (|x| > 65504); the FP16 buffers cannot hold it")
    return k16, v16


def quantize_values(cfg, codec, x16: torch.Tensor):
    """Per-token values (B, H, n, D) in groups of Gv channels, packed along channels (one kernel)."""
    D = x16.shape[-1]
    return codec.ops.packing.quantize_pack(x16, cfg.v_bits, cfg.v_group(D), axis=-1, meta_dtype=nx.dtype_name(cfg.meta_dtype))


def append(cfg, codec, st: PagedState, k, v) -> PagedState:
    """Append (B, H_kv, T_new, D) tokens; the same routing, pages and page ids as the reference."""
    k16, v16 = _check_append(cfg, codec, st, k, v)
    return _append16(cfg, codec, st, k16, v16)


def append_checked(cfg, codec, st: PagedState, k, v) -> PagedState:
    """:func:`append` for a caller that has made its checks of ``st`` and of k, v already: ``st`` made by
    ``init`` with ``cfg`` itself; k, v float16 / float32 tensors (B, H_kv, T_new, D) of the cache's shape
    on its device; the capacity. That caller is ``kvq.integrations.methods.KVStore``, which validates every
    append before it writes (a model's step appends one token per layer: the checks once, not twice). The
    values are still checked while validation is on: NaN / inf (rule 8), then fp16 overflow, as
    :func:`append` checks them."""
    C.check_finite(k, "k")
    C.check_finite(v, "v")
    k16, v16 = _to_fp16(k, v)
    return _append16(cfg, codec, st, k16, v16)


def _append16(cfg, codec, st: PagedState, k16: torch.Tensor, v16: torch.Tensor) -> PagedState:
    """:func:`append`'s routing of checked fp16 tokens."""
    B, H, D = st.shape
    S, G, R = cfg.sink, cfg.group_size, cfg.residual
    T0, n = st.length, k16.shape[2]
    if n == 0:
        return st
    c0 = counts(cfg, T0)
    dev = st.device
    if n == 1 and T0 >= S and c0["n_kbuf"] + 1 < G:
        return _append_token(cfg, codec, st, k16, v16, c0)
    # 1. sink
    n_s = max(0, min(S - T0, n))
    if n_s:
        st.sink_k[:, :, T0:T0 + n_s] = k16[:, :, :n_s]
        st.sink_v[:, :, T0:T0 + n_s] = v16[:, :, :n_s]
    k_new, v_new = k16[:, :, n_s:], v16[:, :, n_s:]
    p0 = c0["post"]
    m = k_new.shape[2]
    if m == 0:
        st.length = T0 + n
        return st
    # 2. keys: Q-buffer + new keys, cut into pages of G; all full pages encoded at once
    keys = torch.cat([st.k_buf[:, :, :c0["n_kbuf"]], k_new], dim=2)
    n_full = keys.shape[2] // G
    if n_full:
        pages = keys[:, :, :n_full * G].reshape(B, H, n_full, G, D)
        first = st.k_next
        write_key_pages(cfg, codec, st, pages, first, c0["n_kpages"])
        ids = first + torch.arange(n_full * B, dtype=torch.int32, device=dev).view(n_full, B).t()
        st.k_table[:, c0["n_kpages"]:c0["n_kpages"] + n_full] = ids
        st.k_next = first + n_full * B
    rest = keys[:, :, n_full * G:].clone()
    st.k_buf.zero_()
    st.k_buf[:, :, :rest.shape[2]] = rest
    # 3. values: window in token order + new values; the last R stay, the others are evicted
    n_win = c0["n_win"]
    if R and n_win:
        order = torch.arange(p0 - n_win, p0, device=dev) % R
        values = torch.cat([st.v_win.index_select(2, order), v_new], dim=2)
    else:
        values = v_new
    first_p = p0 - n_win
    n_keep = min(values.shape[2], R)
    e = values.shape[2] - n_keep
    evicted = values[:, :, :e].clone()
    if n_keep:
        slots = torch.arange(first_p + e, first_p + e + n_keep, device=dev) % R
        st.v_win[:, :, slots] = values[:, :, e:]
    _evict_values(cfg, codec, st, evicted, c0)
    st.length = T0 + n
    return st


class TokenRoute(NamedTuple):
    """Where one decode token's value goes (:func:`token_route`): ``mode`` 0 where the window is not full yet
    (nothing evicted), 1 where Kitty's evicted value joins its value Q-buffer without filling it, 2 where
    KIVI's evicted value is quantized into its history slot (``new_page``: it opens a page), 3 where Kitty's
    evicted value fills its value Q-buffer (flushed by _evict_values); ``slot``: the window slot the new
    value takes (token order mod R; 0 without a window)."""
    mode: int
    slot: int
    new_page: bool


def token_route(cfg, c0: dict) -> TokenRoute:
    """The routing of one decode token past the sink whose key does not complete a page, from the counts
    ``c0`` before it: the one statement of it, taken by the one-kernel writer and by the copies alike."""
    R, G = cfg.residual, cfg.group_size
    slot = c0["post"] % R if R else 0
    if R and c0["n_win"] < R:
        return TokenRoute(0, slot, False)
    if cfg.v_qbuffer:
        return TokenRoute(1 if c0["n_vbuf"] + 1 < G else 3, slot, False)
    return TokenRoute(2, slot, c0["n_vq"] % G == 0)


def _append_token(cfg, codec, st: PagedState, k16: torch.Tensor, v16: torch.Tensor, c0: dict) -> PagedState:
    """``append`` of one decode token past the sink whose key does not complete a page (G - 1 steps of every
    G): the same state as the general routing, with a few writes in place instead of its concatenations
    and its rewrite of the whole window. The key goes to slot n_kbuf of the Q-buffer (the slots after it
    are zero, as the general routing leaves them); the value takes the window slot of the oldest value
    (token order mod R), which, with the window full, is evicted first; where it goes is
    :func:`token_route`'s. Where the backend has a ``token_append`` writer (both fast backends), all of it is
    one kernel, except Kitty's eviction that fills the value Q-buffer (mode 3, one step in G), which takes
    the copies and _evict_values."""
    route = token_route(cfg, c0)
    if route.mode != 3 and _fused_token(cfg, codec, st, k16, v16, c0, route):
        st.length += 1
        return st
    nb = c0["n_kbuf"]
    st.k_buf[:, :, nb:nb + 1] = k16
    if cfg.residual == 0:
        evicted = v16
    else:
        s = route.slot
        evicted = st.v_win[:, :, s:s + 1].clone() if route.mode else None
        st.v_win[:, :, s:s + 1] = v16
    if route.mode == 1:
        st.v_buf[:, :, c0["n_vbuf"]:c0["n_vbuf"] + 1] = evicted
    elif route.mode:
        _evict_values(cfg, codec, st, evicted, c0)
    st.length += 1
    return st


def _fused_token(cfg, codec, st: PagedState, k16: torch.Tensor, v16: torch.Tensor, c0: dict,
                 route: TokenRoute) -> bool:
    """``_append_token``'s writes, routed by ``route`` (modes 0-2), by the backend's ``token_append`` kernel
    (True; a new page's id as _evict_values gives it). False (nothing written) where the backend has no
    such writer or declines."""
    fused = _codecs.writer(codec.ops, "token_append")
    if fused is None:
        return False
    D = st.shape[2]
    if not fused(k16, v16, st.k_buf, st.v_win, st.v_buf, st.v_codes, st.v_scale, st.v_mn, st.v_table, c0["n_kbuf"],
                 route.slot, c0["n_vbuf"], route.mode, c0["n_vq"], route.new_page, st.v_next, cfg.v_bits,
                 cfg.v_group(D)):
        return False
    if route.new_page:
        st.v_next += st.shape[0]
    return True


def _evict_values(cfg, codec, st: PagedState, evicted: torch.Tensor, c0: dict) -> None:
    G = cfg.group_size
    B = evicted.shape[0]
    dev = st.device
    if cfg.v_qbuffer:
        toks = torch.cat([st.v_buf[:, :, :c0["n_vbuf"]], evicted], dim=2)
        q0 = c0["n_vq"]
        n_full = toks.shape[2] // G
        rest = toks[:, :, n_full * G:].clone()
        toks = toks[:, :, :n_full * G]
        st.v_buf.zero_()
        st.v_buf[:, :, :rest.shape[2]] = rest
    else:
        toks, q0 = evicted, c0["n_vq"]
    e = toks.shape[2]
    if e == 0:
        return
    # pages opened by these tokens: page-major, then batch (the reference's allocation order)
    pg0, pg1 = -(-q0 // G), (q0 + e - 1) // G + 1                     # new pages [pg0, pg1)
    n_new = pg1 - pg0
    if n_new > 0:
        ids = st.v_next + torch.arange(n_new * B, dtype=torch.int32, device=dev).view(n_new, B).t()
        st.v_table[:, pg0:pg1] = ids
        st.v_next += n_new * B
    write_values(cfg, codec, st, toks, q0)


def write_key_pages(cfg, codec, st: PagedState, pages: torch.Tensor, first: int, first_index: int) -> bool:
    """Full key pages (B, H, n, G, D) fp16 into the key pool at slots ``first + j * B + b`` (page-major,
    then batch; ``first_index``: the sequence's page number of the first, for Kitty's random draws): the
    codec's single-kernel writer where the backend has one (True), else ``encode_pages`` and copies."""
    if codec.write_pages(cfg, st.k_pool, pages, first):
        return True
    B, n = pages.shape[0], pages.shape[2]
    for name, a in codec.encode_pages(cfg, pages, first_index).items():      # name -> (B, n, H, ...)
        st.k_pool[name][first:first + n * B] = a.transpose(0, 1).reshape((n * B,) + tuple(a.shape[2:]))
    return False


def write_values(cfg, codec, st: PagedState, toks: torch.Tensor, q0: int) -> bool:
    """Values (B, H, e, D) fp16, quantized-history tokens q0 .. q0 + e - 1 whose pages ``st.v_table``
    already names, quantized per token into their page slots: the backend's single-kernel writer where it
    has one and takes this eviction (True), else the value quantizer and scatters."""
    B, H, e, D = toks.shape
    evict = _codecs.writer(codec.ops, "value_evict")
    if evict is not None and evict(toks, st.v_codes, st.v_scale, st.v_mn, st.v_table, q0, cfg.v_bits, cfg.v_group(D)):
        return True
    G = cfg.group_size
    packed, scale, mn = quantize_values(cfg, codec, toks)                    # (B, H, e, ...)
    q = torch.arange(q0, q0 + e, device=toks.device)
    page, slot = q // G, q % G
    pid = st.v_table[:, page].long()                                   # (B, e)
    sl = slot.view(1, e).expand(B, e)
    st.v_codes[pid, :, sl] = packed.transpose(1, 2)                   # (B, e, H, bytes)
    st.v_scale[pid, :, sl] = scale.transpose(1, 2)
    st.v_mn[pid, :, sl] = mn.transpose(1, 2)
    return False


# ---------------------------------------------------------------------------------------------------
# reading the cache


def _values_pages(cfg, codec, st: PagedState, pg0: int, pg1: int) -> torch.Tensor:
    """Value pages [pg0, pg1) of every sequence, fp32 (B, H, (pg1 - pg0) * G, D)."""
    B, H, D = st.shape
    G = cfg.group_size
    ids = st.v_table[:, pg0:pg1].long()
    codes, s, m = st.v_codes[ids], st.v_scale[ids], st.v_mn[ids]       # (B, n, H, G, ...)
    x = codec.ops.packing.unpack_dequantize(codes, s, m, cfg.v_bits, cfg.v_group(D), axis=-1, out_dtype="float32")
    return x.permute(0, 2, 1, 3, 4).reshape(B, H, (pg1 - pg0) * G, D)


def _key_pages(cfg, codec, st: PagedState, pg0: int, pg1: int) -> torch.Tensor:
    """Key pages [pg0, pg1) of every sequence, fp32 (B, H, (pg1 - pg0) * G, D)."""
    B, H, D = st.shape
    G = cfg.group_size
    ids = st.k_table[:, pg0:pg1].long()
    page = {n: a[ids] for n, a in st.k_pool.items()}                   # (B, n, H, ...)
    x = codec.decode(cfg, page)                                         # (B, n, H, G, D)
    return x.permute(0, 2, 1, 3, 4).reshape(B, H, (pg1 - pg0) * G, D)


def _keys_range(cfg, codec, st, a: int, b: int) -> torch.Tensor:
    """K of tokens [a, b) (all past the sink), fp32 (B, H, b - a, D)."""
    B, H, D = st.shape
    S, G = cfg.sink, cfg.group_size
    c = counts(cfg, st.length)
    kq_end = S + c["n_kpages"] * G
    parts = []
    if a < kq_end:
        e = min(b, kq_end)
        pg0, pg1 = (a - S) // G, -(-(e - S) // G)
        x = _key_pages(cfg, codec, st, pg0, pg1)
        parts.append(x[:, :, a - S - pg0 * G:e - S - pg0 * G])
        a = e
    if a < b:
        parts.append(st.k_buf[:, :, a - kq_end:b - kq_end].float())
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


def _values_range(cfg, codec, st, a: int, b: int) -> torch.Tensor:
    """V of tokens [a, b) (all past the sink), fp32 (B, H, b - a, D)."""
    S, G, R = cfg.sink, cfg.group_size, cfg.residual
    c = counts(cfg, st.length)
    vq_end = S + c["n_vq"]
    vb_end = vq_end + c["n_vbuf"]
    parts = []
    if a < vq_end:
        e = min(b, vq_end)
        pg0, pg1 = (a - S) // G, -(-(e - S) // G)
        x = _values_pages(cfg, codec, st, pg0, pg1)
        parts.append(x[:, :, a - S - pg0 * G:e - S - pg0 * G])
        a = e
    if a < b and a < vb_end:
        e = min(b, vb_end)
        parts.append(st.v_buf[:, :, a - vq_end:e - vq_end].float())
        a = e
    if a < b:
        order = torch.arange(a - S, b - S, device=st.device) % R
        parts.append(st.v_win.index_select(2, order).float())
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


def dequantize_cache(cfg, codec, st: PagedState):
    """(K, V) fp32 (B, H, T, D) in token order, bit-identical to the reference's."""
    check_state(cfg, codec, st)
    B, H, D = st.shape
    T = st.length
    c = counts(cfg, T)
    ns = c["n_sink"]
    K = torch.zeros((B, H, T, D), dtype=torch.float32, device=st.device)
    V = torch.zeros_like(K)
    K[:, :, :ns] = st.sink_k[:, :, :ns].float()
    V[:, :, :ns] = st.sink_v[:, :, :ns].float()
    if T > ns:
        K[:, :, ns:] = _keys_range(cfg, codec, st, ns, T)
        V[:, :, ns:] = _values_range(cfg, codec, st, ns, T)
    return K, V


def check_q(codec, st: PagedState, q):
    """The decode query's shape, dtype and device against the cache (and a non-empty cache)."""
    C.check_decode_q(q, st.shape, st.device, st.length, allow_cpu=codec.ops.allow_cpu())
