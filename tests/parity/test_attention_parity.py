"""kvq.fast.<backend>.attention against kvq.reference.attention under the tolerance rule (contract rule 7).

Decode attention is an order-dependent reduction, so the fast result is compared with the float64
truth (the reference run on float64 copies of the same inputs): its max error may be at most twice
that of the float32 reference (a different summation order) plus one rounding step of the output
dtype at the output's magnitude (``tolerance.check_close``). Cases: several segments, empty ones, GQA
ratios 1 / 4 / 8, T_q 1 and 2, D 64 / 128 / 256, odd sequence lengths, strided K / V, fp16 / bf16 / fp32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvq.fast as F
from kvq.reference import attention as RA

from .tolerance import check_close

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
# CPU (interpreter) sequence length -> GPU sequence length
GPU_T = {0: 0, 1: 1, 5: 5, 37: 1000, 120: 777, 200: 2047, 250: 9001, 300: 4133}

# (dtype, GQA ratio H_q / H_kv, T_q, D, segment lengths, strided K / V)
CASES = [
    (FP16, 1, 1, 64, (37,), False),
    (FP16, 4, 1, 128, (300,), False),
    (FP16, 8, 2, 64, (1, 0, 200), False),
    (FP16, 4, 1, 64, (120, 37), True),
    (FP16, 4, 2, 256, (37,), False),
    (BF16, 4, 2, 64, (37, 120), False),
    (BF16, 1, 1, 128, (0, 250), True),
    (FP32, 8, 1, 64, (300,), False),
    (FP32, 4, 2, 128, (5, 37, 0), False),
]


def _case_id(c):
    dt, r, tq, d, segs, strided = c
    return f"{str(dt)[6:]}-gqa{r}-tq{tq}-d{d}-T{'+'.join(map(str, segs))}{'-strided' if strided else ''}"


def _attention(backend):
    return F.backend_module("attention", backend)


def _tensor(rng, shape, dtype, device, strided=False):
    """Random N(0, 1) values in dtype; strided: a (B, T, H, D) buffer seen as (B, H, T, D), or a slice
    of a longer (B, H, T + 7, D) cache."""
    B, H, T, D = shape
    if strided == "bthd":
        base = torch.from_numpy(rng.standard_normal((B, T, H, D)).astype(np.float32)).to(dtype)
        return base.permute(0, 2, 1, 3).to(device)
    if strided == "slice":
        base = torch.from_numpy(rng.standard_normal((B, H, T + 7, D)).astype(np.float32)).to(dtype)
        return base.to(device)[:, :, 3:3 + T]
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype).to(device)


def _np(t, dtype):
    return t.detach().cpu().to(torch.float64 if dtype == np.float64 else torch.float32).numpy().astype(dtype)


def _inputs(case, device, seed=0):
    dtype, ratio, T_q, D, segs, strided = case
    rng = np.random.default_rng(seed)
    B, H_kv = 2, 2
    H_q = ratio * H_kv
    if device == "cuda":
        segs = tuple(GPU_T[t] for t in segs)
        B, H_kv, H_q = 3, 4, 4 * ratio
    q = _tensor(rng, (B, H_q, T_q, D), dtype, device)
    segments = []
    for i, T in enumerate(segs):
        mode = (("bthd", "slice")[i % 2]) if strided else False
        segments.append((_tensor(rng, (B, H_kv, T, D), dtype, device, mode),
                         _tensor(rng, (B, H_kv, T, D), dtype, device, mode)))
    return q, segments


def _truth_and_ref32(q, segments, scale=None):
    """float64 truth and float32 reference of the reference tier on the same (exactly converted) values."""
    q64 = _np(q, np.float64)
    s64 = [(_np(k, np.float64), _np(v, np.float64)) for k, v in segments]
    q32 = _np(q, np.float32)
    s32 = [(_np(k, np.float32), _np(v, np.float32)) for k, v in segments]
    return RA.decode_attention(q64, s64, scale=scale), RA.decode_attention(q32, s32, scale=scale)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_decode_attention(fast_target, case):
    backend, device = fast_target
    A = _attention(backend)
    q, segments = _inputs(case, device, seed=len(case[4]) + case[3])
    out, lse = A.decode_attention(q, segments)
    assert out.dtype == q.dtype and tuple(out.shape) == tuple(q.shape) and out.device == q.device
    assert lse.dtype == torch.float32 and tuple(lse.shape) == tuple(q.shape[:3])
    (o64, l64), (o32, l32) = _truth_and_ref32(q, segments)
    check_close(out, o64, o32, q.dtype, "out")
    check_close(lse, l64, l32, torch.float32, "lse")


@pytest.mark.parametrize("dtype", [FP16, BF16, FP32], ids=["float16", "bfloat16", "float32"])
def test_partial_attention_and_scale(fast_target, dtype):
    """partial_attention over one segment, with an explicit scale."""
    backend, device = fast_target
    A = _attention(backend)
    q, [(k, v)] = _inputs((dtype, 4, 1, 64, (200,), False), device, seed=11)
    o, lse = A.partial_attention(q, k, v, scale=0.3)
    (o64, l64), (o32, l32) = _truth_and_ref32(q, [(k, v)], scale=0.3)
    check_close(o, o64, o32, dtype, "o")
    check_close(lse, l64, l32, torch.float32, "lse")


def test_empty_segments(fast_target):
    """Only empty segments: o = 0 and lse = -inf, exactly; an empty segment next to others changes nothing."""
    backend, device = fast_target
    A = _attention(backend)
    q, segs = _inputs((FP16, 4, 2, 64, (0, 0), False), device)
    out, lse = A.decode_attention(q, segs)
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())
    o, l = A.partial_attention(q, *segs[0])
    assert bool((o == 0).all()) and bool((l == float("-inf")).all())
    q, segs = _inputs((FP16, 4, 1, 64, (37,), False), device, seed=3)
    empty = (segs[0][0][:, :, :0], segs[0][1][:, :, :0])
    a = A.decode_attention(q, segs)
    b = A.decode_attention(q, [empty, segs[0], empty])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [FP16, FP32], ids=["float16", "float32"])
def test_merge(fast_target, dtype):
    """merge of given partials (one empty) against the reference merge of the same partials."""
    backend, device = fast_target
    A = _attention(backend)
    rng = np.random.default_rng(5)
    shape = (2, 3, 2, 64)
    parts_np = []
    for i in range(3):
        o = rng.standard_normal(shape).astype(np.float32)
        lse = (3 * rng.standard_normal(shape[:-1])).astype(np.float32)
        if i == 1:
            o[:] = 0.0
            lse[:] = -np.inf
        parts_np.append((o, lse))
    parts_t = [(torch.from_numpy(o).to(dtype).to(device), torch.from_numpy(lse).to(device)) for o, lse in parts_np]
    o_f, l_f = A.merge(parts_t)
    assert o_f.dtype == dtype and l_f.dtype == torch.float32
    truth = RA.merge([(_np(o, np.float64), _np(l, np.float64)) for o, l in parts_t])
    ref32 = RA.merge([(_np(o, np.float32), _np(l, np.float32)) for o, l in parts_t])
    check_close(o_f, truth[0], ref32[0], dtype, "o")
    check_close(l_f, truth[1], ref32[1], torch.float32, "lse")
    # every partial empty in a row -> o = 0, lse = -inf
    empty = [(torch.zeros(shape, dtype=dtype, device=device),
              torch.full(shape[:-1], float("-inf"), device=device))] * 2
    o_e, l_e = A.merge(empty)
    assert bool((o_e == 0).all()) and bool((l_e == float("-inf")).all())


@pytest.mark.parametrize("S, D", [(1, 16), (9, 128), (17, 64), (40, 128)])
def test_merge_many_partials(fast_target, S, D):
    """merge of S partials (some rows with -inf partials among finite ones) against the reference: the
    CuPy merge takes 1, 2 or 4 warps per row by S (attention.merge_warps_per_row) in chunks of 8 partials,
    lanes covering D with 1, 2 or 4 dims each."""
    backend, device = fast_target
    A = _attention(backend)
    rng = np.random.default_rng(S * 1000 + D)
    shape = (3, 5, D)
    parts = []
    for i in range(S):
        o = rng.standard_normal(shape).astype(np.float32)
        lse = (4 * rng.standard_normal(shape[:-1])).astype(np.float32)
        lse[i % 3, i % 5] = -np.inf                   # a partial with no keys in some row
        parts.append((torch.from_numpy(o).to(device), torch.from_numpy(lse).to(device)))
    o_f, l_f = A.merge(parts)
    truth = RA.merge([(_np(o, np.float64), _np(l, np.float64)) for o, l in parts])
    ref32 = RA.merge([(_np(o, np.float32), _np(l, np.float32)) for o, l in parts])
    check_close(o_f, truth[0], ref32[0], FP32, f"o (S={S}, D={D})")
    check_close(l_f, truth[1], ref32[1], FP32, f"lse (S={S}, D={D})")


@pytest.mark.gpu
@pytest.mark.parametrize("S", [3, 12, 33])
def test_cupy_merge_head_dim_beyond_256(S):
    """CuPy merge with D = 300 (more than 32 lanes x 8 dims: the grid's second dimension takes dims 256-299)
    and fp16 partials, against the reference."""
    import kvq.fast.cupy.attention as CA
    rng = np.random.default_rng(S)
    shape = (2, 7, 300)
    parts = [(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).half().cuda(),
              torch.from_numpy((2 * rng.standard_normal(shape[:-1])).astype(np.float32)).cuda()) for _ in range(S)]
    o_f, l_f = CA.merge(parts)
    assert o_f.dtype == FP16
    truth = RA.merge([(_np(o, np.float64), _np(l, np.float64)) for o, l in parts])
    ref32 = RA.merge([(_np(o, np.float32), _np(l, np.float32)) for o, l in parts])
    check_close(o_f, truth[0], ref32[0], FP16, "o")
    check_close(l_f, truth[1], ref32[1], FP32, "lse")


def test_merge_of_partials_equals_decode(fast_target):
    """decode over two segments == merge of partial_attention over each (float32, within tolerance)."""
    backend, device = fast_target
    A = _attention(backend)
    q, segs = _inputs((FP32, 4, 1, 64, (37, 120), False), device, seed=8)
    o_m, l_m = A.merge([A.partial_attention(q, k, v) for k, v in segs])
    (o64, l64), (o32, l32) = _truth_and_ref32(q, segs)
    check_close(o_m, o64, o32, FP32, "merged o")
    check_close(l_m, l64, l32, FP32, "merged lse")


def test_errors(fast_target):
    backend, device = fast_target
    A = _attention(backend)
    q, [(k, v)] = _inputs((FP16, 4, 1, 64, (37,), False), device)
    with pytest.raises(ValueError, match="at least one"):
        A.decode_attention(q, [])
    with pytest.raises(ValueError, match="GQA"):
        A.decode_attention(q[:, :3], [(k, v)])
    with pytest.raises(ValueError, match="same shape"):
        A.decode_attention(q, [(k, v[:, :, :5])])
    with pytest.raises(ValueError, match="head dims"):
        A.decode_attention(q[..., :32], [(k, v)])
    with pytest.raises(ValueError, match="4 dimensions"):
        A.decode_attention(q[0], [(k, v)])
    with pytest.raises(ValueError, match="pair"):
        A.decode_attention(q, [k])
    with pytest.raises(TypeError):
        A.decode_attention(q.double(), [(k.double(), v.double())])
    with pytest.raises(TypeError):
        A.decode_attention(q, [(k.float(), v.float())])
    q48, k48 = q[..., :48], k[..., :48]
    with pytest.raises(ValueError, match="D=48"):
        A.decode_attention(q48, [(k48, k48)])
    with pytest.raises(ValueError, match="at least one"):
        A.merge([])
    o, lse = A.partial_attention(q, k, v)
    with pytest.raises(ValueError, match="lse"):
        A.merge([(o, lse[:, :1])])
