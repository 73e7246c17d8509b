"""The fused BitDecoding decode (kvq.fast.triton.bitdecoding_decode) against
kvq.reference.bitdecoding.decode_attention.

Decode attention is an order-dependent reduction (contract rule 7): out (in q's dtype) and lse (float32)
follow the tolerance rule (``tolerance.check_close``) against the reference run on float64 q (the truth)
and on float32 q (ref32: the reference's own float32 order), as the other decode tests do. The cache is
built by the reference (``R.init`` / ``R.append``; ``test_bitdecoding_triton`` proves the fast pages are
the same bytes) and copied field by field to torch tensors, so every case costs one decode.

Cases: the four kinds KC2, KC4, KT2, KT4 (W_n 1 or 2, groups of 32, D = 64 on the CPU), context lengths
N_r - 1 (only the residual), N_r (only pages), 3 N_r + 5 (both), GQA ratios 1 / 4 / 8, T_q 1 and 2,
fp16 / bf16 / fp32 q, 72 query rows per KV head (two row blocks), explicit scales, an outlier key
channel, head dims 32 and 256, other launch knobs (one-warp and whole-page chunks, the other unpacking,
few splits) on configs whose key groups span warps; the kernel reads the packed words through the page
table (one corrupted key word, value word or scale changes the result as it changes the reference's;
pages moved around the pool, the unused pool filled with garbage, give the same bits); one decode-kernel
launch per decode; ``supported``. On the GPU (``pytest -m gpu``) the same with longer contexts (D = 128,
B = 2, H_kv = 4), and the paper's BitDecoding-KC2 and BitDecoding-KT4 with a few thousand tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import numpy as np
import pytest
import torch

from kvq.reference import bitdecoding as R

from .tolerance import check_close

BDD = pytest.importorskip("kvq.fast.triton.bitdecoding_decode")
from kvq.fast.triton import _launch as L  # noqa: E402

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


@pytest.fixture
def device(triton_device):
    """tests/conftest.py's Triton targets (same ids and skip rules)."""
    return triton_device


def small(bits, k_mode, warps_n, k_group=32, v_group=32, max_tokens=4096):
    return R.BitDecodingConfig(bits=bits, k_mode=k_mode, warps_n=warps_n, k_group=k_group, v_group=v_group,
                               max_tokens=max_tokens)


# the four kinds, small pages for the interpreter: N_r = 64, 64, 128, 32
KINDS = {"KC2": small(2, "channel", 1), "KC4": small(4, "channel", 2), "KT2": small(2, "tensor", 2),
         "KT4": small(4, "tensor", 1)}
SHAPE = {"cpu": (2, 2, 64), "cuda": (2, 4, 128)}          # (B, H_kv, D)


def lengths(cfg):
    """Only the residual, only pages, both."""
    n = cfg.n_r
    return {"res": n - 1, "pages": n, "both": 3 * n + 5}


@functools.lru_cache(maxsize=None)
def _ref_state(cfg, B, H, D, L, seed, outlier=False):
    """The reference cache after appending L random fp16 tokens (in two appends: prefill, then the rest)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, L, D)).astype(np.float32)
    v = rng.standard_normal((B, H, L, D)).astype(np.float32)
    if outlier:
        k[..., 5] *= 40.0                                        # an outlier key channel
        v[..., 9] *= 10.0
    st = R.init(cfg, B, H, D)
    cut = L // 3
    R.append(cfg, st, k[:, :, :cut].astype(np.float16), v[:, :, :cut].astype(np.float16))
    R.append(cfg, st, k[:, :, cut:].astype(np.float16), v[:, :, cut:].astype(np.float16))
    return st


def ref_state(cfg, device, L, seed=0, outlier=False, shape=None):
    B, H, D = shape or SHAPE[device]
    return _ref_state(cfg, B, H, D, L, seed, outlier).copy()


def to_torch(st, device):
    """The reference state's fields as torch tensors on the device (a namespace with the same names)."""
    fields = {n: torch.from_numpy(np.ascontiguousarray(a)).to(device) for n, a in st.arrays().items()}
    return types.SimpleNamespace(**fields, length=st.length, next_page=st.next_page, shape=tuple(st.shape))


def make_q(st, device, g_q, T_q, dtype, seed, mag=1.0):
    B, H, D = st.shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H * g_q, T_q, D)).astype(np.float32) * np.float32(mag)
    return torch.from_numpy(q).to(dtype).to(device)


