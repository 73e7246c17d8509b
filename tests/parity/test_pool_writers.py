"""The paged cache's single-kernel pool writers (``kvq.fast.triton._flush`` and its CUDA twin
``kvq.fast.cupy._flush``): ``flush_key_pages`` (KIVI's and Kitty's full key pages, one launch per flush)
and ``evict_values`` (the values that leave the window, quantized per token into their page slots, one
launch per append), both straight into the pool; and ``append_token`` (a decode token's whole append, one launch).

The cache state they leave equals the reference's bit for bit and the torch path's (``FUSED_FLUSH``
off: the quantize kernels and copies into the pool), over bit widths 2 / 4 / 8, value groups that do
not fill whole bytes, are not a power of two or span several warps (D = 64), fp32 metadata, Kitty's
boost rates (none, all), a page group that is not a power of two, and bulk, chunked and one-token
appends. Kitty uses keys with an unambiguous channel ranking (contract rule 7:
``test_kivi_kitty_parity.test_kitty_near_ties`` covers near-ties, through the same kernel). The appends
use the writers (no page arrays, no separate value quantization); Kitty's random selection (host RNG)
and a backend without writers take the torch path; bad arguments raise before any launch and leave the
pool as it was. Under the interpreter the Triton writer declines large evictions, which take the value
quantizer (``kvq.fast.triton._flush.INTERP_EVICT_PROGRAMS``: one program per token and head is slow
there); the parity tests lift the limit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvq.fast.caches import codecs as _codecs
from kvq.fast.caches import paged as _paged
from kvq.fast.cupy import _flush as CW
from kvq.fast.cupy import kitty as CK
from kvq.fast.cupy import kivi as CV
from kvq.fast.triton import _flush as W
from kvq.fast.triton import kitty as TK
from kvq.fast.triton import kivi as TV
from kvq.fast.triton import packing as TP
from kvq.fast.triton import quant as TQ
from kvq.reference import kitty as RT
from kvq.reference import kivi as RK

from .cases import assert_bits_equal
from .test_kivi_kitty_parity import _chunks, _kv, assert_same_state

#: (backend, device): the Triton kernels under the CPU interpreter (CI) and on the GPU, the CUDA kernels on the GPU
TARGETS = [pytest.param(("triton", "cpu"), id="triton-interp"),
           pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
           pytest.param(("cupy", "cuda"), id="cupy-cuda", marks=pytest.mark.gpu)]
#: backend -> (KIVI module, Kitty module, writers module)
MODS = {"triton": (TV, TK, W), "cupy": (CV, CK, CW)}


@pytest.fixture(params=TARGETS)
def target(request):
    if request.param[1] == "cpu" and torch.cuda.is_available():
        pytest.skip("the Triton interpreter target runs only on machines without a GPU (CI)")
    return request.param


def _fast(backend, kind):
    """The backend's module of the method kind ("kivi" / "kitty") and its writers."""
    kivi, kitty, writers = MODS[backend]
    return (kivi if kind == "kivi" else kitty), writers


