"""kvq.fast.{triton,cupy}.kitty.channel_sensitivity against kvq.reference.kitty.channel_sensitivity (Fig. 2b).

The INT2 (or b-bit) keys come from each backend's quantize / dequantize kernels and are bit-identical
to the reference's (``test_quantized_keys_bit_exact``, on the tie / constant / normal value kinds).
The MSE is an order-dependent reduction (contract rule 7): it follows the tolerance rule
(``tolerance.check_close``) against the reference, which computes the scores in float64 (the truth),
with the reference's formula evaluated in float32 as ``ref32`` (the reference itself always upcasts
to float64, so ``ref32`` is its loop run on float32 scores: ``kvq.reference.attention``'s own score /
softmax pieces). Each case also checks that the bound is far below the values (the check can fail)
and that the exact zeros agree (a constant channel quantizes exactly: its MSE is exactly 0).
Bad input raises the reference's error (same type and message) where the rule is shared.

Targets: Triton through the interpreter (CI, CPU) and on the GPU, and the CuPy backend on the GPU
(``pytest -m gpu``), through tests/conftest.py's ``fast_target``.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import kvq.fast as F
from kvq.fast.caches import sensitivity as S
from kvq.reference import attention as RA
from kvq.reference import kitty as RT
from kvq.reference import quant as RQ

from .cases import assert_bits_equal, make_input
from .tolerance import check_close

#: the tolerance bound must lie this far below max |truth|, or the comparison would prove little
POWER = 1e-3


@pytest.fixture
def target(fast_target):
    """(backend, device) from tests/conftest.py's ``fast_target``."""
    return fast_target


def _kitty(target):
    return importlib.import_module(f"kvq.fast.{target[0]}.kitty")


def _ops(target):
    return importlib.import_module(f"kvq.fast.{target[0]}.paged").OPS


def _pair(v: np.ndarray, dtype: torch.dtype, device: str):
    """(tensor in ``dtype`` on ``device``, the array the reference takes for the same values)."""
    t = torch.from_numpy(np.ascontiguousarray(v)).to(dtype)
    ref = t.numpy() if dtype in (torch.float16, torch.float64) else t.float().numpy()     # bf16: its fp32 values
    return t.to(device), ref


def _inputs(c: dict, device: str, seed: int = 0):
    """q (B, H*g, T_q, D) and k (B, H, T, D) of a case: keys N(0, 1) with channel 0 scaled by
    ``outlier`` and channel 1 constant per kv head, a value the float16 metadata holds exactly (so it
    quantizes exactly: zero sensitivity)."""
    rng = np.random.default_rng(seed)
    B, H, g, T, T_q, D = (c[n] for n in ("B", "H", "g", "T", "T_q", "D"))
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k[..., 0] *= c.get("outlier", 1.0)
    k[..., 1] = rng.integers(-16, 16, size=(B, H, 1)) / np.float32(8)    # exact in fp16 / bf16 metadata
    q = rng.standard_normal((B, H * g, T_q, D)).astype(np.float32)
    q_t, q_np = _pair(q, c.get("q_dtype", torch.float32), device)
    k_t, k_np = _pair(k, c.get("k_dtype", torch.float16), device)
    return q_t, q_np, k_t, k_np


def sensitivity32(q, k, *, bits=2, group_size=None, causal=True, scale=None) -> np.ndarray:
    """``ref32``: the reference's loop (quantize, one perturbed softmax per channel, mean of squares)
    with float32 scores, softmax and mean, from ``kvq.reference.attention``'s float32 pieces."""
    k32 = np.asarray(k, np.float32)
    q32 = np.asarray(q).astype(np.float32)
    B, H, T, D = k32.shape
    G = T if group_size is None else group_size
    codes, s, m = RQ.quantize(k32, bits, G, axis=2)
    k_q = RQ.dequantize(codes, s, m, G, axis=2, out_dtype=np.float32)
    sc = RA.resolve_scale(scale, D, np.float32)
    visible = RA.visible_keys(B, q32.shape[2], T, causal, None)

    def probs(kk):
        e, _, l = RA.softmax_parts(RA.scaled_scores(q32, kk, sc), visible)
        return e / l

    ref = probs(k32)
    out = np.zeros((q32.shape[1], D), np.float32)
    for c in range(D):
        kc = k32.copy()
        kc[..., c] = k_q[..., c]
        out[:, c] = ((probs(kc) - ref) ** 2).mean(axis=(0, 2, 3))
    return out