def check(cfg, st, out, lse, q, what="", **kw):
    """out and lse against the reference (truth: float64 q; ref32: float32 q) under the tolerance rule."""
    assert out.dtype == q.dtype and tuple(out.shape) == tuple(q.shape) and out.device == q.device
    assert lse.dtype == FP32 and tuple(lse.shape) == tuple(q.shape[:3])
    q32 = q.detach().cpu().float().numpy()
    o64, l64 = R.decode_attention(cfg, st, q32.astype(np.float64), **kw)
    o32, l32 = R.decode_attention(cfg, st, q32, **kw)
    assert o64.dtype == np.float64 and o32.dtype == np.float32
    check_close(out, o64, o32, q.dtype, f"{what}out")
    check_close(lse, l64, l32, FP32, f"{what}lse")


def decode_and_check(cfg, st, device, g_q, T_q, dtype, seed, what="", **kw):
    fs = to_torch(st, device)
    q = make_q(st, device, g_q, T_q, dtype, seed)
    assert BDD.supported(cfg, fs, q)
    out, lse = BDD.decode(cfg, fs, q, **kw)
    check(cfg, st, out, lse, q, what, **kw)
    return fs, q, out, lse


# (GQA ratio, T_q, q dtype) run on every (kind, length)
QUERIES = [(1, 1, FP16), (4, 2, FP16), (8, 1, FP16), (4, 1, BF16), (1, 2, FP32)]


# ---------------------------------------------------------------------------------------------------
# parity