S = dict(group_size=16, residual=5)
# name, method kind, config, (B, H, D), T, chunk kind
CASES = [
    ("KIVI-K2V2", "kivi", RK.KIVIConfig(2, 2, max_tokens=75, **S), (2, 2, 16), 75, "random"),
    ("KIVI-K4V2*", "kivi", RK.KIVIConfig(4, 2, sink=3, max_tokens=60, **S), (2, 1, 16), 60, "ones"),
    ("KIVI-K8V8", "kivi", RK.KIVIConfig(8, 8, max_tokens=50, **S), (1, 2, 16), 50, "bulk"),
    ("KIVI-K2V4-Gv8", "kivi", RK.KIVIConfig(2, 4, v_group_size=8, max_tokens=60, **S), (2, 1, 32), 60, "random"),
    ("KIVI-K4V2-Gv2", "kivi", RK.KIVIConfig(4, 2, v_group_size=2, max_tokens=50, **S), (1, 2, 16), 50, "random"),
    ("KIVI-K2V2-G12", "kivi", RK.KIVIConfig(2, 2, group_size=12, residual=3, max_tokens=50), (2, 1, 20), 50, "bulk"),
    ("KIVI-K2V4-Gv5", "kivi", RK.KIVIConfig(2, 4, v_group_size=5, max_tokens=40, **S), (1, 2, 20), 40, "random"),
    ("KIVI-K2V2-D64", "kivi", RK.KIVIConfig(2, 2, max_tokens=40, **S), (1, 2, 64), 40, "random"),
    ("KIVI-K4V4-fp32-meta", "kivi", RK.KIVIConfig(4, 4, meta_dtype="float32", max_tokens=50, **S), (1, 2, 16), 50,
     "random"),
    ("Kitty", "kitty", RT.KittyConfig(0.125, sink=3, max_tokens=75, **S), (2, 2, 32), 75, "bulk"),
    ("Kitty-Pro", "kitty", RT.KittyConfig(0.25, sink=3, max_tokens=70, **S), (2, 1, 32), 70, "random"),
    ("Kitty-ones", "kitty", RT.KittyConfig(0.25, sink=2, max_tokens=45, **S), (1, 2, 16), 45, "ones"),
    ("Kitty-no-boost", "kitty", RT.KittyConfig(0.0, sink=3, max_tokens=40, **S), (1, 2, 16), 40, "bulk"),
    ("Kitty-all-boost", "kitty", RT.KittyConfig(1.0, sink=3, max_tokens=40, **S), (2, 1, 16), 40, "random"),
    ("Kitty-G12-D20", "kitty", RT.KittyConfig(0.3, group_size=12, residual=5, sink=3, max_tokens=50), (2, 2, 20), 50,
     "random"),
]


@pytest.mark.parametrize("name, kind, cfg, shape, T, chunks", CASES, ids=[c[0] for c in CASES])
def test_writers_equal_reference_and_torch_path(target, monkeypatch, name, kind, cfg, shape, T, chunks):
    backend, device = target
    ref = RK if kind == "kivi" else RT
    fast, _ = _fast(backend, kind)
    B, H, D = shape
    k, v = _kv(B, H, T, D, cfg.group_size, seed=7, start=cfg.sink)
    rs = ref.init(cfg, B, H, D)
    ref.append(cfg, rs, k, v)
    states = {}
    monkeypatch.setattr(W, "INTERP_EVICT_PROGRAMS", 1 << 30)           # the writer for every eviction
    for fused in (True, False):
        monkeypatch.setattr(_codecs, "FUSED_FLUSH", fused)
        fs = fast.init(cfg, B, H, D)
        t = 0
        for n in _chunks(chunks, T):
            kt, vt = (torch.from_numpy(a[:, :, t:t + n]).to(device) for a in (k, v))
            fast.append(cfg, fs, kt, vt)
            t += n
        assert_same_state(fs, rs, "writers " if fused else "torch path ")
        states[fused] = fs
    for n, a in states[True].arrays().items():
        assert_bits_equal(a, states[False].arrays()[n].cpu().numpy(), n)


@pytest.mark.parametrize("kind, cfg", [("kivi", RK.KIVIConfig(2, 4, sink=2, residual=4, group_size=16, max_tokens=64)),
                                       ("kitty", RT.KittyConfig(0.25, sink=2, residual=4, group_size=16, max_tokens=64))],
                         ids=["KIVI", "Kitty"])
def test_appends_take_the_writers(target, monkeypatch, kind, cfg):
    """With the writers on, appends build no page arrays (encode_pages) and quantize no values apart."""
    backend, device = target
    fast, _ = _fast(backend, kind)

    def forbidden(*a, **kw):
        raise AssertionError("the torch path was taken")

    codec = type(fast.KeyCodec)
    monkeypatch.setattr(W, "INTERP_EVICT_PROGRAMS", 1 << 30)
    monkeypatch.setattr(codec, "encode_pages", forbidden)
    monkeypatch.setattr(_paged, "quantize_values", forbidden)
    k, v = _kv(1, 2, 64, 16, 16, seed=3, start=2)
    fs = fast.init(cfg, 1, 2, 16)
    for t in range(0, 64, 16):
        fast.append(cfg, fs, torch.from_numpy(k[:, :, t:t + 16]).to(device), torch.from_numpy(v[:, :, t:t + 16]).to(device))
    assert fs.k_next == 3 and fs.v_next > 0                         # pages were written
    monkeypatch.setattr(_codecs, "FUSED_FLUSH", False)
    with pytest.raises(AssertionError, match="torch path"):
        fast.append(cfg, fast.init(cfg, 1, 2, 16), torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))


