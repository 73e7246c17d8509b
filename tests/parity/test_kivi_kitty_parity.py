"""kvq.fast.{triton,cupy}.kivi / kitty (paged streaming caches) against kvq.reference.kivi / kitty.

State parity is bit-exact: after the same appends (bulk, one token at a time, random chunks) every
tensor of the fast state equals the reference state's array bit for bit, and the counters agree.
Kitty's channel ranking (eq. 2) is an order-dependent fp32 sum (contract rule 7): the state tests use
keys whose per-page channel magnitudes are far apart (an unambiguous top-k); ``test_kitty_near_ties``
takes plain random keys and allows a different boosted channel only where the reference's scores
tie to within rounding, with every page that selects the same channels still bit-exact.
dequantize is bit-exact (fp32); decode_attention follows the tolerance rule (``tolerance.check_close``)
against the reference run in float64 (truth) and float32. Bad input raises the reference's error
(same type and message) and leaves the state unchanged.

Targets: Triton through the interpreter (CI, CPU) and on the GPU, and the CuPy backend on the GPU
(``pytest -m gpu``). The decode's tail gather is checked for both backends; the Triton-only launch knob
``Knobs.split_p`` only for Triton.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq.reference import kitty as RT
from kvq.reference import kivi as RK

from .cases import assert_bits_equal, assert_same_error as _errors
from .tolerance import check_close

TARGETS = [pytest.param(("triton", "cpu"), id="triton-interp"),
           pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
           pytest.param(("cupy", "cuda"), id="cupy-cuda", marks=pytest.mark.gpu)]


def _target(request):
    backend, device = request.param
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the Triton interpreter target runs only on machines without a GPU (CI)")
    if backend == "cupy":
        pytest.importorskip("cupy")
    return request.param


@pytest.fixture(params=TARGETS)
def target(request):
    """(backend, device): tests/conftest.py's ``fast_target`` (same targets and skip rules)."""
    return _target(request)


@pytest.fixture(params=[t for t in TARGETS if t.values[0][0] == "triton"])
def triton_target(request):
    """The Triton targets only (knobs of the Triton fused kernel)."""
    return _target(request)


@pytest.fixture(params=[t for t in TARGETS if t.values[0][0] == "cupy"])
def cupy_target(request):
    """The CuPy target only (knobs of the CUDA fused kernels; deselected without a GPU)."""
    return _target(request)


def _device_ok(device):
    pass


def _mods(backend="triton"):
    """The backend's (kivi, kitty) modules."""
    import importlib
    return (importlib.import_module(f"kvq.fast.{backend}.kivi"),
            importlib.import_module(f"kvq.fast.{backend}.kitty"))


def _paged(backend="triton"):
    """The backend's paged module (decode kernels, ``gather_tail``)."""
    import importlib
    return importlib.import_module(f"kvq.fast.{backend}.paged")


SMALL = dict(group_size=16, residual=8, max_tokens=256)
CUDA = dict(group_size=128, residual=128, max_tokens=4096)
# name, reference module name, config factory (per device), head dim per device
CASES = [
    ("KIVI-K2V2", "kivi", lambda s: RK.KIVIConfig(2, 2, **s)),
    ("KIVI-K4V2*", "kivi", lambda s: RK.KIVIConfig(4, 2, sink=4 if s is SMALL else 32, **s)),
    ("KIVI-K2V4*-Gv8", "kivi", lambda s: RK.KIVIConfig(2, 4, sink=3, v_group_size=8, **s)),
    ("Kitty", "kitty", lambda s: RT.KittyConfig(0.125, sink=4 if s is SMALL else 32, **s)),
    ("Kitty-Pro", "kitty", lambda s: RT.KittyConfig(0.25, sink=4 if s is SMALL else 32, **s)),
    ("Kitty-random", "kitty", lambda s: RT.KittyConfig(0.25, selection="random", seed=3, sink=2, **s)),
]
IDS = [c[0] for c in CASES]


def _setup(case, target):
    """(cfg, reference module, fast module, (B, H, D)) of a case on a target (backend, device)."""
    backend, device = target
    name, mod, make = case
    small = device == "cpu"
    cfg = make(SMALL if small else CUDA)
    FK, FT = _mods(backend)
    ref, fast = (RK, FK) if mod == "kivi" else (RT, FT)
    B, H, D = (2, 2, 16) if small else (2, 4, 128)
    if name.endswith("Gv8") or (small and name == "Kitty-Pro"):
        D = 32 if small else 128
    return cfg, ref, fast, (B, H, D)


