"""The Triton decodes' launch plans, on the CPU: ``plan`` of ``kvq.fast.triton.paged``, ``oscar_decode`` and
``bitdecoding_decode`` is arithmetic on numbers (no GPU, no kernel), cached per arguments, and the frozen
``Knobs`` it reads refuse bad values by name. The kernels' results with other knobs are the parity tests'
(tests/parity: ``test_decode_p_split``, ``test_tune_knobs``, ``test_launch_knobs``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kvq.fast.triton import bitdecoding_decode as BDD  # noqa: E402
from kvq.fast.triton import oscar_decode as OD  # noqa: E402
from kvq.fast.triton import paged as TP  # noqa: E402


def test_knob_defaults_are_the_former_dicts():
    """Each module's Knobs holds the defaults its TUNE dict held (but the paged decode's waves: 2 since the
    H200 sweep of lab/2026-11-29-triton-decode, and its later ``tokens`` and ``tail_keys``: TOKENS.md there),
    and is immutable and hashable."""
    assert dataclasses.asdict(TP.Knobs()) == {"num_warps": 4, "waves": 2, "block_t": None, "split_p": False,
                                              "k_terms": 2, "num_stages": None, "words": True,
                                              "tokens": {"num_warps": 2, "waves": 4, "block_t": 128,
                                                         "num_stages": 2, "maxnreg": None},
                                              "tail_keys": 32}
    assert dataclasses.asdict(OD.Knobs()) == {"num_warps": 4, "waves": 3, "block_t": None, "k_terms": 3,
                                              "v_terms": 1, "num_stages": None}
    assert dataclasses.asdict(BDD.Knobs()) == {"leaf": None, "unpack": 1, "waves": 4, "bt_max": None,
                                               "num_warps": None, "num_stages": None, "min_tokens": 256}
    for mod in (TP, OD, BDD):
        assert mod.DEFAULT_KNOBS == mod.Knobs() and hash(mod.DEFAULT_KNOBS) == hash(mod.Knobs())
        with pytest.raises(dataclasses.FrozenInstanceError):
            mod.DEFAULT_KNOBS.waves = 1


@pytest.mark.parametrize("mod, key, bad", [
    (TP, "num_warps", 3), (TP, "waves", 0), (TP, "block_t", 24), (TP, "split_p", 1), (TP, "k_terms", 4),
    (TP, "num_stages", 0), (TP, "words", None),
    (OD, "num_warps", 6), (OD, "waves", -1), (OD, "block_t", 8), (OD, "k_terms", 0), (OD, "v_terms", True),
    (OD, "num_stages", "2"),
    (BDD, "leaf", 24), (BDD, "unpack", 2), (BDD, "waves", "4"), (BDD, "bt_max", 0), (BDD, "num_warps", 5),
    (BDD, "num_stages", -1), (BDD, "min_tokens", 0)])
def test_bad_knobs_are_refused(mod, key, bad):
    with pytest.raises(ValueError, match=key):
        mod.Knobs(**{key: bad})


def test_paged_plan():
    """KIVI-K2V2, D = 128, G = 128, fp16 q (magic), 256 pages over 64 programs per split on 132 SMs: at most
    2 programs per SM -> floor(264 / 64) = 4 splits of 64 pages (256 programs, one round), 128-token steps,
    4 warps, words on; each knob changes its part; equal calls share one plan object."""
    TP._plan.cache_clear()
    kw = dict(precise=False, magic=True, interp=False, k_bits=2, v_bits=2, ngv=1)
    p = TP.plan(256, 128, 128, 64, 132, **kw)
    assert (p.n_split, p.pps, p.BT, p.warps, p.stages, p.k_words, p.v_words, p.split_p, p.k_terms) == \
        (4, 64, 128, 4, 2, True, True, False, 2)
    assert TP.plan(256, 128, 128, 64, 132, **kw, knobs=TP.Knobs()) is p and TP._plan.cache_info().hits >= 1
    assert TP.plan(256, 128, 128, 64, 132, **kw, knobs=TP.Knobs(waves=3)).n_split == 6     # floor(396 / 64)
    assert TP.plan(256, 128, 128, 64, 132, **kw, knobs=TP.Knobs(waves=1)).n_split == 2     # floor(132 / 64)
    assert TP.plan(256, 128, 128, 8, 132, **kw).n_split == 32                            # batch 1: 33 -> 8 pages
    assert TP.plan(256, 128, 128, 256, 132, **kw).n_split == 1                           # batch 32: one split
    assert TP.plan(256, 128, 128, 64, 132, **kw, knobs=TP.Knobs(block_t=32)).BT == 32
    assert TP.plan(256, 128, 128, 64, 132, **kw, knobs=TP.Knobs(num_warps=None)).warps == 8   # 128 x 128 > 8192
    assert not TP.plan(256, 128, 128, 64, 132, **kw, knobs=TP.Knobs(words=False)).k_words
    assert TP.plan(256, 128, 128, 64, 132, **kw, knobs=TP.Knobs(split_p=True, k_terms=3)).k_terms == 3
    precise = TP.plan(256, 128, 128, 64, 132, **{**kw, "precise": True, "magic": False, "interp": True})
    assert (precise.BT, precise.warps, precise.stages, precise.k_words) == (32, 4, 1, False)
    assert TP.plan(0, 128, 128, 64, 132, **kw).n_split == 0
    with pytest.raises(TypeError, match="Knobs"):
        TP.plan(256, 128, 128, 64, 132, **kw, knobs={"waves": 1})


def test_paged_tokens_plan():
    """At most 8 query rows per kv head (fp16 q, codes in words, one value group per token) plan
    ``_tokens_kernel``: rows padded to 4 or 8, its own warps / tokens per step / stages, and splits of at
    most ``TokensKnobs.waves`` programs per SM; more rows, other dtypes, value groups, ``words=False`` or
    ``tokens=None`` plan the rows kernel (``rows`` 0)."""
    TP._plan.cache_clear()
    kw = dict(precise=False, magic=True, interp=False, k_bits=2, v_bits=2, ngv=1)
    p = TP.plan(256, 128, 128, 64, 132, **kw, m=4)
    assert (p.rows, p.warps, p.BT, p.stages, p.n_split, p.pps, p.maxnreg) == (4, 2, 128, 2, 8, 32, None)  # 528 // 64
    assert TP.plan(256, 128, 128, 64, 132, **kw, m=8).rows == 8
    assert TP.plan(256, 128, 128, 64, 132, **kw, m=1).rows == 4
    assert TP.plan(256, 16, 16, 64, 132, **kw, m=4).BT == 16                        # at most G tokens per step
    tk = TP.TokensKnobs(num_warps=1, waves=8, block_t=64, num_stages=3, maxnreg=168)
    q = TP.plan(256, 128, 128, 8, 132, **kw, m=4, knobs=TP.Knobs(tokens=tk))
    assert (q.rows, q.warps, q.BT, q.stages, q.n_split, q.pps, q.maxnreg) == (4, 1, 64, 3, 128, 2, 168)  # 1056 // 8
    assert TP.plan(256, 128, 128, 64, 132, **{**kw, "interp": True}, m=4).stages == 1
    for other in (dict(m=9), dict(m=4, ngv=4), dict(m=4, magic=False), dict(m=4, knobs=TP.Knobs(words=False)),
                  dict(m=4, knobs=TP.Knobs(tokens=None))):
        assert TP.plan(256, 128, 128, 64, 132, **{**kw, **other}).rows == 0, other
    with pytest.raises(ValueError, match="maxnreg"):
        TP.TokensKnobs(maxnreg=300)
    with pytest.raises(ValueError, match="num_warps"):
        TP.TokensKnobs(num_warps=3)
    with pytest.raises(ValueError, match="tokens"):
        TP.Knobs(tokens={"num_warps": 1})
    with pytest.raises(ValueError, match="tail_keys"):
        TP.Knobs(tail_keys=0)


def test_oscar_plan():
    """OSCAR's page kernel: 4000 history tokens, 32 programs per split, 132 SMs: about 3 waves of 64-token
    blocks; the knobs move BT, the splits, warps and the dot parts; cached."""
    OD._plan.cache_clear()
    p = OD.plan(4000, 32, 132, precise=False, interp=False)
    assert (p.BT, p.warps, p.stages, p.k_terms, p.v_terms) == (64, 4, 2, 3, 1)
    assert p.n_split * p.tps >= 4000 and p.tps % p.BT == 0 and (p.n_split - 1) * p.tps < 4000
    assert OD.plan(4000, 32, 132, precise=False, interp=False, knobs=OD.Knobs()) is p
    assert OD.plan(4000, 32, 132, precise=False, interp=False, knobs=OD.Knobs(block_t=16)).BT == 16
    assert OD.plan(4000, 32, 132, precise=False, interp=False, knobs=OD.Knobs(waves=1)).n_split < p.n_split
    assert OD.plan(4000, 32, 132, precise=False, interp=False, knobs=OD.Knobs(v_terms=2)).v_terms == 2
    assert OD.plan(4000, 32, 132, precise=True, interp=True).BT == 32
    assert OD.plan(0, 32, 132, precise=False, interp=False).n_split == 0


def test_oscar_tail_splits(monkeypatch):
    """OSCAR's FP16 sink (64) and window (256) at batch 1 on a 132-SM card: the partial kernel takes them in
    splits of TAIL_MIN_KEYS (one block of 32 keys) -- 2 and 8 programs per (batch, kv head), not one each --
    and the merge reads every split after the page kernel's; at batch 8 the same (the SMs still want more)."""
    from kvq.fast.triton import attention as A
    from kvq.reference import oscar as RO

    monkeypatch.setattr(A, "sm_count", lambda dev: 132)
    cfg = RO.OSCARConfig(max_tokens=32768)
    dev = torch.device("cuda", 0)
    for B in (1, 8):
        p = OD._decode_plan(cfg, (B, 8, 128), 32768, (B, 32, 1, 128), (4096, 128, 128, 1),
                            (torch.float32,) + (torch.uint8, torch.float16, torch.float16) * 2 + (torch.int32,)
                            + (torch.float16,) * 4 + (torch.float32,),
                            ((64 * 128, 128, 1),) * 2 + ((256 * 128, 128, 1),) * 2, 256, False, torch.float16, 8,
                            dev, 0, True, OD.DEFAULT_KNOBS)
        (sink, s0, sink_ints), (win, s1, win_ints) = p.fp16
        assert (s0, s1) == (0, 1) and OD.TAIL_MIN_KEYS == 32
        assert sink.grid == (B * 8, 2, 1) and win.grid == (B * 8, 8, 1)
        assert sink_ints[-3] == win_ints[-3] == 32                  # keys per split
        n_pages = p.pages.grid[1]
        assert sink_ints[-1] == n_pages and win_ints[-1] == n_pages + 2 and p.S == n_pages + 10