def test_interpreter_takes_the_quantizer_for_large_evictions(monkeypatch):
    """Under the interpreter the Triton writer declines an eviction of more (token, head) programs than
    INTERP_EVICT_PROGRAMS (it returns False, nothing written) and the value quantizer takes it (the same
    bits); it writes the smaller ones (True); on the GPU it takes every eviction."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter rule is exercised on the CPU (CI)")
    cfg = RK.KIVIConfig(2, 2, group_size=16, residual=4, max_tokens=64)
    k, v = _kv(1, 2, 40, 16, 16, seed=2, distinct=False)
    calls = []
    real = _paged.quantize_values
    monkeypatch.setattr(_paged, "quantize_values", lambda *a: calls.append(a[2].shape[2]) or real(*a))
    monkeypatch.setattr(W, "interpreting", lambda: True)
    fs = TV.init(cfg, 1, 2, 16)
    TV.append(cfg, fs, torch.from_numpy(k[:, :, :30]), torch.from_numpy(v[:, :, :30]))    # 26 x 2 programs
    TV.append(cfg, fs, torch.from_numpy(k[:, :, 30:33]), torch.from_numpy(v[:, :, 30:33]))  # 3 x 2 programs
    assert calls == [26]
    toks = torch.zeros((1, 2, 9, 16), dtype=torch.float16)                      # 18 programs: declined
    pool = (torch.zeros((2, 2, 16, 4), dtype=torch.uint8), torch.zeros((2, 2, 16, 2), dtype=torch.float16),
            torch.zeros((2, 2, 16, 2), dtype=torch.float16))
    table = torch.zeros((1, 1), dtype=torch.int32)
    assert W.evict_values(toks, *pool, table, 0, 2, 8) is False and not pool[0].any()
    ramp = torch.arange(16, dtype=torch.float16).expand(1, 2, 8, 16)           # 16 programs: written
    assert W.evict_values(ramp, *pool, table, 0, 2, 8) is True and pool[0].any() and pool[1].any()
    rs = RK.init(cfg, 1, 2, 16)
    RK.append(cfg, rs, k[:, :, :33], v[:, :, :33])
    assert_same_state(fs, rs)


def test_writers_decline():
    """Kitty's random selection (drawn on the host) and a backend without writers take the torch path."""
    pages = torch.zeros((1, 1, 1, 16, 16), dtype=torch.float16)
    kitty = _codecs.KittyCodec(TK.paged.OPS)
    pool = kitty.empty_pool(RT.CONFIGS["Kitty"], 2, 1, 16, "cpu")
    assert kitty.write_pages(RT.KittyConfig(0.25, selection="random", group_size=16), pool, pages, 0) is False
    bare = _codecs.Ops("bare", TQ, TP, lambda: True)
    assert _codecs.KittyCodec(bare).write_pages(RT.KittyConfig(0.25, group_size=16), pool, pages, 0) is False
    assert _codecs.KIVICodec(bare).write_pages(RK.KIVIConfig(2, 2, group_size=16), {}, pages, 0) is False
    assert _codecs.writer(bare, "value_evict") is None
    assert (TK.paged.OPS.key_flush, TK.paged.OPS.value_evict) == (W.flush_key_pages, W.evict_values)
    assert (CK.paged.OPS.key_flush, CK.paged.OPS.value_evict) == (CW.flush_key_pages, CW.evict_values)
    assert (CK.paged.OPS.token_append, TK.paged.OPS.token_append) == (CW.append_token, W.append_token)
    assert _codecs.writer(bare, "token_append") is None


# ---------------------------------------------------------------------------------------------------
# one decode token's append in one kernel (token_append: Triton's _append_token_kernel, CuPy's flush.cu append_token)


TOKEN_CASES = [c for c in CASES if c[0] in ("KIVI-K2V2", "KIVI-K4V2*", "KIVI-K2V4-Gv5", "KIVI-K4V4-fp32-meta",
                                            "Kitty", "Kitty-G12-D20")]
TOKEN_CASES.append(("KIVI-K2V2-R0", "kivi", RK.KIVIConfig(2, 2, group_size=16, residual=0, max_tokens=50),
                    (2, 1, 16), 50, "ones"))