@pytest.mark.parametrize("which", ["res", "pages", "both"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_decode_attention(device, kind, which, planned_launches):
    """Every kind and context shape: pages only, residual only, both; GQA 1 / 4 / 8, T_q 1 / 2, fp16 /
    bf16 / fp32 q; one launch of the decode kernel per decode, in several splits for several pages."""
    cfg = KINDS[kind]
    L = lengths(cfg)[which]
    if device == "cuda":
        L = {"res": L, "pages": 16 * cfg.n_r, "both": 23 * cfg.n_r + 17}[which]
    st = ref_state(cfg, device, L, seed=L)
    for i, (g_q, T_q, dtype) in enumerate(QUERIES):
        decode_and_check(cfg, st, device, g_q, T_q, dtype, seed=100 + i, what=f"{kind} L={L} {g_q} {T_q} {dtype}: ")
    launches = planned_launches.grids(BDD._decode_kernel)
    assert len(launches) == len(QUERIES), launches
    if L // cfg.n_r >= 3:
        assert all(g[1] >= 2 for g in launches), launches              # (B * H_kv, splits, row blocks)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_decode_plan_reused(device, dtype, monkeypatch, triton_dispatches):
    """The decode's two launches are planned once per call shape and kept: on the GPU a later call makes no
    Triton dispatch at all and gives the first call's bits, as does a call through Triton's dispatch (bf16
    q: its fp32 copy under the interpreter). A new length is a new plan."""
    cfg = KINDS["KC2"]
    n = 3 * cfg.n_r + 5 if device == "cpu" else 16 * cfg.n_r + 5
    st = ref_state(cfg, device, n, seed=31)
    fs, q, out0, lse0 = decode_and_check(cfg, st, device, 4, 1, dtype, seed=32)
    before = BDD._decode_plan.cache_info()
    on_gpu = device != "cpu"
    dispatched = triton_dispatches
    dispatched.clear()
    out1, lse1 = BDD.decode(cfg, fs, q.clone())
    after = BDD._decode_plan.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses
    assert dispatched == []                    # the GPU: kept kernels; the interpreter: no JITFunction at all
    assert torch.equal(out1, out0) and torch.equal(lse1, lse0)
    monkeypatch.setattr(L, "current_stream", lambda device_index: None)       # Triton's dispatch every launch
    out2, lse2 = BDD.decode(cfg, fs, q)
    assert len(dispatched) == (2 if on_gpu else 0)
    assert torch.equal(out2, out0) and torch.equal(lse2, lse0)
    monkeypatch.undo()
    st2 = ref_state(cfg, device, n + 1, seed=31)
    decode_and_check(cfg, st2, device, 4, 1, dtype, seed=32)
    assert BDD._decode_plan.cache_info().misses == after.misses + 1


@pytest.mark.parametrize("kind", ["KC4", "KT2"])
def test_two_row_blocks_and_scale(device, kind):
    """72 query rows per KV head (GQA 8 x T_q 9: two blocks of 64 rows), and an explicit scale."""
    cfg = KINDS[kind]
    st = ref_state(cfg, device, 2 * cfg.n_r + 7, seed=3)
    decode_and_check(cfg, st, device, 8, 9, FP16, seed=4, what="72 rows: ")
    decode_and_check(cfg, st, device, 4, 1, FP16, seed=5, what="scale 0.3: ", scale=0.3)
    decode_and_check(cfg, st, device, 1, 1, FP32, seed=6, what="fp32 scale 0.05: ", scale=0.05)


@pytest.mark.parametrize("kind", ["KC2", "KT4"])
def test_outlier_channel(device, kind):
    """Keys with a channel 40x the others (channel-wise groups absorb it, tensor-wise groups do not),
    values with one 10x: large scores, sharp softmax."""
    cfg = KINDS[kind]
    st = ref_state(cfg, device, 3 * cfg.n_r + 5, seed=7, outlier=True)
    for i, dtype in enumerate((FP16, BF16, FP32)):
        decode_and_check(cfg, st, device, 4, 2, dtype, seed=8 + i, what=f"outlier {dtype}: ")


KNOBS = {"one-warp-chunks": dict(bt_max=1), "whole-page-chunks-other-unpack": dict(bt_max=1024, unpack=None),
         "other-unpack-one-wave": dict(unpack=None, waves=1)}


@pytest.mark.parametrize("knobs", list(KNOBS))
def test_launch_knobs(device, knobs, monkeypatch):
    """Other launch knobs (``bitdecoding_decode.Knobs``) meet the rule too: one warp (8 R tokens) per chunk,
    the whole page in one chunk, the other way of unpacking the words (reshape / gather), few splits; on
    configs with key groups of 64 tokens spanning warps (W_n = 4) and channel groups of 16 / 64 (the
    decode's default knobs replaced: ``plan`` reads ``DEFAULT_KNOBS`` per call)."""
    kn = {key: 1 - BDD.DEFAULT_KNOBS.unpack if key == "unpack" else val for key, val in KNOBS[knobs].items()}
    monkeypatch.setattr(BDD, "DEFAULT_KNOBS", BDD.Knobs(**kn))
    cfg = small(4, "channel", 4, k_group=64, v_group=16)                   # N_r = 128
    st = ref_state(cfg, device, 2 * cfg.n_r + 9, seed=11)
    decode_and_check(cfg, st, device, 4, 1, FP16, seed=12, what=f"{knobs}: ")
    decode_and_check(cfg, st, device, 1, 1, FP32, seed=15, what=f"{knobs}: ")
    cfg = small(2, "tensor", 2, k_group=16, v_group=64)                    # N_r = 128
    st = ref_state(cfg, device, 2 * cfg.n_r + 9, seed=13)
    decode_and_check(cfg, st, device, 8, 2, FP16, seed=14, what=f"{knobs}: ")


@pytest.mark.parametrize("D, bits, k_mode", [(32, 4, "channel"), (256, 2, "tensor")])
def test_head_dims(device, D, bits, k_mode):
    """The smallest head dim the layout allows (8 R = 32 at 4 bits) and the largest the kernel takes."""
    cfg = small(bits, k_mode, 1)
    st = ref_state(cfg, device, 2 * cfg.n_r + 3, seed=31, shape=(1, 2, D))
    decode_and_check(cfg, st, device, 4, 1, FP16, seed=32, what=f"D={D}: ")
    decode_and_check(cfg, st, device, 2, 2, FP32, seed=34, what=f"D={D}: ")


@pytest.mark.gpu
@pytest.mark.parametrize("name, L", [("BitDecoding-KC2", 3001), ("BitDecoding-KT4", 2100)])
def test_paper_configs(device, name, L):
    """The paper's configurations (W_n = 4, groups of 128, N_r = 256 / 128) at D = 128 with a few
    thousand tokens, GQA 4 and 8, fp16 / bf16 / fp32 q."""
    if device != "cuda":
        pytest.skip("a few thousand tokens at D = 128: the GPU target")
    cfg = R.CONFIGS[name]
    st = ref_state(cfg, device, L, seed=L, shape=(2, 4, 128))
    for i, (g_q, T_q, dtype) in enumerate([(4, 1, FP16), (8, 2, FP16), (4, 1, BF16), (8, 1, FP32)]):
        decode_and_check(cfg, st, device, g_q, T_q, dtype, seed=20 + i, what=f"{name} {g_q} {T_q} {dtype}: ")


# ---------------------------------------------------------------------------------------------------
# the kernel reads the packed words through the page table


def _corrupt(st, field, b, page, h, idx):
    """A copy of the reference state with one element of one page (page j of sequence b, KV head h) of
    ``field`` changed: a word inverted (every code becomes qmax - code) or a scale doubled."""
    st = st.copy()
    arr = getattr(st, field)
    pid = st.table[b, page]
    if arr.dtype == np.uint16:
        arr[(pid, h) + idx] = ~arr[(pid, h) + idx]
    else:
        arr[(pid, h) + idx + (0,)] = arr[(pid, h) + idx + (0,)] * np.float16(2) + np.float16(0.5)
    return st


@pytest.mark.parametrize("field, idx", [("k_words", (3, 5)), ("v_words", (7, 2)), ("k_params", (0, 1)),
                                        ("v_params", (4, 1))])
def test_reads_the_packed_words(device, field, idx):
    """One word (or one scale) of page 1 of sequence 1, KV head 1, changed in the cache: the decode of
    the KV head's query rows changes (keys: the lse; values: the output), and equals the reference of
    the changed cache; sequence 0 and KV head 0 keep their bits."""
    cfg = KINDS["KC4"]
    st = ref_state(cfg, device, 3 * cfg.n_r + 5, seed=21)
    bad = _corrupt(st, field, 1, 1, 1, idx)
    fs, q, out, lse = decode_and_check(cfg, st, device, 4, 1, FP16, seed=22)
    fb = to_torch(bad, device)
    out_b, lse_b = BDD.decode(cfg, fb, q)
    check(cfg, bad, out_b, lse_b, q, f"{field} corrupted: ")
    if field.startswith("k"):                                                      # keys move the scores
        assert not torch.equal(lse_b[1, 4:8], lse[1, 4:8]), f"changing {field} did not change the lse"
    else:                                                                          # values move the output
        assert not torch.equal(out_b[1, 4:8], out[1, 4:8]), f"changing {field} did not change the output"
    assert torch.equal(out_b[0], out[0]) and torch.equal(lse_b[0], lse[0])
    assert torch.equal(lse_b[1, :4], lse[1, :4])                                   # KV head 0's rows


def test_page_table_indirection(device):
    """Pages moved to other pool slots (the table updated) and the unused pool filled with random
    words and params: the same bits come out (the kernel follows the table, reads nothing else)."""
    cfg = KINDS["KT2"]
    st = ref_state(cfg, device, 3 * cfg.n_r + 5, seed=23)
    fs, q, out, lse = decode_and_check(cfg, st, device, 4, 2, FP16, seed=24)
    rng = np.random.default_rng(25)
    P = st.k_words.shape[0]
    perm = rng.permutation(P)                                    # old page id p -> new slot perm[p]
    moved = st.copy()
    for name in ("k_words", "k_params", "v_words", "v_params"):
        a = getattr(st, name)
        if a.dtype == np.uint16:
            junk = rng.integers(0, 1 << 16, a.shape, dtype=np.uint16)
        else:
            junk = rng.standard_normal(a.shape).astype(np.float16) * np.float16(100)
        new = junk.copy()
        used = st.table[st.table >= 0]
        new[perm[used]] = a[used]
        setattr(moved, name, new)
    moved.table = np.where(st.table >= 0, perm[np.maximum(st.table, 0)], -1).astype(np.int32)
    r0, r1 = R.decode_attention(cfg, st, q.cpu().float().numpy()), R.decode_attention(cfg, moved,
                                                                                     q.cpu().float().numpy())
    assert np.array_equal(r0[0], r1[0]) and np.array_equal(r0[1], r1[1])          # the same cache
    out_m, lse_m = BDD.decode(cfg, to_torch(moved, device), q)
    assert torch.equal(out_m, out) and torch.equal(lse_m, lse)


# ---------------------------------------------------------------------------------------------------
# supported


def test_supported(device):
    cfg = KINDS["KC2"]
    st = ref_state(cfg, device, cfg.n_r + 1, seed=26)
    fs = to_torch(st, device)
    for dtype in (FP16, BF16, FP32):
        assert BDD.supported(cfg, fs, make_q(st, device, 4, 1, dtype, 0))
    q = make_q(st, device, 4, 1, FP16, 0)
    assert not BDD.supported(cfg, fs, q.double())                                  # float64
    assert not BDD.supported(cfg, fs, q.cpu().numpy())                             # not a tensor
    assert not BDD.supported(cfg, fs, q[:, :3])                                    # H_q not a multiple of H_kv
    assert not BDD.supported(cfg, fs, q[..., :32])                                 # wrong head dim
    assert not BDD.supported(cfg, types.SimpleNamespace(**{**vars(fs), "k_words": fs.k_words.to(torch.int16)}), q)
    assert not BDD.supported(cfg, types.SimpleNamespace(**{k: v for k, v in vars(fs).items() if k != "table"}), q)
    c96 = small(4, "tensor", 1, k_group=32, v_group=32)                            # D = 96: not a power of two
    cfg.check_head_dim(64)
    c96.check_head_dim(96)
    s96 = ref_state(c96, device, 40, seed=27, shape=(1, 1, 96))
    assert not BDD.supported(c96, to_torch(s96, device), make_q(s96, device, 1, 1, FP16, 0))
    for name in R.CONFIGS:                                                          # every paper config at D = 128
        c = dataclasses.replace(R.CONFIGS[name], max_tokens=512)
        s = ref_state(c, device, 3, seed=28, shape=(1, 1, 128))
        assert BDD.supported(c, to_torch(s, device), make_q(s, device, 2, 1, BF16, 0))
