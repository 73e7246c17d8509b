"""The CuPy paged decode's launch plans, on the CPU: a plan is computed once per (configuration, shape,
length, dtype, device, knobs) and reused, holds no tensor, and its prepared launches pack exactly the bytes
the generic launcher packs. The driver, the kernels and the device properties are stand-ins here (the
launches are recorded, not run); the kernels' results are the GPU parity tests'
(tests/parity/test_kivi_kitty_parity.py, ``-m gpu``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvq.fast.cupy._loader as L  # noqa: E402
import kvq.fast.cupy.paged as P  # noqa: E402
import kvq.fast.cupy.plans as PL  # noqa: E402

_PROPS = {"regsPerMultiprocessor": 65536, "sharedMemPerMultiprocessor": 233472, "maxThreadsPerMultiProcessor": 2048,
          "reservedSharedMemPerBlock": 1024, "sharedMemPerBlockOptin": 232448}


class _Fn:
    """A compiled kernel's stand-in: its name and the attributes the planner reads."""

    def __init__(self, name):
        self.name, self.num_regs, self.shared_size_bytes = name, 96, 0


class _Stream:
    def __init__(self, k):
        self.cuda_stream = 100 + k


@pytest.fixture
def fake_device(monkeypatch):
    """CuPy and CUDA stand-ins (132 SMs, H100-like limits); returns the list the launches are recorded in:
    ("launch", kernel name, grid, block, shared memory, stream, bound arguments) and ("wait", ...)."""
    if torch.cuda.is_available():
        pytest.skip("the stand-in device is for machines without a GPU")
    log = []
    fns = {}
    monkeypatch.setattr(L, "kernel", lambda src, expr: fns.setdefault((src, expr), _Fn(expr)))
    monkeypatch.setattr(L, "sm_count", lambda i: 132)
    monkeypatch.setattr(L, "raw_stream", lambda dev: 7)
    monkeypatch.setattr(L, "stream_wait", lambda a, b, dev, k=0: log.append(("wait", a, b, k)))
    monkeypatch.setattr(L, "run", lambda fn, grid, block, args, device, shared_mem=0, stream=None:
                        log.append(("launch", fn.name, tuple(grid), tuple(block), shared_mem, stream, tuple(args))))
    monkeypatch.setattr(L.Prepared, "launch", lambda self, values, dev, stream:
                        log.append(("launch", self.fn.name, self.grid, self.block, self.shared_mem, stream,
                                    self.bind(values))))
    monkeypatch.setattr(L, "on_device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(PL, "allow_smem", lambda fn, smem, dev: fn)
    monkeypatch.setattr(PL, "device_props", lambda i: _PROPS)
    monkeypatch.setattr(PL, "side_stream", lambda dev, k=0: _Stream(k))
    monkeypatch.setattr(P._paged, "check_q", lambda *a, **k: None)     # CuPy refuses CPU tensors
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: None)
    P._decode_plan.cache_clear()
    PL.device_limits.cache_clear()
    PL.resident_slots.cache_clear()
    yield log
    P._decode_plan.cache_clear()
    PL.device_limits.cache_clear()
    PL.resident_slots.cache_clear()


def _cache(name="KIVI-K2V2", T=300, B=2, kitty=False):
    """A CPU cache built by the Triton backend (the state class is shared: ``kvq.fast.caches.paged``) and the CuPy
    key codec of its method."""
    from kvq.fast.cupy import kitty as CT
    from kvq.fast.cupy import kivi as CK
    from kvq.fast.triton import kitty as TT
    from kvq.fast.triton import kivi as TK
    tmod, cmod = (TT, CT) if kitty else (TK, CK)
    cfg = tmod.CONFIGS[name]
    st = tmod.init(cfg, B, 2, 128)
    g = torch.Generator().manual_seed(0)
    k = torch.randn((B, 2, T, 128), generator=g).half()
    tmod.append(cfg, st, k, torch.randn((B, 2, T, 128), generator=g).half())
    return tmod, cfg, cmod.KeyCodec, st


def _q(B=2, dtype=torch.float16):
    return torch.randn((B, 8, 1, 128)).to(dtype)


