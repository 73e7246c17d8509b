"""A model to calibrate on: the layer interface AQUA-KV needs, and a tiny seeded NumPy decoder.

AQUA-KV (Algorithms 1 and 4) works across layers: it predicts layer l's keys and values from layer
l-1's reconstructions, so calibration and inference need a model that can be run one layer at a time.
``KVModel`` is that interface; ``TinyDecoder`` implements it as a small Llama-style decoder-only
transformer (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, pre-norm residual blocks, causal
attention, tied embeddings) with seeded random weights, in float32. It is the model of the tests and
the book; real models (HF transformers) plug in behind the same interface.

    model = TinyDecoder(ModelConfig(n_layers=4, seed=0))
    tokens = sample_tokens(model.cfg, batch=2, T=64, seed=1)           # (B, T) int64
    kv = collect_kv(model, tokens)                                     # [(K, V)] per layer, (B, H_kv, T, D)

The interface, for a model with ``n_layers``, ``n_kv_heads``, ``head_dim`` and ``rope_theta``:

* ``embed(tokens)``: (B, T) ints -> hidden states (B, T, d_model) fp32;
* ``layer(l, x, past_k=None, past_v=None)``: run block l on x (B, T, d_model), the new tokens sitting at
  positions ``T_past .. T_past + T - 1`` after a past of ``T_past`` tokens whose keys (post-RoPE) and
  values are ``past_k``, ``past_v`` (B, H_kv, T_past, D); returns ``(k, v, x_out)``: the block's keys
  (post-RoPE) and values of the new tokens (B, H_kv, T, D) and its output hidden states;
* ``logits(x)``: final norm and output head, (B, T, vocab) fp32.

RoPE is the "rotate half" form (Su et al., 2021, as in Llama): :func:`apply_rope` rotates and, with
``inverse=True``, undoes the rotation (AQUA-KV's pre-RoPE keys). Attention, matrix products and RoPE
are order-dependent reductions or transcendentals: outside bit-exactness (numerics rule 7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from . import checks
from . import numerics as nx
from .attention import attention
from .state import check_int, check_real

F32 = nx.F32

__all__ = ["KVModel", "ModelConfig", "TinyDecoder", "rope_tables", "apply_rope", "rms_norm",
           "sample_tokens", "collect_kv", "forward"]


class KVModel(Protocol):
    """What AQUA-KV needs from a model (see the module docstring)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float | None

    def embed(self, tokens) -> np.ndarray: ...

    def layer(self, l: int, x, past_k=None, past_v=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def logits(self, x) -> np.ndarray: ...


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the tiny decoder (defaults: 4 layers, d_model 128, 4 query / 2 KV heads of dim 32).

    ``spectrum`` shapes the token embeddings: channel c of an embedding is scaled by
    ``(1 + c) ** -spectrum``, so the residual stream has a few dominant directions, as in real LLMs
    (0 gives isotropic embeddings).
    """

    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 256
    vocab_size: int = 256
    rope_theta: float = 10000.0
    eps: float = 1e-5
    spectrum: float = 0.5
    seed: int = 0

    def __post_init__(self):
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} (GQA)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        check_real(self, "rope_theta", 0.0, lo_open=True)
        check_real(self, "eps", 0.0)
        check_real(self, "spectrum", -math.inf)
        check_int(self, "seed", 0)


def _positions(positions) -> np.ndarray:
    """RoPE positions: a 1-D integer array (T,) (a list of ints too; floats and bools are refused)."""
    return checks.int_array(positions, "positions", ndim=1)


def _theta(theta) -> float:
    """The RoPE base: a finite real number > 0."""
    return checks.real_arg(theta, "theta", 0.0, lo_open=True)


def rope_tables(positions, head_dim: int, theta: float):
    """``(cos, sin)`` of shape (T, head_dim) fp32 for integer positions (T,).

    Frequencies ``theta ** (-2i / head_dim)``, angles ``position * frequency``, computed in float64 and
    rounded once to fp32 (a constant table, as a kernel would receive it from the host).

    Raises TypeError / ValueError naming the argument: ``positions`` not a 1-D integer array,
    ``head_dim`` not a positive even int, ``theta`` not a finite real number > 0.
    """
    pos = _positions(positions).astype(np.float64)                             # (T,)
    head_dim = checks.int_arg(head_dim, "head_dim", lo=1)
    if head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int (RoPE rotates pairs), got {head_dim}")
    theta = _theta(theta)
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)   # (D/2,)
    ang = pos[:, None] * inv_freq[None, :]                                     # (T, D/2)
    ang = np.concatenate([ang, ang], axis=-1)                                  # (T, D)
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def apply_rope(x, positions, theta: float, inverse: bool = False) -> np.ndarray:
    """Rotate x (..., T, D) by RoPE at ``positions`` (T,): ``x*cos + rotate_half(x)*sin``.

    ``inverse=True`` rotates by the opposite angle (``x*cos - rotate_half(x)*sin``), undoing it up to
    fp32 rounding. ``rotate_half([x1, x2]) = [-x2, x1]`` on the two halves of the head dim.
    x must have at least 2 dimensions and an even head dim D; see :func:`rope_tables` for the others.
    """
    x = nx.as_f32(x, "x")
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions (..., T, D); got shape {x.shape}")
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"x has an odd head dim D={D} (shape {x.shape}); RoPE rotates pairs")
    inverse = checks.bool_arg(inverse, "inverse")
    pos = _positions(positions)
    if pos.shape[0] != x.shape[-2]:
        raise ValueError(f"{pos.shape[0]} positions for {x.shape[-2]} tokens")
    cos, sin = rope_tables(pos, D, theta)                                      # (T, D)
    rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], axis=-1)         # rotate_half(x)
    s = nx.mul(rot, sin)
    return nx.sub(nx.mul(x, cos), s) if inverse else nx.add(nx.mul(x, cos), s)


def rms_norm(x, w, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2) + eps) * w`` over the last axis, fp32.

    x (..., d) and w (d,) real floating arrays; eps a finite real number >= 0 (TypeError / ValueError
    naming the argument otherwise).
    """
    x = checks.real_array(x, "x", min_ndim=1)
    w = checks.real_array(w, "w", shape=(x.shape[-1],))
    eps = checks.real_arg(eps, "eps", 0.0)
    with np.errstate(over="ignore", invalid="ignore"):     # inf / NaN in x propagate (to inf / NaN), silently
        ms = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)
        return (x / np.sqrt(ms + F32(eps))) * w


