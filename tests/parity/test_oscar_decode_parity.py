"""The fused OSCAR decode (kvq.fast.triton.oscar_decode, behind kvq.fast.triton.oscar.decode_attention)
against kvq.reference.oscar.decode_attention.

decode_attention is an order-dependent reduction (contract rule 7): out (in q's dtype) and lse (float32)
follow the tolerance rule (``tolerance.check_close``) against the reference run on float64 q (truth)
and float32 q (ref32), as the KIVI / Kitty decode tests do. Cases: group sizes D, D / 2, D / 4 (on the
CPU D = 32, so D / 4 = 8 < 16 runs the exact-dequantization path for fp16 q too), 2-, 4- and 8-bit
codes, fp16 and fp32 metadata, GQA ratios 1 / 4 / 8, T_q 1 and 2, 72 query rows per KV head (two row
blocks), a page size that is not a power of two, a history shorter than one page, a cache with only
the sink and window, large magnitudes, other settings of the launch knobs (``oscar_decode.Knobs``),
a check that decode really goes through the page kernel (the unfused history dequantization is
made to raise), and a compile check for sm_90 of the page kernel's tensor-core dots (no GPU needed):
their operand layouts must not wrap along K, a GPU-only error the interpreter cannot see.

The fast cache is built from the reference state's arrays (``test_oscar_parity`` proves that fast
appends give exactly these bytes), so every case costs one decode; one case appends through the fast
tier. Targets: the Triton interpreter on the CPU (small shapes; CI) and Triton on CUDA (larger shapes,
``pytest -m gpu``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kvq.fast.caches import oscar as _oscar
from kvq.reference import oscar as RO

from .tolerance import check_close

@pytest.fixture
def device(triton_device):
    """tests/conftest.py's Triton targets (same ids and skip rules)."""
    return triton_device


def _mods():
    from kvq.fast.triton import oscar, oscar_decode
    return oscar, oscar_decode


# per device: (B, H_kv, D) and the base config (sink, window, page size, capacity)
SHAPE = {"cpu": (2, 2, 32), "cuda": (2, 4, 128)}
BASE = {"cpu": dict(sink=3, window=5, page_size=8, max_tokens=256),
        "cuda": dict(sink=64, window=256, page_size=128, max_tokens=4096)}


def _calib(H, D, seed):
    rng = np.random.default_rng(seed)
    R = [np.linalg.qr(rng.standard_normal((H, D, D)))[0].astype(np.float32) for _ in range(2)]
    return RO.OSCARCalibration(R[0], R[1], 0.95, 0.9)


def _state(device, ng, T, seed, big=False, D=None, **over):
    """(cfg, calib, reference state, fast state): T tokens, group size D // ng (D: the device's, or given)."""
    B, H, D0 = SHAPE[device]
    D = D or D0
    cfg = RO.OSCARConfig(**dict(BASE[device], group_size=D // ng, **over))
    calib = _calib(H, D, seed)
    rng = np.random.default_rng(seed + 1)
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k[:, :, :, 3] *= 8.0                                                   # an outlier channel
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    if big:                                          # |k R|, |v R| <= the largest token norm = 3e4
        k = k * np.float32(3e4 / np.linalg.norm(k, axis=-1).max())
        v = v * np.float32(3e4 / np.linalg.norm(v, axis=-1).max())
    rs = RO.init(cfg, B, H, D)
    RO.append(cfg, calib, rs, k.astype(np.float16), v.astype(np.float16))
    fa = {n: torch.from_numpy(np.ascontiguousarray(a)).to(device) for n, a in rs.arrays().items()}
    fs = _oscar.OSCARTensorState(**fa, length=rs.length, next_page=rs.next_page, shape=tuple(rs.shape))
    return cfg, calib, rs, fs


def _check(cfg, calib, rs, out, lse, q, what="", **kw):
    assert out.dtype == q.dtype and tuple(out.shape) == tuple(q.shape)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == tuple(q.shape[:3])
    q32 = q.detach().cpu().float().numpy()
    o64, l64 = RO.decode_attention(cfg, calib, rs, q32.astype(np.float64), **kw)
    o32, l32 = RO.decode_attention(cfg, calib, rs, q32, **kw)
    check_close(out, o64, o32, q.dtype, f"{what}out")
    check_close(lse, l64, l32, torch.float32, f"{what}lse")


def _q(device, ratio, T_q, dtype, seed, mag=1.0, D=None):
    B, H, D0 = SHAPE[device]
    D = D or D0
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H * ratio, T_q, D)).astype(np.float32) * np.float32(mag)
    return torch.from_numpy(q).to(dtype).to(device)


