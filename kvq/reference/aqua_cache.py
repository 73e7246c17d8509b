"""The AQUA-KV streaming cache over all layers, and inference with it (AQUA-KV §3.3, Algorithm 4).

Per sequence the cache holds, for every layer: the first ``sink`` tokens in FP16; a recent buffer of
up to ``buffer`` tokens in FP16; and, for every earlier token, codes only: layer 0 quantized directly
(``first_layer``), layers 1..L-1 the quantized *residuals* after the predictors (``aqua.py``). When the
buffer fills, its ``buffer`` tokens are compressed as one chunk, layer 0 first, each layer predicted
from the reconstruction of the layer before (the order of calibration); keys pre-RoPE by default.

    st = init(cfg, n_layers=4, batch=1, kv_heads=2, head_dim=32)
    append(cfg, P, st, K, V)                   # K, V: (L, B, H_kv, T_new, D), keys post-RoPE
    kv = dequantize(cfg, P, st)                # [(K_l, V_l)] fp32 (B, H_kv, T, D), keys post-RoPE

The state is data (``AquaState``): the arrays a GPU would hold, preallocated for ``max_tokens``, the
counter ``length`` and the configuration ``init`` made it with (every later call must pass the same one,
and predictors that fit its layers and heads: :func:`check_predictors`). Every chunk is encoded and
decoded on its own (same shapes whatever the history), so appending token by token gives the same state,
bit for bit, as appending all at once. ``append`` works on a copy and commits only on success: a bad
input leaves the state unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from . import numerics as nx
from . import checks
from .aqua import AquaConfig, AquaPredictors, Uniform, decode_checked, encode_checked, from_tokens, to_tokens
from .aqua import check_predictors as _check_predictors
from .model import apply_rope
from .state import cfg_field, check_config, check_dims, check_host_device, check_state, register_layout

F16 = np.float16

__all__ = ["AquaState", "init", "append", "dequantize", "forward", "bits_per_value", "state_bytes"]


@dataclass
class AquaState:
    """All layers' cache (L layers, B batch, H KV heads, D head dim, S sink, R buffer, C chunks, F = H*D).

    ``first_k`` / ``first_v`` map a code name to (B, C, R, ...) arrays of layer 0; ``res_k`` / ``res_v``
    to (L-1, B, C, R, ...) arrays of the residual codes of layers 1..L-1 (names from the backbones).
    """

    sink_k: np.ndarray           # (L, B, H, S, D) fp16, post-RoPE
    sink_v: np.ndarray           # (L, B, H, S, D) fp16
    buf_k: np.ndarray            # (L, B, H, R, D) fp16, post-RoPE; unused slots are zero
    buf_v: np.ndarray            # (L, B, H, R, D) fp16
    first_k: dict
    first_v: dict
    res_k: dict
    res_v: dict
    length: int = 0
    shape: tuple = (0, 0, 0, 0)  # (L, B, H, D)
    cfg: object = cfg_field()    # the AquaConfig init made the cache with

    def arrays(self) -> dict:
        """Every array by name (code arrays as ``first_k.<name>`` ...), for comparisons."""
        out = {n: getattr(self, n) for n in ("sink_k", "sink_v", "buf_k", "buf_v")}
        for group in ("first_k", "first_v", "res_k", "res_v"):
            out.update({f"{group}.{n}": a for n, a in getattr(self, group).items()})
        return out

    def copy(self) -> "AquaState":
        return dataclasses.replace(
            self, sink_k=self.sink_k.copy(), sink_v=self.sink_v.copy(), buf_k=self.buf_k.copy(),
            buf_v=self.buf_v.copy(), **{g: {n: a.copy() for n, a in getattr(self, g).items()}
                                        for g in ("first_k", "first_v", "res_k", "res_v")})


def counts(cfg: AquaConfig, T: int):
    """(n_sink, n_chunks, n_buf) of a sequence of T tokens."""
    n_sink = min(T, cfg.sink)
    post = T - n_sink
    return n_sink, post // cfg.buffer, post % cfg.buffer


def _empty_codes(backbone, lead: tuple, R: int, F: int) -> dict:
    """Zero arrays shaped like the backbone's codes of R token vectors, with leading dims ``lead``."""
    probe = backbone.encode(np.zeros((1, R, F), np.float32))          # shapes and dtypes of one chunk
    return {n: np.zeros(lead + a.shape[1:], a.dtype) for n, a in probe.items()}


