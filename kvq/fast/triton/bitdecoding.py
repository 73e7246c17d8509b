"""Triton BitDecoding: the Residual Kernel (quantize and pack pages into the induced layout) and the page's
dequantization as Triton kernels; mirrors ``kvq.reference.bitdecoding`` (Du et al., sections IV-A, V).

    from kvq.fast.triton import bitdecoding as bd
    cfg = bd.CONFIGS["BitDecoding-KC2"]                       # the reference's objects
    k_words, k_params = bd.pack_keys(cfg, k)                  # k: (..., N_r, D) fp16 / fp32 CUDA tensor

The words (torch.uint16) and the half2 params (torch.float16, last axis (scale, min)) are the reference's
bytes, bit for bit, as in ``kvq.fast.cupy.bitdecoding``. The induced layout, per page of
N_r = 8 W_n R tokens (R = 16 / bits codes per word):

    k_words (8 W_n, D)   word (8 w + g, c), slot i  <-  code of K[w 8R + 8 i + g, c]
    v_words (N_r, D / R) word (t, 8 u + g), slot i  <-  code of V[t, 8 (u R + i) + g]

Both are a reshape of the natural order: token ``w 8R + 8 i + g`` is row-major (w, i, g), channel
``8 (u R + i) + g`` is row-major (u, i, g). So a program holds its page as one (tokens, channels) tile,
quantizes it in place and packs by reshaping the codes to (..., R, 8, ...) and OR-ing (summing disjoint
bit fields) over the R axis: no shared-memory shuffles of its own. Quantization is the contract's
(``kvq.fast.triton.quant``'s helpers: ``load_f32``, ``group_meta``, ``codes_f`` with ``tl.div_rn``), launched
with ``enable_fp_fusion=False``.

The cache (``init`` / ``append`` / ``dequantize`` / ``decode_attention`` on a
:class:`BitDecodingTensorState`, the reference's fields as torch tensors) is written once for both
backends in ``kvq.fast.caches.bitdecoding_cache`` and runs these page kernels: after the same appends every
tensor of the state equals the reference's array bit for bit. Decode runs the fused ``tl.dot`` kernel of
``kvq.fast.triton.bitdecoding_decode`` over the packed pages and the residual rows (``OPS.fused_decode``)
where it takes the configuration; otherwise it dequantizes the history pages and attends them with the
residual through ``kvq.fast.triton.attention``.

    st = bd.init(cfg, batch=1, kv_heads=8, head_dim=128); bd.append(cfg, st, k, v)
    out, lse = bd.decode_attention(cfg, st, q)                # q: (B, H_q, T_q, D)
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvq.fast.caches import bitdecoding as B
from kvq.fast.caches import bitdecoding_cache as _BC
from kvq.fast import common as C
from kvq.fast.caches.bitdecoding_cache import BitDecodingTensorState  # noqa: F401  (the fast state)
from kvq.reference import bitdecoding as _R
from kvq.reference.bitdecoding import CONFIGS, P_N, BitDecodingConfig  # noqa: F401  (the reference's objects)

from kvq.fast.common import cdiv as _cdiv, next_pow2 as _np2  # host grid arithmetic
from . import attention as A
from .quant import codes_f, load_f32, group_meta, sat_f16, interpreting

__all__ = ["BitDecodingConfig", "CONFIGS", "residual_block_size", "partition", "pack_keys", "pack_values",
           "unpack_keys", "unpack_values", "dequantize_page", "query_transform", "query_untransform",
           "BitDecodingTensorState", "init", "append", "dequantize", "decode_attention"]

DEQ_TILE = 4096           # elements per program of the dequantization (GPU; the interpreter takes a page)


# ----------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _seg_stats(x, valid, gid, NG: tl.constexpr, AXIS: tl.constexpr, POW2: tl.constexpr, GP: tl.constexpr,
               B0: tl.constexpr, B1: tl.constexpr):
    """Group min, max and ``sum(x * 0)`` (0, or NaN for non-finite groups) of every element's group, as
    (B0, B1) tiles. Groups run along ``AXIS`` of the (B0, B1) tile; ``gid`` (broadcastable) is the
    element's group index. POW2: the group size GP is a power of two and groups are aligned from 0, so a
    reshape (..., B // GP, GP, ...) reduces them; otherwise a loop over the NG groups with masks.
    Padding (``valid`` false) takes no part; a fully padded group gets (inf, -inf)."""
    xl = tl.where(valid, x, float("inf"))
    xh = tl.where(valid, x, float("-inf"))
    xz = tl.where(valid, x * 0.0, 0.0)
    if POW2:
        if AXIS == 1:
            lo = tl.min(tl.reshape(xl, (B0, B1 // GP, GP)), axis=2)
            hi = tl.max(tl.reshape(xh, (B0, B1 // GP, GP)), axis=2)
            nz = tl.sum(tl.reshape(xz, (B0, B1 // GP, GP)), axis=2)
            lo_e = tl.reshape(tl.broadcast_to(lo[:, :, None], (B0, B1 // GP, GP)), (B0, B1))
            hi_e = tl.reshape(tl.broadcast_to(hi[:, :, None], (B0, B1 // GP, GP)), (B0, B1))
            nz_e = tl.reshape(tl.broadcast_to(nz[:, :, None], (B0, B1 // GP, GP)), (B0, B1))
        else:
            lo = tl.min(tl.reshape(xl, (B0 // GP, GP, B1)), axis=1)
            hi = tl.max(tl.reshape(xh, (B0 // GP, GP, B1)), axis=1)
            nz = tl.sum(tl.reshape(xz, (B0 // GP, GP, B1)), axis=1)
            lo_e = tl.reshape(tl.broadcast_to(lo[:, None, :], (B0 // GP, GP, B1)), (B0, B1))
            hi_e = tl.reshape(tl.broadcast_to(hi[:, None, :], (B0 // GP, GP, B1)), (B0, B1))
            nz_e = tl.reshape(tl.broadcast_to(nz[:, None, :], (B0 // GP, GP, B1)), (B0, B1))
    else:
        lo_e = tl.full((B0, B1), float("inf"), tl.float32)
        hi_e = tl.full((B0, B1), float("-inf"), tl.float32)
        nz_e = tl.zeros((B0, B1), tl.float32)
        for gi in tl.static_range(NG):
            m = gid == gi
            if AXIS == 1:
                lo_g = tl.min(tl.where(m, xl, float("inf")), axis=1)[:, None]
                hi_g = tl.max(tl.where(m, xh, float("-inf")), axis=1)[:, None]
                nz_g = tl.sum(tl.where(m, xz, 0.0), axis=1)[:, None]
            else:
                lo_g = tl.min(tl.where(m, xl, float("inf")), axis=0)[None, :]
                hi_g = tl.max(tl.where(m, xh, float("-inf")), axis=0)[None, :]
                nz_g = tl.sum(tl.where(m, xz, 0.0), axis=0)[None, :]
            lo_e = tl.where(m, lo_g, lo_e)
            hi_e = tl.where(m, hi_g, hi_e)
            nz_e = tl.where(m, nz_g, nz_e)
    return lo_e, hi_e, nz_e


# Quantize and pack pages of keys or values (the Residual Kernel), one program per page.
# Computes: per group min / max, scale = div_rn(mx - mn, qmax) and mn (canonical zeros) rounded to fp16
#   (the half2 params), codes = clamp(rint(div_rn(x - mn_s, scale_s)), 0, qmax) (0 where scale_s == 0),
#   and the words of the induced layout: keys pack R tiles of 8 tokens per word (reshape the token axis
#   to (W, R, 8)), values R tiles of 8 channels (reshape the channel axis to (U, R, 8)).
# Groups: GAXIS 0 = groups of G tokens per channel (KC keys), 1 = groups of G channels per token (KT
#   keys, values); NG groups along that axis.
# Grid: (pages,); tile (BT, BC) = next powers of two of (N_r, D), masked.
# Bytes: reads N_r D inputs, writes N_r D bits / 8 bytes of words and 4 N_r D / G bytes of params.
@triton.jit
def _bd_pack_kernel(x_ptr, w_ptr, p_ptr, NR, D, G,
                    NG: tl.constexpr, BITS: tl.constexpr, R: tl.constexpr, KEYS: tl.constexpr, GAXIS: tl.constexpr,
                    POW2: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    page = tl.program_id(0).to(tl.int64)
    QMAX: tl.constexpr = (1 << BITS) - 1
    t = tl.arange(0, BT)[:, None]                                # (BT, 1) token
    c = tl.arange(0, BC)[None, :]                                # (1, BC) channel
    valid = (t < NR) & (c < D)
    x = load_f32(x_ptr + page * NR * D + (t * D + c), valid, False)
    if GAXIS == 0:
        gid = t // G
        pidx = gid * D + c                                       # (N_r / G, D) params
        first = valid & (t % G == 0)
    else:
        gid = c // G
        pidx = t * NG + gid                                      # (N_r, D / G) params
        first = valid & (c % G == 0)
    lo, hi, nz = _seg_stats(x, valid, gid, NG, GAXIS, POW2, GP, BT, BC)
    scale_st, mn_st, s32, m32 = group_meta(lo, hi, nz, p_ptr, QMAX, 0.0, False)
    pp = p_ptr + (page * (NR * D // G) + pidx) * 2              # N_r D / G groups per page
    tl.store(pp, scale_st, mask=first)                          # half2: [.., 0] scale, [.., 1] min
    tl.store(pp + 1, mn_st, mask=first)
    code = tl.where(valid, codes_f(x, s32, m32, s32, QMAX, 0.0, False, BITS, False), 0)
    if KEYS:
        # token w 8R + 8 i + g = row-major (w, i, g): word row 8 w + g, slot i
        c4 = tl.reshape(code, (BT // (8 * R), R, 8, BC))
        sh = (tl.arange(0, R) * BITS)[None, :, None, None]
        wd = tl.reshape(tl.sum(c4 << sh, axis=1), (BT // R, BC))
        j = tl.arange(0, BT // R)[:, None]
        tl.store(w_ptr + page * (NR // R) * D + (j * D + c), wd.to(tl.int16), mask=(j < NR // R) & (c < D))
    else:
        # channel u 8R + 8 i + g = row-major (u, i, g): word column 8 u + g, slot i
        c4 = tl.reshape(code, (BT, BC // (8 * R), R, 8))
        sh = (tl.arange(0, R) * BITS)[None, None, :, None]
        wd = tl.reshape(tl.sum(c4 << sh, axis=2), (BT, BC // R))
        j = tl.arange(0, BC // R)[None, :]
        DW = D // R
        tl.store(w_ptr + page * NR * DW + (t * DW + j), wd.to(tl.int16), mask=(t < NR) & (j < DW))


# Dequantize pages: K and V (..., N_r, D) fp16 = fp16(fp32(code) * scale_s + mn_s), two rounded fp32 ops,
#   saturated at +-65504 before the rounding (sat_f16, numerics.to_out).
# Computes: per element its word and slot in the induced layout (keys: row (t // 8R) 8 + t % 8, slot
#   (t // 8) % R; values: column (c // 8R) 8 + c % 8, slot (c // 8) % R) and its group's half2 params.
# Grid: (pages, cdiv(N_r, BT)); tile (BT, BC), BC = next_pow2(D).
# Bytes: reads N_r D bits / 4 bytes of words + the params, writes 4 N_r D bytes (K and V fp16).
@triton.jit
def _bd_dequant_kernel(kw_ptr, kp_ptr, vw_ptr, vp_ptr, ko_ptr, vo_ptr, NR, D, KG, NKG, VG, NVG,
                       BITS: tl.constexpr, R: tl.constexpr, CHAN: tl.constexpr, BT: tl.constexpr,
                       BC: tl.constexpr):
    page = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)[:, None]
    c = tl.arange(0, BC)[None, :]
    valid = (t < NR) & (c < D)
    M: tl.constexpr = (1 << BITS) - 1
    out = page * NR * D + (t * D + c)
    # keys
    kw = tl.load(kw_ptr + page * (NR // R) * D + (((t // (8 * R)) * 8 + t % 8) * D + c), mask=valid, other=0)
    kc = ((kw.to(tl.int32) & 0xFFFF) >> (((t // 8) % R) * BITS)) & M
    if CHAN:
        kidx = (t // KG) * D + c
    else:
        kidx = t * NKG + c // KG
    kp = kp_ptr + (page * (NR * D // KG) + kidx) * 2            # N_r D / k_group groups per page
    s = tl.load(kp, mask=valid, other=0.0).to(tl.float32)
    m = tl.load(kp + 1, mask=valid, other=0.0).to(tl.float32)
    tl.store(ko_ptr + out, sat_f16(kc.to(tl.float32) * s + m).to(tl.float16), mask=valid)
    # values
    DW = D // R
    vw = tl.load(vw_ptr + page * NR * DW + (t * DW + ((c // (8 * R)) * 8 + c % 8)), mask=valid, other=0)
    vc = ((vw.to(tl.int32) & 0xFFFF) >> (((c // 8) % R) * BITS)) & M
    vp = vp_ptr + (page * NR * NVG + (t * NVG + c // VG)) * 2
    s = tl.load(vp, mask=valid, other=0.0).to(tl.float32)
    m = tl.load(vp + 1, mask=valid, other=0.0).to(tl.float32)
    tl.store(vo_ptr + out, sat_f16(vc.to(tl.float32) * s + m).to(tl.float16), mask=valid)


# ----------------------------------------------------------------------------------------------------
# Python boundary


def residual_block_size(bits: int, warps_n: int = 4, word_bits: int = _R.WORD_BITS, p_n: int = P_N) -> int:
    """Mirrors `kvq.reference.bitdecoding.residual_block_size` (eq. 1; plain integers, no kernel)."""
    return _R.residual_block_size(bits, warps_n, word_bits, p_n)


def partition(length: int, n_r: int) -> tuple[int, int]:
    """Mirrors `kvq.reference.bitdecoding.partition` (plain integers, no kernel)."""
    return _R.partition(length, n_r)


_dt = B.dtype_name


def _p2(n: int) -> int:
    return _np2(max(int(n), 1))


_check_cfg = B.check_cfg


def _check_block(cfg, x, name: str) -> torch.Tensor:
    return B.check_page_input(cfg, x, name, allow_cpu=interpreting())


def _check_params(params, x, cfg, name: str) -> None:
    """Rule 8 for float32 input: a page whose scale or min overflows the fp16 params raises the reference's
    error (the reference is run on the page to word it: only on this failure path)."""
    if not (C.validation_enabled() and params.numel() and not bool(torch.isfinite(params).all())):
        return
    ref = _R.pack_keys if name == "k" else _R.pack_values
    ref(cfg, x.detach().cpu().numpy())                         # raises the reference's ValueError
    raise ValueError(f"{name}: the group's scale or min overflows float16 (the half2 params); "
                     f"the page's range is too large for BitDecoding's fp16 metadata")


def _launch_pack(cfg, xc: torch.Tensor, keys: bool):
    lead, D = tuple(xc.shape[:-2]), xc.shape[-1]
    n = int(np.prod(lead, dtype=np.int64))
    Nr, R = cfg.n_r, cfg.per_word
    if keys:
        chan = cfg.k_mode == "channel"
        G = cfg.k_group
        words = torch.empty((*lead, P_N * cfg.warps_n, D), dtype=torch.uint16, device=xc.device)
        pshape = (Nr // G, D) if chan else (Nr, D // G)
        gaxis, NG = (0, Nr // G) if chan else (1, D // G)
    else:
        G = cfg.v_group
        words = torch.empty((*lead, Nr, D // R), dtype=torch.uint16, device=xc.device)
        pshape = (Nr, D // G)
        gaxis, NG = 1, D // G
    params = torch.empty((*lead, *pshape, 2), dtype=torch.float16, device=xc.device)
    if n:
        BT, BC = _p2(Nr), _p2(D)
        pow2 = G == _p2(G)
        _bd_pack_kernel[(n,)](xc, words.view(torch.int16), params, Nr, D, G, NG=NG, BITS=cfg.bits, R=R,
                              KEYS=keys, GAXIS=gaxis, POW2=pow2, GP=G if pow2 else 1, BT=BT, BC=BC,
                              num_warps=8 if BT * BC >= 16384 else 4, enable_fp_fusion=False)
    return words, params


def pack_keys(cfg: BitDecodingConfig, k):
    """Mirrors `kvq.reference.bitdecoding.pack_keys`: ``(k_words (..., 8 W_n, D) torch.uint16, k_params
    (..., groups, 2) torch.float16)``, one Triton program per page, bit-exact.

    Differences: k is a float16 / float32 torch tensor on a CUDA device (the CPU under
    ``TRITON_INTERPRET=1``); the NaN / inf and fp16-overflow checks run while ``kvq.fast.validation`` is on
    (with it off, a non-finite group stores a NaN scale); an empty batch (a leading dimension of 0) gives
    empty outputs, as the CuPy backend (the reference raises: nothing to quantize)."""
    xc = _check_block(cfg, k, "k")
    words, params = _launch_pack(cfg, xc, True)
    _check_params(params, xc, cfg, "k")
    return words, params


def pack_values(cfg: BitDecodingConfig, v):
    """Mirrors `kvq.reference.bitdecoding.pack_values`: ``(v_words (..., N_r, D / R) torch.uint16,
    v_params (..., N_r, D / v_group, 2) torch.float16)``, one Triton program per page, bit-exact.

    Differences: as :func:`pack_keys`."""
    xc = _check_block(cfg, v, "v")
    words, params = _launch_pack(cfg, xc, False)
    _check_params(params, xc, cfg, "v")
    return words, params


def unpack_keys(cfg: BitDecodingConfig, k_words) -> torch.Tensor:
    """Mirrors `kvq.reference.bitdecoding.unpack_keys`: codes (..., N_r, D) torch.uint8 (torch ops on the
    words: shifts and masks in int32, the layout's index map as a reshape; ``kvq.fast.caches.bitdecoding``)."""
    _check_cfg(cfg)
    B.check_key_words(cfg, k_words, allow_cpu=interpreting())
    return B.unpack_keys(cfg, k_words)


def unpack_values(cfg: BitDecodingConfig, v_words) -> torch.Tensor:
    """Mirrors `kvq.reference.bitdecoding.unpack_values`: codes (..., N_r, D) torch.uint8 (torch ops)."""
    _check_cfg(cfg)
    B.check_value_words(cfg, v_words, allow_cpu=interpreting())
    return B.unpack_values(cfg, v_words)


def dequantize_page(cfg: BitDecodingConfig, k_words, k_params, v_words, v_params):
    """Mirrors `kvq.reference.bitdecoding.dequantize_page`: (K, V) torch.float16 (..., N_r, D), one Triton
    kernel for both (unpack in registers, ``fp16(fp32(code) * scale + mn)`` without FMA, saturated at
    +-65504 as ``numerics.to_out``), bit-exact.

    Differences: torch tensors on a CUDA device (the CPU under ``TRITON_INTERPRET=1``); the params'
    shapes and dtypes are checked (torch.float16 half2, torch.uint16 words)."""
    _check_cfg(cfg)
    lead, D, n = B.check_page(cfg, k_words, k_params, v_words, v_params, allow_cpu=interpreting())
    chan = cfg.k_mode == "channel"
    ko = torch.empty((*lead, cfg.n_r, D), dtype=torch.float16, device=k_words.device)
    vo = torch.empty_like(ko)
    if n:
        Nr, BC = cfg.n_r, _p2(D)
        BT = _p2(Nr) if interpreting() else min(_p2(Nr), max(1, DEQ_TILE // BC))
        _bd_dequant_kernel[(n, _cdiv(Nr, BT))](
            k_words.contiguous().view(torch.int16), k_params.contiguous(), v_words.contiguous().view(torch.int16),
            v_params.contiguous(), ko, vo, Nr, D, cfg.k_group, (D if chan else D // cfg.k_group), cfg.v_group,
            D // cfg.v_group, BITS=cfg.bits, R=cfg.per_word, CHAN=chan, BT=BT, BC=BC,
            num_warps=4, enable_fp_fusion=False)
    return ko, vo


def query_transform(q, kv_heads: int) -> torch.Tensor:
    """Mirrors `kvq.reference.bitdecoding.query_transform`: (B, H_q, T_q, D) -> (B, H_kv, g_q T_q, D), a view
    where q is contiguous (torch ``reshape``)."""
    return B.query_transform(q, kv_heads)


def query_untransform(o, q_heads: int) -> torch.Tensor:
    """Mirrors `kvq.reference.bitdecoding.query_untransform`: (B, H_kv, g_q T_q, ...) -> (B, H_q, T_q, ...)."""
    return B.query_untransform(o, q_heads)


# ----------------------------------------------------------------------------------------------------
# the cache (kvq.fast.caches.bitdecoding_cache, written once for both backends, run with this module's kernels)


def _fused_decode(cfg, st, q, *, scale=None):
    """``OPS.fused_decode``: the ``tl.dot`` decode (``bitdecoding_decode.decode``) where it takes this cache
    and query, else None (the cache code then dequantizes the history and attends)."""
    from . import bitdecoding_decode as BDD                    # its kernel compiles on first use only

    return BDD.decode(cfg, st, q, scale=scale) if BDD.supported(cfg, st, q) else None


#: this backend's kernels for the shared BitDecoding cache code (``kvq.fast.caches.bitdecoding_cache``)
OPS = _BC.BitDecodingOps("triton", pack_keys, pack_values, dequantize_page, A, interpreting,
                         fused_decode=_fused_decode)


def init(cfg: BitDecodingConfig, batch: int, kv_heads: int, head_dim: int, *,
         device=None) -> BitDecodingTensorState:
    """Mirrors `kvq.reference.bitdecoding.init`: an empty cache with the FP16 residual and the page pool
    preallocated (zeros; the page table -1).

    Differences: returns a :class:`BitDecodingTensorState` (the reference's fields as torch tensors: words
    torch.uint16, params and residual torch.float16, table torch.int32) on ``device`` (a CUDA device,
    e.g. "cuda:1"; the CPU only under the Triton interpreter; None: the current CUDA device, the CPU under
    the interpreter).
    """
    return _BC.init(OPS, cfg, batch, kv_heads, head_dim, device=device)


def append(cfg: BitDecodingConfig, state: BitDecodingTensorState, k, v) -> BitDecodingTensorState:
    """Mirrors `kvq.reference.bitdecoding.append`: append (B, H_kv, T_new, D) tokens; the state is bit-identical.

    Tokens (rounded to fp16) fill the residual block; every N_r-token page they complete is quantized and
    packed into the induced layout by the Residual Kernel (:func:`pack_keys` / :func:`pack_values`), ONE
    launch each per append for all the pages it completes (the page that starts in the residual and the
    pages that come whole from the input, stacked in allocation order), written into one contiguous slice
    of the pool; pages are allocated page-major then batch as the reference, and the residual keeps the
    last ``length mod N_r`` tokens, zero beyond. So after any sequence of appends every tensor of the
    state equals the reference's array bit for bit (streaming equals bulk).
    Differences: k, v are float16 / float32 torch tensors on the cache's device; the NaN / inf and
    float16-overflow checks run while ``kvq.fast.validation`` is on. Validation (and the packing) come
    before any write, so bad input leaves the state unchanged.
    """
    return _BC.append(OPS, cfg, state, k, v)


def dequantize(cfg: BitDecodingConfig, state: BitDecodingTensorState):
    """Mirrors `kvq.reference.bitdecoding.dequantize`: (K, V) fp32 (B, H_kv, T, D) in token order, bit-identical:
    the packed pages dequantized to fp16 by :func:`dequantize_page` (gathered through the page table, one
    launch), then the FP16 residual.

    Differences: torch tensors on the cache's device.
    """
    return _BC.dequantize(OPS, cfg, state)


def decode_attention(cfg: BitDecodingConfig, state: BitDecodingTensorState, q, *, scale=None):
    """Mirrors `kvq.reference.bitdecoding.decode_attention`: ``(out, lse)`` of q (B, H_q, T_q, D) over the
    cache, every cached token visible.

    One fused kernel (``kvq.fast.triton.bitdecoding_decode``) reads the packed words in the induced layout,
    dequantizes them in registers to the reference's fp16 values, attends them and the FP16 residual rows
    with ``tl.dot`` after the query transformation, and one log-sum-exp merge joins its splits. Where that
    kernel does not take the configuration (``bitdecoding_decode.supported``), the history pages are
    dequantized to fp16 (:func:`dequantize_page`, bit-exact) and attended with the residual rows as two
    segments by ``kvq.fast.triton.attention``'s flash decoding (fp16 q on the fp16 segments; bf16 / fp32 q
    in fp32, the fp16 values exact there).
    Differences: torch tensors; q float16 / bfloat16 / float32 (float64 is refused: the reference computes
    the float64 truth); out comes back in q's dtype (the reference returns float32), lse float32;
    attention is an order-dependent reduction (tolerance rule, contract rule 7); D must be a power of two
    in [16, 256] (the attention kernel's).
    """
    return _BC.decode_attention(OPS, cfg, state, q, scale=scale)