# (id, ng = groups per token (G = D / ng), config overrides, q dtype, GQA ratio, T_q, T on cpu, T on cuda)
CASES = [
    ("ng1-2bit-fp16", 1, {}, torch.float16, 4, 1, 50, 3001),
    ("ng2-2bit-meta32-fp32", 2, dict(meta_dtype="float32"), torch.float32, 1, 2, 47, 2100),
    ("ng2-4bit-fp16-gqa8", 2, dict(bits=4), torch.float16, 8, 1, 40, 1500),
    ("ng4-2bit-fp16-tq2", 4, {}, torch.float16, 4, 2, 45, 2500),
    ("ng4-4bit-meta32-fp32-gqa4", 4, dict(bits=4, meta_dtype="float32"), torch.float32, 4, 1, 41, 1777),
    ("ng1-8bit-bf16-page5", 1, dict(bits=8, page_size=5), torch.bfloat16, 1, 1, 44, 1300),
    ("ng4-D64-2bit-fp16", 4, dict(D=64), torch.float16, 1, 1, 40, 1000),      # G = 16 on the CPU too
    ("ng2-2bit-fp16-gqa8-tq9", 2, {}, torch.float16, 8, 9, 30, 900),          # 72 rows: two row blocks
]


@pytest.mark.parametrize("c", CASES, ids=[c[0] for c in CASES])
def test_decode_attention(device, c, planned_launches):
    """Pages + sink + window, several splits per (batch, kv head): out and lse within the tolerance rule."""
    F, _ = _mods()
    name, ng, over, dtype, ratio, T_q, T_cpu, T_gpu = c
    T = T_cpu if device == "cpu" else T_gpu
    cfg, calib, rs, fs = _state(device, ng, T, seed=T, **over)
    assert RO.counts(cfg, T)["n_pages"] >= 2
    q = _q(device, ratio, T_q, dtype, seed=T + 1, D=over.get("D"))
    out, lse = F.decode_attention(cfg, calib, fs, q)
    _check(cfg, calib, rs, out, lse, q)
    launches = planned_launches.grids(_mods()[1]._pages_kernel)
    assert len(launches) == 1 and launches[0][1] >= 2, launches              # (B * H_kv, splits, row blocks)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_history_shorter_than_a_page(device, dtype):
    """A few history tokens in one partly filled page (the rest of the page masked), rotate_back=False
    and scale=0.3."""
    F, _ = _mods()
    cfg = RO.OSCARConfig(**BASE[device])
    T = cfg.sink + cfg.window + 3
    cfg, calib, rs, fs = _state(device, 2, T, seed=5)
    assert RO.counts(cfg, T)["n_hist"] == 3
    q = _q(device, 4, 2, dtype, seed=6)
    out, lse = F.decode_attention(cfg, calib, fs, q, scale=0.3, rotate_back=False)
    _check(cfg, calib, rs, out, lse, q, scale=0.3, rotate_back=False)


@pytest.mark.parametrize("T", ["sink", "sink+window"])
def test_no_pages(device, T, planned_launches):
    """Only FP16 tokens (no history, so no page kernel launch): the sink alone, then sink + window."""
    F, _ = _mods()
    cfg = RO.OSCARConfig(**BASE[device])
    n = cfg.sink - 1 if T == "sink" else cfg.sink + cfg.window
    cfg, calib, rs, fs = _state(device, 1, n, seed=7)
    assert RO.counts(cfg, n)["n_hist"] == 0
    q = _q(device, 4, 1, torch.float16, seed=8)
    out, lse = F.decode_attention(cfg, calib, fs, q)
    _check(cfg, calib, rs, out, lse, q)
    assert planned_launches.grids(_mods()[1]._pages_kernel) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_decode_large_magnitudes(device, dtype):
    """Keys and values up to ~3e4, |q| up to ~1e3: q_d * scale and p * scale far beyond float16 (65504);
    the tensor-core path scales its operands per row, nothing overflows."""
    F, _ = _mods()
    T = 45 if device == "cpu" else 1500
    cfg, calib, rs, fs = _state(device, 2, T, seed=9, big=True)
    assert float(np.abs(rs.win_k.astype(np.float32)).max()) > 5e3
    q = _q(device, 4, 1, dtype, seed=10, mag=300.0)
    out, lse = F.decode_attention(cfg, calib, fs, q, scale=1e-5)
    _check(cfg, calib, rs, out, lse, q, scale=1e-5)