def test_bitdecoding_plan():
    """BitDecoding-KC2-like (R = 8 codes a word, W_n = 4, D = 128, fp16 q): chunks of 128 tokens (2 warps),
    2 page chunks a page; the knobs move the chunking, the splits, the leaf, the unpack mode; cached."""
    BDD._plan.cache_clear()
    args = (8, 4, 128, BDD._MODE_FP16, 40, 100, 32, 16, 132)   # R, W_n, D, mode, pages, residual, base, BLOCK_M, SMs
    p = BDD.plan(*args, cuda=True, interp=False)
    assert (p.leaf, p.WB, p.BT, p.n_pc, p.n_chunks, p.warps, p.unpack, p.stages) == (16, 2, 128, 80, 81, 4, 1, 2)
    assert p.cps * p.S >= p.n_chunks and p.cps * p.BT >= 256                       # >= min_tokens a split
    assert BDD.plan(*args, cuda=True, interp=False, knobs=BDD.Knobs()) is p
    assert BDD.plan(*args, cuda=True, interp=False, knobs=BDD.Knobs(bt_max=1)).BT == 64     # one warp
    assert BDD.plan(*args, cuda=True, interp=False, knobs=BDD.Knobs(leaf=128)).leaf == 128
    assert BDD.plan(*args, cuda=True, interp=False, knobs=BDD.Knobs(unpack=0)).unpack == 0
    assert BDD.plan(*args, cuda=False, interp=True, knobs=BDD.Knobs(waves=1)).S <= p.S
    assert BDD.plan(*args, cuda=True, interp=False, knobs=BDD.Knobs(min_tokens=64)).S >= p.S
    fp32 = BDD.plan(8, 4, 128, BDD._MODE_FP32, 40, 100, 32, 16, 132, cuda=True, interp=False)
    assert (fp32.leaf, fp32.BT) == (16, 64)


