"""BitDecoding (Du et al., section IV-A and V): the low-bit cache layout a tensor core reads directly.

BitDecoding keeps the newest ``res_len = L mod N_r`` tokens of a context in an FP16 *residual* block
and the first ``N_p = L - res_len`` tokens packed at 4 or 2 bits (section V-B(1)). The residual block
size is eq. 1, ``N_r = P_n * W_n * omega / beta``: P_n = 8 tokens per ``mma.m16n8k16`` tile, W_n warps
along the token axis, omega = 16-bit words, beta bits per code (128 tokens at 4 bits, 256 at 2 bits
with W_n = 4). When the residual holds N_r tokens it is quantized and packed as one page.

**The induced layout** (IV-A(1)). The kernel that packs the residual loads it with ``ldmatrix`` into
tensor-core fragments, and each thread quantizes and packs *the values its own registers hold* into
16-bit words; the kernel that decodes loads the words with the same ``ldmatrix`` variant, so that after
unpacking every thread again holds exactly the fragment ``mma`` expects. In array terms, for one page
and one KV head (R = 16 / beta codes per word, w a warp, g = lane // 4, i the code's slot in its word):

    k_words (8 W_n, D) uint16   word (8 w + g, c), slot i  <-  code of K[w * 8R + 8i + g, c]
    v_words (N_r, D / R) uint16 word (t, 8 u + g), slot i  <-  code of V[t, 8 (u R + i) + g]

(slot i in bits [beta i, beta i + beta), the first code in the low bits, as kvq's contract packs). Keys
are read with non-transposed ``ldmatrix`` (a B fragment of Q K^T holds one token, two adjacent channels:
the two words of one register), values with ``ldmatrix.trans`` (a B fragment of P V holds two adjacent
tokens, one channel). ``bitdecoding_lanes`` derives both layouts lane by lane from the PTX fragment maps
(``fragments``) and emulates the ``lop3`` dequantization the 32-bit registers of this layout allow.

Quantization follows kvq's numerics contract (min-max, ``rint``, fp16 metadata), not the public
code's ``roundf`` of ``x * qmax / (mx - mn)`` (PEERS.md). Scale and minimum are stored as half2 pairs
(``[..., 0]`` scale, ``[..., 1]`` min): keys channel-wise ``(N_r / k_group, D, 2)`` (KC: groups of
k_group tokens per channel) or tensor-wise ``(N_r, D / k_group, 2)`` (KT: groups of k_group channels
per token); values tensor-wise ``(N_r, D / v_group, 2)``.

    cfg = CONFIGS["BitDecoding-KC2"]
    st = init(cfg, batch=1, kv_heads=8, head_dim=128); append(cfg, st, k, v)   # k, v: (B, H_kv, T, D)
    out, lse = decode_attention(cfg, st, q)                                     # q: (B, H_q, T_q, D)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import attention as attn
from . import numerics as nx
from .state import FlatArrays, cfg_field, check_config, check_dims, check_host_device, check_state, check_str, register_layout
from .quant import dequantize as _dequantize
from .quant import quantize as _quantize

F16 = np.float16

__all__ = ["BitDecodingConfig", "CONFIGS", "residual_block_size", "partition", "pack_keys", "pack_values",
           "unpack_keys", "unpack_values", "dequantize_page", "query_transform", "query_untransform",
           "BitDecodingState", "init", "append", "dequantize", "decode_attention"]

P_N = 8           # tokens per mma.m16n8k16 B tile (the N of m16n8k16)
WORD_BITS = 16    # omega: packed words are uint16


def residual_block_size(bits: int, warps_n: int = 4, word_bits: int = WORD_BITS, p_n: int = P_N) -> int:
    """Eq. 1: ``N_r = P_n * W_n * (omega / beta)``, the tokens one packed page holds."""
    bits = nx.check_bits(bits, (2, 4))
    for name, v in (("warps_n", warps_n), ("word_bits", word_bits), ("p_n", p_n)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if word_bits % bits:
        raise ValueError(f"word_bits={word_bits} must be a multiple of bits={bits}")
    return int(p_n * warps_n * (word_bits // bits))


def partition(length: int, n_r: int) -> tuple[int, int]:
    """Section V-B(1): ``(N_p, res_len)`` = tokens packed and tokens in the FP16 residual for a context
    of ``length`` tokens: ``N_p = L - (L mod N_r)``, ``res_len = L mod N_r``. (Eq. of IV-A(2) writes the
    residual as the last N_r tokens; the implementation section, followed here, keeps L mod N_r.)"""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
        raise ValueError(f"length must be an int >= 0, got {length!r}")
    if isinstance(n_r, bool) or not isinstance(n_r, (int, np.integer)) or n_r <= 0:
        raise ValueError(f"n_r must be a positive int, got {n_r!r}")
    return int(length - length % n_r), int(length % n_r)


@dataclass(frozen=True)
class BitDecodingConfig:
    """A BitDecoding cache: ``bits`` (4 or 2, keys and values), ``k_mode`` "channel" (KC: per-channel
    groups of ``k_group`` tokens) or "tensor" (KT: per-token groups of ``k_group`` channels), values
    per token in groups of ``v_group`` channels, ``warps_n`` W_n of eq. 1, ``max_tokens`` per sequence
    (the page pool is preallocated). Metadata is fp16 (half2 pairs)."""

    bits: int = 2
    k_mode: str = "channel"
    k_group: int = 128
    v_group: int = 128
    warps_n: int = 4
    max_tokens: int = 4096
    name: str = "BitDecoding"

    def __post_init__(self):
        nx.check_bits(self.bits, (2, 4))
        if not isinstance(self.k_mode, str) or self.k_mode not in ("channel", "tensor"):
            raise ValueError(f"k_mode must be 'channel' or 'tensor', got {self.k_mode!r}")
        for n in ("k_group", "v_group", "warps_n", "max_tokens"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{n} must be a positive int, got {v!r}")
        for n in ("k_group", "v_group"):
            if getattr(self, n) % P_N:
                raise ValueError(f"{n}={getattr(self, n)} must be a multiple of {P_N} (a fragment row or "
                                 f"column block of the {P_N}-wide mma tiles lies in one group)")
        if self.k_mode == "channel" and self.n_r % self.k_group:
            raise ValueError(f"k_group={self.k_group} tokens must divide the residual block N_r={self.n_r}")
        check_str(self, "name")

    @property
    def n_r(self) -> int:
        """Eq. 1 for this configuration."""
        return residual_block_size(self.bits, self.warps_n)

    @property
    def per_word(self) -> int:
        """R = omega / beta codes per 16-bit word."""
        return WORD_BITS // self.bits

    def check_head_dim(self, D: int) -> None:
        """D must be a multiple of 8 R (values: R d-tiles of 8 channels per word column block) and of
        the channel groups."""
        if D % (8 * self.per_word) or D % self.v_group or (self.k_mode == "tensor" and D % self.k_group):
            raise ValueError(f"head_dim={D} must be a multiple of {8 * self.per_word} (8 x {self.per_word} "
                             f"codes per word), of v_group={self.v_group}"
                             + (f" and of k_group={self.k_group}" if self.k_mode == "tensor" else ""))


CONFIGS = {f"BitDecoding-K{m[0].upper()}{b}": BitDecodingConfig(bits=b, k_mode=m, name=f"BitDecoding-K{m[0].upper()}{b}")
           for m in ("channel", "tensor") for b in (4, 2)}


# ---------------------------------------------------------------------------------------------------
# the induced layout of one page (vectorized; bitdecoding_lanes derives the same words lane by lane)


def check_cfg(cfg) -> None:
    """``cfg`` must be a :class:`BitDecodingConfig` (TypeError): the first check of the page functions."""
    check_config(cfg, BitDecodingConfig)


def _check_block(cfg: BitDecodingConfig, x, name: str) -> np.ndarray:
    check_cfg(cfg)
    x = np.asarray(x)
    if x.dtype not in (np.float16, np.float32):
        raise TypeError(f"{name} has dtype {x.dtype}; expected float16 or float32")
    if x.ndim < 2 or x.shape[-2] != cfg.n_r:
        raise ValueError(f"{name} has shape {x.shape}; a page is (..., N_r={cfg.n_r}, D)")
    cfg.check_head_dim(x.shape[-1])
    nx.check_finite(x, name)
    return x


def pack_words(codes: np.ndarray, bits: int) -> np.ndarray:
    """(..., R) uint8 codes -> (...) uint16 words, slot i in bits [bits i, bits i + bits)."""
    shifts = (np.arange(codes.shape[-1]) * bits).astype(np.uint16)
    return np.bitwise_or.reduce(codes.astype(np.uint16) << shifts, axis=-1).astype(np.uint16)


def _unpack_words(words: np.ndarray, bits: int) -> np.ndarray:
    """(...) uint16 words -> (..., R) uint8 codes."""
    shifts = (np.arange(WORD_BITS // bits) * bits).astype(np.uint16)
    return ((words[..., None] >> shifts) & np.uint16((1 << bits) - 1)).astype(np.uint8)


def _half2(scale: np.ndarray, mn: np.ndarray) -> np.ndarray:
    return np.stack([scale, mn], axis=-1).astype(F16)


def pack_keys(cfg: BitDecodingConfig, k):
    """One page of keys (..., N_r, D) -> ``(k_words (..., 8 W_n, D) uint16, k_params half2)``.

    Channel-wise (KC): ``k_params`` (..., N_r / k_group, D, 2); tensor-wise (KT): (..., N_r, D / k_group, 2).
    Word (8 w + g, c) holds, in slot i, the code of token ``w * 8R + 8 i + g``: warp w's R tiles of 8
    tokens, one channel."""
    k = _check_block(cfg, k, "k")
    axis, R = (-2 if cfg.k_mode == "channel" else -1), cfg.per_word
    codes, scale, mn = _quantize(k, cfg.bits, cfg.k_group, axis=axis)
    lead, D = codes.shape[:-2], codes.shape[-1]
    c = codes.reshape(*lead, cfg.warps_n, R, P_N, D)                  # [w, i, g, c]
    words = pack_words(np.moveaxis(c, -3, -1), cfg.bits)              # [w, g, c]
    return words.reshape(*lead, cfg.warps_n * P_N, D), _half2(scale, mn)


def pack_values(cfg: BitDecodingConfig, v):
    """One page of values (..., N_r, D) -> ``(v_words (..., N_r, D / R) uint16, v_params (..., N_r,
    D / v_group, 2) half2)``. Word (t, 8 u + g) holds, in slot i, the code of channel ``8 (u R + i) + g``
    of token t: R tiles of 8 channels, one token."""
    v = _check_block(cfg, v, "v")
    R = cfg.per_word
    codes, scale, mn = _quantize(v, cfg.bits, cfg.v_group, axis=-1)
    lead, D = codes.shape[:-1], codes.shape[-1]
    c = codes.reshape(*lead, D // (P_N * R), R, P_N)                  # [t, u, i, g]
    words = pack_words(np.swapaxes(c, -1, -2), cfg.bits)              # [t, u, g]
    return words.reshape(*lead, D // R), _half2(scale, mn)


def unpack_keys(cfg: BitDecodingConfig, k_words) -> np.ndarray:
    """Inverse of :func:`pack_keys`' layout: k_words (..., 8 W_n, D) -> codes (..., N_r, D) uint8."""
    check_cfg(cfg)
    k_words = np.asarray(k_words)
    if k_words.dtype != np.uint16 or k_words.ndim < 2 or k_words.shape[-2] != P_N * cfg.warps_n:
        raise ValueError(f"k_words has dtype {k_words.dtype}, shape {k_words.shape}; expected uint16 "
                         f"(..., {P_N * cfg.warps_n}, D)")
    lead, D = k_words.shape[:-2], k_words.shape[-1]
    c = _unpack_words(k_words.reshape(*lead, cfg.warps_n, P_N, D), cfg.bits)      # [w, g, c, i]
    return np.moveaxis(c, -1, -3).reshape(*lead, cfg.n_r, D)


