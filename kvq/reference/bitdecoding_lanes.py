"""BitDecoding lane by lane: what each thread of a warp holds, packs and unpacks (sections IV-A, IV-B).

``bitdecoding`` states the induced layout as array reshapes. This module derives it the way the GPU
does, from the PTX fragment maps of ``fragments``, so a reader can check the claim of IV-A(1): when
every thread quantizes and packs the values ``ldmatrix`` put in its own registers, and writes each word
where the same ``ldmatrix`` variant will deliver it back, unpacking yields exactly the registers
``mma.m16n8k16`` needs. It also emulates, bit for bit on uint32 / fp16 patterns,

- the **75316420 order** and the ``lop3`` dequantization of IV-A(3): in the 32-bit register that
  ``ldmatrix`` delivers (two 16-bit words), the low word holds the first element of every half2 pair
  and the high word the second, so one ``lop3(w >> (beta i), mask, 0x64006400, (a & b) | c)`` builds
  the half2 ``(1024 + e_2i, 1024 + e_2i+1)`` and one half2 subtract of 1024 gives both codes exactly;
- the **multi-warp cooperative softmax** of Algorithm 1 (IV-B(2)), and the naive per-warp softmax
  that Table III marks invalid.

    words = residual_kernel_keys(cfg, k)                 # == bitdecoding.pack_keys(cfg, k)[0]
    pairs = lop3_codes(words32, bits=2)                  # (..., 8, 2) fp16 codes, two per lop3
    o = cooperative_attention(q, k, v, warps_n=4)        # == softmax(q k^T / sqrt(d)) v
"""

from __future__ import annotations

import numpy as np

from . import checks
from . import fragments as fr
from . import numerics as nx
from .bitdecoding import P_N, BitDecodingConfig, check_cfg, check_params, pack_words
from .quant import quantize as _quantize

__all__ = ["residual_kernel_keys", "residual_kernel_values", "key_fragments", "value_fragments",
           "LUT_AND_OR", "MAGIC", "lop3", "register_order", "order_digits", "registers", "lop3_codes",
           "cooperative_attention"]


# ---------------------------------------------------------------------------------------------------
# the Residual Kernel's packing, one lane at a time


def _page(cfg, x, name: str, multiple: int) -> np.ndarray:
    """One page (N_r, D) of fp16 / fp32 tokens, finite, D a multiple of ``multiple`` (and of the groups)."""
    check_cfg(cfg)
    x = np.asarray(x)
    if x.dtype not in (np.float16, np.float32):
        raise TypeError(f"{name} has dtype {x.dtype}; expected float16 or float32")
    if x.ndim != 2 or x.shape[0] != cfg.n_r or x.shape[1] % multiple:
        raise ValueError(f"{name} has shape {x.shape}; expected (N_r={cfg.n_r}, D) with D a multiple of {multiple}")
    cfg.check_head_dim(x.shape[1])
    nx.check_finite(x, name)
    return x


def _words(a, name: str, shape: tuple) -> np.ndarray:
    """Packed uint16 words of one page, of exactly ``shape``."""
    a = np.asarray(a)
    if a.dtype != np.uint16 or a.shape != shape:
        raise ValueError(f"{name} has dtype {a.dtype}, shape {a.shape}; expected uint16 {shape}")
    return a


def _codes(x, scale, mn, bits: int) -> np.ndarray:
    """The contract's ``clamp(rint((x - mn_s) / scale_s), 0, qmax)`` (0 where scale_s = 0) on the values
    one thread holds, with its group's stored (scale, min)."""
    s, m = np.float32(scale), np.float32(mn)
    if s == 0:
        return np.uint8(0)
    return np.uint8(nx.rint(nx.clamp(nx.div(nx.sub(np.float32(x), m), s), 0, nx.qmax(bits))))


