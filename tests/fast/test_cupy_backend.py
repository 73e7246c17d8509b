"""The CuPy backend's plumbing: imports without CuPy, mirrors the reference's signatures, views torch
tensors zero-copy through DLPack, launches on torch's current stream, caches compiled modules, and
handles fp16 / bf16 / fp32 (GPU tests, marker gpu). Bit-exact parity lives in tests/parity.

    pytest tests/fast/test_cupy_backend.py -m "not gpu"     # CI
    pytest tests/fast/test_cupy_backend.py -m gpu           # device
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvq.fast import MIRRORED, NOT_YET_IMPLEMENTED  # noqa: E402


# ----------------------------------------------------------------------------------------------------
# CPU: structure


@pytest.mark.parametrize("module", sorted(MIRRORED))
def test_mirrors_reference_signatures(module):
    """Every mirrored function exists (or is listed as not yet implemented) with the reference's signature,
    and its docstring opens with "Mirrors `kvq.reference.<module>.<name>`". A module whose every name is
    listed as not yet implemented may not exist yet (kivi / kitty)."""
    missing = NOT_YET_IMPLEMENTED["cupy"].get(module, {})
    if set(MIRRORED[module]) <= set(missing) and importlib.util.find_spec(f"kvq.fast.cupy.{module}") is None:
        return
    fast = importlib.import_module(f"kvq.fast.cupy.{module}")
    try:
        ref = importlib.import_module(f"kvq.reference.{module}")
    except ImportError:
        ref = None
    missing = NOT_YET_IMPLEMENTED["cupy"].get(module, {})
    for name in MIRRORED[module]:
        if name in missing:
            assert not hasattr(fast, name), f"{module}.{name} is listed as not yet implemented but exists"
            continue
        fn = getattr(fast, name)
        if ref is not None and not inspect.isfunction(getattr(ref, name)):   # data: the reference's object
            assert fn is getattr(ref, name), f"{module}.{name} must be re-exported from kvq.reference.{module}"
            continue
        doc = inspect.getdoc(fn) or ""
        assert doc.startswith(f"Mirrors `kvq.reference.{module}.{name}`"), f"{module}.{name}: {doc[:60]!r}"
        if ref is not None:
            got = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
            want = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(ref, name)).parameters.values()]
            assert got == want, f"{module}.{name}: {got} != reference {want}"


def test_import_does_not_import_cupy():
    import subprocess
    import sys

    code = ("import sys, importlib, kvq.fast.cupy as c\n"
            "for m in c.__all__: importlib.import_module('kvq.fast.cupy.' + m)\n"
            "assert 'cupy' not in sys.modules, 'cupy was imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_sources_ship_with_the_package():
    from kvq.fast.cupy import _loader

    for name in _loader.KERNELS:
        assert "__global__" in _loader.source(name)


# ----------------------------------------------------------------------------------------------------
# GPU: plumbing


@pytest.fixture(scope="module")
def L():
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kvq.fast.cupy import _loader

    return _loader


@pytest.mark.gpu
def test_dlpack_views_are_zero_copy(L):
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.uint8):
        t = torch.zeros((3, 5, 8), dtype=dtype, device="cuda")[:, 1:4]   # a view with an offset
        c = L.arg(t)
        assert c.data.ptr == t.data_ptr(), dtype
        assert c.shape == tuple(t.shape) and c.strides == tuple(s * t.element_size() for s in t.stride())


@pytest.mark.gpu
def test_outputs_are_torch_allocations(L):
    from kvq.fast.cupy import packing, quant

    x = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    codes, scale, mn = quant.quantize(x, 2, 128)
    packed, s2, m2 = packing.quantize_pack(x, 2, 128)
    for t in (codes, scale, mn, packed, s2, m2):
        assert isinstance(t, torch.Tensor) and t.is_cuda
    assert torch.equal(packing.pack(codes, 2), packed)
    assert torch.equal(s2, scale) and torch.equal(m2, mn)


def test_pack_args_lays_out_arguments_as_c_does():
    """The packed launcher's parameter buffer (CPU, no CuPy): each argument at the offset a C struct of the
    kernel's parameter types gives it (ctypes computes that layout independently), torch tensors as their
    data pointers, NumPy scalars as their C types, Python ints / floats as CuPy passes them (int64, double),
    then the array of the arguments' addresses that cuLaunchKernel takes."""
    import ctypes
    import struct

    from kvq.fast.cupy import _loader as L

    t = torch.zeros(3, dtype=torch.float16)
    args = (np.int32(-7), t, np.float32(1.5), np.uint8(200), np.int64(-(2 ** 40)), 3, 0.25, np.uint64(2 ** 63 + 5),
            np.int16(-3), np.float64(-2.5), np.bool_(True), np.float16(0.5), np.uint32(2 ** 32 - 1))
    ctypes_of = [ctypes.c_int32, ctypes.c_uint64, ctypes.c_float, ctypes.c_uint8, ctypes.c_int64, ctypes.c_int64,
                 ctypes.c_double, ctypes.c_uint64, ctypes.c_int16, ctypes.c_double, ctypes.c_bool, ctypes.c_uint16,
                 ctypes.c_uint32]
    S = type("S", (ctypes.Structure,), {"_fields_": [(f"a{i}", c) for i, c in enumerate(ctypes_of)]})
    buf, params = L.pack_args(args)
    base = ctypes.addressof(buf)
    addrs = struct.unpack(f"<{len(args)}Q", ctypes.string_at(params, 8 * len(args)))
    assert params == base + ctypes.sizeof(S)                    # the values, padded to 8 bytes, then the addresses
    assert [a - base for a in addrs] == [getattr(S, f"a{i}").offset for i in range(len(args))]
    s = S.from_buffer_copy(ctypes.string_at(base, ctypes.sizeof(S)))
    want = [-7, t.data_ptr(), 1.5, 200, -(2 ** 40), 3, 0.25, 2 ** 63 + 5, -3, -2.5, True,
            int(np.float16(0.5).view(np.uint16)), 2 ** 32 - 1]
    assert [getattr(s, f"a{i}") for i in range(len(args))] == want