def check_cfg(cfg, F: int | None = None) -> None:
    """``cfg`` must be an :class:`AquaConfig` (TypeError) whose uniform backbones fit token vectors of
    F = H_kv * head_dim values (ValueError: groups of ``group_size`` that divide F, whole bytes)."""
    check_config(cfg, AquaConfig)
    if F is None:
        return
    for name in ("backbone", "first_layer"):
        bb = getattr(cfg, name)
        if isinstance(bb, Uniform) and (F % bb.group_size or (bb.group_size * bb.bits) % 8):
            raise ValueError(f"{name}: uniform groups of {bb.group_size} values at {bb.bits} bits do not fit "
                             f"token vectors of F = kv_heads * head_dim = {F} values (group_size must divide F "
                             f"and hold whole bytes)")


def check_predictors(cfg: AquaConfig, P, n_layers: int, F: int) -> None:
    """``P`` must be :class:`AquaPredictors` for ``n_layers`` layers whose predictors (where ``cfg`` uses
    them; None = no prediction for that layer) map token vectors of F values: ``f_key[l]`` F -> F,
    ``f_value[l]`` 2F -> F ([V_prev_hat; K_hat]), fp32 matrices chained and an (F,) fp32 intercept, every
    weight finite with |w| <= ``kvq.calibration.MAX_PREDICTOR_ABS`` (``aqua.check_predictors``).
    TypeError / ValueError before the cache is read or written."""
    _check_predictors(cfg, P, F, n_layers)


def check_call(cfg: AquaConfig, P, st) -> None:
    """The first checks of every call on a cache: ``st`` made by ``init`` with ``cfg``, predictors that fit it."""
    check_state(st, cfg, AquaConfig, AquaState)
    L, _, H, D = st.shape
    check_predictors(cfg, P, L, H * D)


def init(cfg: AquaConfig, n_layers: int, batch: int, kv_heads: int, head_dim: int, *, device=None) -> AquaState:
    """An empty cache for ``batch`` sequences of up to ``cfg.max_tokens`` tokens, every array preallocated;
    the state records ``cfg``, and every later call must pass the same configuration. ``device``: None
    or "cpu" (the fast tiers' argument; NumPy arrays live on the host)."""
    check_cfg(cfg)
    check_dims(n_layers=n_layers, batch=batch, kv_heads=kv_heads, head_dim=head_dim)
    check_host_device(device)
    L, B, H, D, S, R = n_layers, batch, kv_heads, head_dim, cfg.sink, cfg.buffer
    if cfg.pre_rope and D % 2:
        raise ValueError(f"head_dim={D} must be even for RoPE")
    check_cfg(cfg, H * D)
    F, C = H * D, max(cfg.max_tokens - S, 0) // R
    z = lambda T: np.zeros((L, B, H, T, D), F16)                       # noqa: E731
    return AquaState(sink_k=z(S), sink_v=z(S), buf_k=z(R), buf_v=z(R),
                     first_k=_empty_codes(cfg.first_layer, (B, C), R, F),
                     first_v=_empty_codes(cfg.first_layer, (B, C), R, F),
                     res_k=_empty_codes(cfg.backbone, (L - 1, B, C), R, F),
                     res_v=_empty_codes(cfg.backbone, (L - 1, B, C), R, F), shape=(L, B, H, D), cfg=cfg)