def _silu(x):
    return x / (F32(1) + np.exp(-x))


class TinyDecoder:
    """A seeded Llama-style decoder implementing ``KVModel`` (see the module docstring).

    Weights: ``w ~ N(0, 1 / fan_in)`` (output projections also scaled by ``1 / sqrt(2 * n_layers)``),
    norm gains ``1 + 0.1 * N(0, 1)``, embeddings ``N(0, 1)`` with the channel spectrum of
    ``ModelConfig.spectrum``; all drawn from ``np.random.default_rng(seed)`` in a fixed order, fp32.
    """

    def __init__(self, cfg: ModelConfig = ModelConfig()):
        _check_cfg(cfg)
        self.cfg = cfg
        self.n_layers, self.n_kv_heads, self.head_dim = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        rng = np.random.default_rng(cfg.seed)
        d, Hq, Hk, D, ff = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff

        def w(n_in, n_out, gain=1.0):
            return (rng.standard_normal((n_in, n_out)) * (gain / np.sqrt(n_in))).astype(F32)

        def gain(n):
            return (1.0 + 0.1 * rng.standard_normal(n)).astype(F32)

        spec = (1.0 + np.arange(d)) ** -cfg.spectrum
        self.embedding = (rng.standard_normal((cfg.vocab_size, d)) * spec).astype(F32)   # (V, d)
        out_gain = 1.0 / np.sqrt(2 * cfg.n_layers)
        self.layers = []
        for _ in range(cfg.n_layers):
            self.layers.append(dict(
                attn_norm=gain(d), w_q=w(d, Hq * D), w_k=w(d, Hk * D), w_v=w(d, Hk * D),
                w_o=w(Hq * D, d, out_gain), mlp_norm=gain(d), w_gate=w(d, ff), w_up=w(d, ff),
                w_down=w(ff, d, out_gain)))
        self.final_norm = gain(d)

    # -- the KVModel interface ---------------------------------------------------------------------

    def embed(self, tokens) -> np.ndarray:
        """(B, T) token ids -> (B, T, d_model) fp32."""
        t = np.asarray(tokens)
        if t.ndim != 2 or not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"tokens must be a 2-D integer array (B, T); got {t.dtype} {t.shape}")
        if t.size and (t.min() < 0 or t.max() >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}); got [{t.min()}, {t.max()}]")
        return self.embedding[t]

    def layer(self, l: int, x, past_k=None, past_v=None):
        """Block l on x (B, T, d): ``(k, v, x_out)``, k post-RoPE and v (B, H_kv, T, D) of the new tokens."""
        if isinstance(l, (bool, np.bool_)) or not isinstance(l, (int, np.integer)):
            raise TypeError(f"layer index l must be an int, got {l!r}")
        if not 0 <= l < self.n_layers:
            raise ValueError(f"layer index {l} is outside [0, {self.n_layers})")
        c, p = self.cfg, self.layers[int(l)]
        x = nx.as_f32(x, "x")
        if x.ndim != 3 or x.shape[2] != c.d_model:
            raise ValueError(f"x must be (B, T, d_model={c.d_model}); got shape {x.shape}")
        B, T, _ = x.shape
        Hq, Hk, D = c.n_heads, c.n_kv_heads, c.head_dim
        past_k, past_v = self._check_past(past_k, past_v, B)
        T_past = 0 if past_k is None else past_k.shape[2]
        pos = np.arange(T_past, T_past + T)
        h = rms_norm(x, p["attn_norm"], c.eps)                                     # (B, T, d)
        q = (h @ p["w_q"]).reshape(B, T, Hq, D).transpose(0, 2, 1, 3)             # (B, Hq, T, D)
        k = (h @ p["w_k"]).reshape(B, T, Hk, D).transpose(0, 2, 1, 3)             # (B, Hk, T, D)
        v = (h @ p["w_v"]).reshape(B, T, Hk, D).transpose(0, 2, 1, 3)             # (B, Hk, T, D)
        q, k = apply_rope(q, pos, c.rope_theta), apply_rope(k, pos, c.rope_theta)
        K = k if past_k is None else np.concatenate([past_k, k], axis=2)
        V = v if past_v is None else np.concatenate([past_v, v], axis=2)
        o = attention(q, K, V, causal=True)                                        # (B, Hq, T, D)
        x = x + o.transpose(0, 2, 1, 3).reshape(B, T, Hq * D) @ p["w_o"]
        h = rms_norm(x, p["mlp_norm"], c.eps)
        x = x + (_silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        return np.ascontiguousarray(k), np.ascontiguousarray(v), x.astype(F32, copy=False)

    def logits(self, x) -> np.ndarray:
        """(B, T, d) -> (B, T, vocab): final RMSNorm, then the tied embedding as output head."""
        x = nx.as_f32(x, "x")
        if x.ndim != 3 or x.shape[2] != self.cfg.d_model:
            raise ValueError(f"x must be (B, T, d_model={self.cfg.d_model}); got shape {x.shape}")
        return rms_norm(x, self.final_norm, self.cfg.eps) @ self.embedding.T

    def _check_past(self, past_k, past_v, B: int):
        """A layer's past keys and values: both None, or both fp16 / fp32 (B, H_kv, T_past, D) alike."""
        if past_k is None and past_v is None:
            return None, None
        if past_k is None or past_v is None:
            raise ValueError("past_k and past_v must be given together (or both None)")
        past_k, past_v = nx.as_f32(past_k, "past_k"), nx.as_f32(past_v, "past_v")
        c = self.cfg
        for name, a in (("past_k", past_k), ("past_v", past_v)):
            if a.ndim != 4 or a.shape[0] != B or a.shape[1] != c.n_kv_heads or a.shape[3] != c.head_dim:
                raise ValueError(f"{name} must be (B={B}, H_kv={c.n_kv_heads}, T_past, D={c.head_dim}); "
                                 f"got shape {a.shape}")
        if past_k.shape != past_v.shape:
            raise ValueError(f"past_k {past_k.shape} and past_v {past_v.shape} must have the same shape")
        return past_k, past_v


def sample_tokens(cfg: ModelConfig, batch: int, T: int, seed: int = 0, branching: int = 4) -> np.ndarray:
    """(batch, T) int64 token ids from a seeded bigram chain: each token is followed by one of its
    ``branching`` successors (fixed per token by ``cfg.seed``), chosen uniformly with ``default_rng(seed)``.

    Text-like data: adjacent tokens depend on each other, as in the AQUA-KV probes (Fig. 2, "T-1").
    """
    _check_cfg(cfg)
    batch = checks.int_arg(batch, "batch", lo=0)
    T = checks.int_arg(T, "T", lo=0)
    seed = checks.int_arg(seed, "seed", lo=0)
    branching = checks.int_arg(branching, "branching", lo=1)
    succ = np.random.default_rng(cfg.seed + 1).integers(0, cfg.vocab_size, (cfg.vocab_size, branching))
    rng = np.random.default_rng(seed)
    out = np.empty((batch, T), np.int64)
    if T:
        out[:, 0] = rng.integers(0, cfg.vocab_size, batch)
    for t in range(1, T):
        out[:, t] = succ[out[:, t - 1], rng.integers(0, branching, batch)]
    return out


def collect_kv(model: KVModel, tokens) -> list[tuple[np.ndarray, np.ndarray]]:
    """A clean forward pass (no cache): ``[(K_l, V_l)]`` per layer, K post-RoPE, (B, H_kv, T, D) fp32.

    AQUA-KV Algorithm 1 lines 5-7: the keys and values every predictor is calibrated against.
    """
    _check_model(model)
    x = model.embed(tokens)
    out = []
    for l in range(model.n_layers):
        k, v, x = model.layer(l, x)
        out.append((k, v))
    return out


def forward(model: KVModel, tokens, past=None):
    """Logits (B, T, vocab) of ``tokens`` after an optional past ``[(K_l, V_l)]`` (B, H_kv, T_past, D),
    and the new tokens' ``[(k_l, v_l)]``. Without a past this is a plain causal forward pass."""
    _check_model(model)
    if past is not None:
        if not isinstance(past, (list, tuple)) or len(past) != model.n_layers:
            raise ValueError(f"past must be None or a list of n_layers={model.n_layers} (K, V) pairs, one per "
                             f"layer; got {_describe(past)}")
        for l, pair in enumerate(past):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"past[{l}] must be a (K, V) pair; got {_describe(pair)}")
    x = model.embed(tokens)
    new = []
    for l in range(model.n_layers):
        pk, pv = (None, None) if past is None else past[l]
        k, v, x = model.layer(l, x, pk, pv)
        new.append((k, v))
    return model.logits(x), new


def _describe(v) -> str:
    """A short description of a value for an error message (its type, and its length if it has one)."""
    n = len(v) if isinstance(v, (list, tuple)) else None
    return type(v).__name__ + ("" if n is None else f" of length {n}")


def _check_cfg(cfg) -> None:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")


def _check_model(model) -> None:
    """``model`` implements :class:`KVModel` (embed, layer, logits and an int n_layers >= 1)."""
    ok = all(callable(getattr(model, m, None)) for m in ("embed", "layer", "logits"))
    n = getattr(model, "n_layers", None)
    if not ok or isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise TypeError(f"model must implement KVModel (embed, layer, logits, n_layers), got "
                        f"{type(model).__name__}")