def _check(fast, q_np, k_np, what, **kw):
    """Tolerance rule against the float64 truth, the bound far below the values, exact zeros equal."""
    truth = RT.channel_sensitivity(q_np, k_np, **kw)
    ref32 = sensitivity32(q_np, k_np, **kw)
    assert isinstance(fast, torch.Tensor) and fast.dtype == torch.float64
    f = fast.cpu().numpy()
    r = check_close(f, truth, ref32, torch.float32, what)
    mag = float(np.abs(truth).max())
    assert mag > 0 and r["bound"] <= POWER * mag, (what, r, mag)
    assert np.array_equal(f == 0, truth == 0), f"{what}: exact zeros differ: fast {np.argwhere(f == 0)}, " \
                                               f"reference {np.argwhere(truth == 0)}"
    return truth


# (case, on the GPU: the same with larger sizes). outlier: channel 0 x that factor (100: score changes
# far beyond 1, where p' - p is taken as p exp(x) - p; 3000: scores spread beyond exp's range, so some
# p underflow to 0 while their p' do not); dtypes of q and k; causal with T_q < T.
CASES = [
    dict(B=1, H=2, g=2, T=24, T_q=24, D=12),
    dict(B=2, H=1, g=3, T=40, T_q=8, D=8, G=8, bits=2, outlier=8.0, q_dtype=torch.float16),
    dict(B=1, H=2, g=1, T=16, T_q=16, D=16, bits=4, causal=False, scale=0.7, q_dtype=torch.bfloat16,
         k_dtype=torch.bfloat16),
    dict(B=1, H=1, g=2, T=32, T_q=12, D=8, G=16, bits=8, k_dtype=torch.float32, q_dtype=torch.float64),
    dict(B=1, H=2, g=2, T=20, T_q=20, D=8, bits=3, outlier=100.0, k_dtype=torch.float32),
    dict(B=1, H=1, g=2, T=24, T_q=24, D=8, outlier=3000.0),
]
GPU_SIZES = dict(B=2, T=256, T_q=32, D=64)


def _case(c: dict, device: str) -> dict:
    if device == "cuda":
        c = dict(c, **GPU_SIZES)
        if "G" in c:
            c["G"] = 128
    return c


def _kw(c: dict) -> dict:
    return dict(bits=c.get("bits", 2), group_size=c.get("G"), causal=c.get("causal", True), scale=c.get("scale"))


@pytest.mark.parametrize("ci", range(len(CASES)))
def test_matches_reference(target, ci):
    _, device = target
    c = _case(CASES[ci], device)
    q_t, q_np, k_t, k_np = _inputs(c, device, seed=ci)
    fast = _kitty(target).channel_sensitivity(q_t, k_t, **_kw(c))
    assert fast.device == k_t.device and tuple(fast.shape) == (c["H"] * c["g"], c["D"])
    truth = _check(fast, q_np, k_np, f"case {ci}", **_kw(c))
    assert np.all(truth[:, 1] == 0)                    # the constant channel: the zero check has a subject


def test_backend_module_and_determinism(target):
    """``kvq.fast.backend_module("kitty", backend)`` serves the function; two runs give the same bits."""
    backend, device = target
    c = _case(CASES[0], device)
    q_t, _, k_t, _ = _inputs(c, device)
    a = F.backend_module("kitty", backend).channel_sensitivity(q_t, k_t)
    b = _kitty(target).channel_sensitivity(q_t, k_t)
    assert_bits_equal(a, b.cpu().numpy(), "two calls")


@pytest.mark.parametrize("budget", ["one", "rows", "channels"])
def test_blocks(target, budget, monkeypatch):
    """Blocks of query rows and channels (``BUDGET``; D = 12 not a multiple of the block) agree with the truth."""
    _, device = target
    c = _case(dict(B=1, H=2, g=2, T=24, T_q=10, D=12, G=8, outlier=4.0), device)
    per_row = c["B"] * c["H"] * c["g"] * c["T"]
    monkeypatch.setattr(S, "BUDGET", {"one": 1, "rows": 3 * per_row, "channels": 5 * per_row * c["T_q"]}[budget])
    q_t, q_np, k_t, k_np = _inputs(c, device, seed=11)
    fast = _kitty(target).channel_sensitivity(q_t, k_t, **_kw(c))
    _check(fast, q_np, k_np, f"budget {budget}", **_kw(c))


