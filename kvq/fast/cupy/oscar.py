"""CuPy OSCAR cache: mirrors ``kvq.reference.oscar`` (OSCAR section 4) on torch tensors, bit-exact state.

The CuPy mirror of ``kvq.fast.triton.oscar``: the same state (``OSCARTensorState``, imported from there
with the other backend-neutral host code: counts, calibration objects, rotation staging) and the same
routing (sink, window ring, pages allocated page-major then batch), with the raw CUDA kernels of this
backend: the fixed-order rotation ``kvq.fast.cupy.rotate`` (the reference's operations in its order,
so the same bits), the fused clip + quantize + pack of ``kvq.fast.cupy.oscar_quant``, the history read
back by ``packing.unpack_dequantize`` and attended by ``attention.decode_attention``.

    from kvq.fast.cupy import oscar
    cfg = oscar.CONFIGS["OSCAR"]; st = oscar.init(cfg, batch=1, kv_heads=8, head_dim=128)
    oscar.append(cfg, calib, st, k, v); out, lse = oscar.decode_attention(cfg, calib, st, q)
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast import _common as C
from kvq.fast.triton.oscar import OSCARTensorState, _dtype_name, _rot, counts, identity_calibration  # noqa: F401
from kvq.reference import numerics as nx
from kvq.reference.oscar import (CLIP_GRID, CONFIGS, DEFAULT_CLIP_K, DEFAULT_CLIP_V,  # noqa: F401
                                 OSCARCalibration, OSCARConfig)              # (the reference's objects)

from . import attention as A
from . import oscar_quant as OQ
from .packing import unpack_dequantize
from .rotate import rotate

__all__ = ["DEFAULT_CLIP_K", "DEFAULT_CLIP_V", "CLIP_GRID", "OSCARCalibration", "identity_calibration",
           "quantize_tokens", "OSCARConfig", "CONFIGS", "OSCARTensorState", "counts", "init", "append",
           "dequantize", "decode_attention"]

F16 = torch.float16


def quantize_tokens(x_rot, clip: float, group_size: int, bits: int = 2, meta_dtype="float16"):
    """Mirrors `kvq.reference.oscar.quantize_tokens`: per-token percentile clip + per-token INT-b codes.

    Differences: torch CUDA tensors; ONE fused kernel (``kvq.fast.cupy.oscar_quant.quantize_tokens``
    with ``packed=False``: the reference's unpacked uint8 codes (..., D)); the same bits.
    """
    return OQ.quantize_tokens(x_rot, clip, group_size, bits, meta_dtype, packed=False)


def init(cfg: OSCARConfig, batch: int, kv_heads: int, head_dim: int) -> OSCARTensorState:
    """Mirrors `kvq.reference.oscar.init`: an empty cache with every buffer and the page pool preallocated.

    Differences: returns an :class:`OSCARTensorState` (the reference's fields as torch tensors) on the
    current CUDA device.
    """
    for name, v in (("batch", batch), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    cfg.check_head_dim(head_dim)
    if not torch.cuda.is_available():
        raise RuntimeError("kvq.fast.cupy caches live on a CUDA device")
    B, H, D, Pg = int(batch), int(kv_heads), int(head_dim), cfg.page_size
    N = -(-max(cfg.max_tokens - cfg.sink - cfg.window, 0) // Pg)
    meta = C.torch_dtype(nx.dtype_name(cfg.meta_dtype))
    dev = torch.device("cuda", torch.cuda.current_device())
    z = lambda *s, dt=F16: torch.zeros(s, dtype=dt, device=dev)                    # noqa: E731
    cb, mg = D * cfg.bits // 8, D // cfg.group_size
    return OSCARTensorState(z(B, H, cfg.sink, D), z(B, H, cfg.sink, D), z(B, H, cfg.window, D),
                            z(B, H, cfg.window, D), z(B * N, H, Pg, cb, dt=torch.uint8), z(B * N, H, Pg, mg, dt=meta),
                            z(B * N, H, Pg, mg, dt=meta), z(B * N, H, Pg, cb, dt=torch.uint8),
                            z(B * N, H, Pg, mg, dt=meta), z(B * N, H, Pg, mg, dt=meta),
                            torch.full((B, N), -1, dtype=torch.int32, device=dev), shape=(B, H, D))


# ---------------------------------------------------------------------------------------------------
# append


def _rotate16(x, R: torch.Tensor, name: str) -> torch.Tensor:
    """fp16(x R) as the reference's ``_rotate16``; overflow raises (while validation is on)."""
    y = rotate(x, R).to(F16)
    if C.validation_enabled() and y.numel() and not bool(torch.isfinite(y).all()):
        raise ValueError(f"{name} R overflows float16 (|x| > 65504); the FP16 buffers cannot hold it")
    return y


def _check_append(cfg, calib, st: OSCARTensorState, k, v):
    B, H, D = st.shape
    for name, x in (("k", k), ("v", v)):
        C.check_tensor(x, name)
        if x.dtype not in (torch.float16, torch.float32):
            raise TypeError(f"{name} has dtype {_dtype_name(x.dtype)}; append takes float16 or float32")
        if x.dim() != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; this cache takes (B={B}, H_kv={H}, T_new, D={D})")
        if x.device != st.device:
            raise ValueError(f"{name} is on {x.device}; the cache is on {st.device}")
        C.check_finite(x, name)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if st.length + k.shape[2] > cfg.max_tokens:
        raise ValueError(f"appending {k.shape[2]} tokens to {st.length} exceeds the capacity "
                         f"max_tokens={cfg.max_tokens}")
    if not isinstance(calib, OSCARCalibration):
        raise TypeError(f"calib must be an OSCARCalibration, got {type(calib).__name__}")
    calib.check(H, D)
    dev = st.device
    return _rotate16(k, _rot(calib.R_K, dev), "k"), _rotate16(v, _rot(calib.R_V, dev), "v")


def append(cfg: OSCARConfig, calib: OSCARCalibration, state: OSCARTensorState, k, v) -> OSCARTensorState:
    """Mirrors `kvq.reference.oscar.append`: append (B, H_kv, T_new, D) tokens; the state is bit-identical.

    Every token is rotated (``fp16(k R_K)``, ``fp16(v R_V)``, the fixed-order kernel of
    ``kvq.fast.cupy.rotate``); the first S0 go to the sink, the others to the window ring; tokens
    leaving the window are clipped and quantized (``oscar_quant``'s fused kernel, one launch for K and
    one for V per call) into their page slots, pages allocated page-major then batch as the reference.
    Differences: k, v are float16 / float32 torch CUDA tensors on the cache's device; the NaN / inf and
    float16-overflow checks run while ``kvq.fast.validation`` is on. Validation and quantization come
    before any write, so bad input leaves the state unchanged.
    """
    k16, v16 = _check_append(cfg, calib, state, k, v)
    st, S, W, Pg = state, cfg.sink, cfg.window, cfg.page_size
    B = st.shape[0]
    T0, n = st.length, k16.shape[2]
    if n == 0:
        return st
    dev = st.device
    c0 = counts(cfg, T0)
    n_s = max(0, min(S - T0, n))
    first = c0["n_hist"]                                      # post-sink index of the window's oldest
    if c0["n_win"]:
        order = torch.arange(first, c0["post"], device=dev) % W
        ks = torch.cat([st.win_k.index_select(2, order), k16[:, :, n_s:]], dim=2)   # (B, H, m, D) in order
        vs = torch.cat([st.win_v.index_select(2, order), v16[:, :, n_s:]], dim=2)
    else:
        ks, vs = k16[:, :, n_s:], v16[:, :, n_s:]
    m = ks.shape[2]
    e = m - min(m, W)                                         # the oldest e leave the window
    if e:                                                     # QuantizeAndWrite (before any write)
        meta = nx.dtype_name(cfg.meta_dtype)
        kq = OQ.quantize_tokens(ks[:, :, :e], calib.clip_k, cfg.group_size, cfg.bits, meta)
        vq = OQ.quantize_tokens(vs[:, :, :e], calib.clip_v, cfg.group_size, cfg.bits, meta)
    if n_s:                                                   # 1. sink
        st.sink_k[:, :, T0:T0 + n_s] = k16[:, :, :n_s]
        st.sink_v[:, :, T0:T0 + n_s] = v16[:, :, :n_s]
    if m > e:                                                 # 2. window ring
        slots = torch.arange(first + e, first + m, device=dev) % W
        st.win_k[:, :, slots] = ks[:, :, e:]
        st.win_v[:, :, slots] = vs[:, :, e:]
    if e:                                                     # 3. pages
        pg0, pg1 = -(-first // Pg), (first + e - 1) // Pg + 1            # pages opened: [pg0, pg1)
        if pg1 > pg0:
            ids = st.next_page + torch.arange((pg1 - pg0) * B, dtype=torch.int32, device=dev).view(pg1 - pg0, B).t()
            st.table[:, pg0:pg1] = ids
            st.next_page += (pg1 - pg0) * B
        pos = torch.arange(first, first + e, device=dev)
        pid = st.table[:, pos // Pg].long()                                # (B, e)
        sl = (pos % Pg).view(1, e).expand(B, e)
        for dst, src in zip((st.k_codes, st.k_scale, st.k_mn, st.v_codes, st.v_scale, st.v_mn), kq + vq):
            dst[pid, :, sl] = src.transpose(1, 2)                         # (B, e, H, ...)
    st.length = T0 + n
    return st


# ---------------------------------------------------------------------------------------------------
# reading the cache


def _segments(cfg: OSCARConfig, st: OSCARTensorState):
    """The cache in the rotated frame as three (K, V) fp32 segments (B, H, T_i, D): sink, history, recent.
    The history is unpacked and dequantized by one kernel per K / V (bit-exact, fp32)."""
    B, H, D = st.shape
    c = counts(cfg, st.length)
    dev = st.device
    ns, nh, npg = c["n_sink"], c["n_hist"], c["n_pages"]
    sink = (st.sink_k[:, :, :ns].float(), st.sink_v[:, :, :ns].float())
    if npg:
        ids = st.table[:, :npg].long()                                     # (B, n)
        hist = []
        for codes, s, mn in ((st.k_codes, st.k_scale, st.k_mn), (st.v_codes, st.v_scale, st.v_mn)):
            x = unpack_dequantize(codes[ids], s[ids], mn[ids], cfg.bits, cfg.group_size, axis=-1,
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


def dequantize(cfg: OSCARConfig, calib: OSCARCalibration, state: OSCARTensorState, *, rotated: bool = False):
    """Mirrors `kvq.reference.oscar.dequantize`: (K, V) fp32 (B, H_kv, T, D) in token order, bit-identical.

    ``rotated=True``: the rotated frame (exactly what attention reads); else rotated back by R_K^T,
    R_V^T with the fixed-order kernel (the reference's order, so also bit-identical).
    Differences: torch CUDA tensors on the cache's device.
    """
    if state.length == 0:
        raise ValueError("the cache is empty")
    segs = _segments(cfg, state)
    K, V = (torch.cat([s[i] for s in segs], dim=2) for i in (0, 1))
    if rotated:
        return K, V
    B, H, D = state.shape
    calib.check(H, D)
    dev = state.device
    return rotate(K, _rot(calib.R_K, dev, True)), rotate(V, _rot(calib.R_V, dev, True))


def decode_attention(cfg: OSCARConfig, calib: OSCARCalibration, state: OSCARTensorState, q, *, scale=None,
                     rotate_back: bool = True):
    """Mirrors `kvq.reference.oscar.decode_attention`: ``(out, lse)`` of q (B, H_q, T_q, D) over the cache.

    q is rotated by R_K (the fixed-order kernel; query head h uses the R_K of KV head h // (H_q / H_kv)),
    the INT2 history is unpacked and dequantized into fp32 (bit-exact, ``packing.unpack_dequantize``),
    and the sink, history and recent segments are attended in fp32 by the flash-decoding kernel of
    ``kvq.fast.cupy.attention.decode_attention`` (one log-sum-exp merge); the output is rotated back by
    R_V^T unless ``rotate_back=False``.
    Differences: torch CUDA tensors; q float16 / bfloat16 / float32 (float64 is refused: the reference
    computes the float64 truth); out comes back in q's dtype (fp32 inside; the reference returns
    float32), lse float32; attention is an order-dependent reduction (tolerance rule, contract rule 7);
    D must be one of the CuPy attention kernel's fp32 head dims (16, 32, 64, 128). No fused INT2 decode
    kernel yet: the history is materialized in fp32 per call.
    """
    B, H, D = state.shape
    C.check_tensor(q, "q")
    if q.dim() != 4 or q.shape[0] != B or q.shape[3] != D or q.shape[1] % H:
        raise ValueError(f"q has shape {tuple(q.shape)}; this cache takes (B={B}, H_q (a multiple of {H}), "
                         f"T_q, D={D})")
    if q.dtype not in C.ATTN_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; the fast decode takes float16 / bfloat16 / float32 (the "
                        f"reference tier computes float64 truths)")
    if q.device != state.device:
        raise ValueError(f"q is on {q.device}; the cache is on {state.device}")
    if state.length == 0:
        raise ValueError("the cache is empty: append tokens before attending")
    calib.check(H, D)
    dev = state.device
    qr = rotate(q, _rot(calib.R_K, dev))                                   # (B, H_q, T_q, D) fp32
    out, lse = A.decode_attention(qr, _segments(cfg, state), scale=scale)
    if rotate_back:
        out = rotate(out, _rot(calib.R_V, dev, True))
    return out.to(q.dtype), lse