def _counting(fast, monkeypatch, real):
    """The module's codec with its ``token_append`` writer counted: the mode of each call, in order."""
    modes = []

    def token_append(*a):
        modes.append(a[12])
        return real(*a)

    monkeypatch.setattr(fast.KeyCodec, "ops", dataclasses.replace(fast.KeyCodec.ops, token_append=token_append))
    return modes


def _expected_modes(cfg, T):
    """The ``token_append`` mode of each one-token append of tokens 0 .. T - 1 the routing gives the writer
    (``_paged.token_route``): past the sink, not completing a key page, and not the eviction that fills
    Kitty's value Q-buffer: 0 while the window fills, then 1 (Kitty's value Q-buffer) or 2 (KIVI's pages)."""
    out = []
    for t in range(T):
        c0 = _paged.counts(cfg, t)
        evicting = cfg.residual == 0 or c0["n_win"] == cfg.residual
        if (t >= cfg.sink and c0["n_kbuf"] + 1 < cfg.group_size
                and not (evicting and cfg.v_qbuffer and c0["n_vbuf"] + 1 >= cfg.group_size)):
            out.append(0 if not evicting else 1 if cfg.v_qbuffer else 2)
    return out


@pytest.mark.parametrize("name, kind, cfg, shape, T, chunks", TOKEN_CASES, ids=[c[0] for c in TOKEN_CASES])
def test_token_append(target, monkeypatch, name, kind, cfg, shape, T, chunks):
    """One token per append: after every token the state equals the reference's bit for bit, and the torch
    path's (FUSED_FLUSH off) at the end; with the writers on, every single-token append that does not complete
    a key page takes the backend's one-kernel ``token_append`` (mode 0 while the window fills, 1 into Kitty's
    value Q-buffer, 2 into KIVI's pages, new pages entered in the table), and the eviction that fills Kitty's
    value Q-buffer takes the copies instead."""
    backend, device = target
    fast, writers = _fast(backend, kind)
    ref = RK if kind == "kivi" else RT
    monkeypatch.setattr(W, "INTERP_EVICT_PROGRAMS", 1 << 30)
    modes = _counting(fast, monkeypatch, writers.append_token)
    B, H, D = shape
    k, v = _kv(B, H, T, D, cfg.group_size, seed=11, start=cfg.sink)
    kt, vt = torch.from_numpy(k).to(device), torch.from_numpy(v).to(device)
    states = {}
    for fused in (True, False):
        monkeypatch.setattr(_codecs, "FUSED_FLUSH", fused)
        fs = fast.init(cfg, B, H, D)
        for t in range(T):
            fast.append(cfg, fs, kt[:, :, t:t + 1], vt[:, :, t:t + 1])
            if fused or t == T - 1:
                rs = ref.init(cfg, B, H, D)
                ref.append(cfg, rs, k[:, :, :t + 1], v[:, :, :t + 1])
                assert_same_state(fs, rs, f"{'writers' if fused else 'torch path'}, after token {t}: ")
        states[fused] = fs
    assert modes == _expected_modes(cfg, T)
    assert (2 if kind == "kivi" else 1) in modes and (0 in modes or cfg.residual == 0)
    for n, a in states[True].arrays().items():
        assert_bits_equal(a, states[False].arrays()[n].cpu().numpy(), n)


