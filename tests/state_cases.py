"""The state / configuration battery of every cache method, shared by the reference tier
(``tests/reference/test_state_config.py``) and the fast tier (``tests/parity/test_state_config_fast.py``).

A state records the configuration its ``init`` made it with; ``append`` / ``dequantize`` /
``decode_attention`` refuse (ValueError / TypeError naming the problem) another configuration of the
same method, another method's configuration or state, a calibration or predictors that do not fit, and
bad inputs (dtype, shape, k vs v, capacity, NaN / inf, float16 overflow), all before the first write:
after every rejected call the state is bit-identical to its snapshot.

A tier is ``Tier(mods, T)``: ``mods[method]`` the tier's module of that method, ``T`` the conversion of a
NumPy input (identity for the reference, a torch tensor on the device for the fast tier). Shapes are
small (the Triton interpreter is slow); every method appends enough tokens to fill pages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from kvq.reference import aqua as RA
from kvq.reference import bitdecoding as RB
from kvq.reference import kitty as RT
from kvq.reference import kivi as RK
from kvq.reference import oscar as RO

METHODS = ("kivi", "kitty", "oscar", "bitdecoding", "aqua_cache")
#: (method, another method) pairs
PAIRS = [(m, o) for m in METHODS for o in METHODS if o != m]


def _aqua_cfg(**kw):
    return RA.AquaConfig(backbone=RA.Uniform(2, 32), first_layer=RA.Uniform(4, 32), sink=2, buffer=8,
                         max_tokens=48, **kw)


#: method -> (configuration, dims of init, tokens of the first append, other configurations of the method)
SPECS = {
    "kivi": (RK.KIVIConfig(2, 2, group_size=8, residual=4, sink=2, max_tokens=48, name="t"), (2, 2, 32), 21,
             [dict(max_tokens=64), dict(group_size=16), dict(v_bits=4), dict(name="u")]),
    "kitty": (RT.KittyConfig(0.25, group_size=8, residual=4, sink=2, max_tokens=48, name="t"), (2, 2, 32), 21,
              [dict(max_tokens=64), dict(boost_rate=0.125), dict(selection="random"), dict(residual=8)]),
    "oscar": (RO.OSCARConfig(sink=2, window=4, group_size=32, page_size=4, max_tokens=48, name="t"), (2, 2, 32), 13,
              [dict(max_tokens=64), dict(sink=0, window=4, page_size=4), dict(page_size=8), dict(bits=4)]),
    "bitdecoding": (RB.BitDecodingConfig(bits=4, warps_n=1, k_group=32, v_group=32, max_tokens=96, name="t"),
                    (2, 2, 32), 40, [dict(max_tokens=128), dict(bits=2, k_group=64), dict(k_mode="tensor")]),
    "aqua_cache": (_aqua_cfg(), (2, 1, 2, 16), 13,
                   [dict(max_tokens=64), dict(buffer=4), dict(pre_rope=False), dict(predict_values=False)]),
}

#: an instance of every other configuration class, for "another method's configuration"
CONFIGS = {m: s[0] for m, s in SPECS.items()}


def predictors(L: int, F: int, seed: int = 0, f_in=None) -> RA.AquaPredictors:
    """Random fp32 predictors for L layers of token vectors of F values (f_key F -> F, f_value 2F -> F)."""
    rng = np.random.default_rng(seed)

    def p(n_in):
        return RA.Predictor(((rng.standard_normal((n_in, F)) / np.sqrt(n_in) * 0.5).astype(np.float32),),
                            (0.01 * rng.standard_normal(F)).astype(np.float32))

    return RA.AquaPredictors((None,) + tuple(p(f_in or F) for _ in range(L - 1)),
                             (None,) + tuple(p(f_in or 2 * F) for _ in range(L - 1)))


def extra_of(method: str, dims) -> tuple:
    """The arguments between cfg and the state: OSCAR's calibration, AQUA-KV's predictors, none else."""
    if method == "oscar":
        return (RO.identity_calibration(dims[-1], 0.96, 0.92),)
    if method == "aqua_cache":
        L, _, H, D = dims
        return (predictors(L, H * D),)
    return ()


def kv_shape(method: str, dims, n: int) -> tuple:
    if method == "aqua_cache":
        L, B, H, D = dims
        return (L, B, H, n, D)
    B, H, D = dims
    return (B, H, n, D)


def tokens(method: str, dims, n: int, seed: int = 0):
    """Finite fp16 k, v of n tokens (NumPy)."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(kv_shape(method, dims, n)).astype(np.float16) for _ in range(2))


def query(method: str, dims, dtype=np.float32):
    """q (B, 2 H_kv, 1, D) of zeros-ish values (NumPy)."""
    B, H, D = dims[-3:]
    return (0.1 * np.random.default_rng(5).standard_normal((B, 2 * H, 1, D))).astype(dtype)


@dataclass
class Tier:
    """A tier under test: its module of each method, the conversion of NumPy inputs, whether it is fast."""

    mods: dict
    T: Callable
    fast: bool = False

    def init(self, method, cfg, dims):
        return self.mods[method].init(cfg, *dims)

    def append(self, method, cfg, extra, st, k, v):
        return self.mods[method].append(cfg, *extra, st, self.T(k), self.T(v))

    def dequantize(self, method, cfg, extra, st):
        return self.mods[method].dequantize(cfg, *extra, st)

    def has_decode(self, method) -> bool:
        return hasattr(self.mods[method], "decode_attention")

    def decode(self, method, cfg, extra, st, q):
        if method == "aqua_cache":
            return self.mods[method].decode_attention(cfg, *extra, st, 0, self.T(q))
        return self.mods[method].decode_attention(cfg, *extra, st, self.T(q))


