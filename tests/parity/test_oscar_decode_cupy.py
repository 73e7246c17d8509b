"""The CuPy fused OSCAR decode (kvq.fast.cupy.oscar_decode: the tensor-core kernel oscar_decode_mma over the
packed pages, the FP16 sink and window through oscar_tail_attn, one launch) against
kvq.reference.oscar.decode_attention, on the GPU (``pytest -m gpu``).

out (in q's dtype) and lse (float32) follow the tolerance rule (``tolerance.check_close``) against the
reference on float64 q (truth) and float32 q (ref32), as in test_oscar_decode_parity.py (whose cache
builders this file reuses: the fast state is the reference state's arrays). Cases: 4 and 8 query rows
per KV head (GQA 4 and 8, T_q 2), bf16 q, a history shorter than a page, no history at all, large
magnitudes, the single-stream setting, and the configurations that fall back to the unfused path
(float32 q, G < D); each checks which path ran.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq.reference import oscar as RO

from .test_oscar_decode_parity import BASE, ROTATE_CASES, _check, _q, _state, check_rotate_heads
from .tolerance import check_close

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture
def mods():
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kvq.fast.cupy import oscar, oscar_decode
    return oscar, oscar_decode


@pytest.fixture
def fused_calls(mods, monkeypatch):
    """How many decodes went through the tensor-core path (``oscar_decode.decode`` wrapped)."""
    _, OD = mods
    calls = []
    inner = OD.decode

    def counting(*a, **kw):
        calls.append(1)
        return inner(*a, **kw)

    monkeypatch.setattr(OD, "decode", counting)
    return calls


# (id, q dtype, GQA ratio, T_q, T)
CASES = [("fp16-gqa4", torch.float16, 4, 1, 3001), ("fp16-gqa8", torch.float16, 8, 1, 2222),
         ("fp16-gqa4-tq2", torch.float16, 4, 2, 1900), ("bf16-gqa4", torch.bfloat16, 4, 1, 1500),
         ("fp16-gqa1", torch.float16, 1, 1, 999)]


@pytest.mark.parametrize("c", CASES, ids=[c[0] for c in CASES])
def test_decode_attention(mods, fused_calls, c):
    F, _ = mods
    _, dtype, ratio, T_q, T = c
    cfg, calib, rs, fs = _state(DEV, 1, T, seed=T)
    assert RO.counts(cfg, T)["n_pages"] >= 2
    q = _q(DEV, ratio, T_q, dtype, seed=T + 1)
    out, lse = F.decode_attention(cfg, calib, fs, q)
    _check(cfg, calib, rs, out, lse, q)
    out2, _ = F.decode_attention(cfg, calib, fs, q, scale=0.3, rotate_back=False)
    o64, _ = RO.decode_attention(cfg, calib, rs, q.cpu().double().numpy(), scale=0.3, rotate_back=False)
    o32, _ = RO.decode_attention(cfg, calib, rs, q.cpu().float().numpy(), scale=0.3, rotate_back=False)
    check_close(out2, o64, o32, dtype, "out (scale 0.3, rotated frame)")
    assert len(fused_calls) == 2


def test_history_shorter_than_a_page(mods, fused_calls):
    """Three history tokens in one partly filled page (the rest of the page masked)."""
    F, _ = mods
    cfg = RO.OSCARConfig(**BASE[DEV])
    T = cfg.sink + cfg.window + 3
    cfg, calib, rs, fs = _state(DEV, 1, T, seed=5)
    assert RO.counts(cfg, T)["n_hist"] == 3
    q = _q(DEV, 4, 2, torch.float16, seed=6)
    out, lse = F.decode_attention(cfg, calib, fs, q)
    _check(cfg, calib, rs, out, lse, q)
    assert len(fused_calls) == 1


@pytest.mark.parametrize("T", ["sink", "sink+window"])
def test_no_pages(mods, fused_calls, T):
    """Only FP16 tokens: the split kernel alone, no page kernel."""
    F, _ = mods
    cfg = RO.OSCARConfig(**BASE[DEV])
    n = cfg.sink - 1 if T == "sink" else cfg.sink + cfg.window
    cfg, calib, rs, fs = _state(DEV, 1, n, seed=7)
    q = _q(DEV, 4, 1, torch.float16, seed=8)
    out, lse = F.decode_attention(cfg, calib, fs, q)
    _check(cfg, calib, rs, out, lse, q)
    assert len(fused_calls) == 1


def test_decode_large_magnitudes(mods, fused_calls):
    """Keys and values up to ~3e4, |q| up to ~1e3 and scale 1e-5: q~ and the value scales are normalized
    per row and per page, nothing overflows fp16."""
    F, _ = mods
    cfg, calib, rs, fs = _state(DEV, 1, 1500, seed=9, big=True)
    assert float(np.abs(rs.win_k.astype(np.float32)).max()) > 5e3
    q = _q(DEV, 4, 1, torch.float16, seed=10, mag=300.0)
    out, lse = F.decode_attention(cfg, calib, fs, q, scale=1e-5)
    _check(cfg, calib, rs, out, lse, q, scale=1e-5)
    assert len(fused_calls) == 1


def test_one_stream(mods, fused_calls, monkeypatch):
    """``oscar_decode.Knobs(paged=paged.Knobs(side_stream=False))``: the FP16 segments after the page kernel,
    on one stream (the decode's default knobs replaced: ``decode`` reads ``DEFAULT_KNOBS`` per call)."""
    F, OD = mods
    from kvq.fast.cupy import paged
    monkeypatch.setattr(OD, "DEFAULT_KNOBS", OD.Knobs(paged=paged.Knobs(side_stream=False)))
    cfg, calib, rs, fs = _state(DEV, 1, 2500, seed=11)
    q = _q(DEV, 4, 1, torch.float16, seed=12)
    out, lse = F.decode_attention(cfg, calib, fs, q)
    _check(cfg, calib, rs, out, lse, q)
    assert len(fused_calls) == 1


@pytest.mark.parametrize("prec,first", [(1, True), (1, False), (2, True), (2, False)])
def test_tail_knobs(mods, fused_calls, monkeypatch, prec, first):
    """``oscar_decode.Knobs``: the sink / window kernel in double (1) or four-chain fp32 (2, the default)
    arithmetic, launched before or after the page kernel; every setting meets the tolerance rule, and
    the two launch orders give the same bits (the partials do not depend on which kernel starts first)."""
    F, OD = mods
    cfg, calib, rs, fs = _state(DEV, 1, 2600, seed=17)
    q = _q(DEV, 8, 1, torch.float16, seed=18)
    # (the decode's default knobs replaced: ``decode`` reads ``DEFAULT_KNOBS`` per call)
    monkeypatch.setattr(OD, "DEFAULT_KNOBS", OD.Knobs(tail_prec=prec, tail_first=first))
    out, lse = F.decode_attention(cfg, calib, fs, q)
    _check(cfg, calib, rs, out, lse, q)
    monkeypatch.setattr(OD, "DEFAULT_KNOBS", OD.Knobs(tail_prec=prec, tail_first=not first))
    out2, lse2 = F.decode_attention(cfg, calib, fs, q)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    with pytest.raises(ValueError, match="tail_prec"):
        OD.Knobs(tail_prec=3)                  # refused when made: it never reaches a decode
    assert len(fused_calls) == 2


def test_folded_output_dtype(mods):
    """``rotate_back=False`` (a W_O with R_V^T folded in): the merge writes q's dtype itself; the result
    is the fp32 merge rounded once, i.e. the fp32 decode's output cast."""
    F, _ = mods
    cfg, calib, rs, fs = _state(DEV, 1, 2100, seed=19)
    q = _q(DEV, 4, 1, torch.float16, seed=20)
    out, lse = F.decode_attention(cfg, calib, fs, q, rotate_back=False)
    from kvq.fast.cupy import oscar_decode
    RK = torch.from_numpy(np.ascontiguousarray(calib.R_K, dtype=np.float32)).to(DEV)   # as the decode's copy
    qr = oscar_decode.rotate_heads(q, RK, torch.float32)
    o32, l32 = oscar_decode.decode(cfg, fs, qr)
    assert out.dtype == torch.float16 and o32.dtype == torch.float32
    assert torch.equal(out, o32.to(torch.float16)) and torch.equal(lse, l32)


@pytest.mark.parametrize("one_launch", [True, False, None])
@pytest.mark.parametrize("ratio,T_q,out_dt,r_dt,per_head", [(4, 1, torch.float16, torch.float32, True),
                                                            (2, 3, torch.float32, torch.float64, False),
                                                            (8, 1, torch.bfloat16, torch.float32, False)])
def test_merge_rotate(mods, monkeypatch, ratio, T_q, out_dt, r_dt, per_head, one_launch):
    """``decode(..., R_out=R)`` gives the bits of the merge to fp32 followed by ``rotate_heads``, whether
    the merge rotates the output in its own launch (oscar_merge_rotate, ``Knobs.merge_rotate`` True),
    the two run one after the other (False) or the size rule picks (None), for a per-KV-head or one
    shared R (fp32 or float64), GQA groups and several query tokens (row -> head h -> R[h // G_q]); the
    lse is the merge's either way."""
    _, OD = mods
    monkeypatch.setattr(OD, "DEFAULT_KNOBS", OD.Knobs(merge_rotate=one_launch))
    cfg, calib, rs, fs = _state(DEV, 1, 2500, seed=31)
    q = _q(DEV, ratio, T_q, torch.float16, seed=32)
    RK = torch.from_numpy(np.ascontiguousarray(calib.R_K, dtype=np.float32)).to(DEV)
    qr = OD.rotate_heads(q, RK, torch.float32)
    RVt = torch.from_numpy(np.ascontiguousarray(np.swapaxes(calib.R_V, -1, -2))).to(DEV).to(r_dt)
    R = RVt if per_head else RVt[1]
    assert OD.supported(cfg, fs, qr)
    o32, l32 = OD.decode(cfg, fs, qr)
    out, lse = OD.decode(cfg, fs, qr, out_dtype=out_dt, R_out=R)
    assert out.dtype == out_dt and out.shape == q.shape and torch.equal(lse, l32)
    assert torch.equal(out, OD.rotate_heads(o32, R, out_dt))
    assert not torch.equal(out, o32.to(out_dt))                     # (it did rotate)
    with pytest.raises(ValueError, match="float64 or float32 R"):
        OD.decode(cfg, fs, qr, R_out=R.half())


@pytest.mark.parametrize("what", ["fp32-q", "G64", "4bit"])
def test_unfused_fallback(mods, fused_calls, what):
    """float32 q (the precise path), groups smaller than D and 4-bit codes dequantize the history and
    attend in fp32; same tolerance rule."""
    F, _ = mods
    ng, over, dtype = {"fp32-q": (1, {}, torch.float32), "G64": (2, {}, torch.float16),
                       "4bit": (1, dict(bits=4), torch.float16)}[what]
    cfg, calib, rs, fs = _state(DEV, ng, 1300, seed=13, **over)
    q = _q(DEV, 4, 1, dtype, seed=14)
    out, lse = F.decode_attention(cfg, calib, fs, q)
    _check(cfg, calib, rs, out, lse, q)
    assert fused_calls == []


def test_cuda_graph_capture(mods):
    """decode_attention (fused path) makes no host-to-device copy: with validation off (its checks read
    values back) it captures into a CUDA graph, and a replay gives the eager result."""
    import kvq.fast as fast
    F, _ = mods
    cfg, calib, rs, fs = _state(DEV, 1, 1400, seed=15)
    q = _q(DEV, 4, 1, torch.float16, seed=16)
    out0, lse0 = F.decode_attention(cfg, calib, fs, q)            # warm-up: compile, copy rotations
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with fast.validation(False), torch.cuda.graph(g):
        out, lse = F.decode_attention(cfg, calib, fs, q)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.parametrize("in_dt,out_dt,per_head", ROTATE_CASES)
def test_rotate_heads(mods, in_dt, out_dt, per_head):
    """oscar_decode.rotate_heads (float64 sums, one launch): ``check_rotate_heads`` (the Triton file's)."""
    check_rotate_heads(mods[1], DEV, 128, in_dt, out_dt, per_head)