def _kv(B, H, T, D, G, seed=0, distinct=True, start=0):
    """fp16 keys / values; distinct: per (sequence, head, key page; pages start at token ``start`` = the
    sink size) the channels get magnitudes 1 + 0.45 i in a random order plus at most 0.2 |N(0,1)|, so
    every page's channel ranking is unambiguous (score gaps >= 0.25, far above rounding)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    if distinct:
        for b in range(B):
            for h in range(H):
                for p0 in range(start, T, G):
                    mag = 1.0 + 0.45 * rng.permutation(D)
                    k[b, h, p0:p0 + G] = np.minimum(np.abs(k[b, h, p0:p0 + G]), 1.0) * 0.2 + mag
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    return k.astype(np.float16), v.astype(np.float16)


def assert_same_state(fs, rs, what=""):
    fa, ra = fs.arrays(), rs.arrays()
    assert fa.keys() == ra.keys(), (sorted(fa), sorted(ra))
    for n in ra:
        assert_bits_equal(fa[n], ra[n], f"{what}{n}")
    assert (fs.length, fs.k_next, fs.v_next) == (rs.length, rs.k_next, rs.v_next), what
    assert tuple(fs.shape) == tuple(rs.shape)


def _chunks(kind, T, seed=1):
    if kind == "bulk":
        return [T]
    if kind == "ones":
        return [1] * T
    rng = np.random.default_rng(seed)
    out, t = [], 0
    while t < T:
        n = int(rng.integers(0, 30))
        out.append(min(n, T - t))
        t += out[-1]
    return out


# every case in bulk and random chunks; one token per call (decode, ``_paged._append_token``) for four of them
# (interpreter time): a sink or none, a value Q-buffer (Kitty) or none (KIVI)
STATE = [(c, ch) for c in CASES for ch in ("bulk", "random")] + [(CASES[i], "ones") for i in (0, 1, 3, 5)]


@pytest.mark.parametrize("case, chunks", STATE, ids=[f"{c[0]}-{ch}" for c, ch in STATE])
def test_state_parity(target, case, chunks):
    """Fast appends in chunks == reference bulk append, every field bit for bit; dequantize bit-exact."""
    _, device = target
    _device_ok(device)
    cfg, ref, fast, (B, H, D) = _setup(case, target)
    T = 83 if device == "cpu" else 700
    k, v = _kv(B, H, T, D, cfg.group_size, start=cfg.sink)
    rs = ref.init(cfg, B, H, D)
    ref.append(cfg, rs, k, v)
    fs = fast.init(cfg, B, H, D)
    kt, vt = torch.from_numpy(k).to(device), torch.from_numpy(v).to(device)
    t = 0
    for n in _chunks(chunks, T):
        fast.append(cfg, fs, kt[:, :, t:t + n], vt[:, :, t:t + n])
        t += n
    assert_same_state(fs, rs)
    K, V = ref.dequantize(cfg, rs)
    Kf, Vf = fast.dequantize(cfg, fs)
    assert Kf.dtype == torch.float32 and Vf.dtype == torch.float32
    assert_bits_equal(Kf, K, "dequantized K")
    assert_bits_equal(Vf, V, "dequantized V")


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=[IDS[1], IDS[3]])
def test_state_after_every_token(target, case):
    """A prompt, then one token per append (the decode path, ``kvq.fast.caches.paged._append_token``, and the
    general routing at each page boundary): after every token the fast state equals the reference state of
    the same prefix, bit for bit (window filling, values evicted into pages or the value Q-buffer, key pages
    completed)."""
    _, device = target
    cfg, ref, fast, (B, H, D) = _setup(case, target)
    T0, T = 5, 5 + 2 * cfg.group_size + cfg.residual + 3
    k, v = _kv(B, H, T, D, cfg.group_size, start=cfg.sink, seed=4)
    kt, vt = torch.from_numpy(k).to(device), torch.from_numpy(v).to(device)
    fs = fast.init(cfg, B, H, D)
    fast.append(cfg, fs, kt[:, :, :T0], vt[:, :, :T0])
    for t in range(T0, T):
        fast.append(cfg, fs, kt[:, :, t:t + 1], vt[:, :, t:t + 1])
        rs = ref.init(cfg, B, H, D)
        ref.append(cfg, rs, k[:, :, :t + 1], v[:, :, :t + 1])
        assert_same_state(fs, rs, f"after token {t}: ")


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[IDS[0], IDS[3]])
def test_float32_input_and_prefix_states(target, case):
    """float32 input (rounded to the FP16 buffers) and every intermediate length of a random chunking;
    at each, the decode's tail gather is bit-exact with the reference's dequantize."""
    _, device = target
    _device_ok(device)
    cfg, ref, fast, (B, H, D) = _setup(case, target)
    T = 60 if device == "cpu" else 400
    k, v = _kv(B, H, T, D, cfg.group_size, seed=5, start=cfg.sink)
    k32 = k.astype(np.float32) * np.float32(1.0001)                      # not fp16 values: rounding matters
    v32 = v.astype(np.float32) * np.float32(0.9999)
    rs, fs = ref.init(cfg, B, H, D), fast.init(cfg, B, H, D)
    t = 0
    for n in _chunks("random", T, seed=7):
        ref.append(cfg, rs, k32[:, :, t:t + n], v32[:, :, t:t + n])
        fast.append(cfg, fs, torch.from_numpy(k32[:, :, t:t + n]).to(device),
                    torch.from_numpy(v32[:, :, t:t + n]).to(device))
        t += n
        assert_same_state(fs, rs, f"T={t}: ")
        # the decode's tail gather (sink + post-sink tokens [NF, T - S)) is bit-exact with dequantize
        FP = _paged(target[0])
        K, V = ref.dequantize(cfg, rs)
        c = FP.counts(cfg, t)
        for NF in sorted({0, min(c["n_kpages"] * cfg.group_size, c["n_vq"])}):
            keep = np.r_[0:c["n_sink"], cfg.sink + NF:t]
            tk, tv = FP.gather_tail(cfg, fast.KeyCodec, fs, NF)
            assert_bits_equal(tk, K[:, :, keep], f"T={t} NF={NF}: tail K")
            assert_bits_equal(tv, V[:, :, keep], f"T={t} NF={NF}: tail V")


def _truth_ref32(ref, cfg, rs, q_t):
    q32 = q_t.detach().cpu().float().numpy()
    return ref.decode_attention(cfg, rs, q32.astype(np.float64)), ref.decode_attention(cfg, rs, q32)


# (case index, T on cpu, T on cuda, q dtype, GQA ratio, T_q)
ATTN = [
    (0, 83, 3001, torch.float32, 4, 1),
    (0, 90, 2048 + 77, torch.float16, 4, 2),
    (1, 77, 1500, torch.float32, 2, 2),
    (2, 70, 999, torch.float16, 4, 1),
    (3, 100, 4000, torch.float32, 4, 1),
    (3, 64, 1111, torch.float16, 8, 1),
    (4, 95, 2500, torch.float16, 4, 2),
    (5, 85, 1900, torch.float32, 1, 1),
    (0, 12, 40, torch.float32, 4, 1),           # short: no fused page at all (sink / buffers only)
    (4, 80, 1700, torch.bfloat16, 4, 1),
    (1, 50, 900, torch.float16, 8, 9),          # 72 query rows per KV head: two row blocks
]


@pytest.mark.parametrize("a", ATTN, ids=[f"{IDS[a[0]]}-T{a[1]}-{str(a[3])[6:]}-gqa{a[4]}-tq{a[5]}" for a in ATTN])
def test_decode_attention(target, a):
    _, device = target
    _device_ok(device)
    ci, T_cpu, T_gpu, dtype, ratio, T_q = a
    cfg, ref, fast, (B, H, D) = _setup(CASES[ci], target)
    T = T_cpu if device == "cpu" else T_gpu
    k, v = _kv(B, H, T, D, cfg.group_size, seed=ci + 11, start=cfg.sink)
    rs = ref.init(cfg, B, H, D)
    ref.append(cfg, rs, k, v)
    fs = fast.init(cfg, B, H, D)
    fast.append(cfg, fs, torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))
    rng = np.random.default_rng(ci)
    q = torch.from_numpy(rng.standard_normal((B, H * ratio, T_q, D)).astype(np.float32)).to(dtype).to(device)
    out, lse = fast.decode_attention(cfg, fs, q)
    assert out.dtype == dtype and tuple(out.shape) == tuple(q.shape) and lse.dtype == torch.float32
    (o64, l64), (o32, l32) = _truth_ref32(ref, cfg, rs, q)
    check_close(out, o64, o32, dtype, "out")
    check_close(lse, l64, l32, torch.float32, "lse")
    out2, _ = fast.decode_attention(cfg, fs, q, scale=0.3)
    (o64, _), (o32, _) = (ref.decode_attention(cfg, rs, q.cpu().double().numpy(), scale=0.3),
                          ref.decode_attention(cfg, rs, q.cpu().float().numpy(), scale=0.3))
    check_close(out2, o64, o32, dtype, "out (scale=0.3)")


def _cupy_knobs(monkeypatch, **knobs) -> dict:
    """The CuPy paged decode's default launch knobs replaced by ``kvq.fast.cupy.paged.Knobs(**knobs)`` for
    this test: ``paged.decode_attention`` reads ``DEFAULT_KNOBS`` per call where it is given none, as
    ``cupy.kivi`` / ``cupy.kitty.decode_attention`` call it. Returns ``knobs`` (to change and pass again)."""
    FP = _paged("cupy")
    monkeypatch.setattr(FP, "DEFAULT_KNOBS", FP.Knobs(**knobs))
    return knobs


@pytest.mark.parametrize("a", [ATTN[1], ATTN[6]], ids=["KIVI-K2V2-fp16", "Kitty-Pro-fp16"])
def test_decode_p_split(triton_target, a, monkeypatch):
    """The other setting of ``paged.Knobs.split_p``: True (P as hi + lo halves, two dots, ~fp32
    accuracy) instead of the default False (P rounded once to fp16) also meets the tolerance rule (the
    decode's default knobs replaced: ``plan`` reads ``DEFAULT_KNOBS`` per call)."""
    FP = _paged("triton")
    monkeypatch.setattr(FP, "DEFAULT_KNOBS", FP.Knobs(split_p=True))
    test_decode_attention(triton_target, a)


def _fused_launches(launches, FP) -> dict:
    """The Triton paged decode's launches of its two fused kernels among ``launches`` (``planned_launches``),
    counted by name ("tokens" / "rows")."""
    return {"tokens": len(launches.grids(FP._tokens_kernel)), "rows": len(launches.grids(FP._fused_kernel))}


@pytest.mark.parametrize("a", [ATTN[1], ATTN[5], ATTN[6]], ids=["KIVI-K2V2-fp16-tq2", "Kitty-fp16-gqa8", "Kitty-Pro-fp16-tq2"])
@pytest.mark.parametrize("tokens", [True, False], ids=["tokens", "rows"])
def test_decode_fused_kernel_choice(triton_target, a, tokens, monkeypatch, planned_launches):
    """fp16 q with at most 8 query rows per kv head (and codes in 32-bit words, one value group per token)
    runs ``_tokens_kernel`` (cache tokens on the MMA's M side) by default, and the rows kernel
    (``_fused_kernel``) with ``Knobs(tokens=None)``; each meets the tolerance rule on its own."""
    FP = _paged("triton")
    if not tokens:
        monkeypatch.setattr(FP, "DEFAULT_KNOBS", FP.Knobs(tokens=None))
    test_decode_attention(triton_target, a)
    assert _fused_launches(planned_launches, FP) == ({"tokens": 2, "rows": 0} if tokens else {"tokens": 0, "rows": 2})


def test_decode_many_rows_take_the_rows_kernel(triton_target, planned_launches):
    """72 query rows per kv head (G_q 8 x T_q 9): over ``_tokens_kernel``'s 8, so the rows kernel runs."""
    test_decode_attention(triton_target, ATTN[10])
    assert _fused_launches(planned_launches, _paged("triton")) == {"tokens": 0, "rows": 2}


def test_decode_tail_takes_fp16_q_as_it_is(triton_target, monkeypatch):
    """Triton: the gathered fp32 tail's partial kernel gets fp16 q
    as it is (no cast launch) and widens it exactly as it loads it: the decode's bits equal those with q cast
    to fp32 before the tail (the former path)."""
    _, device = triton_target
    _device_ok(device)
    cfg, _, fast, (B, H, D) = _setup(CASES[0], triton_target)
    k, v = _kv(B, H, 90 if device == "cpu" else 2048 + 77, D, cfg.group_size, seed=3)
    fs = fast.init(cfg, B, H, D)
    fast.append(cfg, fs, torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))
    q = torch.randn((B, 4 * H, 1, D), generator=torch.Generator().manual_seed(5)).to(torch.float16).to(device)
    from kvq.fast.triton import _launch as L
    from kvq.fast.triton import attention as A

    real, seen = L.Launch.__call__, []
    monkeypatch.setattr(L, "current_stream", lambda device_index: None)      # tensors, Triton's dispatch

    def spy(self, args, stream, device_index):
        if self.kernel is A._partial_kernel:
            seen.append(args[0].dtype)
        return real(self, args, stream, device_index)

    def cast(self, args, stream, device_index):
        # q widened to fp32 before the tail's kernel (contiguous: the same strides)
        if self.kernel is A._partial_kernel:
            self.kernel[self.grid](args[0].float(), *args[1:], **self.consts, **self.options)
            return None
        return real(self, args, stream, device_index)

    monkeypatch.setattr(L.Launch, "__call__", spy)
    out, lse = fast.decode_attention(cfg, fs, q)
    monkeypatch.setattr(L.Launch, "__call__", cast)
    out32, lse32 = fast.decode_attention(cfg, fs, q)
    assert seen == [torch.float16]
    assert torch.equal(out, out32) and torch.equal(lse, lse32)