def _key_params(cfg: BitDecodingConfig, k):
    """Per-element (scale, mn) of a key page (N_r, D): the result of the kernel's min / max reduction
    (thread-level, then ``__shfl_xor_sync`` across the warp), taken here from the contract's quantizer."""
    axis = -2 if cfg.k_mode == "channel" else -1
    _, s, m = _quantize(k, cfg.bits, cfg.k_group, axis=axis)
    return np.repeat(s, cfg.k_group, axis=axis), np.repeat(m, cfg.k_group, axis=axis)


def residual_kernel_keys(cfg: BitDecodingConfig, k) -> np.ndarray:
    """k_words (8 W_n, D) of one key page k (N_r, D), written lane by lane.

    Warp w owns R tiles of 8 tokens (tokens ``w * 8R + 8 i + row``). For each 32-channel step s it loads
    every tile with ``ldmatrix.x4`` (non-transposed; matrix m = channels ``32 s + 8 m ..``), so lane L
    holds in half h of register m the element ``ldmatrix(L, m, h)`` = (row, col) of each tile. It packs
    the R values of that (m, h) (one per tile) into one word and stores it at (8 w + row, 32 s + 8 m +
    col): where ``ldmatrix.x4`` of the word matrix puts it back into half h of register m of lane L."""
    k = _page(cfg, k, "k", 32)
    Nr, D = k.shape
    scale, mn = _key_params(cfg, k)
    R = cfg.per_word
    words = np.zeros((P_N * cfg.warps_n, D), np.uint16)
    for w in range(cfg.warps_n):
        for lane in range(fr.LANES):
            for s in range(D // 32):
                for m in range(4):
                    for h in range(2):
                        row, col = fr.ldmatrix(lane, m, h)
                        ch = 32 * s + 8 * m + col
                        toks = [w * P_N * R + P_N * i + row for i in range(R)]
                        codes = np.array([_codes(k[t, ch], scale[t, ch], mn[t, ch], cfg.bits) for t in toks])
                        words[P_N * w + row, ch] = pack_words(codes, cfg.bits)
    return words


def residual_kernel_values(cfg: BitDecodingConfig, v) -> np.ndarray:
    """v_words (N_r, D / R) of one value page v (N_r, D), written lane by lane.

    For each 16-token k-tile kk and each block u of R channel tiles, ``ldmatrix.x2.trans`` (matrix m =
    tokens ``16 kk + 8 m ..``) gives lane L in half h of register m the element (row, col) =
    ``ldmatrix(L, m, h, trans=True)`` of each channel tile j = u R + i: token ``16 kk + 8 m + row``,
    channel ``8 j + col``. Its R values (one per tile) go into one word at (token, 8 u + col)."""
    check_cfg(cfg)
    R = cfg.per_word
    v = _page(cfg, v, "v", P_N * R)
    Nr, D = v.shape
    _, s, m_ = _quantize(v, cfg.bits, cfg.v_group, axis=-1)
    scale, mn = np.repeat(s, cfg.v_group, axis=-1), np.repeat(m_, cfg.v_group, axis=-1)
    words = np.zeros((Nr, D // R), np.uint16)
    for kk in range(Nr // 16):
        for u in range(D // (P_N * R)):
            for lane in range(fr.LANES):
                for m in range(2):
                    for h in range(2):
                        row, col = fr.ldmatrix(lane, m, h, trans=True)
                        t = 16 * kk + 8 * m + row
                        chans = [P_N * (u * R + i) + col for i in range(R)]
                        codes = np.array([_codes(v[t, c], scale[t, c], mn[t, c], cfg.bits) for c in chans])
                        words[t, P_N * u + col] = pack_words(codes, cfg.bits)
    return words


# ---------------------------------------------------------------------------------------------------
# 75316420 and lop3


LUT_AND_OR = (0xF0 & 0xCC) | 0xAA        # 0xEA: lop3's immLut for (a & b) | c (PTX: ta=F0, tb=CC, tc=AA)
MAGIC = 0x64006400                       # fp16 1024.0 in both halves: exponent 10, ulp 1


def lop3(a, b, c, lut: int) -> np.ndarray:
    """PTX ``lop3.b32 d, a, b, c, immLut``: bit k of d is bit ``(a_k << 2) | (b_k << 1) | c_k`` of lut."""
    if isinstance(lut, bool) or not isinstance(lut, (int, np.integer)) or not 0 <= lut <= 0xFF:
        raise ValueError(f"immLut must be an int in [0, 255], got {lut!r}")
    a, b, c = (np.asarray(x, dtype=np.uint32) for x in (a, b, c))
    full = np.uint32(0xFFFFFFFF)
    d = np.zeros(np.broadcast(a, b, c).shape, np.uint32)
    for idx in range(8):                       # the minterms the truth table selects
        if lut >> idx & 1:
            d |= ((a if idx & 4 else a ^ full) & (b if idx & 2 else b ^ full) & (c if idx & 1 else c ^ full))
    return d


def register_order(bits: int) -> tuple:
    """The logical element (``e_2i`` / ``e_2i+1`` = first / second half of half2 pair i) held by each
    code position of a 32-bit register of the induced layout, position 0 = lowest bits: the low word
    holds e_0, e_2, ..., the high word e_1, e_3, ..."""
    bits = nx.check_bits(bits, (2, 4))
    R = 16 // bits
    return tuple(2 * p if p < R else 2 * (p - R) + 1 for p in range(2 * R))


def order_digits(bits: int) -> str:
    """The register order read from the highest position down: '75316420' for 4 bits (IV-A(3)); for
    2 bits the 16 positions, space-separated ('15 13 11 9 7 5 3 1 14 12 10 8 6 4 2 0')."""
    sep = "" if bits == 4 else " "
    return sep.join(str(e) for e in reversed(register_order(bits)))


def registers(lo_words, hi_words) -> np.ndarray:
    """The 32-bit register ``ldmatrix`` fills from two b16 words: ``lo | hi << 16``."""
    return np.asarray(lo_words, np.uint32) | (np.asarray(hi_words, np.uint32) << np.uint32(16))


def lop3_codes(reg, bits: int) -> np.ndarray:
    """Codes of 32-bit registers as fp16, two per ``lop3``: (..., R, 2), ``[..., i, 0]`` = slot i of
    the low word, ``[..., i, 1]`` = slot i of the high word.

    For each i: ``h2 = lop3(reg >> (bits i), mask, MAGIC, (a & b) | c)`` with mask 0x000F000F (4 bits) or
    0x00030003 (2 bits) ORs a code into the low mantissa bits of 1024.0 in each half (exact: the fp16
    ulp at 1024 is 1), then the half2 subtract ``h2 - (1024, 1024)`` leaves the codes as fp16, exactly."""
    bits = nx.check_bits(bits, (2, 4))
    reg = np.asarray(reg, np.uint32)
    mask = np.uint32(((1 << bits) - 1) * 0x00010001)
    out = []
    for i in range(16 // bits):
        h2 = lop3(reg >> np.uint32(bits * i), mask, np.uint32(MAGIC), LUT_AND_OR)
        halves = np.stack([h2 & np.uint32(0xFFFF), h2 >> np.uint32(16)], axis=-1).astype(np.uint16).view(np.float16)
        out.append(halves - np.float16(1024))                            # HSUB2: exact
    return np.stack(out, axis=-2)


# ---------------------------------------------------------------------------------------------------
# the Packing Kernel's view: fragments back from the words


def _dequant(code16, scale, mn) -> np.ndarray:
    """``fp16(fp32(code) * scale + mn)``, the contract's two rounded fp32 operations, then ``to_out``
    (rule 3: fp16 saturates at +-65504)."""
    return nx.to_out(nx.add(nx.mul(code16.astype(np.float32), np.float32(scale)), np.float32(mn)), np.float16)


def key_fragments(cfg: BitDecodingConfig, k_words, k_params, w: int, i: int, kk: int) -> np.ndarray:
    """(32, 4) fp16: the B fragment (``mma_b`` order b0..b3) each lane holds for tile i of warp w
    (tokens ``w * 8R + 8 i ..``) and k-tile kk (channels ``16 kk ..``) after ``ldmatrix.x4`` of the words,
    ``lop3_codes`` and dequantization with the page's params. k_words (8 W_n, D) and k_params are one
    page of :func:`bitdecoding.pack_keys`; w in [0, W_n), i in [0, R), kk in [0, D / 16)."""
    check_cfg(cfg)
    D = np.shape(k_words)[-1] if np.ndim(k_words) else 0
    k_words = _words(k_words, "k_words", (P_N * cfg.warps_n, D))
    if D == 0 or D % 32 or (cfg.k_mode == "tensor" and D % cfg.k_group):
        raise ValueError(f"k_words has D={D} channels; expected a positive multiple of 32"
                         + (f" and of k_group={cfg.k_group}" if cfg.k_mode == "tensor" else ""))
    kp = check_params(k_params, "k_params", (cfg.n_r // cfg.k_group, D, 2) if cfg.k_mode == "channel"
                      else (cfg.n_r, D // cfg.k_group, 2))
    w = checks.int_arg(w, "w", 0, cfg.warps_n - 1)
    i = checks.int_arg(i, "i", 0, cfg.per_word - 1)
    kk = checks.int_arg(kk, "kk", 0, D // 16 - 1)
    out = np.zeros((fr.LANES, 4), np.float16)
    for lane in range(fr.LANES):
        for m in (2 * (kk % 2), 2 * (kk % 2) + 1):                      # the two registers of this k-tile
            row, col = fr.ldmatrix(lane, m, 0)                          # col = 2 t: the pair's first word
            ch = 32 * (kk // 2) + 8 * m + col
            reg = registers(k_words[P_N * w + row, ch], k_words[P_N * w + row, ch + 1])
            pair = lop3_codes(reg, cfg.bits)[i]                          # (2,) codes of channels ch, ch + 1
            tok = w * P_N * cfg.per_word + P_N * i + row
            for h in range(2):
                g = (tok // cfg.k_group, ch + h) if cfg.k_mode == "channel" else (tok, (ch + h) // cfg.k_group)
                out[lane, 2 * (m % 2) + h] = _dequant(pair[h], kp[g][0], kp[g][1])
    return out


def value_fragments(cfg: BitDecodingConfig, v_words, v_params, kk: int, j: int) -> np.ndarray:
    """(32, 4) fp16: the B fragment of P V each lane holds for k-tile kk (tokens ``16 kk ..``) and channel
    tile j (channels ``8 j ..``) after ``ldmatrix.x2.trans`` of the words, ``lop3_codes`` and dequantization.
    v_words (N_r, D / R) and v_params are one page of :func:`bitdecoding.pack_values`; kk in
    [0, N_r / 16), j in [0, D / 8)."""
    check_cfg(cfg)
    R = cfg.per_word
    W = np.shape(v_words)[-1] if np.ndim(v_words) else 0
    v_words = _words(v_words, "v_words", (cfg.n_r, W))
    D = W * R
    if D == 0 or W % P_N or D % cfg.v_group:
        raise ValueError(f"v_words has shape {v_words.shape}: D = {W} x {R} = {D} channels; expected a positive "
                         f"multiple of {P_N * R} and of v_group={cfg.v_group}")
    vp = check_params(v_params, "v_params", (cfg.n_r, D // cfg.v_group, 2))
    kk = checks.int_arg(kk, "kk", 0, cfg.n_r // 16 - 1)
    j = checks.int_arg(j, "j", 0, D // P_N - 1)
    u, i = divmod(j, R)
    out = np.zeros((fr.LANES, 4), np.float16)
    for lane in range(fr.LANES):
        for m in range(2):
            row, col = fr.ldmatrix(lane, m, 0, trans=True)              # row = 2 t: the pair's first token
            t = 16 * kk + 8 * m + row
            reg = registers(v_words[t, P_N * u + col], v_words[t + 1, P_N * u + col])
            pair = lop3_codes(reg, cfg.bits)[i]                          # tokens t, t + 1 of channel 8 j + col
            ch = P_N * j + col
            for h in range(2):
                g = (t + h, ch // cfg.v_group)
                out[lane, 2 * m + h] = _dequant(pair[h], vp[g][0], vp[g][1])
    return out


# ---------------------------------------------------------------------------------------------------
# Algorithm 1: multi-warp cooperative softmax


def cooperative_attention(q, k, v, *, warps_n: int = 4, tile_n: int = 64, cooperative: bool = True,
                          scale=None) -> np.ndarray:
    """Attention of q (M, D) over k, v (N, D) the way a block of W_n warps along N computes it, float64.

    Keys go in tiles of ``tile_n``; warp w owns columns ``[w tile_n / W_n, (w + 1) tile_n / W_n)`` of
    each tile. Cooperative (Algorithm 1): each warp reduces its slice's row max in registers, the W_n
    maxima meet in ``sTMP`` (shared memory) for the tile's max, every warp exponentiates against that
    common max, the P slices meet in ``sAcc`` and one ``P' V`` updates O with ``diag(e^(m - m_new))``.
    Naive (``cooperative=False``): each warp keeps its own running max and sum, and the P slices, each
    scaled to a different max, are summed as if they shared one: valid only for W_n = 1 (Table III)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.asarray(x).dtype.kind not in "fiu":
            raise TypeError(f"{name} must be a real array, got dtype {np.asarray(x).dtype}")
    cooperative = checks.bool_arg(cooperative, "cooperative")
    scale = checks.real_arg(scale, "scale", optional=True)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if q.ndim != 2 or k.ndim != 2 or v.shape != k.shape or q.shape[1] != k.shape[1] or k.shape[0] == 0:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected q (M, D), k and v (N >= 1, D)")
    for name, n in (("warps_n", warps_n), ("tile_n", tile_n)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if tile_n % warps_n:
        raise ValueError(f"tile_n={tile_n} must be a multiple of warps_n={warps_n}")
    sc = 1.0 / np.sqrt(q.shape[1]) if scale is None else float(scale)
    M, N, Dv = q.shape[0], k.shape[0], v.shape[1]
    W = tile_n // warps_n
    m = np.full((warps_n, M), -np.inf)                 # running max: one per warp (naive) or shared (row 0)
    l = np.zeros((warps_n, M))
    O = np.zeros((warps_n, M, Dv))
    for t0 in range(0, N, tile_n):
        slices = [slice(min(t0 + w * W, N), min(t0 + (w + 1) * W, N)) for w in range(warps_n)]
        S = [(q @ k[s].T) * sc for s in slices]        # each warp's (M, W) scores in registers
        smax = np.stack([s.max(axis=1) if s.shape[1] else np.full(M, -np.inf) for s in S])   # (W_n, M)
        if cooperative:
            m_new = np.maximum(m[0], smax.max(axis=0))                 # sTMP: the max across warps
            alpha = np.exp(m[0] - m_new)
            P = np.concatenate([np.exp(s - m_new[:, None]) for s in S], axis=1)   # sAcc
            tile = slice(t0, min(t0 + tile_n, N))
            l[0] = alpha * l[0] + P.sum(axis=1)
            O[0] = P @ v[tile] + alpha[:, None] * O[0]
            m[0] = m_new
        else:
            for w, s in enumerate(S):
                if not s.shape[1]:
                    continue
                m_new = np.maximum(m[w], smax[w])
                alpha = np.exp(m[w] - m_new)
                P = np.exp(s - m_new[:, None])
                l[w] = alpha * l[w] + P.sum(axis=1)
                O[w] = P @ v[slices[w]] + alpha[:, None] * O[w]
                m[w] = m_new
    return O.sum(axis=0) / l.sum(axis=0)[:, None]