def test_pack_args_leaves_other_types_to_cupy():
    """An argument of a type the packed launcher does not know (here a string) sends the launch to CuPy's
    own launcher (None), whatever came before it."""
    from kvq.fast.cupy import _loader as L

    assert L.pack_args((np.int32(1), "x")) is None
    assert L.pack_args(()) is not None


@pytest.mark.gpu
def test_pointer_and_dlpack_modes_agree(L, monkeypatch):
    """Kernels get the same bits whether tensors travel as raw pointers (default) or DLPack views."""
    from kvq.fast.cupy import attention, packing

    x = torch.randn(3, 53, 64, device="cuda", dtype=torch.bfloat16)[:, 1:]   # an offset view, n = 52
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 2, 100, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    got = {}
    for mode in ("pointer", "dlpack"):
        monkeypatch.setattr(L, "ARG_MODE", mode)
        got[mode] = (*packing.quantize_pack(x, 2, 13, axis=1), *attention.decode_attention(q, [(k, v)]))
    for a, b in zip(got["pointer"], got["dlpack"]):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_runs_on_torchs_current_stream(L):
    from kvq.fast.cupy import packing

    x = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
    want = packing.quantize_pack(x, 4, 64, axis=0)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert L.stream().ptr == s.cuda_stream
        x2 = x * 1                                     # produced on s: the kernel must run after it
        got = packing.quantize_pack(x2, 4, 64, axis=0)
    s.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert L.stream().ptr == torch.cuda.current_stream().cuda_stream


@pytest.mark.gpu
def test_modules_are_cached(L):
    m1 = L.module("quant.cu")
    assert L.module("quant.cu") is m1
    k1 = L.kernel("quant.cu", "quant_rows<0, 2, true>")
    assert L.kernel("quant.cu", "quant_rows<0, 2, true>") is k1
    with pytest.raises(ValueError, match="not built"):
        L.kernel("quant.cu", "quant_rows<0, 3, true>")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes_round_trip(L, dtype):
    """Dequantized values lie within half a step of the input, for every input / output dtype."""
    from kvq.fast.cupy import packing, quant

    x = torch.randn(2, 4, 64, 32, device="cuda", dtype=dtype)
    for axis in (2, -1):
        codes, scale, mn = quant.quantize(x, 8, 32, axis, np.float32)
        y = quant.dequantize(codes, scale, mn, 32, axis, torch.float32)
        step = scale.float().repeat_interleave(32, dim=axis)
        assert bool(((y - x.float()).abs() <= step / 2 + 1e-6).all()), (dtype, axis)
        for out in (torch.float16, torch.bfloat16, torch.float32):
            assert quant.dequantize(codes, scale, mn, 32, axis, out).dtype == out
        p, s, m = packing.quantize_pack(x, 4, 32, axis)
        assert p.shape[axis] == x.shape[axis] // 2 and p.dtype == torch.uint8
        assert s.dtype == torch.float16 and s.shape[axis] == x.shape[axis] // 32


# ----------------------------------------------------------------------------------------------------
# CPU: the fused decode's launch planning (kvq.fast.cupy.paged)


@pytest.mark.parametrize("NP,n_base,nw,slots", [(1024, 64, 4, 528), (1024, 8, 4, 528), (1024, 256, 4, 528),
                                                (1024, 256, 4, 396), (3, 64, 4, 528), (250, 64, 4, 528),
                                                (1, 1, 4, 528), (4096, 2, 1, 264), (64, 8, 2, 100)])
