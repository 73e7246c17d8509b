"""kvq.fast.triton.bitdecoding (the Residual Kernel and the page dequantization) against kvq.reference.bitdecoding.

Bit-exact: the packed words and the half2 params of every page equal the reference's bytes, the unpacked
codes equal the reference's, and the dequantized fp16 pages are the same bits. Configurations: the four
kinds (KC4, KC2, KT4, KT2) with one warp (small pages for the interpreter), a W_n = 4 page (the paper's
BitDecoding-KC2), and layouts off the power-of-two path (W_n = 3, groups of 24 / 48 / 96, D = 96: the
kernel's masked group loop) or with channel groups that span warps. Value kinds stress the contract: an
outlier channel, constant groups (scale 0, among them +-0.0), exact ties ((x - mn) / scale = k + 0.5),
negative zeros (minimum -0.0 -> +0.0), float32 input. Bad input raises the reference's error (same type,
same message).

Targets: Triton through the interpreter (CI, CPU) and Triton on the GPU (``pytest -m gpu``).
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
import torch

from kvq.fast import common as C
from kvq.reference import bitdecoding as R

from .cases import assert_same_error

F = pytest.importorskip("kvq.fast.triton.bitdecoding")

@pytest.fixture
def device(triton_device):
    """tests/conftest.py's Triton targets (same ids and skip rules)."""
    return triton_device


def small(bits, k_mode, warps_n=1, k_group=32, v_group=32):
    return R.BitDecodingConfig(bits=bits, k_mode=k_mode, warps_n=warps_n, k_group=k_group, v_group=v_group,
                               max_tokens=4096)


# (config, head_dim)
CFGS = [(small(4, "channel"), 64), (small(2, "channel"), 64), (small(4, "tensor"), 64), (small(2, "tensor"), 64),
        (R.CONFIGS["BitDecoding-KC2"], 128),                                         # W_n = 4, N_r = 256
        (small(4, "channel", warps_n=3, k_group=24, v_group=96), 96),               # N_r = 96: masked loop path
        (small(4, "tensor", k_group=24, v_group=48), 96),                            # channel groups of 24 / 48
        (small(2, "channel", warps_n=2, k_group=128, v_group=64), 128)]              # a key group spans 2 warps
IDS = ["KC4", "KC2", "KT4", "KT2", "KC2-W4", "KC4-W3-kg24-D96", "KT4-kg24-vg48-D96", "KC2-W2-kg128"]
KINDS = ("normal", "outlier", "const", "ties", "negzero")