@pytest.mark.parametrize("a", [ATTN[1], ATTN[5], ATTN[6]], ids=["KIVI-K2V2-fp16", "Kitty-fp16-gqa8", "Kitty-Pro-fp16"])
def test_decode_cuda_cores(cupy_target, a, monkeypatch):
    """CuPy: fp16 q with 2-bit keys and values takes the tensor-core kernel (paged_decode_mma2) by
    default; ``Knobs(mma=False)`` runs the CUDA-core kernel (paged_decode) on the same cases."""
    _cupy_knobs(monkeypatch, mma=False)
    test_decode_attention(cupy_target, a)


@pytest.mark.parametrize("a", [ATTN[1], ATTN[6]], ids=["KIVI-K2V2-fp16", "Kitty-Pro-fp16"])
def test_decode_one_stream(cupy_target, a, monkeypatch):
    """CuPy: ``Knobs(side_stream=False)`` runs the tail (gather + fp32 split kernel) on the caller's
    stream after the fused kernel instead of beside it; same results."""
    _cupy_knobs(monkeypatch, side_stream=False)
    test_decode_attention(cupy_target, a)


@pytest.mark.parametrize("ci, dtype", [(0, torch.float16), (3, torch.float16), (4, torch.float32)],
                         ids=["KIVI-K2V2-fp16", "Kitty-fp16", "Kitty-Pro-fp32"])
def test_decode_launches_packed_cupy_and_graph(cupy_target, ci, dtype, monkeypatch):
    """CuPy: the decode's launches with their arguments packed by kvq (``_loader.LAUNCH_MODE = "packed"``,
    the default: one struct, cuLaunchKernel) and by CuPy's launcher ("cupy") give the same bits, the
    packed path really launches, and the decode replayed from a CUDA graph (raw side streams, fork and
    join by events) gives the eager call's bits; fp32 q (the gather tail on a side stream) too."""
    import kvq.fast.cupy._loader as L

    cfg, ref, fast, (B, H, D) = _setup(CASES[ci], cupy_target)
    k, v = _kv(B, H, 2048 + 77, D, cfg.group_size, seed=ci + 5, start=cfg.sink)
    fs = fast.init(cfg, B, H, D)
    fast.append(cfg, fs, torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda())
    q = torch.randn((B, 4 * H, 1, D), generator=torch.Generator().manual_seed(ci), dtype=torch.float32)
    q = q.to(dtype).cuda()
    packed = []
    real = L._driver_launch()
    assert real is not None
    # every cuLaunchKernel kvq makes itself (the planned launches, _loader.Prepared, and _launch_packed)
    monkeypatch.setattr(L, "_driver_launch", lambda: lambda *a: packed.append(real(*a)))
    want = fast.decode_attention(cfg, fs, q)
    assert packed
    monkeypatch.setattr(L, "LAUNCH_MODE", "cupy")
    n = len(packed)
    got = fast.decode_attention(cfg, fs, q)
    assert len(packed) == n                                    # CuPy's launcher: no packed launch
    monkeypatch.setattr(L, "LAUNCH_MODE", "packed")
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                              # warm-up off the capture, as torch asks
        fast.decode_attention(cfg, fs, q)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = fast.decode_attention(cfg, fs, q)
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(want, outs):
        assert torch.equal(a, b)