def test_token_append_declines_what_it_does_not_take():
    """``append_token`` (CuPy's; Triton's the same where it applies) returns False, launching nothing, for a token
    without unit channel stride, a head dim over the block's threads, or a value group that does not divide D
    (the caller then copies)."""
    B, H, D = 1, 2, 16
    z = lambda *s, dt=torch.float16: torch.zeros(s, dtype=dt)                 # noqa: E731
    pool = (z(2, H, 16, D // 4, dt=torch.uint8), z(2, H, 16, 2), z(2, H, 16, 2), z(B, 1, dt=torch.int32))
    bufs = (z(B, H, 16, D), z(B, H, 4, D), z(B, H, 0, D))
    tok = z(B, H, 1, D)
    strided = z(B, H, 1, 2 * D)[..., ::2]
    assert CW.append_token(strided, tok, *bufs, *pool, 0, 0, 0, 2, 0, True, 0, 2, 8) is False
    assert CW.append_token(tok, strided, *bufs, *pool, 0, 0, 0, 2, 0, True, 0, 2, 8) is False
    assert CW.append_token(tok, tok, *bufs, *pool, 0, 0, 0, 2, 0, True, 0, 2, 5) is False
    assert W.append_token(strided, tok, *bufs, *pool, 0, 0, 0, 2, 0, True, 0, 2, 8) is False
    assert W.append_token(tok, tok, *bufs, *pool, 0, 0, 0, 2, 0, True, 0, 2, 5) is False
    big = z(B, H, 1, 2048)
    assert CW.append_token(big, big, *bufs, *pool, 0, 0, 0, 2, 0, True, 0, 2, 8) is False
    assert not any(t.any() for t in (*bufs, *pool))


def _kpool(Pn, H, D, G, Db, kitty=True, bits=2):
    u8 = dict(dtype=torch.uint8)
    meta = dict(dtype=torch.float16)
    if not kitty:
        return {"codes": torch.zeros((Pn, H, D, G * bits // 8), **u8), "scale": torch.zeros((Pn, H, D), **meta),
                "mn": torch.zeros((Pn, H, D), **meta)}
    return {"low": torch.zeros((Pn, H, D, G // 4), **u8), "high": torch.zeros((Pn, H, Db, G // 4), **u8),
            "idx": torch.zeros((Pn, H, D), **u8), "scale": torch.zeros((Pn, H, D), **meta),
            "mn": torch.zeros((Pn, H, D), **meta)}


KEY_BAD = ["dtype", "ndim", "group", "bits", "kitty-bits", "d_boost", "kivi-d_boost", "names", "pool", "slots",
           "meta-bf16", "meta-mixed", "contiguous"]


@pytest.mark.parametrize("writers", [W, CW], ids=["triton", "cupy"])
@pytest.mark.parametrize("what", KEY_BAD)
def test_flush_key_pages_rejects_bad_arguments(what, writers):
    B, H, n, G, D, Db, bits, kitty = 1, 2, 2, 16, 16, 2, 2, True
    pages = torch.zeros((B, H, n, G, D), dtype=torch.float16)
    pool, first = _kpool(4, H, D, G, Db), 0
    if what == "dtype":
        pages = pages.float()
    elif what == "ndim":
        pages = pages[0]
    elif what == "group":
        pages, pool = torch.zeros((B, H, n, 6, D), dtype=torch.float16), _kpool(4, H, D, 6, Db)
    elif what == "bits":
        bits, kitty, Db, pool = 3, False, 0, _kpool(4, H, D, G, 0, kitty=False)
    elif what == "kitty-bits":
        bits = 4
    elif what == "d_boost":
        Db = D + 1
    elif what == "kivi-d_boost":
        kitty, pool = False, _kpool(4, H, D, G, 0, kitty=False)
    elif what == "names":
        pool = _kpool(4, H, D, G, 0, kitty=False)
    elif what == "pool":
        pool["high"] = torch.zeros((4, H, Db + 1, G // 4), dtype=torch.uint8)
    elif what == "slots":
        first = 3
    elif what == "meta-bf16":                                         # the configurations allow fp16 / fp32
        pool["scale"], pool["mn"] = (torch.zeros((4, H, D), dtype=torch.bfloat16) for _ in range(2))
    elif what == "meta-mixed":
        pool["mn"] = pool["mn"].float()
    else:
        pool["low"] = torch.zeros((4, H, G // 4, D), dtype=torch.uint8).transpose(-1, -2)
    before = {k: t.clone() for k, t in pool.items()}
    with pytest.raises(ValueError, match="metadata" if what.startswith("meta") else None):
        writers.flush_key_pages(pages, pool, first, bits, Db, kitty)
    for k, t in pool.items():
        assert torch.equal(t, before[k]), k


VALUE_BAD = ["dtype", "ndim", "bits", "group", "pool", "table-dtype", "table-rows", "past-table", "meta-bf16",
             "meta-mixed", "contiguous"]


@pytest.mark.parametrize("writers", [W, CW], ids=["triton", "cupy"])
@pytest.mark.parametrize("what", VALUE_BAD)
def test_evict_values_rejects_bad_arguments(what, writers):
    B, H, e, D, G, bits, Gv, q0 = 2, 2, 3, 16, 8, 2, 8, 0
    toks = torch.zeros((B, H, e, D), dtype=torch.float16)
    codes = torch.zeros((4, H, G, D * bits // 8), dtype=torch.uint8)
    scale = torch.zeros((4, H, G, D // Gv), dtype=torch.float16)
    mn = scale.clone()
    table = torch.zeros((B, 2), dtype=torch.int32)
    if what == "dtype":
        toks = toks.float()
    elif what == "ndim":
        toks = toks[0]
    elif what == "bits":
        bits = 3
    elif what == "group":
        Gv = 5
    elif what == "pool":
        scale = torch.zeros((4, H, G, 1), dtype=torch.float16)
    elif what == "table-dtype":
        table = table.long()
    elif what == "table-rows":
        table = torch.zeros((B + 1, 2), dtype=torch.int32)
    elif what == "past-table":
        q0 = 2 * G - 1                                              # its last token lies past the table
    elif what == "meta-bf16":
        scale, mn = scale.bfloat16(), mn.bfloat16()
    elif what == "meta-mixed":
        mn = mn.float()
    else:
        codes = torch.zeros((4, H, D * bits // 8, G), dtype=torch.uint8).transpose(-1, -2)
    before = [t.clone() for t in (codes, scale, mn)]
    with pytest.raises(ValueError, match="metadata" if what.startswith("meta") else None):
        writers.evict_values(toks, codes, scale, mn, table, q0, bits, Gv)
    for t, t0 in zip((codes, scale, mn), before):
        assert torch.equal(t, t0)


def test_cupy_writers_reject_host_tensors_and_other_metadata():
    """The CUDA writers take CUDA tensors and fp16 / fp32 metadata (the shared check, as the Triton
    writers: test_*_rejects_bad_arguments): anything else raises before a launch."""
    pages = torch.zeros((1, 2, 1, 16, 16), dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA tensors"):
        CW.flush_key_pages(pages, _kpool(1, 2, 16, 16, 2), 0, 2, 2, True)
    pool = _kpool(1, 2, 16, 16, 0, kitty=False)
    pool["scale"], pool["mn"] = (torch.zeros((1, 2, 16), dtype=torch.bfloat16) for _ in range(2))
    with pytest.raises(ValueError, match="float16 or float32"):
        CW.flush_key_pages(pages, pool, 0, 2, 0, False)
    toks = torch.zeros((1, 2, 1, 16), dtype=torch.float16)
    codes = torch.zeros((1, 2, 8, 4), dtype=torch.uint8)
    scale = torch.zeros((1, 2, 8, 2), dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA tensors"):
        CW.evict_values(toks, codes, scale, scale.clone(), torch.zeros((1, 1), dtype=torch.int32), 0, 2, 8)


def test_writers_read_strided_slices(target):
    """Pages or tokens cut out of a longer buffer (its batch and head strides) are read in place and give
    the same pool as contiguous copies."""
    backend, device = target
    _, W = _fast(backend, "kitty")
    rng = np.random.default_rng(5)
    B, H, G, D, Db = 2, 2, 16, 16, 4
    buf = torch.from_numpy((rng.standard_normal((B, H, 2 * G + 5, D)) * 3).astype(np.float16)).to(device)
    pages = buf[:, :, :2 * G].reshape(B, H, 2, G, D)
    assert not pages.is_contiguous()
    a, b = ({k: t.to(device) for k, t in _kpool(4, H, D, G, Db).items()} for _ in range(2))
    W.flush_key_pages(pages, a, 0, 2, Db, True)
    W.flush_key_pages(pages.contiguous(), b, 0, 2, Db, True)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert int((a["idx"] < Db).sum()) == 4 * H * Db                 # every page and head boosts Db channels
    toks = buf[:, :, 3:3 + G]
    table = torch.arange(B, dtype=torch.int32, device=device).view(B, 1)
    outs = []
    for x in (toks, toks.contiguous()):
        pool = [torch.zeros((B, H, G, D // 4), dtype=torch.uint8, device=device),
                torch.zeros((B, H, G, 2), dtype=torch.float16, device=device),
                torch.zeros((B, H, G, 2), dtype=torch.float16, device=device)]
        W.evict_values(x, *pool, table, 0, 2, 8)
        outs.append(pool)
    for x, y in zip(*outs):
        assert torch.equal(x, y)