def make(cfg, D, kind, lead=(2,), dtype=np.float16, seed=0):
    """A (*lead, N_r, D) page of the given value kind (groups along tokens and along channels alike)."""
    rng = np.random.default_rng(seed)
    Nr = cfg.n_r
    x = rng.standard_normal((*lead, Nr, D)).astype(np.float32)
    if kind == "outlier":
        x[..., 3] *= 40
    elif kind == "const":                       # constant token groups (per channel) and channel groups (per token)
        x[..., :Nr // 2, :] = -1.25
        x[..., :, :D // 4] = 0.75
        x[..., :, D // 4:D // 2] = -0.0
        x[..., ::2, D // 4:D // 2] = 0.0        # +0.0 / -0.0 mixed: a zero scale, min +0.0
    elif kind == "ties":                        # (x - 0) / 2^-3 = k + 0.5 exactly: every group holds 0 and qmax / 8
        qmax = 2 ** cfg.bits - 1
        x = ((rng.integers(0, qmax, x.shape) + 0.5) * 0.125).astype(np.float32)
        x[..., ::8, :] = 0.0
        x[..., 1::8, :] = qmax * 0.125
        x[..., :, ::8] = 0.0
        x[..., :, 1::8] = qmax * 0.125
    elif kind == "negzero":                     # minima -0.0, groups of all -0.0 along both axes
        x = np.abs(x)
        x[..., ::3, ::5] = -0.0
        x[..., :8, :] = -0.0
        x[..., :, :8] = -0.0
    return x.astype(dtype)


def bits_of(a) -> np.ndarray:
    """A torch tensor / NumPy array as unsigned integers of its width (uint16 words via int16)."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        a = a.view(torch.int16).numpy().view(np.uint16) if a.dtype == torch.uint16 else a.numpy()
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def same_bits(fast, ref, what: str) -> None:
    f, r = bits_of(fast), bits_of(ref)
    assert f.shape == r.shape, (what, f.shape, r.shape)
    assert f.dtype == r.dtype, (what, f.dtype, r.dtype)
    bad = np.argwhere(f != r)
    assert not len(bad), f"{what}: {len(bad)} of {f.size} differ; first at {tuple(bad[0])}: {f[tuple(bad[0])]:#x} " \
                         f"vs reference {r[tuple(bad[0])]:#x}"


def check_page(cfg, k, v, device, what=""):
    """pack / unpack / dequantize of the fast tier equal the reference's, bit for bit."""
    kw, kp = F.pack_keys(cfg, torch.from_numpy(k).to(device))
    vw, vp = F.pack_values(cfg, torch.from_numpy(v).to(device))
    assert kw.dtype == vw.dtype == torch.uint16 and kp.dtype == vp.dtype == torch.float16
    rkw, rkp = R.pack_keys(cfg, k)
    rvw, rvp = R.pack_values(cfg, v)
    same_bits(kw, rkw, f"k_words {what}")
    same_bits(kp, rkp, f"k_params {what}")
    same_bits(vw, rvw, f"v_words {what}")
    same_bits(vp, rvp, f"v_params {what}")
    same_bits(F.unpack_keys(cfg, kw), R.unpack_keys(cfg, rkw), f"key codes {what}")
    same_bits(F.unpack_values(cfg, vw), R.unpack_values(cfg, rvw), f"value codes {what}")
    K, V = F.dequantize_page(cfg, kw, kp, vw, vp)
    RK, RV = R.dequantize_page(cfg, rkw, rkp, rvw, rvp)
    same_bits(K, RK, f"K {what}")
    same_bits(V, RV, f"V {what}")
    return rkp, rvp


# ---------------------------------------------------------------------------------------------------
# bit-exact pages


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CFGS, ids=IDS)
def test_pack_unpack_dequantize_are_bit_exact(device, case, kind):
    cfg, D = case
    k, v = make(cfg, D, kind, seed=1), make(cfg, D, kind, seed=2)
    rkp, rvp = check_page(cfg, k, v, device, kind)
    if kind == "const":                          # the case does hold zero scales
        assert (rkp[..., 0] == 0).any() and ((rvp[..., 0] == 0).any() or cfg.v_group > D // 2)
    if kind == "ties":                           # ... and exact ties
        assert ((k.astype(np.float32) / np.float32(0.125)) % 1 == 0.5).any()
        assert (rkp[..., 0] == 0.125).any() and (rvp[..., 0] == 0.125).any()
    if kind == "negzero":                        # ... and minima of -0.0, stored as +0.0
        assert not np.signbit(rkp[..., 1]).any() and (rkp[..., 1] == 0).any()


@pytest.mark.parametrize("case", CFGS, ids=IDS)
def test_float32_pages_and_leading_shapes(device, case):
    cfg, D = case
    for i, lead in enumerate(((), (3,), (1, 2))):
        k = make(cfg, D, "outlier", lead=lead, dtype=np.float32, seed=10 + i)
        v = make(cfg, D, "normal", lead=lead, dtype=np.float32, seed=20 + i)
        check_page(cfg, k, v, device, f"float32 {lead}")


def test_non_contiguous_input(device):
    cfg, D = CFGS[1]
    big = make(cfg, D, "normal", lead=(3,), seed=5)
    t = torch.from_numpy(np.ascontiguousarray(np.swapaxes(big, 0, 1))).to(device).transpose(0, 1)
    assert not t.is_contiguous()
    same_bits(F.pack_values(cfg, t)[0], R.pack_values(cfg, big)[0], "strided v_words")
    same_bits(F.pack_keys(cfg, t)[1], R.pack_keys(cfg, big)[1], "strided k_params")


def test_nan_propagates_with_validation_off(device):
    """Rule 8 with the boundary check off: the NaN's group stores a NaN scale; other pages are exact."""
    cfg, D = CFGS[2]
    x = make(cfg, D, "normal", lead=(2,), seed=6)
    bad = x.copy()
    bad[1, 5, 7] = np.nan
    with C.validation(False):
        kw, kp = F.pack_keys(cfg, torch.from_numpy(bad).to(device))
    assert bool(torch.isnan(kp[1, 5, 7 // cfg.k_group, 0]))
    same_bits(kw[0], R.pack_keys(cfg, x[0])[0], "k_words of the finite page")
    same_bits(kp[0], R.pack_keys(cfg, x[0])[1], "k_params of the finite page")


# ---------------------------------------------------------------------------------------------------
# bad input: the reference's errors


def test_bad_input_raises_the_references_errors(device):
    cfg, D = CFGS[0]
    x = make(cfg, D, "normal", seed=7)
    nan, inf = x.copy(), x.astype(np.float32)
    nan[1, 3, 3] = np.nan
    inf[0, 2, 5] = -np.inf
    huge = np.full((cfg.n_r, D), 1e6, np.float32)
    huge[0] = -1e6                                               # fp32 input whose scale overflows fp16
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)        # noqa: E731
    for arr in (x[..., :-1, :], x[..., :, :48], x.astype(np.int32), x.astype(np.float64), nan, inf, huge):
        for ref_fn, fast_fn in ((R.pack_keys, F.pack_keys), (R.pack_values, F.pack_values)):
            assert_same_error(lambda: ref_fn(cfg, arr), lambda: fast_fn(cfg, t(arr)))
    words = np.zeros((8 * cfg.warps_n, D), np.int16)
    assert_same_error(lambda: R.unpack_keys(cfg, words), lambda: F.unpack_keys(cfg, t(words)))
    kw16 = np.zeros((8 * cfg.warps_n + 8, D), np.uint16)
    u = lambda a: t(a.view(np.int16)).view(torch.uint16)                        # noqa: E731
    assert_same_error(lambda: R.unpack_keys(cfg, kw16), lambda: F.unpack_keys(cfg, u(kw16)))
    vw16 = np.zeros((cfg.n_r, 12), np.uint16)
    assert_same_error(lambda: R.unpack_values(cfg, vw16), lambda: F.unpack_values(cfg, u(vw16)))
    q = np.zeros((2, 6, 1, D), np.float16)
    assert_same_error(lambda: R.query_transform(q, 4), lambda: F.query_transform(t(q), 4))
    assert_same_error(lambda: R.query_transform(q[0], 2), lambda: F.query_transform(t(q[0]), 2))
    assert_same_error(lambda: R.query_untransform(q, 4), lambda: F.query_untransform(t(q), 4))
    for args in ((-1, 8), (3, 0), (True, 8)):
        assert_same_error(lambda: R.partition(*args), lambda: F.partition(*args))
    assert_same_error(lambda: R.residual_block_size(8), lambda: F.residual_block_size(8))
    with pytest.raises(TypeError, match="BitDecodingConfig"):
        F.pack_keys({"bits": 2}, t(x))
    with pytest.raises(TypeError, match="torch.Tensor"):
        F.pack_keys(cfg, x)
    kw, kp = F.pack_keys(cfg, t(x[0]))
    vw, vp = F.pack_values(cfg, t(x[0]))
    with pytest.raises(ValueError, match="v_params"):
        F.dequantize_page(cfg, kw, kp, vw, vp[:-1])
    with pytest.raises(ValueError, match="k_params"):
        F.dequantize_page(cfg, kw, kp.float(), vw, vp)


# ---------------------------------------------------------------------------------------------------
# the plain-integer and reshape functions, the API


def test_query_transformation_and_integers_are_the_references(device):
    q = np.random.default_rng(3).standard_normal((2, 32, 3, 64)).astype(np.float16)
    qt = F.query_transform(torch.from_numpy(q).to(device), 8)
    same_bits(qt, R.query_transform(q, 8), "transformed q")
    same_bits(F.query_untransform(qt, 32), q, "untransformed q")
    for b in (2, 4):
        for w in (1, 3, 4):
            assert F.residual_block_size(b, w) == R.residual_block_size(b, w)
    for L in (0, 1, 255, 256, 1000):
        assert F.partition(L, 256) == R.partition(L, 256)


def test_api_is_the_cupy_backends():
    """Same public names as kvq.fast.cupy.bitdecoding (read with ast: CuPy may be missing); data re-exported."""
    src = pathlib.Path(F.__file__).parent.parent / "cupy" / "bitdecoding.py"
    tree = ast.parse(src.read_text())
    cupy_all = next(ast.literal_eval(n.value) for n in tree.body
                    if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets))
    assert list(F.__all__) == list(cupy_all)
    assert F.BitDecodingConfig is R.BitDecodingConfig and F.CONFIGS is R.CONFIGS


def test_empty_batch_returns_empty_tensors(device):
    """As the CuPy backend: a leading dimension of 0 gives empty outputs (the reference has nothing to quantize)."""
    cfg, D = CFGS[0]
    kw, kp = F.pack_keys(cfg, torch.zeros((0, cfg.n_r, D), dtype=torch.float16, device=device))
    vw, vp = F.pack_values(cfg, torch.zeros((0, cfg.n_r, D), dtype=torch.float16, device=device))
    assert kw.shape == (0, 8, D) and vw.shape == (0, cfg.n_r, D // cfg.per_word)
    K, V = F.dequantize_page(cfg, kw, kp, vw, vp)
    assert K.shape == V.shape == (0, cfg.n_r, D)