# (case index or a config, T, q dtype, GQA ratio, head dim): tails with quantized keys and fp16 values
# (R = G), fp16 keys and quantized values (R < G), a sink, bf16 q (CUDA-core kernel), D = 64, no page,
# 8-bit keys, mixed key rows over two pages (R > G)
TAIL = [(0, 3001, torch.float16, 4, 128), (0, 2048 + 77, torch.float16, 8, 128), (3, 1111, torch.float16, 8, 128),
        (4, 2500, torch.bfloat16, 4, 128), (1, 1500, torch.float16, 2, 128), (2, 999, torch.float16, 4, 128),
        (lambda: RK.KIVIConfig(2, 4, group_size=128, residual=40, max_tokens=4096), 1000, torch.float16, 4, 128),
        (lambda: RK.KIVIConfig(2, 2, **CUDA), 1300, torch.float16, 4, 64), (0, 100, torch.float16, 4, 128),
        (lambda: RK.KIVIConfig(8, 2, **CUDA), 1100, torch.float16, 4, 128),
        (lambda: RK.KIVIConfig(2, 2, group_size=128, residual=200, max_tokens=4096), 1030, torch.float16, 4, 128)]


@pytest.mark.parametrize("a", TAIL, ids=[f"{IDS[a[0]] if isinstance(a[0], int) else 'KIVI-cfg'}-T{a[1]}-"
                                         f"{str(a[2])[6:]}-gqa{a[3]}-D{a[4]}" for a in TAIL])
def test_decode_tail_in_place(cupy_target, a, monkeypatch):
    """CuPy: half-precision q reads the tail (sink, Q-buffers, window, mixed tokens) in place
    (``Knobs.fused_tail``, the default) and meets the tolerance rule: (fp16 q, D = 128) with the fp16
    rows on the tensor cores (paged_tail_mma, ``Knobs.tail_mma = True``) and the mixed rows by
    paged_mixed_mma where they all have their key in a page and their value in fp16 (else, and with
    ``Knobs.mixed_mma = False``, by paged_tail_attn), in either launch order with the same bits; off the
    tensor cores (``Knobs.tail_mma = False``) with ``Knobs.tail16 = True``
    (fp16 rows by paged_tail16_attn, mixed rows as above, and with ``Knobs.mixed_mma = False`` by
    paged_tail_attn; the auto rule picks it from one tail
    query tile per SM on) and False (every row by paged_tail_attn, one launch); the other launch order
    (``Knobs.tail_first``) gives the same bits; every tail row through paged_tail_attn with the warps
    per block of the gather's split kernel (``Knobs.tail16 = False``) gives the bits of the gather into an
    fp32 copy + attention.cu's split kernel (the same tile values, the same arithmetic)."""
    FP = _paged("cupy")
    ci, T, dtype, ratio, D = a
    if isinstance(ci, int):
        cfg, ref, fast, (B, H, _) = _setup(CASES[ci], cupy_target)
    else:
        cfg, ref, fast, B, H = ci(), RK, _mods("cupy")[0], 2, 4
    k, v = _kv(B, H, T, D, cfg.group_size, seed=T, start=cfg.sink)
    rs, fs = ref.init(cfg, B, H, D), fast.init(cfg, B, H, D)
    ref.append(cfg, rs, k, v)
    fast.append(cfg, fs, torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda())
    c = FP.counts(cfg, T)
    q = torch.from_numpy(np.random.default_rng(T).standard_normal((B, H * ratio, 1, D)).astype(np.float32))
    q = q.to(dtype).cuda()
    (o64, l64), (o32, l32) = _truth_ref32(ref, cfg, rs, q)
    kn = {"tail_first": FP.DEFAULT_KNOBS.tail_first}
    kn["tail_mma"] = True               # fp16 rows on the tensor cores (auto: batch >= 8)
    _cupy_knobs(monkeypatch, **kn)
    out_m, lse_m = fast.decode_attention(cfg, fs, q)
    check_close(out_m, o64, o32, dtype, "out (tail_mma)")
    check_close(lse_m, l64, l32, torch.float32, "lse (tail_mma)")
    kn["tail_first"] = not kn["tail_first"]
    _cupy_knobs(monkeypatch, **kn)
    out_mo, lse_mo = fast.decode_attention(cfg, fs, q)
    assert_bits_equal(out_m.float(), out_mo.float().cpu().numpy(), "out (tail_mma) vs the other launch order")
    assert_bits_equal(lse_m, lse_mo.cpu().numpy(), "lse (tail_mma) vs the other launch order")
    kn["tail_first"] = not kn["tail_first"]
    _cupy_knobs(monkeypatch, **kn)
    kn["tail_mma"] = False
    _cupy_knobs(monkeypatch, **kn)
    kn["tail16"] = True   # fp16 rows + mixed rows (small B: not auto)
    _cupy_knobs(monkeypatch, **kn)
    out, lse = fast.decode_attention(cfg, fs, q)
    check_close(out, o64, o32, dtype, "out")
    check_close(lse, l64, l32, torch.float32, "lse")
    kn["mixed_mma"] = False   # the mixed rows as fp32 tiles, not on the tensor cores
    _cupy_knobs(monkeypatch, **kn)
    out_f, lse_f = fast.decode_attention(cfg, fs, q)
    check_close(out_f, o64, o32, dtype, "out (mixed rows as fp32 tiles)")
    check_close(lse_f, l64, l32, torch.float32, "lse (mixed rows as fp32 tiles)")
    kn["mixed_mma"] = None
    _cupy_knobs(monkeypatch, **kn)
    kn["tail_first"] = not kn["tail_first"]
    _cupy_knobs(monkeypatch, **kn)
    out_o, lse_o = fast.decode_attention(cfg, fs, q)
    kn["tail16"] = False   # every tail row as fp32 tiles
    _cupy_knobs(monkeypatch, **kn)
    out_32, lse_32 = fast.decode_attention(cfg, fs, q)
    check_close(out_32, o64, o32, dtype, "out (fp32 tiles)")
    check_close(lse_32, l64, l32, torch.float32, "lse (fp32 tiles)")
    # with as many warps per block as the gather's split kernel (attn_warps(fp32, D): 1 at D = 128, 2 at
    # D = 64), the same keys per warp and the same bits (other warp counts: same rule, other bits)
    from kvq.fast.cupy import _loader as L
    kn["tail_warps"] = L.attn_warps(L.DT[torch.float32], D)
    _cupy_knobs(monkeypatch, **kn)
    out_32, lse_32 = fast.decode_attention(cfg, fs, q)
    kn["fused_tail"] = False   # gathered into an fp32 copy
    _cupy_knobs(monkeypatch, **kn)
    out_g, lse_g = fast.decode_attention(cfg, fs, q)
    for a_, b_, what in ((out, out_o, "the other launch order"), (out_32, out_g, "the gathered tail")):
        assert_bits_equal(a_.float(), b_.float().cpu().numpy(),
                          f"out vs {what} (n_kpages {c['n_kpages']}, n_vq {c['n_vq']})")
    assert_bits_equal(lse, lse_o.cpu().numpy(), "lse vs the other launch order")
    assert_bits_equal(lse_32, lse_g.cpu().numpy(), "lse (fp32 tiles) vs the gathered tail")


