"""The paged, streaming KV-cache layout shared by KIVI and Kitty (Kitty paper Fig. 1, Fig. 3, section 4.3).

A cache of one layer holds, per sequence and KV head, the tokens of a context in four places:

    sink    the first S tokens, K and V, in FP16 (never quantized);
    keys    a key Q-buffer of up to G FP16 tokens; when it holds G tokens it is quantized per channel
            (groups of G tokens along the token axis) into one key page;
    values  a local window of the R most recent tokens in FP16 (a ring buffer: token p sits in slot
            p % R); the token that leaves it is quantized per token, either at once into the current
            value page (KIVI) or into a value Q-buffer of G FP16 tokens flushed as one page (Kitty);
    pages   fixed-size pages of G tokens in a page pool, addressed through per-sequence page tables
            (vLLM / SGLang style), so the cache is compatible with paged attention.

The state is data: exactly the arrays a GPU holds (``PagedState``), plus the integer counters
``length`` (tokens appended; every other count derives from it) and the pool cursors, and the
configuration ``init`` made it with (``cfg``). Every operation is a function of (config, codec, state,
inputs) and first checks that the config is the state's (``state.check_state``: another method's state
or another configuration is refused); ``append`` validates everything before it changes anything, so
a bad input leaves the state unchanged. Unused buffer slots are zero (a flush zeroes its
buffer), so that two histories with the same tokens give the same bytes everywhere.

    st = init(cfg, codec, batch=1, kv_heads=8, head_dim=128)
    append(cfg, codec, st, k, v)                 # k, v: (B, H_kv, T_new, D), prefill or decode
    out, lse = decode_attention(cfg, codec, st, q)

Methods plug in a *key codec* (``encode(cfg, kpage, page_index) -> page arrays``, ``decode(cfg, page)
-> fp32``; ``page_index`` is the page's position in its sequence, which seeds random baselines):
KIVI stores plain b-bit packed pages, Kitty its dense / sparse 2-bit planes with a boost index.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from . import attention as attn
from . import checks
from . import numerics as nx
from .packing import pack, unpack
from .quant import dequantize, quantize
from .state import cfg_field, check_config, check_dims, check_host_device
from .state import check_state as _check_state

F16 = np.float16


@dataclass
class PagedState:
    """The bytes of one layer's cache (shapes: B batch, H KV heads, D head dim, P pool pages, N pages
    per sequence), plus counters. ``k_pool`` holds the method's key-page arrays, each (P, H, ...)."""

    sink_k: np.ndarray          # (B, H, S, D) fp16
    sink_v: np.ndarray          # (B, H, S, D) fp16
    k_buf: np.ndarray           # (B, H, G, D) fp16   key Q-buffer
    v_win: np.ndarray           # (B, H, R, D) fp16   value local window, ring buffer
    v_buf: np.ndarray           # (B, H, G or 0, D) fp16   value Q-buffer (Kitty), empty for KIVI
    k_pool: dict                # name -> (P, H, ...) key-page arrays (codec-defined)
    v_codes: np.ndarray         # (P, H, G, D * v_bits / 8) uint8, packed along channels
    v_scale: np.ndarray         # (P, H, G, D / Gv) meta dtype
    v_mn: np.ndarray            # (P, H, G, D / Gv) meta dtype
    k_table: np.ndarray         # (B, N) int32 key page ids, -1 = none
    v_table: np.ndarray         # (B, N) int32 value page ids, -1 = none
    length: int = 0             # tokens appended to every sequence
    k_next: int = 0             # next free key page in the pool
    v_next: int = 0             # next free value page in the pool
    shape: tuple = field(default=(0, 0, 0))   # (B, H, D)
    cfg: object = cfg_field()   # the configuration init made the cache with (a KIVIConfig / KittyConfig)

    def arrays(self) -> dict:
        """Every array of the state by name (key-pool arrays as ``k_pool.<name>``), for comparisons."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), np.ndarray)}
        out.update({f"k_pool.{n}": a for n, a in self.k_pool.items()})
        return out

    def copy(self) -> "PagedState":
        new = dataclasses.replace(self, k_pool={n: a.copy() for n, a in self.k_pool.items()})
        for n, a in self.arrays().items():
            if not n.startswith("k_pool."):
                setattr(new, n, a.copy())
        return new


# ---------------------------------------------------------------------------------------------------
# counts: everything derives from the number of tokens T


class PagedConfig:
    """The base of the configurations of a paged cache (``kivi.KIVIConfig``, ``kitty.KittyConfig``), whose
    fields (``sink``, ``group_size``, ``residual``, ``max_tokens``, ``v_qbuffer``) the counts below read. It
    holds no field itself; it lets this module know a paged configuration without importing the methods
    that import it."""

    __slots__ = ()


def _check_paged_cfg(cfg) -> None:
    """``cfg`` must configure a paged cache: a ``kivi.KIVIConfig`` or a ``kitty.KittyConfig`` (TypeError)."""
    if not isinstance(cfg, PagedConfig):
        raise TypeError(f"cfg must be a KIVIConfig or a KittyConfig (the configuration of a paged cache), got "
                        f"{type(cfg).__name__}")


def counts(cfg, T: int) -> dict:
    """Where the T tokens of a sequence live (the bookkeeping of Fig. 1).

    ``n_sink`` sink tokens; ``n_kpages`` full key pages and ``n_kbuf`` tokens in the key Q-buffer;
    ``n_vq`` values quantized into pages (``n_vpages`` pages touched), ``n_vbuf`` values in the
    value Q-buffer, ``n_win`` in the local window. ``cfg``: a KIVIConfig / KittyConfig; ``T`` an int >= 0.
    """
    _check_paged_cfg(cfg)
    T = checks.int_arg(T, "T", lo=0)
    S, G, R = cfg.sink, cfg.group_size, cfg.residual
    n_sink = min(T, S)
    post = T - n_sink
    n_win = min(post, R)
    evicted = post - n_win
    if cfg.v_qbuffer:
        n_vq, n_vbuf = (evicted // G) * G, evicted % G
    else:
        n_vq, n_vbuf = evicted, 0
    return dict(n_sink=n_sink, post=post, n_kpages=post // G, n_kbuf=post % G, n_win=n_win,
                n_vq=n_vq, n_vbuf=n_vbuf, n_vpages=-(-n_vq // G))


def max_pages(cfg) -> int:
    """Key (and value) pages one sequence may need: ``ceil((max_tokens - sink) / group_size)``."""
    _check_paged_cfg(cfg)
    return -(-max(cfg.max_tokens - cfg.sink, 0) // cfg.group_size)


def check_cfg(cfg, codec) -> None:
    """``cfg`` must be the codec's configuration class (KIVI pages take a KIVIConfig, Kitty a KittyConfig)."""
    check_config(cfg, codec.config)