class _Param:
    def __init__(self, name, default=None, has_default=False, do_not_specialize=False):
        self.name, self.default, self.has_default = name, default, has_default
        self.do_not_specialize = do_not_specialize


class _Compiled:
    """Stands in for Triton's CompiledKernel: its launcher records what it is handed."""

    def __init__(self):
        self.calls = []
        self.function, self.packed_metadata = "function", "metadata"

    def run(self, *a):
        self.calls.append(a)


class _Kernel:
    """Stands in for a @triton.jit kernel (x, n, C: constexpr, E: constexpr = 7): ``kernel[grid](...)``
    is Triton's dispatch, recorded, returning the compiled kernel."""

    def __init__(self, loose_n: bool = False):
        self.params = [_Param("x"), _Param("n", do_not_specialize=loose_n), _Param("C"), _Param("E", 7, True)]
        self.dispatched = []
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        def go(*args, **kw):
            self.dispatched.append((grid, args, kw))
            return self.compiled
        return go


def test_launch_dispatches_once_then_runs_the_compiled_kernel(monkeypatch):
    """``_launch.Launch``: a call without a stream goes through Triton's dispatch with the plan's grid,
    constexprs and options, and the first keeps the compiled kernel; a call with a stream hands the compiled
    kernel's launcher the grid, the stream, the handles, no hooks, the arguments and then the constexprs in
    the kernel's order (defaults where not given). A launch that is not ``fast`` (unaligned tensors) and
    the interpreter never keep a kernel; a constexpr without a value is a TypeError naming it."""
    from kvq.fast.triton import _launch as L

    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "COMPILED", {})                  # the stand-in kernels stay out of the real one
    k = _Kernel()
    la = L.Launch(k, (4, 2), {"C": 3}, {"num_warps": 2}, fast=True)
    la(("x0", 5), None, 0)
    assert k.dispatched == [((4, 2, 1), ("x0", 5), {"C": 3, "num_warps": 2})] and k.compiled.calls == []
    assert la.compiled is k.compiled and la.tail == (3, 7)
    la((1234, 5), 11, 0)
    assert len(k.dispatched) == 1
    assert k.compiled.calls == [(4, 2, 1, 11, "function", "metadata", None, None, None, 1234, 5, 3, 7)]
    la(("x2", 5), None, 0)                                   # no stream: Triton's dispatch again
    assert len(k.dispatched) == 2 and len(k.compiled.calls) == 1
    slow = L.Launch(k, (1,), {"C": 3}, {}, fast=False)
    slow(("x", 1), None, 0)
    slow(("x", 1), None, 0)
    assert slow.compiled is None and len(k.dispatched) == 4
    monkeypatch.setattr(L, "interpreting", lambda: True)
    assert not L.Launch(k, (1,), {"C": 3}, {}, fast=True).fast
    monkeypatch.setattr(L, "interpreting", lambda: False)
    missing = L.Launch(k, (1,), {}, {}, fast=True)
    k.fn = lambda: None
    with pytest.raises(TypeError, match="'C'"):
        missing(("x", 1), None, 0)