def test_plan_is_reused_per_shape_and_length(fake_device):
    """The same call shape reuses one plan object; a new length, another q dtype or another knob plans
    anew (equal knobs share the plan); a plan holds no tensor (a Prepared launch refuses one)."""
    tmod, cfg, codec, st = _cache()
    q = _q()
    p1 = P.decode_plan(cfg, codec, st, q)
    assert P.decode_plan(cfg, codec, st, _q()) is p1
    assert not p1.fallback and p1.launches and p1.merge is not None
    for _, launch in p1.launches:
        assert not any(isinstance(a, torch.Tensor) for a in launch.args)
    assert P.decode_plan(cfg, codec, st, _q(dtype=torch.bfloat16)) is not p1
    z = torch.zeros((2, 2, 1, 128), dtype=torch.float16)
    tmod.append(cfg, st, z, z.clone())
    p2 = P.decode_plan(cfg, codec, st, q)
    assert p2 is not p1 and P.decode_plan(cfg, codec, st, q) is p2
    p3 = P.decode_plan(cfg, codec, st, q, knobs=P.Knobs(side_stream=False))
    assert p3 is not p2 and p3.sides == ()
    assert P.decode_plan(cfg, codec, st, q, knobs=P.Knobs(side_stream=False)) is p3
    assert P.decode_plan(cfg, codec, st, q) is p2
    assert P.decode_plan(cfg, codec, st, q, knobs=P.Knobs()) is p2         # the defaults, spelled out
    with pytest.raises(TypeError, match="Slots"):
        L.Prepared(_Fn("k"), (1,), (32,), (torch.zeros(1),))


@pytest.mark.parametrize("kitty, name, T", [(False, "KIVI-K2V2", 300), (False, "KIVI-K4V4", 1000),
                                           (True, "Kitty", 333), (True, "Kitty-Pro", 700)])
def test_decode_launches_bind_the_call_tensors(fake_device, kitty, name, T):
    """decode_attention's launches (fused kernel, tail kernels on their side streams, merge), all from the
    plan: every device address is q's, the output's, a tensor's of the state, or one of the partials' two
    (o, then lse n_partials x rows x D floats later, in one buffer); side streams are forked before and
    joined after."""
    tmod, cfg, codec, st = _cache(name, T, kitty=kitty)
    q = _q()
    out, lse = P.decode_attention(cfg, codec, st, q)
    plan = P.decode_plan(cfg, codec, st, q)
    launches = [e for e in fake_device if e[0] == "launch"]
    assert len(launches) == len(plan.launches) + 1 and launches[-1][1].startswith("attn_merge")
    kp = codec.kernel_arrays(cfg, st)
    known = {t.data_ptr() for t in list(st.arrays().values()) + [v for v in kp.values() if isinstance(v, torch.Tensor)]}
    known |= {q.data_ptr(), out.data_ptr(), lse.data_ptr()}
    addrs = {a for e in launches for a in e[6] if isinstance(a, int) and not isinstance(a, bool) and a > 2 ** 20}
    assert {q.data_ptr(), out.data_ptr(), lse.data_ptr()} <= addrs
    parts = sorted(addrs - known)
    n_o = plan.n_partials * plan.rows * 128
    assert len(parts) == 2 and parts[1] - parts[0] == 4 * n_o     # lse partials after the o partials
    waits = [i for i, e in enumerate(fake_device) if e[0] == "wait"]
    assert len(waits) == 2 * len(plan.sides)
    if plan.sides:
        first, last = waits[0], waits[-1]
        tails = [i for i, e in enumerate(fake_device) if e[0] == "launch" and e[5] in plan.sides]
        assert tails and first < min(tails) and max(tails) < last


def test_prepared_packs_like_pack_args():
    """A Prepared launch packs the bytes pack_args makes of its bound arguments (the parameters before the
    address array), with tensors, device addresses, strides and a float32 scale in slots."""
    t0, t1 = torch.zeros(4), torch.zeros(8)
    types = {0: torch.Tensor, 1: torch.Tensor, 2: np.int64, 3: np.float32}
    args = (L.Slot(0), np.int32(5), L.Slot(1), L.Slot(2), np.int32(-1), L.Slot(3), np.int64(9))
    prep = L.Prepared(_Fn("k"), (3, 2), (64,), args, 128, types)
    for values in ((t0, t1, 7, 0.125 * 1.4426950408889634), (t1, t0.data_ptr() + 8, 2 ** 40, -3.0)):
        bound = prep.bind(values)
        assert isinstance(bound[5], np.float32) and isinstance(bound[3], np.int64)
        want_buf, want_params = L.pack_args(bound)
        got_buf, got_params = prep.pack(values)
        n = want_params - __import__("ctypes").addressof(want_buf)
        assert got_params - __import__("ctypes").addressof(got_buf) == n
        assert want_buf.raw[:n] == got_buf.raw[:n]
    assert prep.grid == (3, 2, 1) and prep.block == (64, 1, 1) and prep.shared_mem == 128


