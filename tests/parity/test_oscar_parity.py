"""kvq.fast.<backend>.oscar (and its rotation kernel kvq.fast.<backend>.rotate) against kvq.reference.oscar.

The rotation kernel reproduces ``kvq.reference.rotations.rotate`` bit for bit (the same fp32 operations
in the same order, no FMA), shared (D, D) and per-head (H, D, D) with the GQA mapping. So the cache
state is bit-exact too: after the same appends (bulk, one token at a time, random chunks) every tensor
of the fast state equals the reference state's array bit for bit, counters and page table included;
dequantize is bit-exact in the rotated frame and rotated back (the same kernel, R^T). decode_attention
follows the tolerance rule (``tolerance.check_close``) against the reference in float64 (truth) and
float32. Bad input raises the reference's error (same type and message) and leaves the state unchanged.

Targets: Triton through the interpreter (CI, CPU) and on the GPU, and the CuPy backend on the GPU
(``pytest -m gpu``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq.reference import oscar as RO
from kvq.reference import rotations as RR

from .cases import assert_bits_equal, assert_same_error as _errors
from .tolerance import check_close


@pytest.fixture
def target(fast_target):
    """(backend, device) from tests/conftest.py's ``fast_target``."""
    return fast_target


def _fast(target):
    """The backend's own OSCAR cache module, kvq.fast.<backend>.oscar."""
    import importlib
    return importlib.import_module(f"kvq.fast.{target[0]}.oscar")


def _rotate(target):
    """The backend's own rotation kernel, kvq.fast.<backend>.rotate.rotate."""
    import importlib
    return importlib.import_module(f"kvq.fast.{target[0]}.rotate").rotate


def _orth(rng, *lead, D):
    q, _ = np.linalg.qr(rng.standard_normal(lead + (D, D)))
    return q.astype(np.float32)


def _calib(kind: str, H: int, D: int, seed: int = 0) -> RO.OSCARCalibration:
    rng = np.random.default_rng(seed)
    if kind == "identity":
        return RO.identity_calibration(D)
    if kind == "shared":
        return RO.OSCARCalibration(_orth(rng, D=D), _orth(rng, D=D))
    return RO.OSCARCalibration(_orth(rng, H, D=D), _orth(rng, H, D=D), 0.9, 1.0)        # per head


SMALL = dict(sink=4, window=8, group_size=16, page_size=8, max_tokens=128)
CUDA = dict(sink=64, window=256, group_size=128, page_size=128, max_tokens=4096)


def _setup(target, **over):
    small = target[1] == "cpu"
    cfg = RO.OSCARConfig(**dict(SMALL if small else CUDA, **over))
    B, H, D = (2, 2, 32) if small else (2, 4, 128)
    return cfg, (B, H, D)