def test_launch_hooks_are_seen():
    """A Triton launch hook (a non-empty HookChain, or any other object) sends launches to Triton's
    dispatch, so profilers see them; an empty chain or None does not."""
    from kvq.fast.triton import _launch as L

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not L._hooked(None) and not L._hooked(Chain([]))
    assert L._hooked(Chain([print])) and L._hooked(print)


def test_launch_hooks_send_launches_to_triton(monkeypatch):
    """With a launch hook set, ``current_stream`` answers None (Triton's dispatch, which calls the hook):
    the hooks of Triton >= 3.4 (``triton.knobs.runtime``) and those of older Triton (``CompiledKernel``)."""
    import triton.compiler

    from kvq.fast.triton import _launch as L

    if L._knobs is not None:
        monkeypatch.setattr(L._knobs.runtime, "launch_enter_hook", print)
        assert L.current_stream(0) is None
        monkeypatch.undo()
    monkeypatch.setattr(L, "_knobs", None)
    monkeypatch.setattr(triton.compiler.CompiledKernel, "launch_enter_hook", print, raising=False)
    monkeypatch.setattr(triton.compiler.CompiledKernel, "launch_exit_hook", None, raising=False)
    assert L.current_stream(0) is None


def test_launch_site_is_kept_per_key(monkeypatch):
    """``_launch.site``: one ``Launch`` per kernel, grid, constexprs, options, alignment and key (so a later
    call of the same shape reuses the compiled kernel the first kept); any of them different, another."""
    from kvq.fast.triton import _launch as L

    monkeypatch.setattr(L, "interpreting", lambda: False)
    k = _Kernel()
    args = (k, (2, 3), (("C", 3),), (("num_warps", 1),), True, ((16, 8), (None,), 0, True))
    la = L.site(*args)
    assert L.site(*args) is la and la.grid == (2, 3, 1) and la.consts == {"C": 3} and la.fast
    for i, other in [(1, (2, 4)), (2, (("C", 4),)), (3, (("num_warps", 2),)), (4, False),
                     (5, ((16, 9), (None,), 0, True))]:
        changed = list(args)
        changed[i] = other
        assert L.site(*changed) is not la
    assert L.aligned((0, 16, 4096)) and not L.aligned((0, 16, 4098)) and L.aligned(())
    assert L.device_index(torch.device("cpu")) == -1