register_layout(AquaConfig, init)                   # what state.check_layout holds a hand-built state against


def _check(cfg: AquaConfig, P: AquaPredictors, st: AquaState, K, V):
    check_call(cfg, P, st)
    L, B, H, D = st.shape
    out = []
    for name, x in (("K", K), ("V", V)):
        x = np.asarray(x)
        if x.dtype not in (np.float16, np.float32):
            raise TypeError(f"{name} has dtype {x.dtype}; append takes float16 or float32")
        if x.ndim != 5 or x.shape[:3] != (L, B, H) or x.shape[4] != D:
            raise ValueError(f"{name} has shape {x.shape}; this cache takes (L={L}, B={B}, H_kv={H}, T_new, D={D})")
        nx.check_finite(x, name)
        with np.errstate(over="ignore"):
            x16 = x.astype(F16)
        if not np.all(np.isfinite(x16)):
            raise ValueError(f"{name} overflows float16 (|x| > 65504); the FP16 buffers cannot hold it")
        out.append(x16)
    if out[0].shape != out[1].shape:
        raise ValueError(f"K and V must have the same shape, got {out[0].shape} and {out[1].shape}")
    n = out[0].shape[3]
    if st.length + n > cfg.max_tokens:
        raise ValueError(f"appending {n} tokens to {st.length} exceeds the capacity max_tokens={cfg.max_tokens}")
    return out


def _keys_in(cfg, k, positions):
    """Keys (..., R, D) as the predictors see them: RoPE undone when ``pre_rope``."""
    k = k.astype(np.float32)
    return apply_rope(k, positions, cfg.rope_theta, inverse=True) if cfg.pre_rope else k


def _flush(cfg: AquaConfig, P: AquaPredictors, st: AquaState, c: int) -> None:
    """Compress the full buffer as chunk c, layer 0 first (Algorithm 2 per layer), and zero it."""
    L, B, H, D = st.shape
    pos = cfg.sink + c * cfg.buffer + np.arange(cfg.buffer)          # positions of the chunk's tokens
    K_hat = V_hat = None
    for l in range(L):
        K = to_tokens(_keys_in(cfg, st.buf_k[l], pos))                # (B, R, F)
        V = to_tokens(st.buf_v[l].astype(np.float32))
        Kq, Vq, K_hat, V_hat = encode_checked(cfg, P, l, K, V, K_hat, V_hat)
        for dst, codes in ((st.first_k if l == 0 else st.res_k, Kq), (st.first_v if l == 0 else st.res_v, Vq)):
            for name, a in codes.items():
                (dst[name][:, c] if l == 0 else dst[name][l - 1, :, c])[...] = a
    st.buf_k[:] = 0
    st.buf_v[:] = 0


def append(cfg: AquaConfig, P: AquaPredictors, st: AquaState, K, V) -> AquaState:
    """Append T_new tokens of every layer, K (post-RoPE) and V (L, B, H_kv, T_new, D); returns ``st``.

    Tokens go to the sink while it has room, then to the buffer; every time the buffer holds
    ``cfg.buffer`` tokens it is compressed as one chunk. Validates before touching ``st``.
    """
    K16, V16 = _check(cfg, P, st, K, V)
    new = st.copy()
    R = cfg.buffer
    for t in range(K16.shape[3]):
        n_sink, n_chunks, n_buf = counts(cfg, new.length)
        if new.length < cfg.sink:
            new.sink_k[:, :, :, n_sink] = K16[:, :, :, t]
            new.sink_v[:, :, :, n_sink] = V16[:, :, :, t]
        else:
            new.buf_k[:, :, :, n_buf] = K16[:, :, :, t]
            new.buf_v[:, :, :, n_buf] = V16[:, :, :, t]
            if n_buf + 1 == R:
                _flush(cfg, P, new, n_chunks)
        new.length += 1
    for f in dataclasses.fields(st):                                   # commit
        setattr(st, f.name, getattr(new, f.name))
    return st


