"""Smoke test of the CuPy backend on a GPU: each function once against kvq.reference, small inputs.

Meant for the first run on a device (fast to read when something is off): every failure message says
which call, what differed, where, and the first differing values. The full bit-exact parity suite is
tests/parity (parametrized over backends).

    pytest -m gpu tests/fast/test_cupy_smoke_gpu.py -x -q
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvq.reference.attention as RA  # noqa: E402
import kvq.reference.packing as RP  # noqa: E402
import kvq.reference.quant as RQ  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(scope="module")
def cp_mods():
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kvq.fast.cupy import attention, packing, quant

    return quant, packing, attention


def _np(t):
    """A torch tensor as the reference sees it (bf16 as fp32 values, which are exact)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _same(what, got, want):
    """Bit-exact comparison (NaN patterns included) with a readable message."""
    got = _np(got) if isinstance(got, torch.Tensor) else np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, reference {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, reference {want.dtype}"
    bad = _bits(got) != _bits(want)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} differ; first at {idx}: "
                             f"got {got[idx]!r}, reference {want[idx]!r}")


def _x(shape, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    x[..., :1] = x[..., :1].round()                    # some exact ties
    return x.to(DTYPES[dtype]).cuda()


# (shape, axis, group) — rows (inner == 1, vector and scalar paths) and cols (inner > 1, odd inner)
QUANT_CASES = [
    ((3, 5, 128), -1, 128),      # rows, 16-byte loads, a team of 4 lanes per group
    ((2, 4, 40), -1, 40),        # rows, G = 40
    ((2, 3, 36), -1, 12),        # rows, G*2 bytes not a multiple of 16: scalar path
    ((2, 2, 96, 8), 2, 32),      # cols, per-channel keys (inner 8, even: two columns per thread)
    ((3, 64, 7), 1, 16),         # cols, odd inner
    ((1, 2, 2048), -1, 2048),    # rows, a long group (chunks re-read past the register cache)
    ((1, 1024, 5), 1, 1024),     # cols, a long group
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape,axis,G", QUANT_CASES)
def test_quantize_dequantize(cp_mods, dtype, shape, axis, G):
    quant, _, _ = cp_mods
    x = _x(shape, dtype)
    for bits in (2, 3, 4, 8):
        for sym in (False, True):
            for meta in (np.float16, np.float32):
                what = f"quantize({dtype}, shape={shape}, axis={axis}, G={G}, bits={bits}, sym={sym}, meta={meta.__name__})"
                codes, scale, mn = quant.quantize(x, bits, G, axis, meta, symmetric=sym)
                rc, rs, rm = RQ.quantize(_np(x), bits, G, axis, meta, symmetric=sym)
                _same(what + " codes", codes, rc)
                _same(what + " scale", scale, rs)
                _same(what + " mn", mn, rm)
                for out in ("float16", "bfloat16", "float32"):
                    y = quant.dequantize(codes, scale, mn, G, axis, out)
                    assert y.dtype == DTYPES[out], f"dequantize out dtype {y.dtype}, wanted {out}"
                    _same(f"dequantize({what}, out={out})", y, RQ.dequantize(rc, rs, rm, G, axis, out))


@pytest.mark.parametrize("shape,axis,G", QUANT_CASES + [((2, 3, 12), -1, 6), ((2, 6, 5), 1, 2)])
def test_pack_family(cp_mods, shape, axis, G):
    """pack / unpack / quantize_pack / unpack_dequantize (G = 6 and 2 straddle bytes at 2 bits)."""
    _, packing, _ = cp_mods
    x = _x(shape, "float16", seed=1)
    for bits in (2, 4, 8):
        what = f"(shape={shape}, axis={axis}, G={G}, bits={bits})"
        if x.shape[axis] % (8 // bits):
            continue
        rng = np.random.default_rng(bits)
        codes_np = rng.integers(0, 2 ** bits, size=shape, dtype=np.uint8)
        codes = torch.from_numpy(codes_np).cuda()
        packed = packing.pack(codes, bits, axis)
        _same("pack" + what, packed, RP.pack(codes_np, bits, axis))
        _same("unpack" + what, packing.unpack(packed, bits, axis), codes_np)
        p, s, m = packing.quantize_pack(x, bits, G, axis)
        rp, rs, rm = RP.quantize_pack(_np(x), bits, G, axis)
        _same("quantize_pack" + what + " packed", p, rp)
        _same("quantize_pack" + what + " scale", s, rs)
        _same("quantize_pack" + what + " mn", m, rm)
        for out in ("float16", "bfloat16", "float32"):
            _same(f"unpack_dequantize{what} out={out}", packing.unpack_dequantize(p, s, m, bits, G, axis, out),
                  RP.unpack_dequantize(rp, rs, rm, bits, G, axis, out))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_quantize_scales_and_ties(cp_mods, dtype):
    """Groups whose scales span the whole exponent range (subnormal to huge stored scales, where the
    kernel's reciprocal shortcut is off) and groups full of exact ties: codes must match bit for bit."""
    quant, packing, _ = cp_mods
    g = torch.Generator().manual_seed(7)
    n_groups, G = 512, 32
    x = torch.randn(n_groups, G, generator=g, dtype=torch.float64)
    if dtype == "float32":
        e = torch.randint(-140, 120, (n_groups, 1), generator=g).double()
    else:
        e = torch.randint(-24, 14, (n_groups, 1), generator=g).double()
    x = x * torch.pow(2.0, e)
    ties = torch.randint(0, 16, (n_groups // 4, G), generator=g).double() * 0.5       # k / 2: exact ties
    x[: n_groups // 4] = ties * torch.pow(2.0, e[: n_groups // 4])
    x = x.to(DTYPES[dtype]).cuda()
    xn = _np(x)
    assert np.isfinite(xn).all()
    for bits in (2, 3, 4, 8):
        for sym in (False, True):
            for meta in ((np.float32,) if dtype == "float32" else (np.float32, np.float16)):
                what = f"quantize({dtype}, bits={bits}, sym={sym}, meta={meta.__name__})"
                try:
                    rc, rs, rm = RQ.quantize(xn, bits, G, -1, meta, symmetric=sym)
                except ValueError:                     # the reference refuses an overflowing scale
                    continue
                codes, scale, mn = quant.quantize(x, bits, G, -1, meta, symmetric=sym)
                _same(what + " codes", codes, rc)
                _same(what + " scale", scale, rs)
                _same(what + " mn", mn, rm)
                for axis_x in (x.T.contiguous(),):       # the same groups along axis 0 (cols kernel)
                    c2, s2, m2 = quant.quantize(axis_x, bits, G, 0, meta, symmetric=sym)
                    _same(what + " codes (axis 0)", c2.T, rc)
                    _same(what + " scale (axis 0)", s2.T, rs)


def test_nan_raises(cp_mods):
    quant, packing, _ = cp_mods
    x = _x((2, 64), "float16")
    x[1, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quant.quantize(x, 2, 32)
    x = _x((64, 3), "bfloat16")
    x[7, 2] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        packing.quantize_pack(x, 2, 32, axis=0)


def _attn_close(what, got, want, ref32):
    """Rule 7: |fast - truth| <= 2 |ref32 - truth| + one rounding step of the output dtype."""
    got = _np(got).astype(np.float64)
    step = np.abs(want).max() * (2.0 ** -7 if "bfloat16" in what else 2.0 ** -10 if "float16" in what
                                 else 2.0 ** -22)
    err = np.abs(got - want).max()
    budget = 2 * np.abs(ref32 - want).max() + step
    assert err <= budget, f"{what}: max error {err:.3g} exceeds {budget:.3g} (float32 reference error " \
                          f"{np.abs(ref32 - want).max():.3g}); first values got {got.ravel()[:4]}, " \
                          f"truth {want.ravel()[:4]}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("D", [64, 128, 256])
def test_decode_attention(cp_mods, dtype, D):
    _, _, attention = cp_mods
    if dtype == "float32" and D == 256:
        pytest.skip("float32 takes D <= 128")
    B, H_q, H_kv, T_q = 2, 8, 2, 2
    q = _x((B, H_q, T_q, D), dtype, seed=2, scale=1.0)
    segs = [(_x((B, H_kv, T, D), dtype, seed=10 + T, scale=1.0), _x((B, H_kv, T, D), dtype, seed=20 + T))
            for T in (37, 0, 300)]
    out, lse = attention.decode_attention(q, segs)
    assert out.dtype == q.dtype and lse.dtype == torch.float32, (out.dtype, lse.dtype)
    q64 = _np(q).astype(np.float64)
    s64 = [(_np(k).astype(np.float64), _np(v).astype(np.float64)) for k, v in segs]
    want_o, want_l = RA.decode_attention(q64, s64)
    ref_o, ref_l = RA.decode_attention(_np(q).astype(np.float32),
                                       [(_np(k).astype(np.float32), _np(v).astype(np.float32)) for k, v in segs])
    _attn_close(f"decode_attention o ({dtype}, D={D})", out, want_o, ref_o)
    _attn_close(f"decode_attention lse ({dtype}, D={D})", lse, want_l, ref_l)
    o1, l1 = attention.partial_attention(q, *segs[2])
    o2, l2 = attention.partial_attention(q, *segs[0])
    e_o, e_l = attention.partial_attention(q, *segs[1])
    assert bool((e_o == 0).all()) and bool(torch.isinf(e_l).all()), "empty segment: o = 0, lse = -inf"
    mo, ml = attention.merge([(o1, l1), (e_o, e_l), (o2, l2)])
    _attn_close(f"merge o ({dtype}, D={D})", mo, want_o, ref_o)
    _attn_close(f"merge lse ({dtype}, D={D})", ml, want_l, ref_l)


def test_decode_attention_strided_gqa(cp_mods):
    """Non-contiguous K / V views (a cache slice), MHA and GQA 8:1, T_q = 3 (two query tiles)."""
    _, _, attention = cp_mods
    for H_q, H_kv in ((4, 4), (16, 2)):
        D = 128
        q = _x((1, H_q, 3, D), "float16", seed=3, scale=1.0)
        kc = _x((1, H_kv, 1000, D), "float16", seed=4, scale=1.0)
        vc = _x((1, H_kv, 1000, D), "float16", seed=5)
        k, v = kc[:, :, 100:777], vc[:, :, 100:777]
        out, lse = attention.decode_attention(q, [(k, v)])
        want_o, want_l = RA.decode_attention(_np(q).astype(np.float64),
                                             [(_np(k).astype(np.float64), _np(v).astype(np.float64))])
        ref_o, ref_l = RA.decode_attention(_np(q).astype(np.float32),
                                           [(_np(k).astype(np.float32), _np(v).astype(np.float32))])
        _attn_close(f"strided decode o (float16, H_q={H_q}, H_kv={H_kv})", out, want_o, ref_o)
        _attn_close(f"strided decode lse (float16, H_q={H_q}, H_kv={H_kv})", lse, want_l, ref_l)
