"""kvq.fast.cupy.bitdecoding_decode (the tensor-core fused decode over the induced layout) against
kvq.reference.bitdecoding.decode_attention.

The cache is built by the reference (its bytes are the fast tier's, bit for bit: test_bitdecoding_cupy.py)
and handed to the kernel as torch tensors; out (fp16) and lse (fp32) follow the tolerance rule
(``tolerance.check_close``): the truth from float64 q, the yardstick from float32 q (the reference's
float32 path, another summation order). Cases: the four kinds at the paper's W_n = 4 and at W_n = 1, 2, 8;
query groups g_q of 1, 4, 8 and 16 (16 rows: the kernel's second accumulator half) at T_q = 1, 2; caches
with no page, no residual, both, and many pages split over blocks; an outlier channel; pages whose params
take the exact fp32 dequantization (a tiny group minimum beside a large scale). Runs on the GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvq.reference import bitdecoding as R

from .tolerance import check_close

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: run `pytest -m gpu` on the device", allow_module_level=True)

from kvq.fast.cupy import bitdecoding_decode as BD  # noqa: E402

D = 128


def cfg_of(bits, mode, nw=4, max_tokens=8192):
    """Channel-wise keys in groups of 128 tokens (or the whole page where N_r < 128), tensor-wise of D."""
    kg = min(128, R.residual_block_size(bits, nw)) if mode == "channel" else D
    return R.BitDecodingConfig(bits=bits, k_mode=mode, warps_n=nw, k_group=kg, v_group=D, max_tokens=max_tokens)


def build(cfg, B, H, L, kind="normal", seed=0):
    """A reference cache of L tokens (appended as a prefill and two single steps) -> (state, torch namespace)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, L, D)).astype(np.float32)
    v = rng.standard_normal((B, H, L, D)).astype(np.float32)
    if kind == "outlier":
        k[..., 5] *= 30
        v[..., 9] *= 20
    elif kind == "tiny_min":                   # groups whose min is a subnormal beside a large range:
        k[..., 3] = np.abs(k[..., 3]) * 40     # the params bd_unsafe2 flags (the exact fp32 path)
        k[..., 0, 3] = 2.0 ** -24
        v[..., 1:, :] = np.abs(v[..., 1:, :]) * 30
        v[..., :, 0] = 2.0 ** -24
    st = R.init(cfg, B, H, D)
    n0 = max(L - 2, 0)
    R.append(cfg, st, k[:, :, :n0], v[:, :, :n0])
    for i in range(n0, L):
        R.append(cfg, st, k[:, :, i:i + 1], v[:, :, i:i + 1])
    dev = torch.device("cuda")
    ts = SimpleNamespace(**{n: torch.from_numpy(np.ascontiguousarray(a)).to(dev) for n, a in st.arrays().items()},
                         length=st.length, next_page=st.next_page, shape=st.shape)
    return st, ts


def check(cfg, st, ts, gq, Tq, seed=1, scale=None):
    B, H, _ = st.shape
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((B, H * gq, Tq, D)) * 0.5).astype(np.float16)
    tq = torch.from_numpy(q).cuda()
    assert BD.supported(cfg, ts, tq)
    out, lse = BD.decode(cfg, ts, tq, scale=scale)
    o64, l64 = R.decode_attention(cfg, st, q.astype(np.float64), scale=scale)
    o32, l32 = R.decode_attention(cfg, st, q.astype(np.float32), scale=scale)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    check_close(out, o64, o32, torch.float16, "out")
    check_close(lse, l64, l32, torch.float32, "lse")
    return out


KINDS = [(2, "channel"), (4, "channel"), (2, "tensor"), (4, "tensor")]
KIDS = ["KC2", "KC4", "KT2", "KT4"]


@pytest.mark.parametrize("bits, mode", KINDS, ids=KIDS)
@pytest.mark.parametrize("gq, Tq", [(1, 1), (4, 1), (8, 1), (4, 2), (16, 1), (8, 3)])
def test_decode_kinds(bits, mode, gq, Tq):
    cfg = cfg_of(bits, mode)
    st, ts = build(cfg, 2, 2, 5 * cfg.n_r + 7)
    check(cfg, st, ts, gq, Tq)


@pytest.mark.parametrize("bits, mode", KINDS, ids=KIDS)
@pytest.mark.parametrize("nw", [1, 2, 8])
def test_decode_warps(bits, mode, nw):
    """W_n warps share each page (Algorithm 1's cooperative max across them)."""
    cfg = cfg_of(bits, mode, nw)
    st, ts = build(cfg, 2, 2, 3 * cfg.n_r + 11, seed=nw)
    check(cfg, st, ts, 4, 1)
    check(cfg, st, ts, 16, 1)


@pytest.mark.parametrize("bits, mode", KINDS, ids=KIDS)
def test_lengths(bits, mode):
    """No page (the residual alone), no residual (pages alone), exactly one page."""
    cfg = cfg_of(bits, mode)
    for L in (cfg.n_r - 1, cfg.n_r, 2 * cfg.n_r, 1):
        st, ts = build(cfg, 1, 2, L, seed=L)
        check(cfg, st, ts, 4, 1)