# caches whose mixed tail rows have their key in a page and their value in fp16 (paged_mixed_mma): config,
# T, GQA ratio, T_q. R = G: up to 127 mixed rows; R > G: mixed rows over two key pages; 4- and 8-bit keys
# (8-bit: the CUDA-core page kernel beside them, whose one fp32 chain per score put this cache's lse at
# 1.27x the bound on the H100 before its scores took interleaved chains; lab/2026-11-22-kivi-kitty-decode/results/h100-mixed-mma);
# Kitty (the high plane) with its sink; 8 query rows; a mixed run starting mid-tile
MIXED = [
    ("K2V2-T3001", lambda: RK.KIVIConfig(2, 2, **CUDA), 3001, 4, 1),
    ("K2V2-R200-T1030", lambda: RK.KIVIConfig(2, 2, group_size=128, residual=200, max_tokens=4096), 1030, 4, 1),
    ("K4V2*-T2100", lambda: RK.KIVIConfig(4, 2, sink=32, **CUDA), 2100, 4, 1),
    ("K8V4-T1100", lambda: RK.KIVIConfig(8, 4, **CUDA), 1100, 4, 1),
    ("Kitty-T2500", lambda: RT.KittyConfig(0.125, sink=32, **CUDA), 2500, 4, 1),
    ("Kitty-Pro-gqa8-T1777", lambda: RT.KittyConfig(0.25, sink=32, **CUDA), 1777, 8, 1),
    ("K2V4-gqa4-tq2-T1333", lambda: RK.KIVIConfig(2, 4, **CUDA), 1333, 4, 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name, make, T, ratio, T_q", MIXED, ids=[m[0] for m in MIXED])
def test_decode_mixed_rows_tensor_cores(name, make, T, ratio, T_q, monkeypatch):
    """CuPy, fp16 q: the mixed tail rows (key in a page, value fp16) on paged_mixed_mma (keys dequantized
    as paged_tail_attn's, held as hi + 2^-11 lo fp16 tiles, on the tensor cores: ``Knobs.mixed_mma``
    True, and None where the automatic rule takes it) meet the tolerance rule, and with False (the fp32-tile
    kernel) too; at batch 1 and 2, with the fp16 rows on the CUDA cores and on the tensor cores."""
    import kvq.fast.cupy.kivi as FK
    import kvq.fast.cupy.kitty as FT
    FP = _paged("cupy")
    cfg = make()
    ref, fast = (RT, FT) if isinstance(cfg, RT.KittyConfig) else (RK, FK)
    calls = []
    real = FP._mixed_mma_kernel
    monkeypatch.setattr(FP, "_mixed_mma_kernel", lambda nw, dev: calls.append(nw) or real(nw, dev))
    for B in (1, 2):
        H, D = 4, 128
        k, v = _kv(B, H, T, D, cfg.group_size, seed=T + B, start=cfg.sink, distinct=False)
        rs, fs = ref.init(cfg, B, H, D), fast.init(cfg, B, H, D)
        ref.append(cfg, rs, k, v)
        fast.append(cfg, fs, torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda())
        c = FP.counts(cfg, T)
        assert c["n_kpages"] * cfg.group_size > c["n_vq"], "the case must have mixed rows with page keys"
        rng = np.random.default_rng(T + B)
        q = torch.from_numpy(rng.standard_normal((B, H * ratio, T_q, D)).astype(np.float32)).half().cuda()
        (o64, l64), (o32, l32) = _truth_ref32(ref, cfg, rs, q)
        for tmma in (False, True):
            for mm in (True, None, False):
                _cupy_knobs(monkeypatch, tail_mma=tmma, mixed_mma=mm)
                n0 = len(calls)
                out, lse = fast.decode_attention(cfg, fs, q)
                if mm is not None:
                    assert (len(calls) > n0) == mm, f"{name}: paged_mixed_mma used: {len(calls) > n0}"
                what = f"{name} B={B} tail_mma={tmma} mixed_mma={mm}"
                check_close(out, o64, o32, torch.float16, f"{what}: out")
                check_close(lse, l64, l32, torch.float32, f"{what}: lse")


# 4-bit keys and / or values on the CuPy tensor-core kernel (paged_decode_mma2<0, NR, KB, VB>): config,
# GQA ratio, T_q (M = ratio * T_q <= 4: NR = 4; else NR = 8), q scale (large: |q| ~ 300, keys / values
# up to 3e4)
MMA4 = [
    ("K4V4-gqa4", lambda: RK.KIVIConfig(4, 4, **CUDA), 4, 1, 1.0),
    ("K4V4-gqa8", lambda: RK.KIVIConfig(4, 4, **CUDA), 8, 1, 1.0),
    ("K2V4-gqa4-tq2", lambda: RK.KIVIConfig(2, 4, **CUDA), 4, 2, 1.0),
    ("K4V2*-gqa4", lambda: RK.KIVIConfig(4, 2, sink=32, **CUDA), 4, 1, 1.0),
    ("K4V4-large", lambda: RK.KIVIConfig(4, 4, **CUDA), 2, 1, 300.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name, make, ratio, T_q, qs", MMA4, ids=[m[0] for m in MMA4])
def test_decode_tensor_cores_4bit(name, make, ratio, T_q, qs):
    """CuPy, fp16 q: 4-bit key and / or value codes take the tensor-core kernel (nibbles unpacked by lop3
    + fma.f16x2, their own fragment orders, mma.cuh mtile_pos) and meet the tolerance rule, at both query
    tile widths, with a partial last page, and with operands far beyond fp16 after scaling."""
    import kvq.fast.cupy.kivi as FK
    FP = _paged("cupy")
    cfg = make()
    B, H, D, T = 2, 4, 128, 2 * 1024 + 300
    k, v = _kv(B, H, T, D, cfg.group_size, seed=len(name), start=cfg.sink, distinct=False)
    if qs != 1.0:
        k = (k.astype(np.float32) * np.float32(3e4 / np.abs(k).max())).astype(np.float16)
        v = (v.astype(np.float32) * np.float32(3e4 / np.abs(v).max())).astype(np.float16)
    rs, fs = RK.init(cfg, B, H, D), FK.init(cfg, B, H, D)
    RK.append(cfg, rs, k, v)
    FK.append(cfg, fs, torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda())
    rng = np.random.default_rng(len(name) + 1)
    q = torch.from_numpy(rng.standard_normal((B, H * ratio, T_q, D)).astype(np.float32) * qs).half().cuda()
    assert FP.mma_ok(cfg, FK.KeyCodec.kernel_arrays(cfg, fs), q, D, ratio * T_q)
    scale = 1e-5 if qs != 1.0 else None
    out, lse = FK.decode_attention(cfg, fs, q, scale=scale)
    (o64, l64), (o32, l32) = (RK.decode_attention(cfg, rs, q.cpu().double().numpy(), scale=scale),
                              RK.decode_attention(cfg, rs, q.cpu().float().numpy(), scale=scale))
    check_close(out, o64, o32, torch.float16, f"{name}: out")
    check_close(lse, l64, l32, torch.float32, f"{name}: lse")


@pytest.mark.gpu
@pytest.mark.parametrize("kb, vb, sums, tmma, sink, mm",
                         [(2, 2, 2, True, 0, None), (4, 4, 2, True, 0, None), (4, 2, 2, True, 0, None),
                          (2, 4, 2, True, 0, None), (2, 2, 2, True, 32, None), (4, 4, 2, True, 32, None),
                          (2, 2, 1, False, 0, False), (4, 4, 1, False, 0, False), (2, 2, 2, False, 0, False),
                          (4, 4, 2, False, 0, False), (2, 2, 2, False, 0, None), (4, 4, 2, False, 32, None)],
                         ids=["K2V2", "K4V4", "K4V2", "K2V4", "K2V2*", "K4V4*", "K2V2-f64tail", "K4V4-f64tail",
                              "K2V2-cudacore-tail", "K4V4-cudacore-tail", "K2V2-cudacore-fp16-rows",
                              "K4V4*-cudacore-fp16-rows"])
def test_decode_tensor_cores_large_operands_sweep(kb, vb, sums, tmma, sink, mm, monkeypatch):
    """CuPy tensor-core decode with large operands (keys / values up to 3e4, |q| ~ 300, scale 1e-5: |lse| ~
    1e3) over 8 random caches (``benchmarks/accuracy_large_operands.py``; ``sink``: an FP16 sink of 32 tokens
    too): the lse meets the tolerance rule on every one (centered key codes in the page kernel; the fp16
    tail rows on the tensor cores with each score's k-step sums added pairwise, ``Knobs.tail_mma = True``
    (the automatic rule takes them at batch >= 8), or on the CUDA cores (False); the CUDA-core tail's score
    sums as four fp32 fma chains,
    the default, or in float64, ``Knobs.tail_sums`` = 2 / 1: with one fp32 fma chain per score the worst
    cache was 1.71x the bound, ``lab/2026-11-22-large-operand-accuracy/model_tail_scores.py``); the mixed rows (keys in a page, values
    fp16) on the tensor cores as hi + 2^-11 lo fp16 key tiles (``Knobs.mixed_mma`` None, the default) or as
    fp32 tiles (False)."""
    knobs = _paged("cupy").Knobs(tail_sums=sums, tail_mma=tmma, mixed_mma=mm)
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "accuracy_large_operands.py"
    spec = importlib.util.spec_from_file_location("accuracy_large_operands", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ratios = [mod.ratio(kb, vb, s, T, sink=sink, knobs=knobs) for s in range(4) for T in (1500, 2348)]
    assert max(ratios) <= 1.0, f"lse error / bound per cache: {[round(r, 2) for r in ratios]}"


@pytest.mark.parametrize("ci", [0, 3], ids=[IDS[0], IDS[3]])
def test_decode_large_magnitudes(target, ci):
    """Keys and values up to ~3e4, |q| up to ~1e3: q_d * scale_d far beyond float16 (65504); the
    tensor-core path scales its operands, nothing overflows."""
    _, device = target
    cfg, ref, fast, (B, H, D) = _setup(CASES[ci], target)
    T = 75 if device == "cpu" else 1500
    k, v = _kv(B, H, T, D, cfg.group_size, seed=9, start=cfg.sink, distinct=ci == 3)
    k = k.astype(np.float32)
    v = v.astype(np.float32)
    k = (k * np.float32(3e4 / np.abs(k).max())).astype(np.float16)    # largest |k| = 3e4 at any length
    v = (v * np.float32(3e4 / np.abs(v).max())).astype(np.float16)
    rs, fs = ref.init(cfg, B, H, D), fast.init(cfg, B, H, D)
    ref.append(cfg, rs, k, v)
    fast.append(cfg, fs, torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))
    q = torch.from_numpy(np.random.default_rng(2).standard_normal((B, 2 * H, 1, D)).astype(np.float32) * 300)
    q = q.to(torch.float16).to(device)
    out, lse = fast.decode_attention(cfg, fs, q, scale=1e-5)
    (o64, l64), (o32, l32) = (ref.decode_attention(cfg, rs, q.cpu().double().numpy(), scale=1e-5),
                              ref.decode_attention(cfg, rs, q.cpu().float().numpy(), scale=1e-5))
    check_close(out, o64, o32, torch.float16, "out")
    check_close(lse, l64, l32, torch.float32, "lse")


def test_group_size_not_a_power_of_two(target):
    """G = 24 (the fused kernel takes powers of two): decode dequantizes the cache and runs the FP16
    kernel on it; state and dequantize are bit-exact as everywhere."""
    _, device = target
    cfg = RK.KIVIConfig(2, 2, group_size=24, residual=8, sink=2, max_tokens=256)
    FK, _ = _mods(target[0])
    B, H, D, T = 2, 2, 16, 90
    k, v = _kv(B, H, T, D, 24, seed=8, distinct=False)
    rs, fs = RK.init(cfg, B, H, D), FK.init(cfg, B, H, D)
    RK.append(cfg, rs, k, v)
    FK.append(cfg, fs, torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))
    assert_same_state(fs, rs)
    q = torch.from_numpy(np.random.default_rng(4).standard_normal((B, 4, 1, D)).astype(np.float32)).to(device)
    out, lse = FK.decode_attention(cfg, fs, q)
    (o64, l64), (o32, l32) = _truth_ref32(RK, cfg, rs, q)
    check_close(out, o64, o32, torch.float32, "out")
    check_close(lse, l64, l32, torch.float32, "lse")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_small_groups(target, dtype):
    """G = 16 at GPU sizes (D = 128, thousands of tokens): the fused kernels with pages of 16 tokens. On
    the GPU the Triton kernel takes its exact fp32 path there (a 16-element tensor-core reduction of
    byte-fed operands is mis-compiled by Triton 3.6 on sm_90); out and lse by the tolerance rule."""
    _, device = target
    cfg = RK.KIVIConfig(2, 2, group_size=16, residual=16, sink=4, max_tokens=4096)
    FK, _ = _mods(target[0])
    B, H, D = (2, 2, 32) if device == "cpu" else (2, 4, 128)
    T = 70 if device == "cpu" else 2000
    k, v = _kv(B, H, T, D, 16, seed=31, start=cfg.sink)
    rs, fs = RK.init(cfg, B, H, D), FK.init(cfg, B, H, D)
    RK.append(cfg, rs, k, v)
    FK.append(cfg, fs, torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))
    q = torch.from_numpy(np.random.default_rng(5).standard_normal((B, 4 * H, 1, D)).astype(np.float32))
    q = q.to(dtype).to(device)
    out, lse = FK.decode_attention(cfg, fs, q)
    (o64, l64), (o32, l32) = _truth_ref32(RK, cfg, rs, q)
    check_close(out, o64, o32, dtype, "out")
    check_close(lse, l64, l32, torch.float32, "lse")


def test_kitty_near_ties(target):
    """Random keys (no built-in ranking): a boosted channel may differ only at a near-tie of the
    reference's scores; pages whose selection agrees are bit-exact; scores agree to rounding."""
    _, device = target
    _device_ok(device)
    _, FT = _mods(target[0])
    cfg = RT.KittyConfig(0.25, sink=3, **(SMALL if device == "cpu" else CUDA))
    B, H, D = (2, 2, 32) if device == "cpu" else (2, 4, 128)
    T = 90 if device == "cpu" else 1200
    k, v = _kv(B, H, T, D, cfg.group_size, seed=21, distinct=False)
    rs = RT.init(cfg, B, H, D)
    RT.append(cfg, rs, k, v)
    fs = FT.init(cfg, B, H, D)
    FT.append(cfg, fs, torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))
    G, S, Db = cfg.group_size, cfg.sink, cfg.d_boost(D)
    ra, fa = rs.arrays(), {n: t.cpu().numpy() for n, t in fs.arrays().items()}
    for n in ra:
        if not n.startswith("k_pool."):
            assert_bits_equal(fs.arrays()[n], ra[n], n)
    n_pages = (T - S) // G
    flips = 0
    for b in range(B):
        for j in range(n_pages):
            pid = rs.k_table[b, j]
            page = k[b, :, S + j * G:S + (j + 1) * G]                      # (H, G, D)
            sc_ref = RT.channel_scores(page)
            sc_fast = FT.channel_scores(torch.from_numpy(page).to(device)).cpu().numpy()
            np.testing.assert_allclose(sc_fast, sc_ref, rtol=2e-6, atol=0)
            for h in range(H):
                rb, fb = ra["k_pool.idx"][pid, h] < Db, fa["k_pool.idx"][pid, h] < Db
                if np.array_equal(rb, fb):
                    for n in ("low", "high", "idx", "scale", "mn"):
                        assert np.array_equal(fa[f"k_pool.{n}"][pid, h].view(np.uint8),
                                              ra[f"k_pool.{n}"][pid, h].view(np.uint8)), (b, j, h, n)
                else:
                    flips += 1
                    kth = np.sort(sc_ref[h])[::-1][Db - 1]                  # the boundary score
                    for c in np.flatnonzero(rb != fb):
                        assert abs(sc_ref[h, c] - kth) <= 4e-6 * kth, (b, j, h, c, sc_ref[h, c], kth)
    assert flips <= max(1, n_pages * B * H // 4)


def test_kitty_page_functions(target):
    """channel_scores / select_boost (ties -> lower channel; random) / encode_page / dequantize_page."""
    _, device = target
    _device_ok(device)
    _, FT = _mods(target[0])
    rng = np.random.default_rng(3)
    G, D = 16, 32
    x = rng.standard_normal((3, G, D)).astype(np.float16)
    x[:, :, 5] = -x[:, :, 4]                                               # exact tie: channel 4 wins
    x[1, :, 7] = 0.0                                                        # zero channel
    x[2] = 1.5                                                              # constant page: all scores tie
    xt = torch.from_numpy(x).to(device)
    sc_ref = RT.channel_scores(x)
    sc = FT.channel_scores(xt)
    np.testing.assert_allclose(sc.cpu().numpy(), sc_ref, rtol=2e-6, atol=0)
    for db in (0, 1, 4, 8, D):
        assert_bits_equal(FT.select_boost(torch.from_numpy(sc_ref).to(device), db), RT.select_boost(sc_ref, db),
                          f"select_boost d={db}")
    r = FT.select_boost(sc, 4, "random", np.random.default_rng([7, 2]))
    assert_bits_equal(r, RT.select_boost(sc_ref, 4, "random", np.random.default_rng([7, 2])), "random")
    boost = RT.select_boost(sc_ref, 8)
    for meta in ("float16", "float32"):
        ref_page = RT.encode_page(x, boost, meta)
        page = FT.encode_page(xt, torch.from_numpy(boost).to(device), meta)
        assert page.keys() == ref_page.keys()
        for n in ref_page:
            assert_bits_equal(page[n], ref_page[n], f"encode_page {n} ({meta})")
        assert_bits_equal(FT.dequantize_page(page, G), RT.dequantize_page(ref_page, G), "dequantize_page")
    with pytest.raises(ValueError, match="same number of channels"):
        bad = boost.copy()
        bad[0, 0] = ~bad[0, 0]
        FT.encode_page(xt, torch.from_numpy(bad).to(device))
    with pytest.raises(ValueError, match="d_boost"):
        FT.select_boost(sc, D + 1)


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=[IDS[1], IDS[3]])
def test_bad_input(target, case):
    _, device = target
    _device_ok(device)
    cfg, ref, fast, (B, H, D) = _setup(case, target)
    k, v = _kv(B, H, 30, D, cfg.group_size, seed=2, start=cfg.sink)
    rs, fs = ref.init(cfg, B, H, D), fast.init(cfg, B, H, D)
    ref.append(cfg, rs, k, v)
    fast.append(cfg, fs, torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))
    before = fs.copy()
    T = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)     # noqa: E731
    k1, v1 = k[:, :, :3], v[:, :, :3]
    nan = k1.copy()
    nan[0, 1, 2, 3] = np.nan
    big = k1.astype(np.float32)
    big[1, 0, 0, 0] = 1e6
    bad = [
        (k1.astype(np.float64), v1),                                   # dtype
        (k1.astype(np.int32), v1),
        (k1[:, :1], v1[:, :1]),                                        # wrong H
        (k1[..., :D // 2], v1[..., :D // 2]),                          # wrong D
        (k1[0], v1[0]),                                                # 3-D
        (k1, v[:, :, :4]),                                             # k / v shapes differ
        (nan, v1),                                                     # NaN
        (big, v1.astype(np.float32)),                                  # overflows fp16
        (np.zeros((B, H, cfg.max_tokens, D), np.float16),) * 2,       # over capacity
    ]
    for kb, vb in bad:
        _errors(lambda: ref.append(cfg, rs, kb, vb), lambda: fast.append(cfg, fs, T(kb), T(vb)))
        assert_same_state(fs, before)
    assert_same_state(fs, rs)
    q = np.zeros((B, H * 2, 1, D), np.float32)
    for qb in (q[:, :H + 1] if H > 1 else q[:1], q[..., :D // 2], q[0]):
        _errors(lambda: ref.decode_attention(cfg, rs, qb), lambda: fast.decode_attention(cfg, fs, T(qb)))
    empty_r, empty_f = ref.init(cfg, B, H, D), fast.init(cfg, B, H, D)
    _errors(lambda: ref.decode_attention(cfg, empty_r, q), lambda: fast.decode_attention(cfg, empty_f, T(q)))
    _errors(lambda: ref.init(cfg, 0, H, D), lambda: fast.init(cfg, 0, H, D))
    with pytest.raises(TypeError):
        fast.decode_attention(cfg, fs, T(q).double())
    # an empty append changes nothing
    fast.append(cfg, fs, T(k[:, :, :0]), T(v[:, :, :0]))
    assert_same_state(fs, before)


@pytest.mark.parametrize("ci", [0, 3], ids=["KIVI-K2V2", "Kitty"])
def test_decode_plan_reused(triton_target, ci, monkeypatch, triton_dispatches):
    """Triton: a decode's launches are planned once per call shape (``paged.decode_plan``) and kept; on the
    GPU a plan's launches keep their compiled kernels after the first call, so a later call makes no Triton
    dispatch at all and gives the first call's bits, as does a call through Triton's dispatch. A new length
    is a new plan, whose first call takes the kernels earlier plans compiled for the same binaries; a q that
    is not 16-byte aligned gets a plan that always dispatches, with the same bits."""
    from kvq.fast.triton import _launch as L

    _, device = triton_target
    cfg, ref, fast, (B, H, D) = _setup(CASES[ci], triton_target)
    FP = _paged("triton")
    T = 90 if device == "cpu" else 2048 + 77
    k, v = _kv(B, H, T + 1, D, cfg.group_size, seed=ci, start=cfg.sink)
    fs = fast.init(cfg, B, H, D)
    fast.append(cfg, fs, torch.from_numpy(k[:, :, :T]).to(device), torch.from_numpy(v[:, :, :T]).to(device))
    q = torch.randn((B, 4 * H, 1, D), generator=torch.Generator().manual_seed(ci)).to(torch.float16).to(device)
    codec = fast.KeyCodec
    out0, lse0 = fast.decode_attention(cfg, fs, q)
    p = FP.decode_plan(cfg, codec, fs, q)
    assert FP.decode_plan(cfg, codec, fs, q.clone()) is p
    launches = [x for x in (p.gather, p.fused, p.tail, p.merge) if x is not None]
    assert p.fused is not None and p.gather is not None and len(launches) == 4
    on_gpu = device != "cpu"
    assert all(x.fast == on_gpu and (x.compiled is not None) == on_gpu for x in launches)
    assert p.ready == on_gpu and p.launches == tuple(launches)

    dispatched = triton_dispatches
    dispatched.clear()
    out1, lse1 = fast.decode_attention(cfg, fs, q.clone())
    assert dispatched == [] if on_gpu else True
    assert torch.equal(out1, out0) and torch.equal(lse1, lse0)
    monkeypatch.setattr(L, "current_stream", lambda device_index: None)       # Triton's dispatch every launch
    out2, lse2 = fast.decode_attention(cfg, fs, q)
    assert len(dispatched) == (4 if on_gpu else 0)
    assert torch.equal(out2, out0) and torch.equal(lse2, lse0)
    monkeypatch.undo()

    # not 16-byte aligned: a plan of its own that never keeps a kernel, so Triton's dispatch picks the
    # binary for that alignment every call (on the GPU its loads are laid out differently, and the sums'
    # order with them: the bits may differ from the aligned q's; the tolerance rule holds, and repeated
    # calls agree)
    qm = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)[1:].view(q.shape)
    qm.copy_(q)
    pm = FP.decode_plan(cfg, codec, fs, qm)
    assert pm is not p and not any(x.fast for x in pm.launches)
    out3, lse3 = fast.decode_attention(cfg, fs, qm)
    out4, lse4 = fast.decode_attention(cfg, fs, qm)
    assert torch.equal(out4, out3) and torch.equal(lse4, lse3)
    assert pm.fused.compiled is None and not pm.ready
    rs = ref.init(cfg, B, H, D)
    ref.append(cfg, rs, k[:, :, :T], v[:, :, :T])
    (o64, l64), (o32, l32) = _truth_ref32(ref, cfg, rs, q)
    check_close(out3, o64, o32, torch.float16, "out (q not 16-byte aligned)")
    check_close(lse3, l64, l32, torch.float32, "lse (q not 16-byte aligned)")

    # one token more: another plan (one more tail token or a page more)
    fast.append(cfg, fs, torch.from_numpy(k[:, :, T:]).to(device), torch.from_numpy(v[:, :, T:]).to(device))
    p2 = FP.decode_plan(cfg, codec, fs, q)
    assert p2 is not p and (p2.NF, p2.NT) != (p.NF, p.NT)
    # its first call takes the kernels that earlier plans compiled for the same binaries (_launch.COMPILED):
    # Triton's dispatch at most for a launch whose constexprs or options the first plan's launches had not
    fresh = sum(x._binary not in {y._binary for y in launches} for x in p2.launches)
    dispatched.clear()
    out5, lse5 = fast.decode_attention(cfg, fs, q)
    assert len(dispatched) <= fresh if on_gpu else True
    assert p2.ready == on_gpu
    rs2 = ref.init(cfg, B, H, D)
    ref.append(cfg, rs2, k, v)
    (o64, l64), (o32, l32) = _truth_ref32(ref, cfg, rs2, q)
    check_close(out5, o64, o32, torch.float16, "out (a new length's plan)")
    check_close(lse5, l64, l32, torch.float32, "lse (a new length's plan)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_addresses_match_tensors(triton_target, dtype, monkeypatch):
    """Triton: a ready plan's call hands each launch the device addresses of exactly the tensors (and
    buffer views) the dispatch path hands it, the integers and the scale unchanged (bf16 q: its fp32 copy
    for the gathered tail, alive until the launches). Checked by recording both paths' arguments (on the
    CPU too, where no launch may take addresses: the launches are recorded, not run)."""
    from kvq.fast.triton import _launch as L

    cfg, _, fast, (B, H, D) = _setup(CASES[3], triton_target)
    _, device = triton_target
    k, v = _kv(B, H, 90 if device == "cpu" else 2048 + 77, D, cfg.group_size, seed=2, start=cfg.sink)
    fs = fast.init(cfg, B, H, D)
    fast.append(cfg, fs, torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))
    q = torch.randn((B, 4 * H, 1, D), generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    FP = _paged("triton")
    p = FP.decode_plan(cfg, fast.KeyCodec, fs, q)
    got = {}

    def record(self, args, stream, device_index):
        got.setdefault(stream is not None, []).append((self.kernel, args))

    monkeypatch.setattr(L.Launch, "__call__", record)
    monkeypatch.setattr(L, "current_stream", lambda device_index: None)
    monkeypatch.setattr(p, "ready", False)
    fast.decode_attention(cfg, fs, q)
    monkeypatch.setattr(L, "current_stream", lambda device_index: 1)
    monkeypatch.setattr(p, "ready", True)
    fast.decode_attention(cfg, fs, q)
    tensors, addresses = got[False], got[True]
    assert p.gather is not None
    assert [kern for kern, _ in tensors] == [kern for kern, _ in addresses] and len(tensors) == 4
    for (kern, ta), (_, aa) in zip(tensors, addresses):
        assert len(ta) == len(aa), kern
        for x, y in zip(ta, aa):
            if isinstance(x, torch.Tensor):
                assert isinstance(y, int), kern
                if x.data_ptr() != y:          # out, lse and the buffer are new each call: same layout
                    assert not any(x is t for t in (q, fs.k_buf, fs.v_codes, fs.k_table)), kern
            else:
                assert x == y, kern
    # the state's tensors and (fp16) q are passed at their own addresses
    gather_args = addresses[0][1]
    assert fs.k_buf.data_ptr() in gather_args and fs.v_table.data_ptr() in gather_args
    fused, tail = addresses[1][1], addresses[2][1]
    assert (fused[0] == q.data_ptr()) == (not p.q_float) and (tail[0] == q.data_ptr()) == (not p.tail_q_float)
    assert p.tail_q_float == (dtype == torch.bfloat16)
    if p.q_float and p.tail_q_float:                       # one fp32 copy of q serves both
        assert fused[0] == tail[0]
