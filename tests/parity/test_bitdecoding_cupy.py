"""kvq.fast.cupy.bitdecoding (the Residual Kernel and the page dequantization) against kvq.reference.bitdecoding.

Bit-exact: the packed words and the half2 params of every page equal the reference's bytes, the unpacked
codes equal the reference's, and the dequantized fp16 pages are the same bits. Value kinds stress the
contract: an outlier channel, constant groups (scale 0, among them -0.0), exact ties ((x - mn) / scale =
k + 0.5 with power-of-two scales), float32 input, and groups that span warps (channel groups of more than
8 R tokens). Runs on the GPU (``pytest -m gpu``); CI compiles the CUDA source (tests/fast/test_cuda_compile.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq.reference import bitdecoding as R

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: run `pytest -m gpu` on the device", allow_module_level=True)

from kvq.fast.cupy import bitdecoding as F  # noqa: E402

CFGS = [R.BitDecodingConfig(bits=b, k_mode=m, warps_n=nw, k_group=kg, v_group=vg)
        for b, m, nw, kg, vg in [(4, "channel", 4, 128, 128), (2, "channel", 4, 128, 128), (4, "tensor", 4, 128, 128),
                                 (2, "tensor", 4, 128, 128), (2, "channel", 4, 32, 32), (4, "channel", 4, 8, 64),
                                 (2, "channel", 1, 64, 64), (4, "tensor", 2, 32, 16), (2, "tensor", 8, 64, 128),
                                 (4, "channel", 8, 256, 32), (2, "channel", 2, 128, 128)]]
IDS = [f"K{c.k_mode[0].upper()}{c.bits}-W{c.warps_n}-kg{c.k_group}-vg{c.v_group}" for c in CFGS]
KINDS = ("normal", "outlier", "const", "ties", "negzero")


def make(cfg, kind, lead=(2, 3), D=128, dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, cfg.n_r, D)).astype(np.float32)
    if kind == "outlier":
        x[..., 7] *= 40
    elif kind == "const":
        x[..., :, :16] = 0.75
        x[..., :16, :] = -0.0
        x[..., 0, :] = 2.5
    elif kind == "ties":                      # codes land exactly on k + 0.5 with mn = 0, scale 2^-3
        qmax = 2**cfg.bits - 1
        k = rng.integers(0, qmax, x.shape)
        x = ((k + 0.5) * 0.125).astype(np.float32)
        x[..., ::8, :] = 0.0                  # every group holds its min 0 and its max qmax / 8
        x[..., 1::8, :] = qmax * 0.125
        x[..., :, ::8] = 0.0
        x[..., :, 1::8] = qmax * 0.125
    elif kind == "negzero":
        x[..., ::3, ::5] = -0.0
    return x.astype(dtype)


def u16(t):
    return t.view(torch.int16).cpu().numpy().view(np.uint16)


def same_bits(a_t, b_np, what):
    a = u16(a_t) if a_t.dtype == torch.uint16 else a_t.cpu().numpy()
    b = np.asarray(b_np)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    if a.dtype == np.float16:
        a, b = a.view(np.uint16), b.view(np.uint16)
    bad = np.flatnonzero(a.ravel() != b.ravel())
    assert bad.size == 0, f"{what}: {bad.size} of {a.size} differ, first at {np.unravel_index(bad[0], a.shape)}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cfg", CFGS, ids=IDS)
def test_pack_and_dequantize_are_bit_exact(cfg, kind):
    D = 128
    k = make(cfg, kind, D=D, seed=1)
    v = make(cfg, kind, D=D, seed=2)
    kw, kp = F.pack_keys(cfg, torch.from_numpy(k).cuda())
    vw, vp = F.pack_values(cfg, torch.from_numpy(v).cuda())
    rkw, rkp = R.pack_keys(cfg, k)
    rvw, rvp = R.pack_values(cfg, v)
    same_bits(kw, rkw, "k_words")
    same_bits(kp, rkp, "k_params")
    same_bits(vw, rvw, "v_words")
    same_bits(vp, rvp, "v_params")
    same_bits(F.unpack_keys(cfg, kw), R.unpack_keys(cfg, rkw), "key codes")
    same_bits(F.unpack_values(cfg, vw), R.unpack_values(cfg, rvw), "value codes")
    K, V = F.dequantize_page(cfg, kw, kp, vw, vp)
    RK, RV = R.dequantize_page(cfg, rkw, rkp, rvw, rvp)
    same_bits(K, RK, "K")
    same_bits(V, RV, "V")


@pytest.mark.parametrize("cfg", CFGS[:4], ids=IDS[:4])
def test_float32_pages_and_odd_leading_shapes(cfg):
    for lead in ((), (1,), (5,), (3, 1, 2)):
        k = make(cfg, "outlier", lead=lead, dtype=np.float32, seed=len(lead))
        kw, kp = F.pack_keys(cfg, torch.from_numpy(k).cuda())
        vw, vp = F.pack_values(cfg, torch.from_numpy(k).cuda())
        same_bits(kw, R.pack_keys(cfg, k)[0], f"k_words {lead}")
        same_bits(kp, R.pack_keys(cfg, k)[1], f"k_params {lead}")
        same_bits(vw, R.pack_values(cfg, k)[0], f"v_words {lead}")
        same_bits(vp, R.pack_values(cfg, k)[1], f"v_params {lead}")


def test_unaligned_and_strided_input():
    cfg = CFGS[1]
    big = make(cfg, "normal", lead=(3,), seed=5)
    t = torch.from_numpy(big).cuda()
    view = t.reshape(-1)[1:1 + 2 * cfg.n_r * 128].reshape(2, cfg.n_r, 128)      # 2-byte offset
    ref = big.reshape(-1)[1:1 + 2 * cfg.n_r * 128].reshape(2, cfg.n_r, 128)
    same_bits(F.pack_keys(cfg, view)[0], R.pack_keys(cfg, ref)[0], "unaligned k_words")
    tr = torch.from_numpy(np.ascontiguousarray(np.swapaxes(big, 0, 1))).cuda().transpose(0, 1)   # non-contiguous
    same_bits(F.pack_values(cfg, tr)[0], R.pack_values(cfg, big)[0], "strided v_words")


def test_bad_input_raises_the_references_errors():
    cfg = CFGS[0]
    x = make(cfg, "normal", seed=7)
    bad = [(x[..., :-1, :], ValueError, "N_r=128"), (x.astype(np.int32), TypeError, "float16 or float32")]
    nan = x.copy()
    nan[0, 0, 3, 3] = np.nan
    for arr, err, match in bad:
        with pytest.raises(err, match=match):
            R.pack_keys(cfg, arr)
        with pytest.raises(err, match=match):
            F.pack_keys(cfg, torch.from_numpy(arr).cuda())
    with pytest.raises(ValueError, match="NaN"):
        R.pack_values(cfg, nan)
    with pytest.raises(ValueError, match="non-finite"):
        F.pack_values(cfg, torch.from_numpy(nan).cuda())
    with pytest.raises(ValueError, match="head_dim=96"):
        F.pack_keys(cfg, torch.zeros((cfg.n_r, 96), dtype=torch.float16, device="cuda"))
    with pytest.raises(ValueError, match="overflows float16"):
        F.pack_keys(cfg, torch.full((cfg.n_r, 128), 1e6, device="cuda").index_fill_(0, torch.tensor([0], device="cuda"), -1e6))
    with pytest.raises(TypeError, match="BitDecodingConfig"):
        F.pack_keys({"bits": 2}, torch.from_numpy(x).cuda())
    with pytest.raises(ValueError, match="W_n"):
        F.pack_keys(R.BitDecodingConfig(warps_n=3, k_group=8), torch.zeros((8 * 3 * 8, 128), device="cuda"))
    with pytest.raises(ValueError, match="uint16"):
        F.unpack_keys(cfg, torch.zeros((32, 128), dtype=torch.int16, device="cuda"))


def test_query_transformation_is_the_references():
    q = np.random.default_rng(3).standard_normal((2, 32, 3, 128)).astype(np.float16)
    qt = F.query_transform(torch.from_numpy(q).cuda(), 8)
    same_bits(qt, R.query_transform(q, 8), "transformed q")
    same_bits(F.query_untransform(qt, 32), q, "untransformed q")