@pytest.mark.parametrize("kind", ["ties", "const", "normal", "negzero"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [2, 4])
def test_quantized_keys_bit_exact(target, kind, dtype, bits):
    """The keys channel_sensitivity perturbs with: the backend's kernels, bit for bit the reference's."""
    _, device = target
    shape, G = ((2, 3, 256, 40), 128) if device == "cuda" else ((1, 2, 16, 6), 8)
    k_t, k_np = make_input(kind, shape, 2, G, bits, False, dtype, device, seed=bits)
    codes, s, m = RQ.quantize(k_np, bits, G, axis=2)
    want = RQ.dequantize(codes, s, m, G, axis=2, out_dtype=np.float32)
    assert_bits_equal(S.quantized_keys(_ops(target), k_t, bits, G), want, f"{kind} {dtype} {bits}-bit")


# ------------------------------------------------------------------------------------------------
# bad input

def _base():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 4, 8, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
    return q, k


def _nan(a, v):
    a = a.copy()
    a[0, 0, 0, 0] = v
    return a


#: (what, q, k, keyword arguments) as functions of the base q, k: both tiers must raise the same error
SHARED = [
    ("k 3-D", lambda q, k: (q, k[0], {})),
    ("q 3-D", lambda q, k: (q[0], k, {})),
    ("GQA", lambda q, k: (q[:, :3], k, {})),
    ("head dim", lambda q, k: (q[..., :8], k, {})),
    ("batch", lambda q, k: (np.concatenate([q, q]), k, {})),
    ("no query rows", lambda q, k: (q[:, :, :0], k, {})),
    ("causal T_q > T", lambda q, k: (np.concatenate([q, q], axis=2), k, {})),
    ("k NaN", lambda q, k: (q, _nan(k, np.nan), {})),
    ("k inf", lambda q, k: (q, _nan(k, -np.inf), {})),
    ("q inf", lambda q, k: (_nan(q, np.inf), k, {})),
    ("bits", lambda q, k: (q, k, {"bits": 5})),
    ("group size", lambda q, k: (q, k, {"group_size": 3})),
    ("group size 0", lambda q, k: (q, k, {"group_size": 0})),
    ("empty k", lambda q, k: (q, k[:, :, :0], {})),
    ("empty batch", lambda q, k: (q[:0], k[:0], {})),
    ("scale type", lambda q, k: (q, k, {"scale": "a"})),
    ("scale inf", lambda q, k: (q, k, {"scale": float("inf")})),
]


@pytest.mark.parametrize("what", [s[0] for s in SHARED])
def test_bad_input_same_error(target, what):
    _, device = target
    q, k = _base()
    q, k, kw = dict(SHARED)[what](q, k)
    with pytest.raises((TypeError, ValueError)) as ref_err:
        RT.channel_sensitivity(q, k, **kw)
    with pytest.raises(ref_err.type) as fast_err:
        _kitty(target).channel_sensitivity(torch.from_numpy(q).to(device), torch.from_numpy(k).to(device), **kw)
    assert str(fast_err.value) == str(ref_err.value), what


def test_bad_input_fast_only(target):
    """Errors whose wording is the fast tier's own: dtypes, non-tensors, devices, metadata overflow."""
    _, device = target
    fast = _kitty(target).channel_sensitivity
    q, k = _base()
    q_t, k_t = torch.from_numpy(q).to(device), torch.from_numpy(k).to(device)
    with pytest.raises(TypeError, match="k has dtype torch.float64"):
        fast(q_t, k_t.double())
    with pytest.raises(TypeError, match="k has dtype"):
        RT.channel_sensitivity(q, k.astype(np.float64))                 # the reference refuses it too
    with pytest.raises(TypeError, match="q has dtype torch.int32"):
        fast(q_t.int(), k_t)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        fast(q_t, k)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        fast(q, k_t)
    other = "meta" if device == "cpu" else "cpu"                        # a device the backend refuses
    with pytest.raises(ValueError, match=f"q is on {other}"):
        fast(q_t.to(other), k_t)
    with pytest.raises(ValueError, match="scale overflows float16 metadata"):
        fast(q_t, k_t * 1e5)
    with pytest.raises(ValueError, match="scale overflows float16 metadata"):
        RT.channel_sensitivity(q, k * np.float32(1e5))


def test_validation_off_propagates_nan(target):
    """Rule 8 with the checks off: NaN in k (kv head 0) or q (query head 3) turns the rows it reaches
    into NaN, never into finite numbers; the other rows stay finite."""
    _, device = target
    fast = _kitty(target).channel_sensitivity
    q, k = _base()                                             # H_q = 4, H_kv = 2: heads 0, 1 read kv head 0
    with F.validation(False):
        a = fast(torch.from_numpy(q).to(device), torch.from_numpy(_nan(k, np.nan)).to(device)).cpu()
        q_bad = q.copy()
        q_bad[0, 3, 2, 5] = np.nan
        b = fast(torch.from_numpy(q_bad).to(device), torch.from_numpy(k).to(device)).cpu()
    assert torch.isnan(a[:2]).all() and torch.isfinite(a[2:]).all()
    assert torch.isnan(b[3]).all() and torch.isfinite(b[:3]).all()