def test_split_plan_covers_every_page_once(NP, n_base, nw, slots):
    """plans.n_splits: the splits cover pages [0, NP) exactly once in whole pages per warp, no split is
    empty, and no other count in 1..NP has a smaller makespan under the documented model."""
    from kvq.fast.cupy import plans

    sp, pps = plans.n_splits(NP, n_base, nw, slots)
    assert pps % nw == 0 and pps >= nw
    assert sp == -(-NP // pps) and (sp - 1) * pps < NP <= sp * pps     # no empty split, all pages

    def cost(s):
        p = -(-(-(-NP // s)) // nw) * nw
        s = -(-NP // p)
        return -(-(n_base * s) // slots) * (p // nw + 1)

    assert cost(sp) == min(cost(s) for s in range(1, NP + 1))


def test_split_plan_fills_one_wave():
    """B = 8, 8 KV heads, 128K tokens on 132 SMs x 4 blocks: 8 splits (512 blocks: one wave), not the
    partial second wave that a fixed blocks-per-SM target gave (576 blocks)."""
    from kvq.fast.cupy import plans

    assert plans.n_splits(1024, 64, 4, 528) == (8, 128)


@pytest.mark.parametrize("NP,n_base,want", [(255, 8, (32, 8)), (1023, 8, (32, 32)), (63, 64, (4, 16)),
                                             (63, 256, (1, 64)), (255, 64, (4, 64)), (1023, 64, (8, 128)),
                                             (1023, 256, (2, 512))])
def test_fused_splits_small_grids_at_two_blocks_per_sm(monkeypatch, NP, n_base, want):
    """plans.fused_splits on 132 SMs x 4 blocks: a plan that leaves each warp at most FEW_PAGES_PER_WARP (8) pages
    (batch 1; batch 8 up to 32K; batch 32 at 8K) is re-planned on 2 blocks per SM (1 x 32K: 64 splits of 1
    page per warp -> 32 of 2, measured 34 -> 27 us on the H100; 8 x 32K: 8 splits of 8 pages per warp -> 4
    of 16); a long grid (32 pages per warp: 8 x 128K, 32 x 32K) keeps the kernel's occupancy (OSCAR's
    decode adds few_bases: test_fused_splits_few_bases)."""
    from kvq.fast.cupy import plans

    sp, pps = plans.fused_splits(NP, n_base, 4, 528, 132, max_blocks_per_sm=None)
    assert (sp, pps) == want
    old_sp, old_pps = plans.n_splits(NP, n_base, 4, 528)
    small = old_pps // 4 <= plans.FEW_PAGES_PER_WARP
    assert (sp, pps) == (plans.n_splits(NP, n_base, 4, 264) if small else (old_sp, old_pps))
    assert n_base * sp <= (264 if small else 528)                  # one wave in either case


@pytest.mark.parametrize("NP,n_base", [(253, 8), (509, 64), (1021, 64), (253, 256), (1021, 128)])
def test_fused_splits_few_bases(monkeypatch, NP, n_base):
    """few_bases (OSCAR's page kernel, 3 blocks per SM, 396 slots on 132 SMs): a split of fewer than 132
    (batch x KV head) blocks is planned on 2 blocks per SM however many pages each warp gets (8 x 64K: 22
    pages per warp at 3 blocks per SM, measured 0.136 -> 0.130 ms); a split of 132 or more (32 x 32K: 256
    blocks, measured 0.277 at 3 blocks per SM, 0.339 at 2) keeps the plain rule; without few_bases nothing
    changes."""
    from kvq.fast.cupy import plans

    got = plans.fused_splits(NP, n_base, 4, 396, 132, few_bases=True, max_blocks_per_sm=None)
    plain = plans.fused_splits(NP, n_base, 4, 396, 132)
    if n_base < 132:
        assert got == plans.n_splits(NP, n_base, 4, 264)
        assert n_base * got[0] <= 264                               # one wave at 2 blocks per SM
    else:
        assert got == plain
    if n_base == 64:                                                # 22 / 43 pages per warp: the rule keeps 3
        assert plain == plans.n_splits(NP, n_base, 4, 396) != got


def test_fused_splits_cap_from_knobs():
    """max_blocks_per_sm = n (``paged.Knobs``) plans on at most n blocks per SM (never more than the kernel
    holds); anything but a positive int or None is refused, by fused_splits and by the Knobs."""
    from kvq.fast.cupy import paged, plans

    assert plans.fused_splits(1023, 8, 4, 528, 132, max_blocks_per_sm=1) == plans.n_splits(1023, 8, 4, 132)
    assert plans.fused_splits(255, 8, 4, 528, 132, max_blocks_per_sm=8) == plans.n_splits(255, 8, 4, 528)
    for bad in (0, -1, 2.5, "2"):
        with pytest.raises(ValueError, match="max_blocks_per_sm"):
            plans.fused_splits(255, 8, 4, 528, 132, max_blocks_per_sm=bad)
        with pytest.raises(ValueError, match="max_blocks_per_sm"):
            paged.Knobs(max_blocks_per_sm=bad)


def test_blocks_per_sm_limits(monkeypatch):
    """blocks_per_sm: the least of the register (per-warp allocation in units of 256), shared-memory
    (plus the driver's reserve per block) and thread limits."""
    from kvq.fast.cupy import plans

    monkeypatch.setattr(plans, "device_limits", lambda i: (65536, 233472, 2048, 1024))
    fn = type("F", (), {"num_regs": 128, "shared_size_bytes": 288})()
    assert plans.blocks_per_sm(fn, 128, 45056, 0) == 4                 # registers: 65536 / (4096 * 4)
    fn.num_regs = 168
    assert plans.blocks_per_sm(fn, 128, 45056, 0) == 3                 # 5376 per warp
    fn.num_regs = 32
    assert plans.blocks_per_sm(fn, 128, 100000, 0) == 2                # shared memory
    assert plans.blocks_per_sm(fn, 1024, 0, 0) == 2                    # threads


@pytest.mark.parametrize("optin, want, got", [(232448, 4, 4), (232448, 2, 2), (101376, 4, 2), (101376, 2, 2),
                                              (49152, 4, 1), (232448, 1, 1)])
def test_tail_warps_fit_the_device(monkeypatch, optin, want, got):
    """paged_tail_attn's warps per block as asked (``Knobs.tail_warps``), fewer where the device's opt-in
    shared memory (H100 227 KiB, sm_86 99 KiB) cannot hold their fp32 tiles (33 KiB per warp at D = 128)."""
    from kvq.fast.cupy import paged, plans

    monkeypatch.setattr(plans, "smem_optin", lambda i: optin)
    assert paged._tail_warps(128, 0, 77824, knobs=paged.Knobs(tail_warps=want)) == got


def _tail_static(n: int, sums: int = 2) -> int:
    """paged_tail_attn<128, 4, n, 0, sums>'s static shared memory as ptxas reports it (sm_90: 4224 / 3136 /
    2592 bytes at 4 / 2 / 1 warps with sums = 2, 6272 / 5184 / 4640 with sums = 1): the queries [4][128]
    (fp32 with four fp32 chains per score, fp64 with float64 sums), the probabilities [n][32][4] fp32, m and
    l [n][4] fp32 each."""
    return 4 * 128 * (8 if sums == 1 else 4) + n * 32 * 4 * 4 + 2 * n * 4 * 4


@pytest.mark.parametrize("method, k_bits, v_bits, kitty, db, got", [
    ("KIVI-K2V2", 2, 2, False, 0, 4), ("Kitty", 2, 2, True, 16, 2), ("Kitty-Pro", 2, 2, True, 32, 2),
    ("KIVI-K2V4", 2, 4, False, 0, 2), ("KIVI-K4V4", 4, 4, False, 0, 2), ("no pages", 4, 4, False, 0, 4)])
def test_tail_warps_auto(monkeypatch, method, k_bits, v_bits, kitty, db, got):
    """``Knobs.tail_warps = None`` (the default): where the tail would wait for the fused tensor-core kernel's blocks (two
    per SM all along, or a small grid of at most SHORT_PAGES_PER_WARP pages per warp), the most warps whose
    tail block leaves an H100 SM (228 KiB of shared memory) room for them; else the most warps; every block
    counted with its static shared memory (the fused kernel's 288 / 800 bytes, the tail's queries and
    probabilities) and the driver's 1 KiB reserve. KIVI-K2V2: 2 x 46.4 + 140.4 KiB fit; Kitty: 2 x 49.4 +
    140.4 KiB do not, so its tail takes 2 warps."""
    from kvq.fast.cupy import paged, plans

    monkeypatch.setattr(plans, "smem_optin", lambda i: 232448)
    monkeypatch.setattr(plans, "device_limits", lambda i: (65536, 233472, 2048, 1024))
    assert paged.DEFAULT_KNOBS.tail_warps is None
    fused = 0 if method == "no pages" else paged._mma2_smem(kitty, db, 4, k_bits, v_bits) + (800 if kitty else 288)
    assert paged._tail_warps(128, 0, fused, tail_static=_tail_static) == got
    # the float64 sums' larger static queries (Knobs.tail_sums = 1) change no choice on the H100
    assert paged._tail_warps(128, 0, fused, tail_static=lambda n: _tail_static(n, 1)) == got
    # a fused grid of more than two blocks per SM leaves no room worth keeping: the most warps
    assert paged._tail_warps(128, 0, fused, tail_static=_tail_static, fused_per_sm=4, fused_resident=4) == 4
    # a small grid (two blocks per SM) of a kernel that could hold four: beside it only if it is short
    short = dict(fused_per_sm=2, fused_resident=4, fused_pages_per_warp=paged.SHORT_PAGES_PER_WARP)
    assert paged._tail_warps(128, 0, fused, tail_static=_tail_static, **short) == got
    short["fused_pages_per_warp"] += 1
    assert paged._tail_warps(128, 0, fused, tail_static=_tail_static, **short) == 4
    if method == "Kitty":                      # without the static parts and the reserve it looked like 4 fit
        monkeypatch.setattr(plans, "device_limits", lambda i: (65536, 233472, 2048, 0))
        assert paged._tail_warps(128, 0, paged._mma2_smem(kitty, db, 4, k_bits, v_bits)) == 4


@pytest.mark.parametrize("optin, want, got", [(232448, None, 4), (232448, 2, 2), (49152, 4, 2), (49152, None, 2)])
def test_tail16_warps(monkeypatch, optin, want, got):
    """paged_tail16_attn (fp16 tiles, 16.5 KiB per warp at D = 128): ``Knobs.tail16_warps`` or the auto
    rule, capped by the device (48 KiB holds two warps); KIVI-K4V4's fused blocks leave room for 4 warps."""
    from kvq.fast.cupy import paged, plans

    monkeypatch.setattr(plans, "smem_optin", lambda i: optin)
    monkeypatch.setattr(plans, "device_limits", lambda i: (65536, 233472, 2048, 1024))
    assert paged._tail_warps(128, 0, paged._mma2_smem(False, 0, 4, 4, 4), fp16=True,
                             knobs=paged.Knobs(tail16_warps=want)) == got


def test_tail_warps_rejects_unbuilt_counts():
    from kvq.fast.cupy import paged

    for key in ("tail_warps", "tail16_warps"):
        with pytest.raises(ValueError, match="built for"):
            paged.Knobs(**{key: 3})


@pytest.mark.parametrize("sms, per_sm_max", [(1, 3), (64, 4)])
def test_decode_tells_tail_warps_the_fused_blocks_per_sm(monkeypatch, sms, per_sm_max):
    """decode_attention's glue (CPU, launches recorded, no CuPy): ``_tail_warps`` gets the fused kernel's
    shared memory per block (dynamic + static) and the fused blocks an SM holds in this launch (the least of
    its resident blocks per SM and the grid over the SMs), and the tail launches with the warps it chose."""
    from kvq.fast.cupy import paged as PD
    from kvq.fast.triton import kivi as TK
    from kvq.reference import kivi as RK

    rec, asked = _patch_decode_glue(monkeypatch, sms, per_sm_max), []
    real = PD._tail_warps

    def spy(D, dev, fused_block=0, fp16=False, tail_static=None, fused_per_sm=2, fused_resident=2,
            fused_pages_per_warp=0, other=0, warp_bytes=0, knobs=PD.DEFAULT_KNOBS):
        assert other == 0 and warp_bytes == 0  # no tensor-core tail beside (knobs tail_mma, mixed_mma False)
        n = real(D, dev, fused_block, fp16, tail_static, fused_per_sm, fused_resident, fused_pages_per_warp,
                 knobs=knobs)
        asked.append((fused_block, fused_per_sm, fused_resident, fused_pages_per_warp,
                      tail_static(n) if tail_static else None, n))
        return n

    monkeypatch.setattr(PD, "_tail_warps", spy)
    kn = dict(tail_mma=False,    # the fp16 rows too through paged_tail_attn / tail16
              mixed_mma=False)   # ... and the mixed rows
    cfg = RK.KIVIConfig(2, 2, group_size=128, residual=128, max_tokens=4096)
    B, H, D, T = 1, 4, 128, 1100
    st = _kivi_cache(cfg, B, H, D, T)
    PD.decode_attention(cfg, TK.KeyCodec, st, torch.zeros((B, 4 * H, 1, D), dtype=torch.float16),
                        knobs=PD.Knobs(**kn))
    fused = [r for r in rec if r[0] == "mma2"]
    tails = [r for r in rec if r[0].startswith("paged_tail")]
    assert len(fused) == 1 and tails and len(asked) == len(tails)
    _, grid, fblock, smem, args = fused[0]
    blocks = grid[0] * grid[1] * grid[2]
    pps = int(args[24])                        # paged_decode_mma2's pages per split
    for (fused_block, per_sm, resident, ppw, static, n), (_, _, block, _, _) in zip(asked, tails):
        assert fused_block == smem + 288
        assert per_sm == min(per_sm_max, -(-blocks // sms)) and per_sm != 2 and resident == per_sm_max
        assert ppw == pps // (fblock[0] // 32)
        assert static == 288 and block == (32 * n,)
    assert all(r[0].endswith(", 2>") for r in tails)  # Knobs.tail_sums: four fp32 chains per score
    kn["tail_sums"] = 1
    rec.clear()
    PD.decode_attention(cfg, TK.KeyCodec, st, torch.zeros((B, 4 * H, 1, D), dtype=torch.float16),
                        knobs=PD.Knobs(**kn))
    tails = [r for r in rec if r[0].startswith("paged_tail")]
    assert tails and all(r[0].endswith(", 1>") for r in tails)


def _kivi_cache(cfg, B, H, D, T):
    """A CPU cache state (the Triton backend's, which runs on the CPU) of T random fp16 tokens."""
    from kvq.fast.triton import kivi as TK

    rng = np.random.default_rng(0)
    k = torch.from_numpy(rng.standard_normal((B, H, T, D)).astype(np.float16))
    v = torch.from_numpy(rng.standard_normal((B, H, T, D)).astype(np.float16))
    st = TK.init(cfg, B, H, D)
    TK.append(cfg, st, k, v)
    return st


#: the raw stream handles the CPU glue tests give torch's current stream and side stream k (SIDE_STREAM + k)
MAIN_STREAM, SIDE_STREAM = 7, 100


def _patch_decode_glue(monkeypatch, sms=132, per_sm_max=4):
    """decode_attention's CuPy glue made to run on the CPU: kernels are names (static shared memory 288 bytes),
    launches are recorded instead of run, the device has ``sms`` SMs holding ``per_sm_max`` fused blocks each,
    streams are raw handles (MAIN_STREAM, SIDE_STREAM + k). Returns the list of launch records: (kernel name,
    grid, block, dynamic shared memory, arguments), and ("merge", ...) for the merge; its ``.streams``: each
    launch's stream, its ``.waits``: the stream waits (launches before it, waiting stream, waited stream)."""
    import contextlib

    import kvq.fast.cupy._loader as L
    import kvq.fast.cupy.attention as A
    from kvq.fast import common as C
    from kvq.fast.cupy import paged as PD
    from kvq.fast.cupy import plans as PL

    class K(str):
        shared_size_bytes = 288

    class Rec(list):
        """the launch records, and beside them each launch's stream and the stream waits, in call order"""

        def __init__(self):
            super().__init__()
            self.streams, self.waits = [], []

        def clear(self):
            super().clear()
            self.streams.clear()
            self.waits.clear()

    rec = Rec()

    def run(fn, grid, block, args, dev, shared_mem=0, stream=None):
        rec.append((fn, grid, block, shared_mem, args))
        rec.streams.append(MAIN_STREAM if stream is None else stream)

    def launch(self, values, dev, stream):           # a planned launch (_loader.Prepared), recorded as run's
        args = self.bind(values)
        if str(self.fn).startswith("attn_merge"):   # as _merge_launch(o_part, lse_part, out, lse, rows, S, D)
            rec.append(("merge", *args[:4], int(args[4]), int(args[6]), int(args[5])))
            return
        run(self.fn, self.grid, self.block[:1] if self.block[1:] == (1, 1) else self.block, args, dev,
            self.shared_mem, stream)

    monkeypatch.setattr(L, "run", run)
    monkeypatch.setattr(L.Prepared, "launch", launch)
    monkeypatch.setattr(L, "on_device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(PD, "_decode_plan", PD._decode_plan.__wrapped__)   # plan every call: the stand-ins change
    monkeypatch.setattr(L, "raw_stream", lambda d: MAIN_STREAM)
    monkeypatch.setattr(L, "stream_wait", lambda waiter, waited, d, k=0: rec.waits.append((len(rec), waiter, waited)))
    monkeypatch.setattr(L, "kernel", lambda src, name: K(name))
    monkeypatch.setattr(L, "sm_count", lambda d: sms)
    monkeypatch.setattr(PL, "resident_slots", lambda *a, **k: per_sm_max * sms)
    monkeypatch.setattr(PL, "smem_optin", lambda i: 232448)
    monkeypatch.setattr(PL, "device_limits", lambda i: (65536, 233472, 2048, 1024))
    monkeypatch.setattr(PL, "allow_smem", lambda fn, smem, dev: fn)
    monkeypatch.setattr(PD, "_mma_kernel", lambda *a: K("mma2"))
    monkeypatch.setattr(PL, "side_stream", lambda d, k=0: type("Side", (), {"cuda_stream": SIDE_STREAM + k})())
    monkeypatch.setattr(PD, "mma_ok", lambda *a: True)
    monkeypatch.setattr(PD, "fused_ok", lambda cfg, D: True)
    monkeypatch.setattr(PD, "_aligned", lambda *t: True)
    monkeypatch.setattr(A, "merge_launch", lambda *a: rec.append(("merge",) + a))
    stream = type("S", (), {"wait_stream": lambda self, o: None})()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    orig = C.check_decode_q
    monkeypatch.setattr(C, "check_decode_q", lambda q, shape, device, length, allow_cpu=False:
                        orig(q, shape, device, length, allow_cpu=True))
    for f in (PD._tail_kernel, PD._tail_mma_kernel, PD._mixed_mma_kernel):
        f.cache_clear()
    return rec


def _record_decode_launches(monkeypatch, sms=132):
    """decode_attention's CuPy glue on the CPU: (launch records, a function that decodes a KIVI-K2V2* cache
    (sink 32, window 128, B = 2, H_kv = 4, D = 128, T = 1100: sink, key-buffer and mixed tail rows) with q
    of a dtype and GQA ratio). A record: (kernel name, grid, block, dynamic shared memory, arguments)."""
    from kvq.fast.cupy import paged as PD
    from kvq.fast.triton import kivi as TK
    from kvq.reference import kivi as RK

    rec = _patch_decode_glue(monkeypatch, sms)
    cfg = RK.KIVIConfig(2, 2, group_size=128, residual=128, max_tokens=4096, sink=32)
    B, H, D, T = 2, 4, 128, 1100
    st = _kivi_cache(cfg, B, H, D, T)

    def decode(dtype=torch.float16, ratio=4, **knobs):
        """decode with these launch knobs (``PD.Knobs`` fields; none: the defaults)"""
        rec.clear()
        PD.decode_attention(cfg, TK.KeyCodec, st, torch.zeros((B, ratio * H, 1, D), dtype=dtype),
                            knobs=PD.Knobs(**knobs))
        return rec

    return cfg, PD.counts(cfg, T), decode


@pytest.mark.parametrize("ratio", [4, 8, 12])
def test_decode_puts_fp16_tail_rows_on_tensor_cores(monkeypatch, ratio):
    """decode_attention's glue (CPU, launches recorded): with fp16 q and D = 128 the tail rows whose key and
    value are both fp16 (sink, key buffer) go to paged_tail_mma (``Knobs.tail_mma`` None / True: 2 warps
    beside a small fused grid, else 4, their tiles in dynamic shared memory, query tiles of 8 rows, the mixed
    rows skipped by (gap_at, gap) =
    (sink, mixed rows)) and the mixed rows (``Knobs.mixed_mma = False``) to paged_tail_attn, their partials
    numbered after the fused
    kernel's and each other's; bf16 q, or ``Knobs.tail_mma = False``, keep the tail off the tensor cores;
    the merge sees every partial."""
    import kvq.fast.cupy._loader as L
    from kvq.fast.cupy import paged as PD

    sms = 16                                   # B x H_kv = 8 (sequence, kv head) blocks fill a quarter of them
    cfg, c, decode = _record_decode_launches(monkeypatch, sms)
    kn = {"mixed_mma": False}   # the mixed rows: test_decode_puts_mixed_rows_on_tensor_cores
    NF = min(c["n_kpages"] * 128, c["n_vq"])
    n_mixed = max(c["n_kpages"] * 128, c["n_vq"]) - NF
    NT = c["n_sink"] + c["post"] - NF
    assert c["n_sink"] == 32 and n_mixed > 0 and NT - n_mixed > 32        # sink, key-buffer and mixed rows
    for want in (None, True):
        kn["tail_mma"] = want
        rec = decode(ratio=ratio, **kn)
        fused = [r for r in rec if r[0] == "mma2"]
        mma = [r for r in rec if r[0].startswith("paged_tail_mma")]
        mixed = [r for r in rec if r[0].startswith("paged_tail_attn")]
        assert len(fused) == len(mma) == len(mixed) == 1 and not [r for r in rec if "tail16" in r[0]]
        name, grid, block, smem, args = mma[0]
        # beside a small fused grid (at most two blocks per SM) 2 warps, so that a mixed-row block fits too
        fg = fused[0][1]
        nw = 2 if -(-(fg[0] * fg[1] * fg[2]) // sms) <= 2 else 4
        assert name == L.paged_tail_mma_name(nw) and block == (32 * nw,) and smem == nw * L.tail_mma_warp_bytes()
        # (q, 15 TailRows pointers, gap_at, gap, o_part, lse_part, 3 q strides, B, Hq, Tq, T, chunk, splits, split0, qk)
        gap_at, gap, T_rows, chunk, n, split0 = (int(args[16]), int(args[17]), int(args[26]), int(args[27]),
                                                 int(args[28]), int(args[29]))
        assert (gap_at, gap, T_rows) == (32, n_mixed, NT - n_mixed)
        assert grid == (n * -(-ratio // 8), 4, 2) and n * chunk >= T_rows and chunk % 32 == 0
        n_fused = fused[0][1][0]
        # (q, 15 pointers, kbits, vbits, kitty, u0, o_part, lse_part, 3 q strides, B, Hq, Tq, T, chunk, splits, split0, qk)
        m_args = mixed[0][4]
        assert int(m_args[19]) == 32 and int(m_args[28]) == n_mixed        # u0 = sink, T = the mixed rows
        m_n, m_split0 = int(m_args[30]), int(m_args[31])
        assert sorted([(split0, n), (m_split0, m_n)]) in ([(n_fused, n), (n_fused + n, m_n)],
                                                          [(n_fused, m_n), (n_fused + m_n, n)])
        merge = [r for r in rec if r[0] == "merge"][0]
        assert merge[6] == n_fused + n + m_n                                # S_TOTAL partials
    for dtype, want in ((torch.bfloat16, None), (torch.float16, False)):
        kn["tail_mma"] = want
        rec = decode(dtype, ratio, **kn)
        assert not [r for r in rec if r[0].startswith("paged_tail_mma")]
        assert [r for r in rec if r[0].startswith("paged_tail")]


@pytest.mark.parametrize("ratio", [4, 12])
def test_decode_puts_mixed_rows_on_tensor_cores(monkeypatch, ratio):
    """decode_attention's glue (CPU, launches recorded): with fp16 q and D = 128 the mixed tail rows (key in a
    page, value fp16) go to paged_mixed_mma by default (``Knobs.mixed_mma`` None / True): one launch of
    query tiles of 8 rows, u0 = the sink, T = the mixed rows, the key bits and Kitty flag, its warps' three
    tiles in dynamic shared memory, the fp16 rows beside it (paged_tail_mma, or paged_tail16_attn with
    ``Knobs.tail_mma = False``), every partial numbered once and merged; False, bf16 q, or
    ``Knobs.tail16 = False`` keep them on paged_tail_attn."""
    import kvq.fast.cupy._loader as L
    from kvq.fast.cupy import paged as PD

    sms = 16
    cfg, c, decode = _record_decode_launches(monkeypatch, sms)
    NF = min(c["n_kpages"] * 128, c["n_vq"])
    n_mixed = max(c["n_kpages"] * 128, c["n_vq"]) - NF
    NT = c["n_sink"] + c["post"] - NF
    assert c["n_kpages"] * 128 > c["n_vq"] and n_mixed > 0 and NT - n_mixed > 32
    kn = {}
    for tmma, fp16_kernel in ((None, "paged_tail_mma"), (False, "paged_tail16_attn")):
        kn["tail_mma"] = tmma
        for want in (None, True):
            kn["mixed_mma"] = want
            rec = decode(ratio=ratio, **kn)
            fused = [r for r in rec if r[0] == "mma2"]
            mixed = [r for r in rec if r[0].startswith("paged_mixed_mma")]
            fp16 = [r for r in rec if r[0].startswith(fp16_kernel)]
            assert len(fused) == len(mixed) == len(fp16) == 1 and not [r for r in rec if "tail_attn" in r[0]]
            name, grid, block, smem, args = mixed[0]
            nw = block[0] // 32
            assert name == L.paged_mixed_mma_name(nw) and smem == nw * L.mixed_mma_warp_bytes()
            # (q, 15 TailRows pointers, kbits, kitty, u0, o_part, lse_part, 3 q strides, B, Hq, Tq, T, chunk,
            # splits, split0, qk)
            kbits, kitty, u0, T_rows, chunk, n, split0 = (int(args[16]), int(args[17]), int(args[18]),
                                                          int(args[27]), int(args[28]), int(args[29]), int(args[30]))
            assert (kbits, kitty, u0, T_rows) == (2, 0, 32, n_mixed)
            assert grid == (n * -(-ratio // 8), 4, 2) and n * chunk >= T_rows and chunk % 32 == 0
            n_fused = fused[0][1][0]
            # paged_tail_mma and paged_tail16_attn: (q, 15 pointers, gap_at, gap, o_part, lse_part, 3 q
            # strides, B, Hq, Tq, T, chunk, splits, split0, qk)
            f_args = fp16[0][4]
            f_n, f_split0 = int(f_args[28]), int(f_args[29])
            assert sorted([(split0, n), (f_split0, f_n)]) in ([(n_fused, n), (n_fused + n, f_n)],
                                                              [(n_fused, f_n), (n_fused + f_n, n)])
            merge = [r for r in rec if r[0] == "merge"][0]
            assert merge[6] == n_fused + n + f_n
    kn = {"tail_mma": None}
    for dtype, key, val in ((torch.float16, "mixed_mma", False), (torch.bfloat16, "mixed_mma", None),
                            (torch.float16, "tail16", False)):
        kn[key] = val
        rec = decode(dtype, ratio, **kn)
        assert not [r for r in rec if r[0].startswith("paged_mixed_mma")]
        assert [r for r in rec if r[0].startswith("paged_tail_attn")]
        kn[key] = None


def test_mixed_mma_rule_keeps_one_tail_launch_beside_a_long_grid(monkeypatch):
    """The automatic rule (``Knobs.mixed_mma`` None) leaves the mixed rows on paged_tail_attn where
    paged_mixed_mma would cost the fp16 rows a launch of their own beside a long fused grid (more than
    SHORT_PAGES_PER_WARP pages a warp, no other rule splitting the fp16 rows off): the whole tail in one
    launch; True puts them on the tensor cores there too (H100, Kitty 1 x 128K: 0.0497 ms with the one
    launch, 0.0551 without)."""
    from kvq.fast.cupy import paged as PD
    from kvq.fast.triton import kivi as TK
    from kvq.reference import kivi as RK

    rec = _patch_decode_glue(monkeypatch, sms=8, per_sm_max=1)
    cfg = RK.KIVIConfig(2, 2, group_size=128, residual=128, max_tokens=4096, sink=32)
    B, H, D, T = 1, 4, 128, 4050
    st = _kivi_cache(cfg, B, H, D, T)
    for want, on in ((None, False), (True, True)):
        rec.clear()
        PD.decode_attention(cfg, TK.KeyCodec, st, torch.zeros((B, 4 * H, 1, D), dtype=torch.float16),
                            knobs=PD.Knobs(tail_mma=False, mixed_mma=want))
        fused = [r for r in rec if r[0] == "mma2"][0]
        assert int(fused[4][24]) // (fused[2][0] // 32) > PD.SHORT_PAGES_PER_WARP    # a long fused grid
        names = [r[0] for r in rec if r[0].startswith("paged_")]
        if on:
            assert len(names) == 2 and any(n.startswith("paged_mixed_mma") for n in names)
        else:
            assert len(names) == 1 and names[0].startswith("paged_tail_attn")


@pytest.mark.parametrize("side", [True, False])
def test_decode_forks_and_joins_side_streams(monkeypatch, side):
    """decode_attention's glue (CPU, launches recorded): the fused kernel launches on the caller's stream and
    each tail part on a side stream of its own (raw handles, no torch stream context), every side stream
    waits for the caller's stream before the first launch and the caller's stream waits for every side
    stream after the last one, before the merge; ``Knobs.side_stream = False``: everything on the
    caller's stream, no waits."""
    from kvq.fast.cupy import paged as PD

    _, _, decode = _record_decode_launches(monkeypatch, 16)
    rec = decode(side_stream=side)
    launches = [r for r in rec if r[0] != "merge"]
    merge_at = [i for i, r in enumerate(rec) if r[0] == "merge"]
    assert merge_at == [len(rec) - 1] and len(launches) >= 3           # fused, fp16 rows, mixed rows
    fused = [s for r, s in zip(launches, rec.streams) if r[0] == "mma2"]
    tails = [s for r, s in zip(launches, rec.streams) if r[0] != "mma2"]
    assert fused == [MAIN_STREAM]
    if not side:
        assert set(tails) == {MAIN_STREAM} and rec.waits == []
        return
    assert sorted(tails) == [SIDE_STREAM + k for k in range(len(tails))]   # one side stream a part
    forks = [(w, d) for n, w, d in rec.waits if n == 0]
    joins = [(w, d) for n, w, d in rec.waits if n == len(launches)]
    assert len(forks) + len(joins) == len(rec.waits)
    assert sorted(forks) == [(s, MAIN_STREAM) for s in sorted(tails)]
    assert sorted(joins) == [(MAIN_STREAM, s) for s in sorted(tails)]


@pytest.mark.parametrize("bad", [1, "yes", 0])
def test_mixed_mma_knob_rejects_bad_values(monkeypatch, bad):
    """``Knobs.mixed_mma`` is None, True or False: anything else is a clear error before any launch."""
    _, _, decode = _record_decode_launches(monkeypatch, 16)
    with pytest.raises(ValueError, match="mixed_mma"):
        decode(mixed_mma=bad)


@pytest.mark.parametrize("key, bad", [("tail_mma", 1), ("tail_mma", "yes"), ("tail_mma_warps", 3),
                                      ("tail_mma_warps", 8)])
def test_tail_mma_knobs_reject_bad_values(monkeypatch, key, bad):
    """``Knobs.tail_mma`` is None, True or False and ``Knobs.tail_mma_warps`` one of the warp counts
    paged_tail_mma is built for: anything else is a clear error before any launch."""
    _, _, decode = _record_decode_launches(monkeypatch, 16)
    with pytest.raises(ValueError, match=key):
        decode(**{key: bad})


def test_tail_mma_warps_fit_the_device(monkeypatch):
    """paged_tail_mma's warps per block: ``Knobs.tail_mma_warps``, or 4 (2 beside a fused grid of at most
    two blocks per SM), capped by what one block may hold (17 KiB of tiles per warp)."""
    from kvq.fast.cupy import paged as PD
    from kvq.fast.cupy import plans as PL

    for optin, want, per_sm, got in ((232448, None, 0, 4), (232448, None, 4, 4), (232448, None, 2, 2),
                                     (232448, None, 1, 2), (232448, 4, 2, 4), (232448, 2, 4, 2),
                                     (48 * 1024, None, 0, 2), (20 * 1024, None, 4, 1)):
        monkeypatch.setattr(PL, "smem_optin", lambda i, o=optin: o)
        assert PD._tail_mma_warps(0, per_sm, PD.Knobs(tail_mma_warps=want)) == got


def test_tail_mma_auto_rule(monkeypatch):
    """``Knobs.tail_mma`` None: the tensor-core tail where it applies (fp16 q, D = 128, the tail read in
    place, some fp16 rows), its blocks fill a quarter of the SMs (batch 8 x 8 kv heads on 132 SMs, not
    batch 1) and its fp16 rows are at least 1 / TAIL_MMA_SHARE of the fused tokens (Kitty at 8K on the
    H100: 128 fp16 rows beside 7936 fused tokens; not at 32K), or, where they hold a sink and the blocks
    are fewer than the SMs, at least 1 / TAIL_MMA_SINK_SHARE (Kitty 8 x 8K with an empty key Q-buffer: the
    32 sink rows beside 8064 fused tokens; not at 32 x 8K, 256 blocks, nor at 8 x 32K); True: wherever it
    applies."""
    from kvq.fast.cupy import paged as PD

    h, f, b = (torch.zeros(1, dtype=t) for t in (torch.float16, torch.float32, torch.bfloat16))

    kn = {}

    def ok(q, D, in_place, rows, fused, blocks=64, sink=0):
        return PD._tail_mma_ok(q, D, in_place, rows, fused, blocks, 132, sink, PD.Knobs(**kn))

    assert ok(h, 128, True, 128, 7936) and ok(h, 128, True, 128, 128 * PD.TAIL_MMA_SHARE) and ok(h, 128, True, 5, 0)
    assert ok(h, 128, True, 128, 7936, 33) and not ok(h, 128, True, 128, 7936, 32) and not ok(h, 128, True, 128, 0, 8)
    assert not ok(h, 128, True, 128, 32512) and not ok(h, 128, True, 128, 128 * PD.TAIL_MMA_SHARE + 1)
    # the sink's share: Kitty 8 x 8K (sink 32, fused 8064) yes; without a sink (KIVI's 32 key Q-buffer
    # rows), with blocks filling the SMs (32 x 8K), past 1 / TAIL_MMA_SINK_SHARE (8 x 32K) or at batch 1 no
    assert ok(h, 128, True, 32, 8064, 64, 32) and ok(h, 128, True, 32, 32 * PD.TAIL_MMA_SINK_SHARE, 131, 32)
    assert not ok(h, 128, True, 32, 8064, 64, 0) and not ok(h, 128, True, 32, 8064, 132, 32)
    assert not ok(h, 128, True, 32, 32 * PD.TAIL_MMA_SINK_SHARE + 1, 64, 32) and not ok(h, 128, True, 32, 32512, 64, 32)
    assert not ok(h, 128, True, 32, 8064, 8, 32)
    for args in ((f, 128, True, 128, 0), (b, 128, True, 128, 0), (h, 64, True, 128, 0), (h, 128, False, 128, 0),
                 (h, 128, True, 0, 0)):
        assert not ok(*args)
    kn["tail_mma"] = True
    assert ok(h, 128, True, 1, 10 ** 6, 1) and not ok(h, 64, True, 128, 0)
    kn["tail_mma"] = False
    assert not ok(h, 128, True, 128, 0) and not ok(h, 128, True, 32, 8064, 64, 32)


def test_tail_warps_leave_room_for_the_tensor_core_tail(monkeypatch):
    """Beside a fused grid of at most two blocks per SM, a mixed-row block shares the SM with a paged_tail_mma
    block too (``other``): Kitty's 4-warp mixed block (135 KiB) fitted beside two fused blocks' neighbours no
    longer, 2 warps do (H100, Kitty 8 x 8K: 0.0446 ms at 2 warps, 0.0499 at 4)."""
    import kvq.fast.cupy._loader as L
    from kvq.fast.cupy import paged, plans

    monkeypatch.setattr(plans, "smem_optin", lambda i: 232448)
    monkeypatch.setattr(plans, "device_limits", lambda i: (65536, 233472, 2048, 1024))
    fused = paged._mma2_smem(True, 16, 4, 2, 2) + 1024
    long_grid = dict(fused_per_sm=2, fused_resident=4, fused_pages_per_warp=4)
    assert paged._tail_warps(128, 0, fused, tail_static=_tail_static, **long_grid) == 4
    other = 2 * L.tail_mma_warp_bytes()
    assert paged._tail_warps(128, 0, fused, tail_static=_tail_static, **long_grid, other=other) == 2
    assert paged._tail_warps(128, 0, fused, tail_static=_tail_static, fused_per_sm=4, fused_resident=4,
                             other=other) == 4


@pytest.mark.parametrize("bad", [0, 3, True, "2", None])
def test_tail_sums_rejects_unbuilt_modes(bad):
    """``Knobs.tail_sums`` takes the summations the tail kernels are built for (1 float64, 2 four fp32
    chains); anything else is a clear error before any launch (when the knobs are made)."""
    from kvq.fast.cupy import paged

    with pytest.raises(ValueError, match="tail_sums"):
        paged.Knobs(tail_sums=bad)
    assert paged._tail_sums(paged.Knobs(tail_sums=1)) == 1
