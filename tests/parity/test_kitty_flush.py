"""Kitty's fused key-page flush (``kvq.fast.triton._kitty_flush``): one Triton kernel per flush writes the
page arrays straight into the pool. Its state equals the reference's bit for bit (keys with an
unambiguous channel ranking: contract rule 7 lets a near-tie flip a boosted channel, see
``test_kivi_kitty_parity.test_kitty_near_ties``, which runs through it too) and the torch path's; the
append uses it (no intermediate arrays); it declines random selection and backends without it; bad
arguments raise before any launch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvq.fast import _codecs
from kvq.fast.triton import _kitty_flush as KF
from kvq.fast.triton import kitty as TK
from kvq.fast.triton import packing as TP
from kvq.fast.triton import quant as TQ
from kvq.reference import kitty as RT

from .cases import assert_bits_equal
from .test_kivi_kitty_parity import _kv, assert_same_state

TRITON = [pytest.param("cpu", id="triton-interp"), pytest.param("cuda", id="triton-cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=TRITON)
def device(request):
    if request.param == "cpu" and torch.cuda.is_available():
        pytest.skip("the Triton interpreter target runs only on machines without a GPU (CI)")
    return request.param


# (boost rate, G, D, B, H, T, chunks): Kitty, Kitty-Pro, no boost, every channel boosted, a group that
# is not a power of two with a head dim that is not either
CASES = [(0.125, 16, 32, 2, 2, 75, [75]), (0.25, 16, 32, 2, 1, 70, [9, 30, 1, 30]), (0.0, 16, 16, 1, 2, 40, [40]),
         (1.0, 16, 16, 2, 1, 40, [17, 23]), (0.3, 12, 20, 2, 2, 50, [25, 25])]


@pytest.mark.parametrize("rate, G, D, B, H, T, chunks", CASES)
def test_fused_flush_equals_reference_and_torch_path(device, monkeypatch, rate, G, D, B, H, T, chunks):
    cfg = RT.KittyConfig(rate, group_size=G, residual=5, sink=3, max_tokens=T)
    k, v = _kv(B, H, T, D, G, seed=7, start=cfg.sink)
    rs = RT.init(cfg, B, H, D)
    RT.append(cfg, rs, k, v)
    states = {}
    for fused in (True, False):
        monkeypatch.setattr(_codecs, "FUSED_FLUSH", fused)
        fs = TK.init(cfg, B, H, D)
        t = 0
        for n in chunks:
            kt, vt = (torch.from_numpy(a[:, :, t:t + n]).to(device) for a in (k, v))
            TK.append(cfg, fs, kt, vt)
            t += n
        assert_same_state(fs, rs, "fused " if fused else "torch ")
        states[fused] = fs
    for name, a in states[True].arrays().items():
        assert_bits_equal(a, states[False].arrays()[name].cpu().numpy(), name)


def test_append_takes_the_fused_kernel(device, monkeypatch):
    """With the fused flush on, Kitty's appends never build page arrays (encode_pages) to copy."""
    def no_arrays(*a, **kw):
        raise AssertionError("encode_pages was called")

    monkeypatch.setattr(_codecs.KittyCodec, "encode_pages", no_arrays)
    cfg = RT.CONFIGS["Kitty"]
    cfg = dataclasses.replace(cfg, group_size=16, residual=4, sink=2, max_tokens=64)
    k, v = _kv(1, 2, 64, 16, 16, seed=3, start=2)
    fs = TK.init(cfg, 1, 2, 16)
    TK.append(cfg, fs, torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))
    assert fs.k_next == 3                                           # (64 - 2 - 4 buffered) // 16 pages
    monkeypatch.setattr(_codecs, "FUSED_FLUSH", False)
    with pytest.raises(AssertionError, match="encode_pages was called"):
        TK.append(cfg, TK.init(cfg, 1, 2, 16), torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))


def test_write_pages_declines():
    """Random selection (drawn on the host) and a backend without the kernel take encode_pages."""
    pages = torch.zeros((1, 1, 1, 16, 16), dtype=torch.float16)
    pool = _codecs.KittyCodec(TK.paged.OPS).empty_pool(RT.CONFIGS["Kitty"], 2, 1, 16, "cpu")
    rnd = RT.KittyConfig(0.25, selection="random", group_size=16)
    assert _codecs.KittyCodec(TK.paged.OPS).write_pages(rnd, pool, pages, 0) is False
    bare = _codecs.KittyCodec(_codecs.Ops("bare", TQ, TP, lambda: True))
    assert bare.write_pages(RT.KittyConfig(0.25, group_size=16), pool, pages, 0) is False
    assert TK.paged.OPS.kitty_flush is KF.flush_pages


def _pool(Pn, H, D, G, Db, meta=torch.float16):
    u8 = dict(dtype=torch.uint8)
    return {"low": torch.zeros((Pn, H, D, G // 4), **u8), "high": torch.zeros((Pn, H, Db, G // 4), **u8),
            "idx": torch.zeros((Pn, H, D), **u8), "scale": torch.zeros((Pn, H, D), dtype=meta),
            "mn": torch.zeros((Pn, H, D), dtype=meta)}


@pytest.mark.parametrize("what", ["dtype", "ndim", "group", "d_boost", "pool", "slots", "contiguous"])
def test_flush_pages_rejects_bad_arguments(what):
    B, H, n, G, D, Db = 1, 2, 2, 16, 16, 2
    pages = torch.zeros((B, H, n, G, D), dtype=torch.float16)
    pool, first = _pool(4, H, D, G, Db), 0
    if what == "dtype":
        pages = pages.float()
    elif what == "ndim":
        pages = pages[0]
    elif what == "group":
        pages, pool = torch.zeros((B, H, n, 6, D), dtype=torch.float16), _pool(4, H, D, 6, Db)
    elif what == "d_boost":
        Db = D + 1
    elif what == "pool":
        pool["high"] = torch.zeros((4, H, Db + 1, G // 4), dtype=torch.uint8)
    elif what == "slots":
        first = 3
    else:
        pool["low"] = torch.zeros((4, H, G // 4, D), dtype=torch.uint8).transpose(-1, -2)
    before = {k: t.clone() for k, t in pool.items()}
    with pytest.raises(ValueError):
        KF.flush_pages(pages, pool, first, Db)
    for k, t in pool.items():
        assert torch.equal(t, before[k]), k


def test_flush_pages_reads_a_strided_slice(device):
    """Pages cut out of a longer key buffer (batch and head strides of the buffer) are read in place
    and give the same pool as a contiguous copy."""
    rng = np.random.default_rng(5)
    B, H, G, D, Db = 2, 2, 16, 16, 4
    buf = torch.from_numpy((rng.standard_normal((B, H, 2 * G + 5, D)) * 3).astype(np.float16)).to(device)
    pages = buf[:, :, :2 * G].reshape(B, H, 2, G, D)
    assert not pages.is_contiguous()
    a, b = _pool(4, H, D, G, Db), _pool(4, H, D, G, Db)
    a = {k: t.to(device) for k, t in a.items()}
    b = {k: t.to(device) for k, t in b.items()}
    KF.flush_pages(pages, a, 0, Db)
    KF.flush_pages(pages.contiguous(), b, 0, Db)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert int((a["idx"] < Db).sum()) == 4 * H * Db                 # every page and head boosts Db channels