def check_state(cfg, codec, st) -> None:
    """The first check of every operation: ``st`` is a ``PagedState`` made by ``init`` with ``cfg``."""
    _check_state(st, cfg, codec.config, PagedState)


def init(cfg, codec, batch: int, kv_heads: int, head_dim: int, *, device=None) -> PagedState:
    """An empty cache with every buffer and the page pool preallocated (capacity ``cfg.max_tokens``);
    the state records ``cfg``. ``device``: None or "cpu" (NumPy arrays live on the host)."""
    check_cfg(cfg, codec)
    check_dims(batch=batch, kv_heads=kv_heads, head_dim=head_dim)
    check_host_device(device)
    cfg.check_head_dim(head_dim)
    B, H, D, G = batch, kv_heads, head_dim, cfg.group_size
    N = max_pages(cfg)
    P = B * N
    meta = np.dtype(nx.dtype_name(cfg.meta_dtype))
    Gv = cfg.v_group(D)
    return PagedState(
        sink_k=np.zeros((B, H, cfg.sink, D), F16), sink_v=np.zeros((B, H, cfg.sink, D), F16),
        k_buf=np.zeros((B, H, G, D), F16), v_win=np.zeros((B, H, cfg.residual, D), F16),
        v_buf=np.zeros((B, H, G if cfg.v_qbuffer else 0, D), F16),
        k_pool=codec.empty_pool(cfg, P, H, D),
        v_codes=np.zeros((P, H, G, D * cfg.v_bits // 8), np.uint8),
        v_scale=np.zeros((P, H, G, D // Gv), meta), v_mn=np.zeros((P, H, G, D // Gv), meta),
        k_table=np.full((B, N), -1, np.int32), v_table=np.full((B, N), -1, np.int32),
        shape=(B, H, D), cfg=cfg)


# ---------------------------------------------------------------------------------------------------
# append: insert (sink / Q-buffer / window), quantize and pack full buffers (section 4.3)


def _check_append(cfg, codec, st: PagedState, k, v):
    check_state(cfg, codec, st)
    B, H, D = st.shape
    for name, x in (("k", k), ("v", v)):
        x = np.asarray(x)
        if x.dtype not in (np.float16, np.float32):
            raise TypeError(f"{name} has dtype {x.dtype}; append takes float16 (or float32, rounded to "
                            f"the FP16 buffers)")
        if x.ndim != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D:
            raise ValueError(f"{name} has shape {x.shape}; this cache takes (B={B}, H_kv={H}, T_new, D={D})")
        nx.check_finite(x, name)
    if np.shape(k) != np.shape(v):
        raise ValueError(f"k and v must have the same shape, got {np.shape(k)} and {np.shape(v)}")
    n = np.shape(k)[2]
    if st.length + n > cfg.max_tokens:
        raise ValueError(f"appending {n} tokens to {st.length} exceeds the capacity max_tokens="
                         f"{cfg.max_tokens}")
    with np.errstate(over="ignore"):                     # overflow is reported just below
        k16 = np.asarray(k).astype(F16)
        v16 = np.asarray(v).astype(F16)
    if not (np.isfinite(k16).all() and np.isfinite(v16).all()):
        raise ValueError("k or v overflows float16 (|x| > 65504); the FP16 buffers cannot hold it")
    return k16, v16


def _alloc(table_row: np.ndarray, idx: int, cursor: int) -> tuple[int, int]:
    table_row[idx] = cursor
    return cursor, cursor + 1


def quantize_values(cfg, x16: np.ndarray):
    """Per-token quantization of values (B, H, n, D) in groups of Gv channels, packed along channels."""
    D = x16.shape[-1]
    codes, scale, mn = quantize(x16, cfg.v_bits, cfg.v_group(D), axis=-1, meta_dtype=cfg.meta_dtype)
    return pack(codes, cfg.v_bits, axis=-1), scale, mn


def append(cfg, codec, st: PagedState, k, v) -> PagedState:
    """Append ``T_new`` tokens (prefill or decode) to every sequence; returns the (mutated) state.

    The tokens are routed as in section 4.3: sink first; then keys to the key Q-buffer (a full
    buffer is quantized into a key page) and values to the local window (the token it evicts is
    quantized per token, or parked in the value Q-buffer and flushed one page at a time). Streaming
    (one token per call) and bulk (all at once) produce the same state bit for bit.
    """
    k16, v16 = _check_append(cfg, codec, st, k, v)
    B, H, D = st.shape
    S, G, R = cfg.sink, cfg.group_size, cfg.residual
    T0, n = st.length, k16.shape[2]
    if n == 0:
        return st
    c0 = counts(cfg, T0)
    # 1. sink
    n_s = max(0, min(S - T0, n))
    st.sink_k[:, :, T0:T0 + n_s] = k16[:, :, :n_s]
    st.sink_v[:, :, T0:T0 + n_s] = v16[:, :, :n_s]
    k_new, v_new = k16[:, :, n_s:], v16[:, :, n_s:]          # (B, H, m, D), post-sink tokens
    p0 = c0["post"]                                           # post-sink index of k_new[:, :, 0]
    # 2. keys: Q-buffer contents + new keys, cut into pages of G
    keys = np.concatenate([st.k_buf[:, :, :c0["n_kbuf"]], k_new], axis=2)
    n_full = keys.shape[2] // G
    for j in range(n_full):
        page = keys[:, :, j * G:(j + 1) * G]                  # (B, H, G, D) fp16
        arrays = codec.encode(cfg, page, c0["n_kpages"] + j)  # name -> (B, H, ...)
        for b in range(B):
            pid, st.k_next = _alloc(st.k_table[b], c0["n_kpages"] + j, st.k_next)
            for name, a in arrays.items():
                st.k_pool[name][pid] = a[b]
    rest = keys[:, :, n_full * G:]
    st.k_buf[:] = 0                                           # a flushed buffer is zeroed: defined state
    st.k_buf[:, :, :rest.shape[2]] = rest
    # 3. values: the window in token order + new values; the last R stay, the others are evicted
    win_order = [(p % R) for p in range(p0 - c0["n_win"], p0)] if R else []
    values = np.concatenate([st.v_win[:, :, win_order], v_new], axis=2)      # post-sink tokens
    first = p0 - c0["n_win"]                                  # post-sink index of values[:, :, 0]
    n_keep = min(values.shape[2], R)
    evicted = values[:, :, :values.shape[2] - n_keep]         # post-sink indices first .. first+e-1
    for i in range(n_keep):
        p = first + evicted.shape[2] + i
        st.v_win[:, :, p % R] = values[:, :, evicted.shape[2] + i]
    _evict_values(cfg, st, evicted, c0)
    st.length = T0 + n
    return st


def _evict_values(cfg, st: PagedState, evicted: np.ndarray, c0: dict) -> None:
    """Values leaving the window (B, H, e, D): quantized per token into value pages (KIVI), or parked
    in the value Q-buffer and quantized one full page at a time (Kitty)."""
    G = cfg.group_size
    B = evicted.shape[0]
    if cfg.v_qbuffer:                                         # Kitty: buffer, then whole pages
        toks = np.concatenate([st.v_buf[:, :, :c0["n_vbuf"]], evicted], axis=2)
        q0 = c0["n_vq"]                                       # tokens already in pages (page multiple)
        n_full = toks.shape[2] // G
        rest = toks[:, :, n_full * G:]
        toks = toks[:, :, :n_full * G]
        st.v_buf[:] = 0
        st.v_buf[:, :, :rest.shape[2]] = rest
    else:                                                     # KIVI: every evicted token at once
        toks, q0 = evicted, c0["n_vq"]
    if toks.shape[2] == 0:
        return
    packed, scale, mn = quantize_values(cfg, toks)            # (B, H, e, ...)
    for i in range(toks.shape[2]):
        q = q0 + i                                            # index among quantized values
        page, slot = divmod(q, G)
        for b in range(B):
            if slot == 0:
                _, st.v_next = _alloc(st.v_table[b], page, st.v_next)
            pid = st.v_table[b, page]
            st.v_codes[pid, :, slot] = packed[b, :, i]
            st.v_scale[pid, :, slot] = scale[b, :, i]
            st.v_mn[pid, :, slot] = mn[b, :, i]


# ---------------------------------------------------------------------------------------------------
# reading the cache: dequantize, segments, decode attention


def _dequant_values(cfg, st: PagedState, b: int, n_vq: int, D: int) -> np.ndarray:
    """The first ``n_vq`` quantized values of sequence b, fp32 (H, n_vq, D)."""
    G = cfg.group_size
    H = st.shape[1]
    out = np.zeros((H, n_vq, D), np.float32)
    for page in range(-(-n_vq // G)):
        pid = st.v_table[b, page]
        m = min(G, n_vq - page * G)
        codes = unpack(st.v_codes[pid, :, :m], cfg.v_bits, axis=-1)
        out[:, page * G:page * G + m] = dequantize(codes, st.v_scale[pid, :, :m], st.v_mn[pid, :, :m],
                                                   cfg.v_group(D), axis=-1, out_dtype=np.float32)
    return out


def dequantize_cache(cfg, codec, st: PagedState):
    """The K and V the cache represents, in token order: fp32 (B, H, T, D) each.

    Sink and buffered tokens are their FP16 values; quantized tokens are ``code * scale + mn`` in
    fp32 (the values a fused kernel computes in registers, before any rounding to FP16).
    """
    check_state(cfg, codec, st)
    B, H, D = st.shape
    T = st.length
    c = counts(cfg, T)
    S, G, R = cfg.sink, cfg.group_size, cfg.residual
    K = np.zeros((B, H, T, D), np.float32)
    V = np.zeros((B, H, T, D), np.float32)
    K[:, :, :c["n_sink"]] = st.sink_k[:, :, :c["n_sink"]]
    V[:, :, :c["n_sink"]] = st.sink_v[:, :, :c["n_sink"]]
    for b in range(B):
        for j in range(c["n_kpages"]):
            page = {n: a[st.k_table[b, j]] for n, a in st.k_pool.items()}
            K[b, :, S + j * G:S + (j + 1) * G] = codec.decode(cfg, page)      # (H, G, D)
        V[b, :, S:S + c["n_vq"]] = _dequant_values(cfg, st, b, c["n_vq"], D)
    kq_end = S + c["n_kpages"] * G
    K[:, :, kq_end:T] = st.k_buf[:, :, :c["n_kbuf"]]
    vb0 = S + c["n_vq"]
    V[:, :, vb0:vb0 + c["n_vbuf"]] = st.v_buf[:, :, :c["n_vbuf"]]
    w0 = vb0 + c["n_vbuf"]
    if R:
        V[:, :, w0:T] = st.v_win[:, :, [(p % R) for p in range(c["post"] - c["n_win"], c["post"])]]
    return K, V


def segment_bounds(cfg, T: int) -> list[tuple[int, int]]:
    """Token ranges over which both K and V have one representation each (sink, quantized, buffer,
    window): the boundaries of the key layout and of the value layout, merged. ``T`` an int >= 0."""
    c = counts(cfg, T)
    T = int(T)
    S, G = cfg.sink, cfg.group_size
    cuts = {0, T, c["n_sink"], S + c["n_kpages"] * G, S + c["n_vq"], S + c["n_vq"] + c["n_vbuf"]}
    cuts = sorted(x for x in cuts if 0 <= x <= T)
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def decode_attention(cfg, codec, st: PagedState, q, *, scale=None):
    """Attention of ``q`` (B, H_q, T_q, D) over the whole cache, as flash-decoding does it: one
    partial (output, log-sum-exp) per segment of ``segment_bounds``, merged by log-sum-exp.

    Every query attends to every cached token (decode: the queries' own K / V are appended first).
    Returns ``(out, lse)`` in fp32 (float64 when q is float64).
    """
    check_state(cfg, codec, st)
    B, H, D = st.shape
    q = np.asarray(q)
    if q.ndim != 4 or q.shape[0] != B or q.shape[3] != D or q.shape[1] % H:
        raise ValueError(f"q has shape {q.shape}; this cache takes (B={B}, H_q (a multiple of {H}), T_q, D={D})")
    if st.length == 0:
        raise ValueError("the cache is empty: append tokens before attending")
    K, V = dequantize_cache(cfg, codec, st)
    if q.dtype == np.float64:
        K, V = K.astype(np.float64), V.astype(np.float64)
    else:
        q = nx.as_f32(q, "q")
    segs = [(K[:, :, a:b], V[:, :, a:b]) for a, b in segment_bounds(cfg, st.length)]
    return attn.decode_attention(q, segs, scale=scale)