# ----------------------------------------------------------------------------------------------------
# the launch knobs (frozen Knobs) and the pure planners


def test_paged_knobs_defaults_and_checks():
    """paged.Knobs: the defaults the decode ran with as a dict before (15 knobs), immutable and hashable;
    every bad value is a ValueError naming the knob; decode_plan refuses what is not a Knobs."""
    import dataclasses

    k = P.Knobs()
    assert dataclasses.asdict(k) == {
        "num_warps": None, "waves": None, "mma": True, "side_stream": True, "fused_tail": True, "tail_tiles": 1,
        "tail_first": False, "tail16": None, "tail_warps": None, "tail16_warps": None, "max_blocks_per_sm": None,
        "tail_sums": 2, "tail_mma": None, "tail_mma_warps": None, "mixed_mma": None}
    assert k == P.DEFAULT_KNOBS and hash(k) == hash(P.Knobs())
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.mma = False
    bad = {"num_warps": 0, "waves": -1, "mma": 1, "side_stream": None, "fused_tail": "yes", "tail_tiles": 0,
           "tail_first": None, "tail16": 0, "tail_warps": 3, "tail16_warps": 8, "max_blocks_per_sm": 2.5,
           "tail_sums": True, "tail_mma": "auto", "tail_mma_warps": 16, "mixed_mma": 1}
    assert set(bad) == set(dataclasses.asdict(k))
    for key, val in bad.items():
        with pytest.raises(ValueError, match=key):
            P.Knobs(**{key: val})
    with pytest.raises(TypeError, match="Knobs"):
        P._knobs({"mma": False})


def test_paged_knob_changes_the_plan(fake_device):
    """A knob other than its default changes the launches the plan holds: the CUDA-core page kernel
    (mma=False), the tail launched first, fewer splits at one block per SM."""
    tmod, cfg, codec, st = _cache(T=3000, B=2)
    q = _q()
    base = P.decode_plan(cfg, codec, st, q)
    names = [launch.fn.name for _, launch in base.launches if hasattr(launch, "fn")]
    assert names[0].startswith("paged_decode_mma2")
    cuda = P.decode_plan(cfg, codec, st, q, knobs=P.Knobs(mma=False))
    assert [launch.fn.name for _, launch in cuda.launches][0].startswith("paged_decode<")
    first = P.decode_plan(cfg, codec, st, q, knobs=P.Knobs(tail_first=True))
    assert first.launches[-1][1].fn.name == names[0] and first.launches != base.launches
    one = P.decode_plan(cfg, codec, st, q, knobs=P.Knobs(max_blocks_per_sm=1, waves=None))
    assert one.n_partials <= base.n_partials


def test_paged_default_knobs_are_read_per_call(fake_device, monkeypatch):
    """Without ``knobs`` the decode takes ``DEFAULT_KNOBS`` as it stands at the call (the GPU tests replace it
    to run the method modules' decode_attention, which pass no knobs, with other knobs)."""
    tmod, cfg, codec, st = _cache(T=3000, B=2)
    q = _q()
    assert P.decode_plan(cfg, codec, st, q).sides
    monkeypatch.setattr(P, "DEFAULT_KNOBS", P.Knobs(side_stream=False))
    assert P.decode_plan(cfg, codec, st, q).sides == ()
    fake_device.clear()
    P.decode_attention(cfg, codec, st, q)
    assert not [e for e in fake_device if e[0] == "wait"]                  # everything on one stream


def test_oscar_plan_is_pure_and_cached():
    """oscar_decode.plan: numbers in, a frozen Plan out, on the CPU (no CUDA, no kernel), cached per
    arguments; the defaults reproduce the documented rules; each knob changes its decision; bad knob
    values are refused when the knobs are made."""
    import dataclasses

    import kvq.fast.cupy.oscar_decode as OD

    OD._plan.cache_clear()
    args = (1, 8, 32, 1, 128, 32, 128, 256, 132, 396)          # B, H, H_q, T_q, D, sink, window, pages, SMs, slots
    p = OD.plan(*args)
    assert OD.plan(*args) is p and OD.plan(*args, OD.Knobs()) is p and OD._plan.cache_info().hits >= 2
    assert p.side and not p.first and p.one_launch           # 8 tail blocks < 132 SMs: the pages first
    assert (p.n_split, p.pps) == PL.fused_splits(256, 8, 4, 396, 132, few_bases=True)
    assert OD.plan(*args, OD.Knobs(tail_first=True)).first
    assert not OD.plan(*args, OD.Knobs(merge_rotate=False)).one_launch
    assert not OD.plan(*args, OD.Knobs(paged=P.Knobs(side_stream=False))).side
    capped = OD.plan(*args, OD.Knobs(paged=P.Knobs(max_blocks_per_sm=1)))
    assert (capped.n_split, capped.pps) == PL.n_splits(256, 8, 4, 132)
    assert OD.plan(32, 8, 32, 1, 128, 32, 128, 256, 132, 396).first      # 256 tail blocks: the tail first
    assert dataclasses.asdict(OD.Knobs())["tail_prec"] == 2
    for key, val in (("tail_prec", 3), ("tail_prec", True), ("tail_first", 1), ("merge_rotate", "yes")):
        with pytest.raises(ValueError, match=key):
            OD.Knobs(**{key: val})
    with pytest.raises(TypeError, match="paged"):
        OD.Knobs(paged={"side_stream": False})
    with pytest.raises(TypeError, match="Knobs"):
        OD.plan(*args, {"tail_prec": 1})


