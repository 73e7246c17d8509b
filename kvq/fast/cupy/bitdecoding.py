"""CuPy BitDecoding: the Residual Kernel (quantize and pack pages into the induced layout) and the page's
dequantization as raw CUDA kernels (``bitdecoding.cu``); mirrors ``kvq.reference.bitdecoding``.

    from kvq.fast.cupy import bitdecoding as bd
    cfg = bd.CONFIGS["BitDecoding-KC2"]                       # the reference's objects
    k_words, k_params = bd.pack_keys(cfg, k)                  # k: (..., N_r, D) fp16 / fp32 CUDA tensor

The words (torch.uint16) and the half2 params (torch.float16, last axis (scale, min)) are the reference's
bytes, bit for bit.

The cache (``init`` / ``append`` / ``dequantize`` / ``decode_attention`` on a
:class:`BitDecodingTensorState`, the reference's fields as torch tensors) is written once for both
backends in ``kvq.fast.caches.bitdecoding_cache`` and runs these kernels: after the same appends every tensor
of the state equals the reference's array bit for bit. Decode runs the fused tensor-core kernel of
``kvq.fast.cupy.bitdecoding_decode`` over the packed pages where it applies (fp16 q, D = 128, the paper's
group layouts: its ``supported``), else dequantizes the history pages and attends them with the residual
through ``kvq.fast.cupy.attention``.

    st = bd.init(cfg, batch=1, kv_heads=8, head_dim=128); bd.append(cfg, st, k, v)
    out, lse = bd.decode_attention(cfg, st, q)                # q: (B, H_q, T_q, D)
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast.caches import bitdecoding as B
from kvq.fast.caches import bitdecoding_cache as _BC
from kvq.fast import common as C
from kvq.fast.caches.bitdecoding_cache import BitDecodingTensorState  # noqa: F401  (the fast state)
from kvq.reference import bitdecoding as _R
from kvq.reference.bitdecoding import CONFIGS, P_N, BitDecodingConfig  # noqa: F401  (the reference's objects)

from . import _loader as L
from . import bitdecoding_decode as BD
from . import attention as A

__all__ = ["BitDecodingConfig", "CONFIGS", "residual_block_size", "partition", "pack_keys", "pack_values",
           "unpack_keys", "unpack_values", "dequantize_page", "query_transform", "query_untransform",
           "BitDecodingTensorState", "init", "append", "dequantize", "decode_attention"]

_SRC = "bitdecoding.cu"
_DT = {torch.float16: 0, torch.float32: 2}


def residual_block_size(bits: int, warps_n: int = 4, word_bits: int = _R.WORD_BITS, p_n: int = P_N) -> int:
    """Mirrors `kvq.reference.bitdecoding.residual_block_size` (eq. 1; plain integers, no kernel)."""
    return _R.residual_block_size(bits, warps_n, word_bits, p_n)


def partition(length: int, n_r: int) -> tuple[int, int]:
    """Mirrors `kvq.reference.bitdecoding.partition` (plain integers, no kernel)."""
    return _R.partition(length, n_r)


def _check_cfg(cfg) -> None:
    B.check_cfg(cfg)
    if cfg.warps_n not in L.BITDECODING_WARPS:
        raise ValueError(f"warps_n={cfg.warps_n}: the CUDA kernels are built for W_n in {L.BITDECODING_WARPS}")


def _check_block(cfg, x, name: str) -> torch.Tensor:
    """The reference's page checks on a CUDA tensor; returns it contiguous and 8-byte aligned."""
    _check_cfg(cfg)
    xc = B.check_page_input(cfg, x, name, allow_cpu=False)
    return xc if xc.data_ptr() % 8 == 0 else xc.clone()


def _check_params(p, name: str) -> None:
    """Rule 8 for float32 input: a page whose range overflows the fp16 params raises, as the reference."""
    if C.validation_enabled() and p.numel() and not bool(torch.isfinite(p).all()):
        raise ValueError(f"{name}: the group's scale or min overflows float16 (the half2 params); "
                         f"the page's range is too large for BitDecoding's fp16 metadata")


