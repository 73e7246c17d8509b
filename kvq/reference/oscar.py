"""OSCAR: offline covariance-aware rotations and a rotated INT2 KV cache (OSCAR paper, sections 3-4, App. A-B).

Offline (Algorithm 1, Calibrate): from one layer's Q, K, V the key target ``C_Q = (1/N) sum_n q_n^T q_n``
and the value target ``C_S = (1/N) V^T S^T S V`` (S the causal attention matrix), their eigenbases
``U_Q``, ``U_S``, the rotations ``R_K = U_Q H P_br`` and ``R_V = U_S H P_br`` (eq. 3, ``rotations.py``)
and the clip ratios ``c_K``, ``c_V``. Online (section 4): the first ``S0`` tokens (sink) and the most
recent ``W`` stay in FP16; every other token is clipped per token at the ``c``-quantile of its
``|entries|`` and quantized per token to INT2 in groups of G channels (App. A.5), into pages.

    calib = calibrate(q, k, v)                  # one layer: q (B, H_q, N, D), k, v (B, H_kv, N, D)
    cfg = CONFIGS["OSCAR"]; st = init(cfg, batch=1, kv_heads=8, head_dim=128)
    append(cfg, calib, st, k, v); out, lse = decode_attention(cfg, calib, st, q)

**The cache lives in the rotated frame.** Sink and window hold ``fp16(k R_K)`` and ``fp16(v R_V)``;
pages hold the codes of ``clip(fp16(k R_K))``. ``decode_attention`` rotates q by R_K, which leaves the
scores unchanged (``(q R_K)(k R_K)^T = q k^T``, R_K orthogonal), and rotates the output back by
``R_V^T``, or leaves it rotated (``rotate_back=False``) for a ``W_O`` into which ``R_V^T`` has been
folded (:func:`fold_value_rotation`; then give the cache ``calib.folded()``: values arrive rotated).
Rotations are fp32 and applied by ``rotations.rotate`` (a fixed-order reduction, contract rule 7);
given the rotated fp16 tokens, clipping, codes and metadata are bit-exact (rules 1-3).

Layout (why not ``paged.PagedState``: its keys are per channel behind a G-token Q-buffer; OSCAR's
keys, like its values, are per token behind the W-token window, so K and V share one window and
one page table): a page holds ``page_size`` tokens; codes pack along channels (per-token groups).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from . import attention as attn
from . import checks
from . import numerics as nx
from .state import FlatArrays, cfg_field, check_config, check_dims, check_host_device, check_state, check_str, register_layout
from .packing import pack, unpack
from .quant import dequantize as _dequantize
from .rotations import (ROTATIONS, as_real64, broadcast_heads, compose, eig_desc, head_matrices, quantize_tokens,
                        rotate)
from .rotations import target_covariances

F16 = np.float16
__all__ = ["DEFAULT_CLIP_K", "DEFAULT_CLIP_V", "CLIP_GRID", "OSCARCalibration", "identity_calibration",
           "calibrate", "calibrate_clip", "quantize_tokens",
           "OSCARConfig", "CONFIGS", "OSCARState", "counts", "init", "append", "dequantize",
           "decode_attention", "fold_value_rotation"]

DEFAULT_CLIP_K, DEFAULT_CLIP_V = 0.96, 0.92            # the paper's operating point (Table 6)
CLIP_GRID = tuple(round(0.80 + 0.01 * i, 2) for i in range(21))   # 0.80, 0.81, ..., 1.00


# ---------------------------------------------------------------------------------------------------
# calibration (Algorithm 1, Calibrate; section 3; App. A.3)


@dataclass(frozen=True, eq=False)
class OSCARCalibration:
    """One layer's fixed transforms: ``R_K``, ``R_V`` fp32 (D, D), or (H_kv, D, D) per KV head, and
    the clip ratios ``clip_k``, ``clip_v`` in (0, 1] (1 = no clip). ``lam_K`` / ``lam_V``: the target
    spectra (descending), for inspection; ``rotation``: the kind from ``rotations.ROTATIONS``."""

    R_K: np.ndarray
    R_V: np.ndarray
    clip_k: float = DEFAULT_CLIP_K
    clip_v: float = DEFAULT_CLIP_V
    lam_K: np.ndarray | None = None
    lam_V: np.ndarray | None = None
    rotation: str = "oscar"

    def __post_init__(self):
        for name in ("R_K", "R_V"):
            R = np.asarray(getattr(self, name))
            if R.dtype != np.float32:
                raise TypeError(f"{name} has dtype {R.dtype}; rotations are stored in float32")
            if R.ndim not in (2, 3) or R.shape[-1] != R.shape[-2]:
                raise ValueError(f"{name} has shape {R.shape}; expected (D, D) or (H_kv, D, D)")
            nx.check_finite(R, name)
            err = np.abs(np.swapaxes(R, -1, -2).astype(np.float64) @ R - np.eye(R.shape[-1])).max()
            if err > 1e-4:
                raise ValueError(f"{name} is not orthogonal (max |R^T R - I| = {err:.3g})")
        if np.shape(self.R_K) != np.shape(self.R_V):
            raise ValueError(f"R_K {np.shape(self.R_K)} and R_V {np.shape(self.R_V)} differ in shape")
        for name in ("clip_k", "clip_v"):
            c = getattr(self, name)
            if isinstance(c, bool) or not isinstance(c, (float, int, np.floating)) or not 0 < c <= 1:
                raise ValueError(f"{name}={c!r} must be a ratio in (0, 1]")
        for name in ("lam_K", "lam_V"):
            lam = getattr(self, name)
            if lam is not None and np.asarray(lam).dtype.kind not in "fiu":
                raise TypeError(f"{name} must be None or a real array (the target spectrum), got "
                                f"{type(lam).__name__} of dtype {np.asarray(lam).dtype}")
        if not isinstance(self.rotation, str):
            raise TypeError(f"rotation must be a str (a kind of rotations.ROTATIONS, e.g. 'oscar'), got "
                            f"{self.rotation!r}")

    @property
    def head_dim(self) -> int:
        return int(np.shape(self.R_K)[-1])

    def check(self, kv_heads: int, head_dim: int) -> None:
        """Raise unless the rotations fit a cache of ``kv_heads`` heads of dim ``head_dim``."""
        s = np.shape(self.R_K)
        if s[-1] != head_dim or (len(s) == 3 and s[0] != kv_heads):
            raise ValueError(f"calibration rotations have shape {s}; this cache needs ({head_dim}, "
                             f"{head_dim}) or ({kv_heads}, {head_dim}, {head_dim})")

    def folded(self) -> "OSCARCalibration":
        """The calibration to use once R_V is folded into W_V and W_O: R_V replaced by the identity."""
        eye = np.broadcast_to(np.eye(self.head_dim, dtype=np.float32), np.shape(self.R_V)).copy()
        return dataclasses.replace(self, R_V=eye)


def identity_calibration(head_dim: int, clip_k: float = 1.0, clip_v: float = 1.0) -> OSCARCalibration:
    """No rotation (naive INT2 with ``clip = 1``; "clip only" with the default ratios). ``head_dim`` an
    int >= 1; the clip ratios in (0, 1] (checked by :class:`OSCARCalibration`)."""
    head_dim = checks.int_arg(head_dim, "head_dim", lo=1)
    eye = np.eye(head_dim, dtype=np.float32)
    return OSCARCalibration(eye, eye.copy(), clip_k, clip_v, rotation="identity")


def calibrate_clip(x_rot, M, group_size: int, bits: int = 2, ratios=CLIP_GRID, meta_dtype="float16"):
    """Fit one clip ratio from rotated calibration tokens x_rot (B, H, T, D).

    Objective (stated, App. A.7's surrogate with the residual not frozen): the mean over tokens of
    ``e M e^T``, ``e = Q(clip_c(x~)) - x~`` the token's quantization error in the rotated frame and
    ``M = R^T C R`` the target covariance there ((D, D) or (H, D, D)). For keys with ``C = C_Q`` it is
    the mean squared logit error ``|q (k - k_hat)^T|^2`` over the calibration queries (eq. 1).
    Returns ``(best ratio, objective per ratio (len(ratios),) float64)``; ties go to the larger ratio.
    ``ratios``: a non-empty sequence of ratios in (0, 1]; M finite, (D, D) or (H, D, D).
    """
    x = nx.as_f32(x_rot, "x_rot")
    if x.ndim != 4:
        raise ValueError(f"x_rot must be (B, H, T, D) rotated tokens, got shape {x.shape}")
    B, H, T, D = x.shape
    M = as_real64(M, "M", ndim=(2, 3), square=True)
    if M.shape[-1] != D or (M.ndim == 3 and M.shape[0] != H):
        raise ValueError(f"M has shape {M.shape}; tokens x_rot {x.shape} need ({D}, {D}) or ({H}, {D}, {D})")
    nx.check_finite(M, "M")
    ratios = _check_ratios(ratios)
    M = head_matrices(M, H)
    obj = []
    for c in ratios:
        codes, s, m = quantize_tokens(x, c, group_size, bits, meta_dtype)
        e = _dequantize(codes, s, m, group_size, -1, np.float32).astype(np.float64) - x
        obj.append(float(np.einsum("bhtd,hde,bhte->", e, M, e)) / (x.shape[0] * x.shape[2]))
    obj = np.array(obj)
    best = max(i for i in range(len(obj)) if obj[i] == obj.min())
    return float(ratios[best]), obj


def _check_ratios(ratios) -> tuple:
    """``ratios`` (a non-empty sequence of clip ratios in (0, 1]) as a tuple of floats."""
    if isinstance(ratios, (str, bytes)) or not hasattr(ratios, "__iter__") or isinstance(ratios, dict):
        raise TypeError(f"ratios must be a sequence of clip ratios in (0, 1], got {ratios!r}")
    out = tuple(checks.real_arg(c, f"ratios[{i}]", 0.0, 1.0, lo_open=True) for i, c in enumerate(ratios))
    if not out:
        raise ValueError("ratios is empty; give at least one clip ratio in (0, 1]")
    return out


def _check_clip_pair(clip):
    """``clip``: "fit" or a pair ``(c_K, c_V)`` of ratios in (0, 1] (returned as floats)."""
    if isinstance(clip, str):
        if clip != "fit":
            raise ValueError(f"clip={clip!r} must be a pair (c_K, c_V) or 'fit'")
        return clip
    if not isinstance(clip, (tuple, list, np.ndarray)) or len(clip) != 2:
        raise (ValueError if isinstance(clip, (tuple, list, np.ndarray)) else TypeError)(
            f"clip must be a pair (c_K, c_V) of ratios in (0, 1] or 'fit', got {clip!r}")
    return tuple(checks.real_arg(c, f"clip[{i}]", 0.0, 1.0, lo_open=True) for i, c in enumerate(clip))


def calibrate(q, k, v, *, rotation: str = "oscar", target: str = "attention", per_head: bool = False,
              clip=(DEFAULT_CLIP_K, DEFAULT_CLIP_V), group_size: int = 128, bits: int = 2, scale=None,
              seed: int = 0, targets: dict | None = None) -> OSCARCalibration:
    """Algorithm 1, Calibrate, for one layer: targets, eigenbases, rotations, clip ratios.

    Args:
        q: (B, H_q, N, D); k, v: (B, H_kv, N, D) calibration activations (float16 / 32 / 64).
        rotation: a kind of ``rotations.ROTATIONS`` ("oscar" = U H P_br; the ablations of Table 4).
        target: "attention" (``C_Q`` / ``C_S``, OSCAR) or "tensor" (``C_K`` / ``C_V``, Table 4's
            raw-cache PCA target). per_head: one rotation per KV head (MoE models) or one per layer.
        clip: ``(c_K, c_V)``, or "fit" for :func:`calibrate_clip` over ``CLIP_GRID`` on the rotated
            calibration tokens (group_size, bits: the quantizer the fit assumes).
        seed: for ``rotation="random"`` (keys and values get different matrices).
        targets: the output of ``rotations.target_covariances(q, k, v, per_head=per_head)`` when it is
            already computed (calibrating several ablations on one layer); None computes it.
    """
    if not isinstance(target, str) or target not in ("attention", "tensor"):
        raise ValueError(f"target={target!r} must be 'attention' or 'tensor'")
    if not isinstance(rotation, str) or rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r} is unknown; choose one of {tuple(ROTATIONS)}")
    per_head = checks.bool_arg(per_head, "per_head")
    clip = _check_clip_pair(clip)
    if clip == "fit":                                   # the quantizer the fit assumes
        group_size = checks.int_arg(group_size, "group_size", lo=1, optional=True)
        bits = nx.check_bits(bits)
    seed = checks.int_arg(seed, "seed", lo=0)
    if targets is not None and (not isinstance(targets, dict)
                                or not {"C_Q", "C_S", "C_K", "C_V"} <= set(targets)):
        raise TypeError("targets must be None or the dict of rotations.target_covariances (C_Q, C_S, C_K, C_V)")
    cov = target_covariances(q, k, v, per_head=per_head, scale=scale) if targets is None else targets
    C_K, C_V = (cov["C_Q"], cov["C_S"]) if target == "attention" else (cov["C_K"], cov["C_V"])
    (lam_K, U_K), (lam_V, U_V) = eig_desc(C_K), eig_desc(C_V)
    rng = np.random.default_rng(seed)
    R_K, R_V = (np.stack([compose(rotation, u, rng=rng) for u in U]) if per_head else compose(rotation, U, rng=rng)
                for U in (U_K, U_V))
    if isinstance(clip, str):
        H = np.shape(k)[1]
        xs = [_rotate16(np.asarray(x, np.float32), R.astype(np.float32), name)
              for x, R, name in ((k, R_K, "k"), (v, R_V, "v"))]
        clip = tuple(calibrate_clip(x, np.swapaxes(R, -1, -2) @ C @ R, group_size, bits)[0]
                     for x, R, C in zip(xs, (R_K, R_V), (C_K, C_V)))
    return OSCARCalibration(R_K.astype(np.float32), R_V.astype(np.float32), float(clip[0]), float(clip[1]),
                            lam_K, lam_V, rotation)


# ---------------------------------------------------------------------------------------------------
# the cache (section 4; Algorithm 1, Prefill and DecodeStep)


@dataclass(frozen=True)
class OSCARConfig:
    """An OSCAR cache configuration: ``sink`` S0 FP16 initial tokens (64), ``window`` W FP16 recent
    tokens (256), ``group_size`` G channels per quantization group for keys and values (128; the
    ablations use 64, 32), ``page_size`` tokens per page (128), ``bits`` (2), ``meta_dtype`` of the
    stored scale / min, ``max_tokens`` the capacity per sequence (the page pool is preallocated)."""

    sink: int = 64
    window: int = 256
    group_size: int = 128
    page_size: int = 128
    bits: int = 2
    meta_dtype: str = "float16"
    max_tokens: int = 4096
    name: str = "OSCAR"

    def __post_init__(self):
        nx.check_bits(self.bits, (2, 4, 8))
        for n in ("sink", "window", "group_size", "page_size", "max_tokens"):
            v, lo = getattr(self, n), int(n not in ("sink", "window"))
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{n} must be an int >= {lo}, got {v!r}")
        if nx.dtype_name(self.meta_dtype) not in nx.META_DTYPES:
            raise ValueError(f"meta_dtype={self.meta_dtype!r} is not supported; choose one of {nx.META_DTYPES}")
        check_str(self, "name")

    def check_head_dim(self, D: int) -> None:
        if D % self.group_size or D % (8 // self.bits):
            raise ValueError(f"head_dim={D} must be a multiple of group_size={self.group_size} and of "
                             f"{8 // self.bits} ({self.bits}-bit codes pack along channels)")


CONFIGS = {"OSCAR": OSCARConfig(), "OSCAR-G64": OSCARConfig(group_size=64, name="OSCAR-G64"),
           "OSCAR-G32": OSCARConfig(group_size=32, name="OSCAR-G32")}


@dataclass
class OSCARState(FlatArrays):
    """The bytes of one layer's OSCAR cache, all in the rotated frame (B batch, H KV heads, D head dim,
    P pool pages, N pages per sequence, Pg = page_size), plus counters."""

    sink_k: np.ndarray          # (B, H, S0, D) fp16   fp16(k R_K) of the first S0 tokens
    sink_v: np.ndarray          # (B, H, S0, D) fp16
    win_k: np.ndarray           # (B, H, W, D) fp16    recent window, ring: post-sink token p in slot p % W
    win_v: np.ndarray           # (B, H, W, D) fp16
    k_codes: np.ndarray         # (P, H, Pg, D * bits / 8) uint8, packed along channels
    k_scale: np.ndarray         # (P, H, Pg, D / G) meta dtype
    k_mn: np.ndarray            # (P, H, Pg, D / G)
    v_codes: np.ndarray         # (P, H, Pg, D * bits / 8) uint8
    v_scale: np.ndarray         # (P, H, Pg, D / G)
    v_mn: np.ndarray            # (P, H, Pg, D / G)
    table: np.ndarray           # (B, N) int32 page ids (keys and values share pages), -1 = none
    length: int = 0             # tokens appended to every sequence
    next_page: int = 0          # next free page in the pool
    shape: tuple = field(default=(0, 0, 0))   # (B, H, D)
    cfg: object = cfg_field()   # the OSCARConfig init made the cache with


def counts(cfg: OSCARConfig, T: int) -> dict:
    """Where T tokens live: ``n_sink`` [0, S0), ``n_hist`` INT2 history, ``n_win`` FP16 recent (the
    logical layout of section 4: sink || history || recent); ``post`` = tokens after the sink.
    ``T`` an int >= 0."""
    check_cfg(cfg)
    T = checks.int_arg(T, "T", lo=0)
    n_sink = min(T, cfg.sink)
    post = T - n_sink
    n_win = min(post, cfg.window)
    n_hist = post - n_win
    return dict(n_sink=n_sink, post=post, n_win=n_win, n_hist=n_hist, n_pages=-(-n_hist // cfg.page_size))


def check_cfg(cfg) -> None:
    """``cfg`` must be an :class:`OSCARConfig` (TypeError)."""
    check_config(cfg, OSCARConfig)


def check_calib(calib, kv_heads: int, head_dim: int) -> None:
    """``calib`` must be an :class:`OSCARCalibration` (TypeError) whose rotations fit the cache's heads
    (ValueError): the check of every call that takes one, before it reads or writes the cache."""
    if not isinstance(calib, OSCARCalibration):
        raise TypeError(f"calib must be an OSCARCalibration, got {type(calib).__name__}")
    calib.check(kv_heads, head_dim)


def init(cfg: OSCARConfig, batch: int, kv_heads: int, head_dim: int, *, device=None) -> OSCARState:
    """An empty cache with every buffer and the page pool preallocated; the state records ``cfg``, and
    every later call must pass the same configuration. ``device``: None or "cpu" (the fast tiers'
    argument; NumPy arrays live on the host)."""
    check_cfg(cfg)
    check_dims(batch=batch, kv_heads=kv_heads, head_dim=head_dim)
    check_host_device(device)
    cfg.check_head_dim(head_dim)
    B, H, D, Pg = batch, kv_heads, head_dim, cfg.page_size
    N = -(-max(cfg.max_tokens - cfg.sink - cfg.window, 0) // Pg)
    meta = np.dtype(nx.dtype_name(cfg.meta_dtype))
    z = lambda *s, dt=F16: np.zeros(s, dt)                                # noqa: E731
    cb, mg = D * cfg.bits // 8, D // cfg.group_size
    return OSCARState(z(B, H, cfg.sink, D), z(B, H, cfg.sink, D), z(B, H, cfg.window, D), z(B, H, cfg.window, D),
                      z(B * N, H, Pg, cb, dt=np.uint8), z(B * N, H, Pg, mg, dt=meta), z(B * N, H, Pg, mg, dt=meta),
                      z(B * N, H, Pg, cb, dt=np.uint8), z(B * N, H, Pg, mg, dt=meta), z(B * N, H, Pg, mg, dt=meta),
                      np.full((B, N), -1, np.int32), shape=(B, H, D), cfg=cfg)


register_layout(OSCARConfig, init)                   # what state.check_layout holds a hand-built state against


def _rotate16(x, R, name: str):
    """Rotate (B, H, n, D) by R (fp32) and round to the FP16 the buffers hold; overflow raises."""
    with np.errstate(over="ignore"):
        y = rotate(x, broadcast_heads(R, np.shape(x)[1])).astype(F16)
    if not np.isfinite(y).all():
        raise ValueError(f"{name} R overflows float16 (|x| > 65504); the FP16 buffers cannot hold it")
    return y


def _check_append(cfg, calib, st, k, v):
    check_state(st, cfg, OSCARConfig, OSCARState)
    B, H, D = st.shape
    for name, x in (("k", k), ("v", v)):
        x = np.asarray(x)
        if x.dtype not in (np.float16, np.float32):
            raise TypeError(f"{name} has dtype {x.dtype}; append takes float16 or float32")
        if x.ndim != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D:
            raise ValueError(f"{name} has shape {x.shape}; this cache takes (B={B}, H_kv={H}, T_new, D={D})")
        nx.check_finite(x, name)
    if np.shape(k) != np.shape(v):
        raise ValueError(f"k and v must have the same shape, got {np.shape(k)} and {np.shape(v)}")
    if st.length + np.shape(k)[2] > cfg.max_tokens:
        raise ValueError(f"appending {np.shape(k)[2]} tokens to {st.length} exceeds the capacity "
                         f"max_tokens={cfg.max_tokens}")
    check_calib(calib, H, D)
    return _rotate16(k, calib.R_K, "k"), _rotate16(v, calib.R_V, "v")


def append(cfg: OSCARConfig, calib: OSCARCalibration, state: OSCARState, k, v) -> OSCARState:
    """Append tokens k, v (B, H_kv, T_new, D) (prefill or decode steps); returns the mutated state.

    Every token is rotated (``fp16(k R_K)``, ``fp16(v R_V)``); the first S0 go to the sink, the others
    to the recent window; a token leaving the window (the oldest, once W are newer) is clipped and
    quantized into its page slot (``QuantizeAndWrite``). Validation comes first, so bad input leaves
    the state unchanged; streaming and bulk appends give the same state bit for bit.
    """
    k16, v16 = _check_append(cfg, calib, state, k, v)
    st, S, W, Pg = state, cfg.sink, cfg.window, cfg.page_size
    T0, n = st.length, k16.shape[2]
    c0 = counts(cfg, T0)
    n_s = max(0, min(S - T0, n))                              # 1. sink
    st.sink_k[:, :, T0:T0 + n_s] = k16[:, :, :n_s]
    st.sink_v[:, :, T0:T0 + n_s] = v16[:, :, :n_s]
    first = c0["n_hist"]                                      # post-sink index of the window's oldest
    ring = [p % W for p in range(first, c0["post"])]
    ks = np.concatenate([st.win_k[:, :, ring], k16[:, :, n_s:]], axis=2)      # (B, H, m, D) in order
    vs = np.concatenate([st.win_v[:, :, ring], v16[:, :, n_s:]], axis=2)
    e = ks.shape[2] - min(ks.shape[2], W)                     # 2. the oldest e leave the window
    for i in range(e, ks.shape[2]):
        st.win_k[:, :, (first + i) % W] = ks[:, :, i]
        st.win_v[:, :, (first + i) % W] = vs[:, :, i]
    if e:                                                     # 3. QuantizeAndWrite
        kc, ksc, kmn = quantize_tokens(ks[:, :, :e], calib.clip_k, cfg.group_size, cfg.bits, cfg.meta_dtype)
        vc, vsc, vmn = quantize_tokens(vs[:, :, :e], calib.clip_v, cfg.group_size, cfg.bits, cfg.meta_dtype)
        kc, vc = pack(kc, cfg.bits, axis=-1), pack(vc, cfg.bits, axis=-1)
        for i in range(e):
            page, slot = divmod(first + i, Pg)
            for b in range(st.shape[0]):
                if slot == 0:
                    st.table[b, page], st.next_page = st.next_page, st.next_page + 1
                pid = st.table[b, page]
                for dst, src in ((st.k_codes, kc), (st.k_scale, ksc), (st.k_mn, kmn),
                                 (st.v_codes, vc), (st.v_scale, vsc), (st.v_mn, vmn)):
                    dst[pid, :, slot] = src[b, :, i]
    st.length = T0 + n
    return st


def _segments(cfg: OSCARConfig, st: OSCARState):
    """The cache in the rotated frame as three (K, V) fp32 segments (B, H, T_i, D): sink, history, recent."""
    B, H, D = st.shape
    c = counts(cfg, st.length)
    hist = [np.zeros((B, H, c["n_hist"], D), np.float32) for _ in range(2)]
    for b in range(B):
        for j in range(c["n_pages"]):
            pid, lo = st.table[b, j], j * cfg.page_size
            m = min(cfg.page_size, c["n_hist"] - lo)
            for out, codes, s, mn in ((hist[0], st.k_codes, st.k_scale, st.k_mn), (hist[1], st.v_codes, st.v_scale, st.v_mn)):
                out[b, :, lo:lo + m] = _dequantize(unpack(codes[pid, :, :m], cfg.bits, -1), s[pid, :, :m],
                                                   mn[pid, :, :m], cfg.group_size, -1, np.float32)
    ring = [p % cfg.window for p in range(c["n_hist"], c["post"])]
    f32 = lambda a: a.astype(np.float32)                                 # noqa: E731
    return [(f32(st.sink_k[:, :, :c["n_sink"]]), f32(st.sink_v[:, :, :c["n_sink"]])), tuple(hist),
            (f32(st.win_k[:, :, ring]), f32(st.win_v[:, :, ring]))]


def _transpose(R):
    return np.ascontiguousarray(np.swapaxes(np.asarray(R), -1, -2))


def dequantize(cfg: OSCARConfig, calib: OSCARCalibration, state: OSCARState, *, rotated: bool = False):
    """The (K, V) the cache represents, fp32 (B, H_kv, T, D) in token order: in the rotated frame
    (``rotated=True``: exactly the values attention reads) or rotated back by R_K^T, R_V^T."""
    check_state(state, cfg, OSCARConfig, OSCARState)
    check_calib(calib, *state.shape[1:])
    if state.length == 0:
        raise ValueError("the cache is empty")
    segs = _segments(cfg, state)
    K, V = (np.concatenate([s[i] for s in segs], axis=2) for i in (0, 1))
    if rotated:
        return K, V
    H = state.shape[1]
    return rotate(K, broadcast_heads(_transpose(calib.R_K), H)), rotate(V, broadcast_heads(_transpose(calib.R_V), H))


def _per_query_head(R, H_q: int, H_kv: int):
    """R (D, D) as is; (H_kv, D, D) -> (H_q, 1, D, D), query head h using KV head h // (H_q / H_kv)."""
    R = np.asarray(R)
    return R if R.ndim == 2 else R[np.arange(H_q) // (H_q // H_kv)][:, None]


def decode_attention(cfg: OSCARConfig, calib: OSCARCalibration, state: OSCARState, q, *, scale=None,
                     rotate_back: bool = True):
    """Attention of q (B, H_q, T_q, D) over the cache: ``(out, lse)``, every cached token visible.

    q is rotated by R_K (``q R_K``), the sink, history and recent segments are attended separately and
    merged by log-sum-exp (``attention.decode_attention``, as the paper's two kernels plus merge), and
    the output, which is in R_V's frame, is rotated back by R_V^T unless ``rotate_back=False`` (a
    model whose W_O holds R_V^T, :func:`fold_value_rotation`). fp32 (float64 for float64 q).
    """
    check_state(state, cfg, OSCARConfig, OSCARState)
    B, H, D = state.shape
    q = np.asarray(q)
    if q.dtype not in (np.float16, np.float32, np.float64):
        raise TypeError(f"q has dtype {q.dtype}; decode_attention takes float16 / float32 queries (float64: "
                        f"the exact ground truth)")
    if q.ndim != 4 or q.shape[0] != B or q.shape[3] != D or q.shape[1] % H:
        raise ValueError(f"q has shape {q.shape}; this cache takes (B={B}, H_q (a multiple of {H}), T_q, D={D})")
    if state.length == 0:
        raise ValueError("the cache is empty: append tokens before attending")
    check_calib(calib, H, D)
    H_q = q.shape[1]
    RK, RVt = _per_query_head(calib.R_K, H_q, H), _per_query_head(_transpose(calib.R_V), H_q, H)
    segs = _segments(cfg, state)
    if q.dtype == np.float64:                                 # exact rotations (a ground truth for tests)
        mm = lambda x, R: x @ (R if R.ndim == 2 else R[:, 0]).astype(np.float64)      # noqa: E731
        out, lse = attn.decode_attention(mm(q, RK), [(a.astype(np.float64), b.astype(np.float64)) for a, b in segs],
                                         scale=scale)
        return (mm(out, RVt) if rotate_back else out), lse
    out, lse = attn.decode_attention(rotate(q, RK), segs, scale=scale)
    return (rotate(out, RVt) if rotate_back else out), lse


def fold_value_rotation(W_V, W_O, R_V, n_heads: int):
    """Fold R_V into the projections (section 4): ``W_V' = W_V R_V`` per KV head and
    ``W_O'[h] = R_V^T W_O[h]`` per query head block, float64.

    Row-vector convention: ``v = x W_V`` with W_V (d_model, H_kv * D); the layer output is
    ``concat_h(o_h) W_O`` with W_O (H_q * D, d_model). With the folded weights the values come out
    rotated (``v' = v R_V``), attention gives ``o'_h = o_h R_V``, and ``o'_h (R_V^T W_O[h]) = o_h W_O[h]``:
    the layer's output is unchanged. R_V: (D, D) or (H_kv, D, D); n_heads: H_q, a multiple of H_kv.
    Real arrays (float or integer; NaN / inf propagate into the result).
    """
    W_V, W_O = as_real64(W_V, "W_V", ndim=2), as_real64(W_O, "W_O", ndim=2)
    R = as_real64(R_V, "R_V", ndim=(2, 3), square=True)
    n_heads = checks.int_arg(n_heads, "n_heads", lo=1)
    D = R.shape[-1]
    if D == 0 or W_V.shape[1] % D:
        raise ValueError(f"W_V has shape {W_V.shape}; with R_V of shape {R.shape} it must be (d_model, H_kv * {D})")
    H_kv = W_V.shape[1] // D
    if H_kv == 0:
        raise ValueError(f"W_V has shape {W_V.shape}: no value heads (it must be (d_model, H_kv * {D}), H_kv >= 1)")
    if R.ndim == 3 and R.shape[0] != H_kv:
        raise ValueError(f"R_V has shape {R.shape}; W_V {W_V.shape} holds H_kv={H_kv} heads of D={D}")
    if n_heads % H_kv:
        raise ValueError(f"n_heads={n_heads} must be a multiple of H_kv={H_kv} (W_V {W_V.shape}, D={D})")
    if W_O.shape[0] != n_heads * D:
        raise ValueError(f"W_O has shape {W_O.shape}; n_heads={n_heads} query heads of D={D} need "
                         f"({n_heads * D}, d_model)")
    R = head_matrices(R, H_kv)                                                     # (H_kv, D, D)
    W_V2 = np.einsum("mhd,hde->mhe", W_V.reshape(-1, H_kv, D), R).reshape(W_V.shape)
    Rq = R[np.arange(n_heads) // (n_heads // H_kv)]                       # (H_q, D, D)
    W_O2 = np.einsum("hde,hdm->hem", Rq, W_O.reshape(n_heads, D, -1)).reshape(W_O.shape)
    return W_V2, W_O2