def _kv(B, H, T, D, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k[:, :, :, 3] *= 8.0                                                   # an outlier channel
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    return k.astype(np.float16), v.astype(np.float16)


def _chunks(kind, T, seed=1):
    if kind == "bulk":
        return [T]
    if kind == "ones":
        return [1] * T
    rng = np.random.default_rng(seed)
    out, t = [], 0
    while t < T:
        n = int(rng.integers(0, 20))
        out.append(min(n, T - t))
        t += out[-1]
    return out


def assert_same_state(fs, rs, what=""):
    fa, ra = fs.arrays(), rs.arrays()
    assert fa.keys() == ra.keys(), (sorted(fa), sorted(ra))
    for n in ra:
        assert_bits_equal(fa[n], ra[n], f"{what}{n}")
    assert (fs.length, fs.next_page) == (rs.length, rs.next_page), what
    assert tuple(fs.shape) == tuple(rs.shape)


def _t(a, device):
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


# ---------------------------------------------------------------------------------------------------
# the rotation kernel


ROT = [("shared", 1, np.float16, 1), ("shared", 1, np.float32, 37), ("per_head", 1, np.float16, 77),
       ("per_head", 4, np.float32, 5), ("shared", 2, "bfloat16", 19), ("per_head", 2, np.float16, 130)]


@pytest.mark.parametrize("kind, ratio, dtype, T", ROT, ids=[f"{r[0]}-gqa{r[1]}-{np.dtype(r[2]).name if r[2] != 'bfloat16' else 'bf16'}-T{r[3]}" for r in ROT])
def test_rotate_bit_exact(target, kind, ratio, dtype, T):
    """rotate(x, R) == rotations.rotate bit for bit: shared / per-head R, odd T, zeros (-0.0 -> +0.0)."""
    _, device = target
    rotate = _rotate(target)
    D = 32 if device == "cpu" else 128
    H_kv, B = 2, 2
    rng = np.random.default_rng(T)
    x = (rng.standard_normal((B, H_kv * ratio, T, D)) * 4).astype(np.float32)
    x[0, 0, 0] = 0.0
    x[-1, -1, -1, : D // 2] = -0.0
    R = _orth(rng, H_kv, D=D) if kind == "per_head" else _orth(rng, D=D)
    if dtype == "bfloat16":
        xt = torch.from_numpy(x).to(torch.bfloat16).to(device)
        xr = xt.float().cpu().numpy()                                     # bf16 values as fp32 (exact)
    else:
        xr = x.astype(dtype)
        xt = _t(xr, device)
    Rr = R[np.arange(H_kv * ratio) // ratio][:, None] if kind == "per_head" else R
    ref = RR.rotate(xr, Rr)
    got = rotate(xt, _t(R, device))
    assert got.dtype == torch.float32
    assert_bits_equal(got, ref, "rotate")
    # a strided view (tokens and heads swapped in memory) gives the same bits
    xs = xt.transpose(1, 2).contiguous().transpose(1, 2)
    assert_bits_equal(rotate(xs, _t(R, device)), ref, "rotate (strided x)")


def test_rotate_other_shapes_and_errors(target):
    _, device = target
    rotate = _rotate(target)
    rng = np.random.default_rng(5)
    R = _orth(rng, D=16)
    x = rng.standard_normal((7, 16)).astype(np.float32)
    assert_bits_equal(rotate(_t(x, device), _t(R, device)), RR.rotate(x, R), "rotate 2-D")
    assert tuple(rotate(_t(x[:0], device), _t(R, device)).shape) == (0, 16)
    with pytest.raises(TypeError, match="float32"):
        rotate(_t(x, device), _t(R.astype(np.float64), device))
    with pytest.raises(ValueError, match="needs"):
        rotate(_t(x[:, :8], device), _t(R, device))
    with pytest.raises(ValueError, match="multiple"):
        rotate(_t(x.reshape(1, 7, 1, 16), device), _t(_orth(rng, 2, D=16), device))


# ---------------------------------------------------------------------------------------------------
# the cache state


STATE = [("shared", "bulk", {}), ("shared", "ones", {}), ("shared", "random", {}),
         ("per_head", "bulk", {}), ("per_head", "random", {}), ("identity", "random", {}),
         ("per_head", "random", dict(group_size=32, meta_dtype="float32")),
         ("shared", "random", dict(sink=0, bits=4)), ("shared", "random", dict(window=0, page_size=5))]
SIDS = [f"{k}-{c}" + "".join(f"-{a}{b}" for a, b in o.items()) for k, c, o in STATE]


@pytest.mark.parametrize("kind, chunks, over", STATE, ids=SIDS)
def test_state_parity(target, kind, chunks, over):
    """Fast appends in chunks == reference bulk append, every field bit for bit; dequantize bit-exact
    in the rotated frame and rotated back."""
    _, device = target
    F = _fast(target)
    cfg, (B, H, D) = _setup(target, **over)
    calib = _calib(kind, H, D)
    T = (37 if chunks == "ones" else 61) if device == "cpu" else 1000
    k, v = _kv(B, H, T, D)
    rs = RO.init(cfg, B, H, D)
    RO.append(cfg, calib, rs, k, v)
    fs = F.init(cfg, B, H, D)
    kt, vt = _t(k, device), _t(v, device)
    t = 0
    for n in _chunks(chunks, T):
        F.append(cfg, calib, fs, kt[:, :, t:t + n], vt[:, :, t:t + n])
        t += n
    assert_same_state(fs, rs)
    for rotated in (True, False):
        K, V = RO.dequantize(cfg, calib, rs, rotated=rotated)
        Kf, Vf = F.dequantize(cfg, calib, fs, rotated=rotated)
        assert Kf.dtype == torch.float32 and Vf.dtype == torch.float32
        assert_bits_equal(Kf, K, f"dequantized K (rotated={rotated})")
        assert_bits_equal(Vf, V, f"dequantized V (rotated={rotated})")


def test_float32_input_prefix_states(target):
    """float32 input (rotated in fp32, rounded to the FP16 buffers); the state after every chunk."""
    _, device = target
    F = _fast(target)
    cfg, (B, H, D) = _setup(target)
    calib = _calib("per_head", H, D, seed=3)
    T = 45 if device == "cpu" else 700
    k, v = _kv(B, H, T, D, seed=4)
    k32, v32 = k.astype(np.float32) * np.float32(1.0001), v.astype(np.float32) * np.float32(0.9999)
    rs, fs = RO.init(cfg, B, H, D), F.init(cfg, B, H, D)
    t = 0
    for n in _chunks("random", T, seed=7):
        RO.append(cfg, calib, rs, k32[:, :, t:t + n], v32[:, :, t:t + n])
        F.append(cfg, calib, fs, _t(k32[:, :, t:t + n], device), _t(v32[:, :, t:t + n], device))
        t += n
        assert_same_state(fs, rs, f"T={t}: ")


# ---------------------------------------------------------------------------------------------------
# decode attention


def _truth_ref32(cfg, calib, rs, q_t, **kw):
    q32 = q_t.detach().cpu().float().numpy()
    return (RO.decode_attention(cfg, calib, rs, q32.astype(np.float64), **kw),
            RO.decode_attention(cfg, calib, rs, q32, **kw))


# (calibration kind, T on cpu (cuda: x 20), q dtype, GQA ratio, T_q, rotate_back)
ATTN = [
    ("shared", 61, torch.float32, 1, 1, True),
    ("per_head", 61, torch.float32, 4, 2, True),
    ("per_head", 50, torch.float32, 4, 1, False),
    ("shared", 39, torch.float16, 4, 2, False),
    ("per_head", 70, torch.float16, 1, 2, True),
    ("shared", 9, torch.float32, 4, 1, True),                  # sink + window only, no page yet
    ("identity", 44, torch.bfloat16, 4, 1, True),
]


@pytest.mark.parametrize("a", ATTN, ids=[f"{a[0]}-T{a[1]}-{str(a[2])[6:]}-gqa{a[3]}-tq{a[4]}-back{int(a[5])}"
                                         for a in ATTN])
def test_decode_attention(target, a):
    _, device = target
    F = _fast(target)
    kind, T, dtype, ratio, T_q, back = a
    cfg, (B, H, D) = _setup(target)
    T = T if device == "cpu" else T * 20
    calib = _calib(kind, H, D, seed=T)
    k, v = _kv(B, H, T, D, seed=T)
    rs = RO.init(cfg, B, H, D)
    RO.append(cfg, calib, rs, k, v)
    fs = F.init(cfg, B, H, D)
    F.append(cfg, calib, fs, _t(k, device), _t(v, device))
    rng = np.random.default_rng(T + ratio)
    q = torch.from_numpy(rng.standard_normal((B, H * ratio, T_q, D)).astype(np.float32)).to(dtype).to(device)
    out, lse = F.decode_attention(cfg, calib, fs, q, rotate_back=back)
    assert out.dtype == dtype and tuple(out.shape) == tuple(q.shape) and lse.dtype == torch.float32
    assert tuple(lse.shape) == tuple(q.shape[:3])
    (o64, l64), (o32, l32) = _truth_ref32(cfg, calib, rs, q, rotate_back=back)
    check_close(out, o64, o32, dtype, "out")
    check_close(lse, l64, l32, torch.float32, "lse")
    out2, _ = F.decode_attention(cfg, calib, fs, q, scale=0.3, rotate_back=back)
    (o64, _), (o32, _) = _truth_ref32(cfg, calib, rs, q, scale=0.3, rotate_back=back)
    check_close(out2, o64, o32, dtype, "out (scale=0.3)")


# ---------------------------------------------------------------------------------------------------
# bad input


def test_bad_input(target):
    _, device = target
    F = _fast(target)
    cfg, (B, H, D) = _setup(target)
    calib = _calib("per_head", H, D)
    k, v = _kv(B, H, 30, D, seed=2)
    rs, fs = RO.init(cfg, B, H, D), F.init(cfg, B, H, D)
    RO.append(cfg, calib, rs, k, v)
    F.append(cfg, calib, fs, _t(k, device), _t(v, device))
    before = fs.copy()
    T = lambda a: _t(a, device)                                                    # noqa: E731
    k1, v1 = k[:, :, :3], v[:, :, :3]
    nan = k1.copy()
    nan[0, 1, 2, 3] = np.nan
    inf = v1.copy()
    inf[1, 0, 0, 0] = np.inf
    big = k1.astype(np.float32)
    big[1, 0, 0, :] = 6e4                                                # finite; k R overflows fp16
    bad = [
        (k1.astype(np.float64), v1),                                   # dtype
        (k1.astype(np.int32), v1),
        (k1[:, :1], v1[:, :1]),                                        # wrong H
        (k1[..., :D // 2], v1[..., :D // 2]),                          # wrong D
        (k1[0], v1[0]),                                                # 3-D
        (k1, v[:, :, :4]),                                             # k / v shapes differ
        (nan, v1),                                                     # NaN
        (k1, inf),                                                     # inf
        (big, v1.astype(np.float32)),                                  # overflows fp16 after rotation
        (np.zeros((B, H, cfg.max_tokens, D), np.float16),) * 2,       # over capacity
    ]
    for kb, vb in bad:
        _errors(lambda: RO.append(cfg, calib, rs, kb, vb), lambda: F.append(cfg, calib, fs, T(kb), T(vb)))
        assert_same_state(fs, before)
    other = _calib("shared", H, D // 2)                                 # head dim mismatch
    wrong_h = _calib("per_head", H + 1, D)                              # per-head count mismatch
    for cb in (other, wrong_h, "calib"):
        _errors(lambda: RO.append(cfg, cb, rs, k1, v1), lambda: F.append(cfg, cb, fs, T(k1), T(v1)))
        assert_same_state(fs, before)
    assert_same_state(fs, rs)
    q = np.zeros((B, H * 2, 1, D), np.float32)
    for qb in (q[:, :H + 1], q[..., :D // 2], q[0], q[:1]):
        _errors(lambda: RO.decode_attention(cfg, calib, rs, qb),
                lambda: F.decode_attention(cfg, calib, fs, T(qb)))
    _errors(lambda: RO.decode_attention(cfg, wrong_h, rs, q), lambda: F.decode_attention(cfg, wrong_h, fs, T(q)))
    empty_r, empty_f = RO.init(cfg, B, H, D), F.init(cfg, B, H, D)
    _errors(lambda: RO.decode_attention(cfg, calib, empty_r, q), lambda: F.decode_attention(cfg, calib, empty_f, T(q)))
    _errors(lambda: RO.dequantize(cfg, calib, empty_r), lambda: F.dequantize(cfg, calib, empty_f))
    _errors(lambda: RO.init(cfg, 0, H, D), lambda: F.init(cfg, 0, H, D))
    _errors(lambda: RO.init(cfg, B, H, 24), lambda: F.init(cfg, B, H, 24))
    with pytest.raises(TypeError):
        F.decode_attention(cfg, calib, fs, T(q).double())
    with pytest.raises(TypeError):
        F.append(cfg, calib, fs, k1, v1)                                  # NumPy arrays: the reference's input
    F.append(cfg, calib, fs, T(k[:, :, :0]), T(v[:, :, :0]))              # an empty append changes nothing
    assert_same_state(fs, before)


def test_module_objects(target):
    """Data names are the reference's objects; quantize_tokens / identity_calibration / counts mirror it."""
    F = _fast(target)
    for name in ("DEFAULT_CLIP_K", "DEFAULT_CLIP_V", "CLIP_GRID", "OSCARCalibration", "OSCARConfig", "CONFIGS"):
        assert getattr(F, name) is getattr(RO, name)
    c = F.identity_calibration(32, 0.9)
    assert isinstance(c, RO.OSCARCalibration) and c.clip_k == 0.9 and c.rotation == "identity"
    cfg = RO.CONFIGS["OSCAR"]
    for T in (0, 1, 64, 320, 321, 1000):
        assert F.counts(cfg, T) == RO.counts(cfg, T)
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 32)).astype(np.float16)
    codes, s, m = F.quantize_tokens(_t(x, target[1]), 0.9, 16)
    rc, rsc, rm = RO.quantize_tokens(x, 0.9, 16)
    for a, b, n in ((codes, rc, "codes"), (s, rsc, "scale"), (m, rm, "mn")):
        assert_bits_equal(a, b, n)