def dequantize(cfg: AquaConfig, P: AquaPredictors, st: AquaState) -> list:
    """The cache's ``[(K_l, V_l)]``, fp32 (B, H, T, D), keys post-RoPE: sink, decoded chunks, buffer.

    Chunks are decoded one at a time, layer 0 first (Algorithm 3), as they were encoded.
    """
    check_call(cfg, P, st)
    L, B, H, D = st.shape
    n_sink, n_chunks, n_buf = counts(cfg, st.length)
    F, R = H * D, cfg.buffer
    parts = [[[st.sink_k[l][:, :, :n_sink].astype(np.float32)], [st.sink_v[l][:, :, :n_sink].astype(np.float32)]]
             for l in range(L)]
    for c in range(n_chunks):
        pos = cfg.sink + c * R + np.arange(R)
        K_hat = V_hat = None
        for l in range(L):
            Kq = {n: (a[:, c] if l == 0 else a[l - 1, :, c]) for n, a in (st.first_k if l == 0 else st.res_k).items()}
            Vq = {n: (a[:, c] if l == 0 else a[l - 1, :, c]) for n, a in (st.first_v if l == 0 else st.res_v).items()}
            K_hat, V_hat = decode_checked(cfg, P, l, Kq, Vq, F, K_hat, V_hat)           # (B, R, F)
            k = from_tokens(K_hat, H)
            if cfg.pre_rope:
                k = apply_rope(k, pos, cfg.rope_theta)
            parts[l][0].append(k)
            parts[l][1].append(from_tokens(V_hat, H))
    for l in range(L):
        parts[l][0].append(st.buf_k[l][:, :, :n_buf].astype(np.float32))
        parts[l][1].append(st.buf_v[l][:, :, :n_buf].astype(np.float32))
    return [(np.concatenate(k, axis=2), np.concatenate(v, axis=2)) for k, v in parts]


def forward(model, cfg: AquaConfig, P: AquaPredictors, st: AquaState, tokens) -> np.ndarray:
    """Algorithm 4: logits (B, T, vocab) of ``tokens`` attending to the cache, then append their K / V.

    The past is read with :func:`dequantize` (all layers at once; Algorithm 4 interleaves the same
    decode with the layers to hold one layer at a time), each layer runs with it, and the new tokens'
    keys and values of every layer are appended with :func:`append`.
    """
    past = dequantize(cfg, P, st)
    x = model.embed(tokens)
    ks, vs = [], []
    for l in range(model.n_layers):
        k, v, x = model.layer(l, x, *past[l])
        ks.append(k)
        vs.append(v)
    append(cfg, P, st, np.stack(ks), np.stack(vs))
    return model.logits(x)


def bits_per_value(cfg: AquaConfig, n_layers: int, F: int) -> Fraction:
    """Bits per quantized value, averaged over layers (the paper's "Quant. bits"; sink, buffer and
    predictors not counted): ``(first_layer + (L - 1) * backbone) / L`` at F values per token.
    Llama 3.2 3B (28 layers, F = 1024), HIGGS 2-bit with a 4-bit first layer: 2.09 (Table 2).
    cfg an AquaConfig, n_layers and F ints >= 1 (TypeError / ValueError naming them)."""
    check_cfg(cfg)
    L = checks.int_arg(n_layers, "n_layers", lo=1)
    F = checks.int_arg(F, "F", lo=1)
    return (cfg.first_layer.bits_per_value(F) + (L - 1) * cfg.backbone.bits_per_value(F)) / L


def state_bytes(st: AquaState) -> int:
    """Bytes of every array of the state (what the reference holds; indices one per byte-aligned element)."""
    if not isinstance(st, AquaState):
        raise TypeError(f"st must be an AquaState (an AQUA-KV cache made by init), got {type(st).__name__}")
    return int(sum(a.nbytes for a in st.arrays().values()))