@pytest.mark.parametrize("knobs", [dict(v_terms=2), dict(block_t=16, waves=1)], ids=["v2", "bt16-waves1"])
def test_tune_knobs(device, knobs, monkeypatch):
    """Other launch knobs of the page kernel meet the tolerance rule too: P * scale in two fp16 parts,
    and blocks of 16 tokens in few long splits."""
    F, OD = _mods()
    # the decode's default knobs replaced (``plan`` reads ``DEFAULT_KNOBS`` per call)
    monkeypatch.setattr(OD, "DEFAULT_KNOBS", OD.Knobs(**knobs))
    T = 50 if device == "cpu" else 2000
    cfg, calib, rs, fs = _state(device, 2, T, seed=11)
    q = _q(device, 4, 2, torch.float16, seed=12)
    out, lse = F.decode_attention(cfg, calib, fs, q)
    _check(cfg, calib, rs, out, lse, q)


def test_fused_path_taken(device, monkeypatch, planned_launches):
    """Decode reads the packed pages: with the unfused history dequantization made to raise, a cache
    appended through the fast tier still decodes within the tolerance rule, one page-kernel launch per
    decode (fp16 q: tensor cores; fp32 q: exact dequantization); ops without a fused decode (as the
    CuPy backend's) take the unfused path."""
    F, OD = _mods()
    B, H, D = SHAPE[device]
    cfg = RO.OSCARConfig(**dict(BASE[device], group_size=D // 2))
    T = 37 if device == "cpu" else 1200
    calib = _calib(H, D, 13)
    rng = np.random.default_rng(14)
    k, v = (rng.standard_normal((B, H, T, D)).astype(np.float16) for _ in range(2))
    rs = RO.init(cfg, B, H, D)
    RO.append(cfg, calib, rs, k, v)
    fs = F.init(cfg, B, H, D)
    F.append(cfg, calib, fs, torch.from_numpy(k).to(device), torch.from_numpy(v).to(device))

    def no_history(*a, **kw):
        raise AssertionError("the unfused path dequantized the history")

    monkeypatch.setattr(_oscar, "segments", no_history)
    monkeypatch.setattr(F.OPS.packing, "unpack_dequantize", no_history)
    for dtype in (torch.float16, torch.float32):
        q = _q(device, 2, 1, dtype, seed=15)
        out, lse = F.decode_attention(cfg, calib, fs, q)
        _check(cfg, calib, rs, out, lse, q, f"{dtype}: ")
    assert len(planned_launches.grids(OD._pages_kernel)) == 2, planned_launches
    assert F.OPS.fused_decode is OD.decode
    with pytest.raises(AssertionError, match="unfused path"):
        _oscar.decode_attention(dataclasses.replace(F.OPS, fused_decode=None), cfg, calib, fs, q)


def test_fp16_tokens_read_in_place(device, planned_launches):
    """The sink and the window reach the partial kernel as views of the state's own fp16 buffers (two
    segments, no fp32 copy), and the query and the output are rotated by one ``rotate_heads`` launch each
    (the output's rounded to q's dtype there); without the rotation back, the merge writes q's dtype."""
    F, OD = _mods()
    from kvq.fast.triton import attention as TA
    seen = planned_launches
    ptr = lambda a: a if isinstance(a, int) else a.data_ptr()                  # noqa: E731 (address or tensor)
    T = 50 if device == "cpu" else 2000
    cfg, calib, rs, fs = _state(device, 2, T, seed=21)
    for back in (True, False):
        seen.clear()
        q = _q(device, 4, 1, torch.float16, seed=22)
        out, lse = F.decode_attention(cfg, calib, fs, q, rotate_back=back)
        _check(cfg, calib, rs, out, lse, q, rotate_back=back)
        kinds = [la.kernel for la, _ in seen]
        assert kinds.count(OD._rotate_heads_kernel) == (2 if back else 1)
        parts = [(la, a) for la, a in seen if la.kernel is TA._partial_kernel]
        assert [(ptr(a[1]), ptr(a[2])) for _, a in parts] == [
            (fs.sink_k.data_ptr(), fs.sink_v.data_ptr()), (fs.win_k.data_ptr(), fs.win_v.data_ptr())]
        assert fs.sink_k.dtype == fs.win_v.dtype == torch.float16
        merge = [la for la, _ in seen if la.kernel is TA._merge_kernel]
        assert len(merge) == 1 and merge[0].consts["OUT_KIND"] == (2 if back else 0)      # fp32 / fp16


def test_decode_plan_reused(device, monkeypatch, triton_dispatches):
    """The decode's launches (query rotation, pages, sink, window, merge, output rotation) are planned once
    per call shape and kept: on the GPU a later call makes no Triton dispatch at all and gives the first
    call's bits, as does a call through Triton's dispatch; under the interpreter every launch dispatches.
    A new length is a new plan."""
    F, OD = _mods()
    from kvq.fast.triton import _launch as L
    T = 50 if device == "cpu" else 2000
    cfg, calib, rs, fs = _state(device, 2, T, seed=23)
    q = _q(device, 4, 1, torch.float16, seed=24)
    out0, lse0 = F.decode_attention(cfg, calib, fs, q)
    before = OD._decode_plan.cache_info()
    on_gpu = device != "cpu"
    dispatched = triton_dispatches
    dispatched.clear()
    out1, lse1 = F.decode_attention(cfg, calib, fs, q.clone())
    after = OD._decode_plan.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses
    assert dispatched == []                    # the GPU: kept kernels; the interpreter: no JITFunction at all
    assert torch.equal(out1, out0) and torch.equal(lse1, lse0)
    monkeypatch.setattr(L, "current_stream", lambda device_index: None)       # Triton's dispatch every launch
    out2, lse2 = F.decode_attention(cfg, calib, fs, q)
    assert len(dispatched) == (6 if on_gpu else 0)
    assert torch.equal(out2, out0) and torch.equal(lse2, lse0)
    monkeypatch.undo()
    _, _, rs2, fs2 = _state(device, 2, T + 1, seed=23)
    F.decode_attention(cfg, calib, fs2, q)
    assert OD._decode_plan.cache_info().misses == after.misses + 1


def test_output_rotation_is_the_plans_own(device, monkeypatch):
    """The decode's output rotation reads the merged fp32 rows from the plan's buffer, at an offset whose
    16-byte alignment is the plan's: its launch is the plan's own, never the launch ``rotate_heads`` keeps per
    call shape for its (aligned) tensors, whose kept kernel may assume that alignment."""
    F, OD = _mods()
    from kvq.fast.triton import _launch as L
    T = 50 if device == "cpu" else 2000
    cfg, calib, rs, fs = _state(device, 2, T, seed=25)
    q = _q(device, 4, 1, torch.float16, seed=26)
    seen, plans = [], []
    real, real_plan = L.Launch.__call__, OD._decode_plan

    def record(self, args, stream, device_index):
        seen.append(self)
        return real(self, args, stream, device_index)

    monkeypatch.setattr(L.Launch, "__call__", record)
    monkeypatch.setattr(OD, "_decode_plan", lambda *a: plans.append(real_plan(*a)) or plans[-1])
    out, lse = F.decode_attention(cfg, calib, fs, q)
    rot = [la for la in seen if la.kernel is OD._rotate_heads_kernel]
    assert len(rot) == 2 and len(plans) == 1 and plans[0].rot_out is rot[1]     # the query's, then the plan's
    seen.clear()
    H, D = fs.shape[1], fs.shape[2]
    R = torch.eye(D, dtype=torch.float32, device=device).expand(H, D, D).contiguous()   # as R_V^T: fp32, per head
    OD.rotate_heads(torch.zeros(q.shape, dtype=torch.float32, device=device), R, q.dtype)   # the output's call shape
    assert len(seen) == 1 and seen[0] is not rot[1]


#: (x dtype, output dtype, per-KV-head R) of the rotate_heads tests (both backends)
ROTATE_CASES = [(torch.float32, torch.float32, False), (torch.float16, torch.float32, True),
                (torch.float32, torch.float16, True), (torch.bfloat16, torch.bfloat16, False)]


@pytest.mark.parametrize("in_dt,out_dt,per_head", ROTATE_CASES)
def test_rotate_heads(device, in_dt, out_dt, per_head):
    """oscar_decode.rotate_heads (float64 sums, one launch): ``check_rotate_heads``."""
    _, OD = _mods()
    check_rotate_heads(OD, device, 32 if device == "cpu" else 128, in_dt, out_dt, per_head)


def check_rotate_heads(OD, device, D, in_dt, out_dt, per_head):
    """A backend's ``rotate_heads`` equals the float64 product rounded to fp32 and then to the output dtype,
    to within one fp32 rounding of the sum (its order differs), for a strided x and per-KV-head rotations
    (GQA: head h uses R[h // 4]); a float32 R gives the bits of its float64 copy; fp16 output saturates at
    +-65504 (rule 3); a bad R is refused."""
    g = torch.Generator().manual_seed(3)
    B, Hkv, Gq, T = 2, 3, 4, 5
    x = (torch.randn(B, T, Hkv * Gq, D, generator=g) * 7).to(in_dt).to(device).transpose(1, 2)   # strided
    R = torch.linalg.qr(torch.randn(Hkv if per_head else 1, D, D, generator=g, dtype=torch.float64))[0]
    R = (R if per_head else R[0]).to(device)
    got = OD.rotate_heads(x, R, out_dt)
    R3 = R if per_head else R.unsqueeze(0).expand(Hkv, D, D)
    exact = (x.double().reshape(B, Hkv, Gq * T, D) @ R3).reshape(B, Hkv * Gq, T, D)
    assert got.dtype == out_dt and got.shape == x.shape and got.is_contiguous()
    f32 = exact.float()
    # the float64 sums differ from the library's in the last bits: at most one fp32 step apart after
    # rounding, hence at most one step of the output dtype after the second rounding
    step = torch.finfo(out_dt).eps * exact.abs().max().item()
    assert (got.double() - f32.to(out_dt).double()).abs().max().item() <= step
    if out_dt == torch.float32:
        assert (got.double() - exact).abs().max().item() <= torch.finfo(torch.float32).eps * exact.abs().max().item()
    R32 = R.float()
    assert torch.equal(OD.rotate_heads(x, R32, out_dt), OD.rotate_heads(x, R32.double(), out_dt))
    with pytest.raises(ValueError, match="float64 or float32 R"):
        OD.rotate_heads(x, R.half(), out_dt)
    if out_dt == torch.float16:                       # beyond fp16's range: +-65504, not inf
        big = OD.rotate_heads(x.float() * 1e5, R, out_dt)
        assert torch.isfinite(big).all() and big.abs().max().item() == 65504.0


# The page kernel compiled for sm_90 (no GPU: Triton's NVIDIA backend, as tests/fast/test_triton_compile_*
# do), its TTGIR's tensor-core dot operands as (rows, cols, opIdx, kWidth).
_DOTS_SCRIPT = textwrap.dedent('''
    import json, re, sys
    import triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from kvq.fast.triton import oscar_decode as OD
    cx = json.loads(sys.argv[1])
    types = {"q_ptr": "*fp32", "kc_ptr": "*u8", "vc_ptr": "*u8", "tab_ptr": "*i32", "o_ptr": "*fp32",
             "m_ptr": "*fp32", "l_ptr": "*fp32", "ks_ptr": "*fp16", "km_ptr": "*fp16", "vs_ptr": "*fp16",
             "vm_ptr": "*fp16", "qk_scale": "fp32"}
    fn = OD._pages_kernel
    sig = {a: "constexpr" if a in cx else types.get(a, "i32") for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 2})
    pat = r"tensor<(\\d+)x(\\d+)xf16, #ttg\\.dot_op<\\{opIdx = (\\d), parent = #\\w+, kWidth = (\\d+)\\}>>"
    print(json.dumps([[int(x) for x in m] for m in re.findall(pat, k.asm["ttgir"])]))
''')

_DOT_CASES = {   # the tensor-core path at its smallest K extents: blocks of 16 tokens (P @ V), groups of 16
    "G128-bt16": dict(D=128, G=128, BT=16),   # channels (q k); the three failed on an H200 before KMIN
    "G64-bt16-gqa8": dict(D=128, G=64, BT=16, G_Q=8),
    "D64-G16-bt16": dict(D=64, G=16, BT=16, G_Q=1),
    "G16-bt64-4bit": dict(D=128, G=16, BT=64, BITS=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_DOT_CASES))
def test_tensor_core_dots_cover_k(name):
    """Every tensor-core dot of the page kernel has a K extent of at least 4 x its operands' kWidth:
    the fp16 codes come from 8-bit loads, so Triton gives the mma operands kWidth = 8, a layout 32 wide
    along K; a K of 16 (blocks of 16 tokens, groups of 16 channels) wraps it, and the mma then sums half
    the products twice (wrong on the GPU only: the interpreter's dot is exact)."""
    pytest.importorskip("triton")
    cx = dict(G_Q=4, PG=128, BITS=2, BLOCK_M=16, PRECISE=False, TIGHT=True, NBLK=0, K_TERMS=3, V_TERMS=1,
              SHIFT=2048.0)
    cx.update(_DOT_CASES[name])
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _DOTS_SCRIPT, json.dumps(cx)], capture_output=True, text=True,
                         env=env, timeout=600, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    ops = json.loads(res.stdout.strip().splitlines()[-1])
    assert ops, f"{name}: no tensor-core dot operand in the TTGIR"
    short = [(r, c, i, w) for r, c, i, w in ops if (c if i == 0 else r) < 4 * w]
    assert not short, f"{name}: dot operands (rows, cols, opIdx, kWidth) with K < 4 kWidth: {short}"