@pytest.mark.parametrize("bits, mode", KINDS, ids=KIDS)
def test_many_pages_splits(bits, mode):
    """Enough pages that the plan splits every sequence over several blocks."""
    cfg = cfg_of(bits, mode, max_tokens=32768)
    st, ts = build(cfg, 2, 4, 48 * cfg.n_r + 33, seed=3)
    q = torch.zeros((2, 16, 1, D), dtype=torch.float16, device="cuda")
    n_split, pps, _, _ = BD.plan(cfg, ts, q)
    assert n_split > 1 and pps * n_split >= 48
    check(cfg, st, ts, 4, 1, scale=0.05)


@pytest.mark.parametrize("kind", ["outlier", "tiny_min"])
@pytest.mark.parametrize("bits, mode", KINDS, ids=KIDS)
def test_value_kinds(bits, mode, kind):
    cfg = cfg_of(bits, mode)
    st, ts = build(cfg, 2, 2, 4 * cfg.n_r + 3, kind=kind, seed=5)
    check(cfg, st, ts, 8, 1)


def test_tiny_min_params_are_flagged():
    """The 'tiny_min' cache really has pages whose params bd_unsafe2 flags (else its test would not reach
    the exact path): the NumPy model of the rule (tests/fast/test_bitdecoding_fma_rule.py) on its params."""
    from ..fast.test_bitdecoding_fma_rule import unsafe

    cfg = cfg_of(2, "channel")
    st, _ = build(cfg, 1, 1, cfg.n_r, kind="tiny_min")
    kp, vp = st.k_params[st.table[0, 0]], st.v_params[st.table[0, 0]]
    assert unsafe(kp[..., 0], kp[..., 1]).any() and unsafe(vp[..., 0], vp[..., 1]).any()


def test_reads_the_packed_words():
    """Flipping one code of one packed key word and one value word changes the kernel's output, and the
    reference's on the same modified cache agrees with it (the kernel reads the words, nothing else)."""
    cfg = cfg_of(2, "channel")
    st, ts = build(cfg, 1, 1, 2 * cfg.n_r, seed=7)
    before = check(cfg, st, ts, 4, 1)
    pid = int(st.table[0, 1])
    st.k_words[pid, 0, 3, 17] ^= np.uint16(0x3)
    st.v_words[pid, 0, 40, 5] ^= np.uint16(0x3 << 6)
    ts.k_words.copy_(torch.from_numpy(st.k_words))
    ts.v_words.copy_(torch.from_numpy(st.v_words))
    after = check(cfg, st, ts, 4, 1)
    assert not torch.equal(before, after)


def test_supported():
    cfg = cfg_of(2, "channel")
    _, ts = build(cfg, 1, 1, 10)
    q16 = torch.zeros((1, 4, 1, D), dtype=torch.float16, device="cuda")
    assert BD.supported(cfg, ts, q16)
    assert not BD.supported(cfg, ts, q16.float())
    assert not BD.supported(cfg, ts, q16.bfloat16())
    vg = R.BitDecodingConfig(bits=2, k_mode="channel", v_group=64)
    assert not BD.supported(vg, ts, q16)
    kt = R.BitDecodingConfig(bits=2, k_mode="tensor", k_group=64)
    assert not BD.supported(kt, ts, q16)
    kc = R.BitDecodingConfig(bits=2, k_mode="channel", k_group=32)      # smaller than a warp's 64 tokens
    assert not BD.supported(kc, ts, q16)


def test_cache_decode_runs_the_fused_kernel(monkeypatch):
    """End to end on the fast cache: ``kvq.fast.cupy.bitdecoding`` init / append (prefill, then decode steps)
    and decode_attention, which takes the fused kernel for fp16 q (counted) and falls back for fp32 q; both
    within the tolerance rule of the reference on the same appends."""
    from kvq.fast.cupy import bitdecoding as F

    calls = []
    real = BD.decode
    monkeypatch.setattr(BD, "decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = cfg_of(2, "channel")
    rng = np.random.default_rng(9)
    k = rng.standard_normal((2, 2, 2 * cfg.n_r + 3, D)).astype(np.float16)
    v = rng.standard_normal((2, 2, 2 * cfg.n_r + 3, D)).astype(np.float16)
    rs, fs = R.init(cfg, 2, 2, D), F.init(cfg, 2, 2, D)
    for a, b in ((0, cfg.n_r + 1), (cfg.n_r + 1, cfg.n_r + 2), (cfg.n_r + 2, 2 * cfg.n_r + 3)):
        R.append(cfg, rs, k[:, :, a:b], v[:, :, a:b])
        F.append(cfg, fs, torch.from_numpy(k[:, :, a:b]).cuda(), torch.from_numpy(v[:, :, a:b]).cuda())
    q = (rng.standard_normal((2, 8, 1, D)) * 0.5).astype(np.float16)
    o64, l64 = R.decode_attention(cfg, rs, q.astype(np.float64))
    o32, l32 = R.decode_attention(cfg, rs, q.astype(np.float32))
    out, lse = F.decode_attention(cfg, fs, torch.from_numpy(q).cuda())
    assert len(calls) == 1
    check_close(out, o64, o32, torch.float16, "out")
    check_close(lse, l64, l32, torch.float32, "lse")
    out, lse = F.decode_attention(cfg, fs, torch.from_numpy(q).cuda().float())
    assert len(calls) == 1 and out.dtype == torch.float32
    check_close(out, o64, o32, torch.float32, "out (fp32 q: the fallback)")