def test_planned_launch_is_kept_per_shape():
    """``_loader.planned``: one Prepared launch per kernel, grid, block, shared memory and argument kinds,
    every argument a Slot of its kind; its packing equals ``pack_args`` of the same values typed by hand."""
    fn = _Fn("k")
    kinds = (torch.Tensor, np.int32, np.int64, np.float32)
    prep = L.planned(fn, (4, 1), (128,), 0, kinds)
    assert L.planned(fn, (4, 1), (128,), 0, kinds) is prep
    for other in ((fn, (5, 1), (128,), 0, kinds), (fn, (4, 1), (64,), 0, kinds), (fn, (4, 1), (128,), 16, kinds),
                  (fn, (4, 1), (128,), 0, kinds[:3] + (np.int32,))):
        assert L.planned(*other) is not prep
    assert all(isinstance(a, L.Slot) and a.index == i for i, a in enumerate(prep.args))
    values = (2 ** 33 + 256, -7, 2 ** 40, 0.1)
    want_buf, want_params = L.pack_args((np.uint64(values[0]), np.int32(-7), np.int64(2 ** 40), np.float32(0.1)))
    got_buf, got_params = prep.pack(values)
    n = want_params - __import__("ctypes").addressof(want_buf)
    assert got_params - __import__("ctypes").addressof(got_buf) == n and want_buf.raw[:n] == got_buf.raw[:n]


_C_KINDS = {"int": np.int32, "i64": np.int64, "float": np.float32}


def _cu_kinds(src: str, kernel: str) -> tuple:
    """The argument kinds of ``kernel``'s signature in the CUDA source ``src`` (kvq/fast/cupy): a pointer is a
    tensor, ``int`` / ``i64`` / ``float`` their NumPy types."""
    import re
    from pathlib import Path

    text = (Path(L.__file__).parent / src).read_text()
    params = re.search(rf"\b{kernel}\(([^)]*)\)\s*{{", text).group(1)
    out = []
    for p in params.split(","):
        words = p.replace("__restrict__", "").split()
        out.append(torch.Tensor if "*" in p else _C_KINDS[words[-2]])
    return tuple(out)


@pytest.mark.parametrize("src, kernel, module, name", [
    ("oscar_append.cu", "oscar_append", "oscar_append", "_KINDS"),
    ("oscar_decode.cu", "oscar_tail_attn", "oscar_decode", "_TAIL_KINDS"),
    ("oscar_decode.cu", "oscar_decode_mma", "oscar_decode", "_PAGES_KINDS"),
    ("oscar_decode.cu", "oscar_merge_rotate", "oscar_decode", "_MERGE_ROTATE_KINDS"),
    ("oscar_decode.cu", "rotate_heads_f64", "oscar_decode", "_ROTATE_KINDS")])
def test_planned_kinds_match_the_kernels(src, kernel, module, name):
    """The argument kinds the CuPy OSCAR launches are planned with are the kernels' signatures, in order (a
    wrong kind packs the wrong bytes, which only a GPU run would show)."""
    import importlib

    mod = importlib.import_module(f"kvq.fast.cupy.{module}")
    assert getattr(mod, name) == _cu_kinds(src, kernel)


def test_device_index_reads_the_device():
    """``_loader.device_index``: the index a CUDA device names (no CUDA call for it); a bare ``cuda`` device
    is the current one (only where a GPU is present)."""
    assert L.device_index(torch.device("cuda", 3)) == 3 and L.device_index(torch.device("cuda:0")) == 0
    if torch.cuda.is_available():
        assert L.device_index(torch.device("cuda")) == torch.cuda.current_device()