def test_launch_reads_the_key_from_the_arguments(monkeypatch):
    """``_launch.launch(kernel, grid, *args, **kw)``: the first call of a key dispatches with the tensors, a
    later one hands the kept kernel's launcher the tensors' addresses; a float changes no key, an int's
    value, a bool against an int of the same value, a dtype and a tensor's alignment each do; an argument
    of another kind dispatches every call; the interpreter always dispatches."""
    from kvq.fast.triton import _launch as L

    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "COMPILED", {})                  # the stand-in kernels stay out of the real one
    monkeypatch.setattr(L, "current_stream", lambda device_index: 7)
    monkeypatch.setattr(L, "_args_device", lambda args: 0)
    k = _Kernel()
    x = torch.zeros(64, dtype=torch.float32)
    L.launch(k, (3,), x, 5, C=1, num_warps=2)
    assert len(k.dispatched) == 1 and k.dispatched[0][1][0] is x and k.dispatched[0][2] == {"C": 1, "num_warps": 2}
    L.launch(k, (3,), x, 5, C=1, num_warps=2)
    assert len(k.dispatched) == 1
    assert k.compiled.calls[-1] == (3, 1, 1, 7, "function", "metadata", None, None, None, x.data_ptr(), 5, 1, 7)
    n = len(k.dispatched)
    L.launch(k, (3,), x, 5.5, C=1, num_warps=2)            # a float: a key of its own (its type, not its value)
    L.launch(k, (3,), x, 6.5, C=1, num_warps=2)            # another float value: the same key as 5.5
    assert len(k.dispatched) == n + 1
    for args in [(x, 6), (x, True), (x.double(), 5), (x[1:], 5)]:
        before = len(k.dispatched)
        L.launch(k, (3,), *args, C=1, num_warps=2)
        assert len(k.dispatched) == before + 1, args
    before = len(k.dispatched)
    L.launch(k, (3,), x, (1, 2), C=1)
    L.launch(k, (3,), x, (1, 2), C=1)
    assert len(k.dispatched) == before + 2
    monkeypatch.setattr(L, "interpreting", lambda: True)
    L.launch(k, (3,), x, 5, C=1, num_warps=2)
    assert len(k.dispatched) == before + 3


def test_launch_key_of_an_unspecialized_int(monkeypatch):
    """An int parameter marked ``do_not_specialize`` (a length that moves every step) keys ``launch`` by its
    range only, as Triton types it (i32, i64, u64): every i32 value shares one launch, so the compiled
    kernel serves the next step; a value beyond i32 is another key; a bool stays a value of its own."""
    from kvq.fast.triton import _launch as L

    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "COMPILED", {})                  # the stand-in kernels stay out of the real one
    monkeypatch.setattr(L, "current_stream", lambda device_index: 7)
    monkeypatch.setattr(L, "_args_device", lambda args: 0)
    k = _Kernel(loose_n=True)
    x = torch.zeros(64, dtype=torch.float32)
    for n in (5, 6, 16, -3, 2 ** 31 - 1):
        L.launch(k, (3,), x, n, C=1)
    assert len(k.dispatched) == 1
    assert [c[10] for c in k.compiled.calls] == [6, 16, -3, 2 ** 31 - 1]    # each call's own value
    for n, d in ((2 ** 31, 2), (2 ** 40, 2), (2 ** 63, 3), (True, 4), (7, 4)):
        L.launch(k, (3,), x, n, C=1)
        assert len(k.dispatched) == d, n
    assert L._int_kind(2 ** 31) == L._int_kind(-2 ** 31 - 1) != L._int_kind(0)