def unpack_values(cfg: BitDecodingConfig, v_words) -> np.ndarray:
    """Inverse of :func:`pack_values`' layout: v_words (..., N_r, D / R) -> codes (..., N_r, D) uint8."""
    check_cfg(cfg)
    v_words = np.asarray(v_words)
    R = cfg.per_word
    if v_words.dtype != np.uint16 or v_words.ndim < 2 or v_words.shape[-1] % P_N:
        raise ValueError(f"v_words has dtype {v_words.dtype}, shape {v_words.shape}; expected uint16 "
                         f"(..., N_r, D / {R}) with D / {R} a multiple of {P_N}")
    lead, W = v_words.shape[:-1], v_words.shape[-1]
    c = _unpack_words(v_words.reshape(*lead, W // P_N, P_N), cfg.bits)            # [t, u, g, i]
    return np.swapaxes(c, -1, -2).reshape(*lead, W * R)


def dequantize_page(cfg: BitDecodingConfig, k_words, k_params, v_words, v_params):
    """(K, V) fp16 (..., N_r, D) of one page: ``fp16(fp32(code) * scale + mn)`` (contract rule 3),
    exactly the fp16 operands the tensor-core kernel feeds to ``mma``.

    The arguments are what :func:`pack_keys` / :func:`pack_values` return for one page: v_words must hold
    the keys' N_r tokens and D channels, and k_params / v_params are float16 (or float32) half2 pairs of
    the layout's shape (NaN metadata propagates into K, V)."""
    check_cfg(cfg)
    kc, vc = unpack_keys(cfg, k_words), unpack_values(cfg, v_words)
    lead, D = kc.shape[:-2], kc.shape[-1]
    if vc.shape != kc.shape:
        raise ValueError(f"v_words has shape {np.shape(v_words)}; the page of k_words {np.shape(k_words)} needs "
                         f"{lead + (cfg.n_r, D // cfg.per_word)} (N_r={cfg.n_r} tokens, D={D} channels)")
    if cfg.k_mode == "channel":
        axis, kp_want = -2, lead + (cfg.n_r // cfg.k_group, D, 2)
    else:
        if D % cfg.k_group:
            raise ValueError(f"k_words has D={D} channels, not a multiple of k_group={cfg.k_group}")
        axis, kp_want = -1, lead + (cfg.n_r, D // cfg.k_group, 2)
    if D % cfg.v_group:
        raise ValueError(f"v_words has D={D} channels, not a multiple of v_group={cfg.v_group}")
    kp = check_params(k_params, "k_params", kp_want)
    vp = check_params(v_params, "v_params", lead + (cfg.n_r, D // cfg.v_group, 2))
    K = _dequantize(kc, kp[..., 0], kp[..., 1], cfg.k_group, axis=axis, out_dtype=F16)
    V = _dequantize(vc, vp[..., 0], vp[..., 1], cfg.v_group, axis=-1, out_dtype=F16)
    return K, V


def check_params(p, name: str, want: tuple) -> np.ndarray:
    """Half2 (scale, min) pairs: a float16 / float32 array of shape ``want`` (ValueError / TypeError)."""
    if p is None:
        raise TypeError(f"{name} must be an array of (scale, min) pairs, got None")
    p = np.asarray(p)
    if p.dtype not in (np.float16, np.float32):
        raise TypeError(f"{name} has dtype {p.dtype}; the page's (scale, min) pairs are float16 (half2)")
    if p.shape != want:
        raise ValueError(f"{name} has shape {p.shape}; this page needs {want} (scale, min) pairs")
    return p


# ---------------------------------------------------------------------------------------------------
# query transformation (section V-A)


def transformed_shape(q_shape, kv_heads: int) -> tuple:
    """(B, H_kv, g_q * T_q, D) for q of shape (B, H_q, T_q, D), or ValueError (both tiers' check)."""
    if len(q_shape) != 4:
        raise ValueError(f"q has shape {tuple(q_shape)}; expected (B, H_q, T_q, D)")
    B, H_q, T_q, D = q_shape
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, (int, np.integer)) or kv_heads <= 0 or H_q % kv_heads:
        raise ValueError(f"kv_heads={kv_heads!r} must be a positive int dividing H_q={H_q}")
    return (B, int(kv_heads), (H_q // kv_heads) * T_q, D)


def untransformed_shape(o_shape, q_heads: int) -> tuple:
    """(B, H_q, T_q, ...) for o of shape (B, H_kv, g_q * T_q, ...), or ValueError (both tiers' check)."""
    if len(o_shape) < 3:
        raise ValueError(f"o has shape {tuple(o_shape)}; expected (B, H_kv, g_q * T_q, ...)")
    B, H, M = o_shape[:3]
    if isinstance(q_heads, bool) or not isinstance(q_heads, (int, np.integer)) or q_heads <= 0 or q_heads % H \
            or M % (q_heads // H):
        raise ValueError(f"q_heads={q_heads!r} must be a positive multiple of H_kv={H} whose group "
                         f"divides the {M} rows")
    return (B, int(q_heads), M // (q_heads // H), *o_shape[3:])


def query_transform(q, kv_heads: int) -> np.ndarray:
    """The paper's ``[1, (g_q, h_kv)] -> [g_q, h_kv]``: q (B, H_q, T_q, D) -> (B, H_kv, g_q * T_q, D).

    kvq's GQA convention (that of HF ``repeat_kv``): query head h reads KV head ``h // g_q``. Row
    ``j * T_q + s`` of KV head ``kv`` is query head ``kv * g_q + j`` at position s, so the g_q heads that
    share a KV head become the M rows of one MMA tile (a reshape: no data moves)."""
    q = np.asarray(q)
    return q.reshape(transformed_shape(q.shape, kv_heads))


def query_untransform(o, q_heads: int) -> np.ndarray:
    """Inverse of :func:`query_transform`: (B, H_kv, g_q * T_q, ...) -> (B, H_q, T_q, ...)."""
    o = np.asarray(o)
    return o.reshape(untransformed_shape(o.shape, q_heads))


# ---------------------------------------------------------------------------------------------------
# the cache: FP16 residual + packed pages through a page table


@dataclass
class BitDecodingState(FlatArrays):
    """The bytes of one layer's cache (B batch, H KV heads, D head dim, P pool pages, N pages per
    sequence, N_r tokens per page), plus counters. Keys and values of a page share its page id."""

    res_k: np.ndarray           # (B, H, N_r, D) fp16   residual block, rows [0, length mod N_r) valid
    res_v: np.ndarray           # (B, H, N_r, D) fp16
    k_words: np.ndarray         # (P, H, 8 W_n, D) uint16
    k_params: np.ndarray        # (P, H, N_r / k_group, D, 2) or (P, H, N_r, D / k_group, 2) fp16 half2
    v_words: np.ndarray         # (P, H, N_r, D / R) uint16
    v_params: np.ndarray        # (P, H, N_r, D / v_group, 2) fp16 half2
    table: np.ndarray           # (B, N) int32 page ids, -1 = none
    length: int = 0             # tokens appended to every sequence
    next_page: int = 0          # next free page of the pool
    shape: tuple = field(default=(0, 0, 0))   # (B, H, D)
    cfg: object = cfg_field()   # the BitDecodingConfig init made the cache with


def init(cfg: BitDecodingConfig, batch: int, kv_heads: int, head_dim: int, *, device=None) -> BitDecodingState:
    """An empty cache with the residual and the page pool preallocated (zeros); the state records
    ``cfg``, and every later call must pass the same configuration. ``device``: None or "cpu" (the fast
    tiers' argument; NumPy arrays live on the host)."""
    check_config(cfg, BitDecodingConfig)
    check_dims(batch=batch, kv_heads=kv_heads, head_dim=head_dim)
    check_host_device(device)
    cfg.check_head_dim(head_dim)
    B, H, D, Nr, R = batch, kv_heads, head_dim, cfg.n_r, cfg.per_word
    N = cfg.max_tokens // Nr
    P = B * N
    kp = (Nr // cfg.k_group, D) if cfg.k_mode == "channel" else (Nr, D // cfg.k_group)
    z = lambda *s, dt=F16: np.zeros(s, dt)                                # noqa: E731
    return BitDecodingState(z(B, H, Nr, D), z(B, H, Nr, D), z(P, H, P_N * cfg.warps_n, D, dt=np.uint16),
                            z(P, H, *kp, 2), z(P, H, Nr, D // R, dt=np.uint16), z(P, H, Nr, D // cfg.v_group, 2),
                            np.full((B, N), -1, np.int32), shape=(B, H, D), cfg=cfg)


register_layout(BitDecodingConfig, init)                   # what state.check_layout holds a hand-built state against


def _check_append(cfg: BitDecodingConfig, st: BitDecodingState, k, v):
    check_state(st, cfg, BitDecodingConfig, BitDecodingState)
    B, H, D = st.shape
    out = []
    for name, x in (("k", k), ("v", v)):
        x = np.asarray(x)
        if x.dtype not in (np.float16, np.float32):
            raise TypeError(f"{name} has dtype {x.dtype}; append takes float16 or float32")
        if x.ndim != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D:
            raise ValueError(f"{name} has shape {x.shape}; this cache takes (B={B}, H_kv={H}, T_new, D={D})")
        nx.check_finite(x, name)
        with np.errstate(over="ignore"):
            x16 = x.astype(F16)
        if not np.isfinite(x16).all():
            raise ValueError(f"{name} overflows float16 (|x| > 65504); the FP16 residual cannot hold it")
        out.append(x16)
    if out[0].shape != out[1].shape:
        raise ValueError(f"k and v must have the same shape, got {out[0].shape} and {out[1].shape}")
    if st.length + out[0].shape[2] > cfg.max_tokens:
        raise ValueError(f"appending {out[0].shape[2]} tokens to {st.length} exceeds the capacity "
                         f"max_tokens={cfg.max_tokens}")
    return out


def append(cfg: BitDecodingConfig, state: BitDecodingState, k, v) -> BitDecodingState:
    """Append tokens k, v (B, H_kv, T_new, D) (prefill or decode); returns the mutated state.

    Tokens (rounded to fp16) fill the residual block; each time it holds N_r tokens it is packed into
    the sequence's next page (the Residual Kernel's "quantize when res_len = N_r") and cleared to zero.
    So after any sequence of appends of L tokens in total the state holds ``partition(L, N_r)``, and
    streaming equals bulk bit for bit. Validation comes first: bad input leaves the state unchanged."""
    k16, v16 = _check_append(cfg, state, k, v)
    st, Nr = state, cfg.n_r
    pos = 0
    while pos < k16.shape[2]:
        r = st.length % Nr
        n = min(Nr - r, k16.shape[2] - pos)
        st.res_k[:, :, r:r + n] = k16[:, :, pos:pos + n]
        st.res_v[:, :, r:r + n] = v16[:, :, pos:pos + n]
        st.length += n
        pos += n
        if r + n == Nr:                                       # the residual is full: one page
            kw, kp = pack_keys(cfg, st.res_k)
            vw, vp = pack_values(cfg, st.res_v)
            page = st.length // Nr - 1
            for b in range(st.shape[0]):
                st.table[b, page], st.next_page = st.next_page, st.next_page + 1
                pid = st.table[b, page]
                st.k_words[pid], st.k_params[pid] = kw[b], kp[b]
                st.v_words[pid], st.v_params[pid] = vw[b], vp[b]
            st.res_k[:] = 0
            st.res_v[:] = 0
    return st


def _segments(cfg: BitDecodingConfig, st: BitDecodingState):
    """[(K, V) packed history, (K, V) residual], fp32 (B, H, T_i, D)."""
    B, H, D = st.shape
    n_p, res = partition(st.length, cfg.n_r)
    hist = [np.zeros((B, H, n_p, D), np.float32) for _ in range(2)]
    for b in range(B):
        for j in range(n_p // cfg.n_r):
            pid = st.table[b, j]
            K, V = dequantize_page(cfg, st.k_words[pid], st.k_params[pid], st.v_words[pid], st.v_params[pid])
            hist[0][b, :, j * cfg.n_r:(j + 1) * cfg.n_r] = K
            hist[1][b, :, j * cfg.n_r:(j + 1) * cfg.n_r] = V
    f32 = lambda a: a[:, :, :res].astype(np.float32)                     # noqa: E731
    return [tuple(hist), (f32(st.res_k), f32(st.res_v))]


def dequantize(cfg: BitDecodingConfig, state: BitDecodingState):
    """The (K, V) the cache represents, fp32 (B, H_kv, T, D) in token order: packed pages dequantized
    to fp16 (what the tensor cores read), then the FP16 residual."""
    check_state(state, cfg, BitDecodingConfig, BitDecodingState)
    if state.length == 0:
        raise ValueError("the cache is empty")
    segs = _segments(cfg, state)
    return tuple(np.concatenate([s[i] for s in segs], axis=2) for i in (0, 1))


def decode_attention(cfg: BitDecodingConfig, state: BitDecodingState, q, *, scale=None):
    """Attention of q (B, H_q, T_q, D) over the cache: ``(out, lse)``, every cached token visible; the
    packed pages and the residual are attended separately and merged by log-sum-exp (the Packing Kernel
    and the Residual Kernel of Fig. 7). fp32 (float64 for float64 q)."""
    check_state(state, cfg, BitDecodingConfig, BitDecodingState)
    B, H, D = state.shape
    q = np.asarray(q)
    if q.ndim != 4 or q.shape[0] != B or q.shape[3] != D or q.shape[1] % H:
        raise ValueError(f"q has shape {q.shape}; this cache takes (B={B}, H_q (a multiple of {H}), T_q, D={D})")
    if state.length == 0:
        raise ValueError("the cache is empty: append tokens before attending")
    segs = _segments(cfg, state)
    if q.dtype == np.float64:
        segs = [(a.astype(np.float64), b.astype(np.float64)) for a, b in segs]
    return attn.decode_attention(q, segs, scale=scale)