def build(tier: Tier, method: str):
    """(cfg, dims, extra, state) with the spec's tokens appended."""
    cfg, dims, n, _ = SPECS[method]
    extra = extra_of(method, dims)
    st = tier.init(method, cfg, dims)
    k, v = tokens(method, dims, n)
    tier.append(method, cfg, extra, st, k, v)
    assert st.length == n
    return cfg, dims, extra, st


# ---------------------------------------------------------------------------------------------------
# snapshots: every field of the state, arrays by their bytes


def _bytes(a) -> tuple:
    if isinstance(a, np.ndarray):
        return ("np", str(a.dtype), a.shape, a.tobytes())
    import torch

    t = a.detach()
    return ("torch", str(t.dtype), tuple(t.shape), str(t.device),
            t.contiguous().view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b"")


def _is_array(a) -> bool:
    if isinstance(a, np.ndarray):
        return True
    try:
        import torch
    except ImportError:                                   # the reference tests need no torch
        return False
    return isinstance(a, torch.Tensor)


def snapshot(st) -> dict:
    """Every field of a state dataclass: arrays (and dicts of arrays) as their bytes, the rest as is
    (the counters, the shape) or by identity (the configuration)."""
    out = {}
    for f in dataclasses.fields(st):
        v = getattr(st, f.name)
        if _is_array(v):
            out[f.name] = _bytes(v)
        elif isinstance(v, dict):
            out[f.name] = {n: _bytes(a) for n, a in v.items()}
        elif f.name == "cfg":
            out[f.name] = id(v)
        else:
            out[f.name] = v
    return out


def assert_unchanged(st, snap: dict, what: str) -> None:
    now = snapshot(st)
    bad = [n for n in snap if now[n] != snap[n]]
    assert not bad, f"{what}: the rejected call changed {bad}"


def rejects(fn, exc, match: str, st, snap: dict, what: str) -> None:
    """fn() raises ``exc`` whose message matches ``match``, and the state is bit-identical afterwards."""
    with pytest.raises(exc, match=match):
        fn()
    assert_unchanged(st, snap, what)


# ---------------------------------------------------------------------------------------------------
# the bad calls


def bad_kv(method: str, dims, cfg, fast: bool) -> list:
    """(label, k, v, exception, match) of append calls that must be refused (NumPy arrays; the fast tier
    converts them)."""
    k, v = tokens(method, dims, 3, seed=7)
    ax = 3 if method == "aqua_cache" else 2                     # the token axis
    lead = 1 if method == "aqua_cache" else 0                   # B's axis
    nan, inf = k.copy(), v.copy()
    nan.flat[5] = np.nan
    inf.flat[3] = -np.inf
    big = k.astype(np.float32)
    big.flat[2] = 1e6
    cap = np.zeros(kv_shape(method, dims, cfg.max_tokens), np.float16)
    half = dims[-1] // 2

    def cut(x, axis, n):
        return np.take(x, range(n), axis=axis)

    def resize(x, axis):                                        # another size along axis: 1, or 2 for 1
        return cut(x, axis, 1) if x.shape[axis] > 1 else np.concatenate([x, x], axis=axis)

    out = [
        ("int32 k", k.astype(np.int32), v, TypeError, "dtype"),
        ("int8 v", k, v.astype(np.int8), TypeError, "dtype"),
        ("float64 k", k.astype(np.float64), v, TypeError, "dtype"),
        ("wrong batch", resize(k, lead), resize(v, lead), ValueError, "shape"),
        ("wrong kv heads", resize(k, lead + 1), resize(v, lead + 1), ValueError, "shape"),
        ("wrong head dim", k[..., :half], v[..., :half], ValueError, "shape"),
        ("one axis too few", k[0], v[0], ValueError, "shape"),
        ("k vs v tokens", k, cut(v, ax, 2), ValueError, "same shape"),
        ("v head dim", k, v[..., :half], ValueError, "shape"),
        ("NaN in k", nan, v, ValueError, "non-finite"),
        ("inf in v", k, inf, ValueError, "non-finite"),
        ("fp16 overflow", big, v.astype(np.float32), ValueError, "overflows"),
        ("over capacity", cap, cap, ValueError, "capacity"),
    ]
    if method == "aqua_cache":
        out.append(("wrong layers", k[:1], v[:1], ValueError, "shape"))
    return out


def bad_q(method: str, dims) -> list:
    """(label, q, exception, match) of decode calls that must be refused."""
    q = query(method, dims)
    return [
        ("q heads not a multiple", q[:, :3] if q.shape[1] > 2 else q[:, :1, :, :], ValueError, "H_q"),
        ("q head dim", q[..., :q.shape[-1] // 2], ValueError, "shape"),
        ("q batch", q[:1] if q.shape[0] > 1 else np.concatenate([q, q]), ValueError, "shape"),
        ("q 3-D", q[0], ValueError, "shape"),
    ]


def other_configs(method: str) -> list:
    cfg, _, _, others = SPECS[method]
    return [dataclasses.replace(cfg, **kw) for kw in others]