def pack_keys(cfg: BitDecodingConfig, k):
    """Mirrors `kvq.reference.bitdecoding.pack_keys`: ``(k_words (..., 8 W_n, D) torch.uint16, k_params
    (..., groups, 2) torch.float16)``, one block per page (bd_pack_keys), bit-exact.

    Differences: k is a float16 / float32 CUDA tensor; the NaN / inf check runs while
    ``kvq.fast.validation`` is on."""
    xc = _check_block(cfg, k, "k")
    lead, D = tuple(xc.shape[:-2]), xc.shape[-1]
    n = int(np.prod(lead, dtype=np.int64))
    chan = cfg.k_mode == "channel"
    kp_shape = (cfg.n_r // cfg.k_group, D) if chan else (cfg.n_r, D // cfg.k_group)
    words = torch.empty((*lead, P_N * cfg.warps_n, D), dtype=torch.uint16, device=xc.device)
    params = torch.empty((*lead, *kp_shape, 2), dtype=torch.float16, device=xc.device)
    if n:
        smem = 2 * cfg.warps_n * D * 4 if chan and cfg.k_group > P_N * cfg.per_word else 0
        fn = L.kernel(_SRC, f"bd_pack_keys<{_DT[xc.dtype]}, {cfg.bits}, {cfg.warps_n}>")
        L.run(fn, (n,), (32 * cfg.warps_n,),
              (xc, np.int64(cfg.n_r * D), np.int32(D), np.int32(chan), np.int32(cfg.k_group), words, params),
              xc.device, shared_mem=smem)
    _check_params(params, "k")
    return words, params


def pack_values(cfg: BitDecodingConfig, v):
    """Mirrors `kvq.reference.bitdecoding.pack_values`: ``(v_words (..., N_r, D / R) torch.uint16,
    v_params (..., N_r, D / v_group, 2) torch.float16)``, one block per page (bd_pack_values), bit-exact.

    Differences: as :func:`pack_keys`."""
    xc = _check_block(cfg, v, "v")
    lead, D = tuple(xc.shape[:-2]), xc.shape[-1]
    n = int(np.prod(lead, dtype=np.int64))
    words = torch.empty((*lead, cfg.n_r, D // cfg.per_word), dtype=torch.uint16, device=xc.device)
    params = torch.empty((*lead, cfg.n_r, D // cfg.v_group, 2), dtype=torch.float16, device=xc.device)
    if n:
        fn = L.kernel(_SRC, f"bd_pack_values<{_DT[xc.dtype]}, {cfg.bits}, {cfg.warps_n}>")
        L.run(fn, (n,), (32 * cfg.warps_n,),
              (xc, np.int64(cfg.n_r * D), np.int32(D), np.int32(cfg.v_group), words, params), xc.device)
    _check_params(params, "v")
    return words, params


def unpack_keys(cfg: BitDecodingConfig, k_words) -> torch.Tensor:
    """Mirrors `kvq.reference.bitdecoding.unpack_keys`: codes (..., N_r, D) torch.uint8 (torch ops on the
    words: shifts and masks, the layout's index map; ``kvq.fast.caches.bitdecoding``)."""
    _check_cfg(cfg)
    B.check_key_words(cfg, k_words, allow_cpu=False)
    return B.unpack_keys(cfg, k_words)


def unpack_values(cfg: BitDecodingConfig, v_words) -> torch.Tensor:
    """Mirrors `kvq.reference.bitdecoding.unpack_values`: codes (..., N_r, D) torch.uint8."""
    _check_cfg(cfg)
    B.check_value_words(cfg, v_words, allow_cpu=False)
    return B.unpack_values(cfg, v_words)


def dequantize_page(cfg: BitDecodingConfig, k_words, k_params, v_words, v_params):
    """Mirrors `kvq.reference.bitdecoding.dequantize_page`: (K, V) torch.float16 (..., N_r, D), one thread
    per element (bd_dequantize; fp16 saturated at +-65504 as ``numerics.to_out``), bit-exact."""
    _check_cfg(cfg)
    lead, D, n = B.check_page(cfg, k_words, k_params, v_words, v_params, allow_cpu=False)
    chan = cfg.k_mode == "channel"
    ko = torch.empty((*lead, cfg.n_r, D), dtype=torch.float16, device=k_words.device)
    vo = torch.empty_like(ko)
    if n:
        total = 2 * n * cfg.n_r * D
        fn = L.kernel(_SRC, f"bd_dequantize<{cfg.bits}, {cfg.warps_n}>")
        L.run(fn, (L.grid_1d(total, 256),), (256,),
              (k_words.contiguous(), k_params.contiguous(), v_words.contiguous(), v_params.contiguous(),
               np.int64(n), np.int32(D), np.int32(chan), np.int32(cfg.k_group), np.int32(cfg.v_group), ko, vo),
              k_words.device)
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
    """``OPS.fused_decode``: the tensor-core decode (``bitdecoding_decode.decode``) where it takes this cache
    and query, else None (the cache code then dequantizes the history and attends)."""
    return BD.decode(cfg, st, q, scale=scale) if BD.supported(cfg, st, q) else None


#: this backend's kernels for the shared BitDecoding cache code (``kvq.fast.caches.bitdecoding_cache``)
OPS = _BC.BitDecodingOps("cupy", pack_keys, pack_values, dequantize_page, A, lambda: False,
                         fused_decode=_fused_decode)


def init(cfg: BitDecodingConfig, batch: int, kv_heads: int, head_dim: int, *,
         device=None) -> BitDecodingTensorState:
    """Mirrors `kvq.reference.bitdecoding.init`: an empty cache with the FP16 residual and the page pool
    preallocated (zeros; the page table -1).

    Differences: returns a :class:`BitDecodingTensorState` (the reference's fields as torch tensors: words
    torch.uint16, params and residual torch.float16, table torch.int32) on ``device`` (a CUDA device,
    e.g. "cuda:1"; None: the current CUDA device);
    W_n must be one the CUDA kernels are built for (checked here, before the reference's checks).
    """
    _check_cfg(cfg)
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
    Differences: k, v are float16 / float32 torch CUDA tensors on the cache's device; the NaN / inf and
    float16-overflow checks run while ``kvq.fast.validation`` is on. Validation (and the packing) come
    before any write, so bad input leaves the state unchanged.
    """
    return _BC.append(OPS, cfg, state, k, v)


def dequantize(cfg: BitDecodingConfig, state: BitDecodingTensorState):
    """Mirrors `kvq.reference.bitdecoding.dequantize`: (K, V) fp32 (B, H_kv, T, D) in token order, bit-identical:
    the packed pages dequantized to fp16 by :func:`dequantize_page` (gathered through the page table, one
    launch), then the FP16 residual.

    Differences: torch CUDA tensors on the cache's device.
    """
    return _BC.dequantize(OPS, cfg, state)


def decode_attention(cfg: BitDecodingConfig, state: BitDecodingTensorState, q, *, scale=None):
    """Mirrors `kvq.reference.bitdecoding.decode_attention`: ``(out, lse)`` of q (B, H_q, T_q, D) over the
    cache, every cached token visible.

    fp16 q with D = 128 and the paper's group layouts (``bitdecoding_decode.supported``): the fused
    tensor-core kernel ``bd_decode`` reads the packed pages in place (``ldmatrix``, ``lop3`` unpacking,
    dequantization in the registers to the reference's fp16 bits, ``mma.sync``, split-KV, the cooperative
    softmax) and the FP16 residual is attended beside it, all merged by log-sum-exp (the Packing and
    Residual Kernels of Fig. 7). Otherwise the history pages are dequantized to fp16
    (:func:`dequantize_page`, bit-exact) and attended with the residual rows as two segments by the split
    kernel of ``kvq.fast.cupy.attention``; fp16 q attends the fp16 segments, bf16 / fp32 q in fp32 (the
    fp16 values are exact there).
    Differences: torch CUDA tensors; q float16 / bfloat16 / float32 (float64 is refused: the reference
    computes the float64 truth); out comes back in q's dtype (the reference returns float32), lse float32;
    attention is an order-dependent reduction (tolerance rule, contract rule 7); D must be one of the CuPy
    attention kernel's head dims (16, 32, 64, 128, 256; bf16 / fp32 q, attended in fp32: up to 128).
    """
    return _BC.decode_attention(OPS, cfg, state, q, scale=scale)