def test_host_grid_arithmetic_is_tritons():
    """``kvq.fast.common.cdiv`` / ``next_pow2`` (the host's grid and block arithmetic of the Triton
    launches) give ``triton.cdiv`` / ``triton.next_power_of_2``'s values, at a host call's cost."""
    import triton

    from kvq.fast import common as C

    for n in list(range(0, 300)) + [2 ** 20 - 1, 2 ** 20, 2 ** 20 + 1, 2 ** 31 + 5, 3 * 2 ** 40]:
        assert C.next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 32, 127, 128):
            assert C.cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_launches_share_a_compiled_kernel(monkeypatch):
    """A new ``Launch`` (a plan of another length: another grid) takes the kernel an earlier launch compiled
    for the same binary (``COMPILED``: the kernel, constexprs, options, the arguments' ``spec_key`` and the
    device) at its first call, instead of Triton's dispatch: its own grid, the current stream, the tensors
    as they are. Another constexpr, option, specialized int value, dtype or device is another binary; a
    ``do_not_specialize`` int's value is not; a launch that is not ``fast``, or a call where the compiled
    kernel may not be launched directly (``current_stream`` None: a hook, another device), dispatches."""
    from kvq.fast.triton import _launch as L

    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "COMPILED", {})
    stream = [7]
    monkeypatch.setattr(L, "current_stream", lambda device_index: stream[0])
    k = _Kernel(loose_n=True)
    x = torch.zeros(64, dtype=torch.float32)
    first = L.Launch(k, (4, 2), {"C": 3}, {"num_warps": 2}, fast=True)
    first((x, 5), None, 0)
    assert len(k.dispatched) == 1 and len(L.COMPILED) == 1
    second = L.Launch(k, (8, 1), {"C": 3}, {"num_warps": 2}, fast=True)
    entered = []
    real = L.Launch.__call__
    monkeypatch.setattr(L.Launch, "__call__", lambda self, *a: (entered.append(a), real(self, *a))[1])
    second((x, 9), None, 0)                                  # a loose int's other value: the same binary
    monkeypatch.setattr(L.Launch, "__call__", real)
    assert len(entered) == 1                                 # one launch, one call (counters see it once)
    assert len(k.dispatched) == 1 and second.compiled is k.compiled and second.tail == (3, 7)
    assert k.compiled.calls == [(8, 1, 1, 7, "function", "metadata", None, None, None, x, 9, 3, 7)]
    for consts, options, args, dev in [({"C": 4}, {"num_warps": 2}, (x, 5), 0),
                                       ({"C": 3}, {"num_warps": 4}, (x, 5), 0),
                                       ({"C": 3}, {"num_warps": 2}, (x.double(), 5), 0),
                                       ({"C": 3}, {"num_warps": 2}, (x, 5), 1)]:
        before = len(k.dispatched)
        L.Launch(k, (1,), consts, options, fast=True)(args, None, dev)
        assert len(k.dispatched) == before + 1, (consts, options, dev)
    tight = _Kernel()                                        # n specialized: its value is in the key
    L.Launch(tight, (1,), {"C": 3}, {}, fast=True)((x, 5), None, 0)
    L.Launch(tight, (2,), {"C": 3}, {}, fast=True)((x, 6), None, 0)
    L.Launch(tight, (3,), {"C": 3}, {}, fast=True)((x, 5), None, 0)
    assert len(tight.dispatched) == 2
    before = len(k.dispatched)
    slow = L.Launch(k, (1,), {"C": 3}, {"num_warps": 2}, fast=False)
    slow((x, 5), None, 0)
    assert len(k.dispatched) == before + 1 and slow.compiled is None
    stream[0] = None                                         # a hook is set: Triton's dispatch
    hooked = L.Launch(k, (2,), {"C": 3}, {"num_warps": 2}, fast=True)
    hooked((x, 5), None, 0)
    assert len(k.dispatched) == before + 2 and hooked.compiled is k.compiled
