"""The fused OSCAR append (``kvq.fast.<backend>.oscar_append``: one kernel per append for K and one for V)
against ``kvq.reference.oscar.append`` and against the unfused path (``kvq.fast.caches.oscar.FUSED_APPEND``).

After every append of a mixed sequence (prefill shorter / longer than sink + window, spanning several
pages, then 1-token decode steps that cross page boundaries; batch > 1; shared and per-head R; fp16 and
fp32 input; G = 32 / 64 / 128 at D = 128 and a D = 64 case; 4- and 8-bit codes, fp32 metadata) every
tensor of the fast state equals the reference state bit for bit, and the unfused path gives the same
bits. The race case (old window tokens leave the window in the same launch that overwrites their ring
slots) is exercised step by step; the rotation-overflow bound sends a huge token down the unfused path,
which raises exactly as the reference (state unchanged) or appends it when it does not overflow.

Targets: Triton through the interpreter (CI, CPU) and on the GPU, and the CuPy backend on the GPU
(``pytest -m gpu``).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from kvq.fast import common as C
from kvq.fast.caches import oscar as O
from kvq.reference import oscar as RO

from .cases import as_bits, assert_bits_equal, assert_same_error


@pytest.fixture
def target(fast_target):
    return fast_target


def _mods(target):
    """(kvq.fast.<backend>.oscar, kvq.fast.<backend>.oscar_append)."""
    return (importlib.import_module(f"kvq.fast.{target[0]}.oscar"),
            importlib.import_module(f"kvq.fast.{target[0]}.oscar_append"))


def _orth(rng, *lead, D):
    return np.linalg.qr(rng.standard_normal(lead + (D, D)))[0].astype(np.float32)


def _calib(kind, H, D, seed=0, clip=(0.9, 0.8)):
    rng = np.random.default_rng(seed)
    if kind == "identity":
        return RO.identity_calibration(D, *clip)
    lead = (H,) if kind == "per_head" else ()
    return RO.OSCARCalibration(_orth(rng, *lead, D=D), _orth(rng, *lead, D=D), *clip)


def _kv(B, H, T, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k[..., 5] *= 8.0                                                       # an outlier channel
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    return k.astype(dtype), v.astype(dtype)


def _t(a, device):
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def assert_same_state(fs, rs, what=""):
    """Every tensor of the fast state equals the reference's (or another fast state's) bit for bit."""
    fa, ra = fs.arrays(), rs.arrays()
    assert fa.keys() == ra.keys()
    for n in ra:
        if isinstance(ra[n], torch.Tensor):
            assert np.array_equal(as_bits(fa[n]), as_bits(ra[n])), f"{what}{n} differs"
        else:
            assert_bits_equal(fa[n], ra[n], f"{what}{n}")
    assert (fs.length, fs.next_page) == (rs.length, rs.next_page), what


class _Spy:
    """Counts the fused kernel's launches (monkeypatched over the backend's oscar_append.append)."""

    def __init__(self, monkeypatch, mod):
        self.calls, real = 0, mod.append

        def spy(*a, **kw):
            self.calls += 1
            return real(*a, **kw)

        monkeypatch.setattr(mod, "append", spy)


# (name, config overrides, (B, H, D), calibration kind, input dtype, chunks before the decode steps, steps)
# sink 4, window 8: a prefill shorter than sink + window, one that overflows the window into several
# pages, prefills that start with a partly filled window, then 1-token steps crossing page boundaries.
SMALL = dict(sink=4, window=8, page_size=4, max_tokens=96)
CASES = [
    ("G128-shared-fp16", dict(group_size=128), (2, 2, 128), "shared", np.float16, [3, 6, 17], 12),
    ("G64-perhead-fp32", dict(group_size=64, page_size=8), (2, 2, 128), "per_head", np.float32, [25, 2], 14),
    ("G32-perhead-fp16-meta32", dict(group_size=32, meta_dtype="float32"), (1, 3, 128), "per_head", np.float16,
     [12, 11], 10),
    ("D64-G32-4bit", dict(group_size=32, bits=4, page_size=8), (2, 2, 64), "shared", np.float16, [30], 12),
    ("D64-G64-8bit-nosink", dict(group_size=64, bits=8, sink=0), (2, 1, 64), "per_head", np.float32, [5, 9], 12),
]


def _run_sequence(F, cfg, calib, B, H, D, dtype, chunks, steps, device, seed=1):
    """Append chunks, then `steps` 1-token appends; compare with the reference after every append."""
    T = sum(chunks) + steps
    k, v = _kv(B, H, T, D, dtype, seed=seed)
    rs, fs = RO.init(cfg, B, H, D), F.init(cfg, B, H, D)
    kt, vt = _t(k, device), _t(v, device)
    t = 0
    for i, n in enumerate(list(chunks) + [1] * steps):
        RO.append(cfg, calib, rs, k[:, :, t:t + n], v[:, :, t:t + n])
        F.append(cfg, calib, fs, kt[:, :, t:t + n], vt[:, :, t:t + n])
        t += n
        assert_same_state(fs, rs, f"append {i} (n={n}, T={t}): ")
    return fs, rs


@pytest.mark.parametrize("name, over, shape, kind, dtype, chunks, steps", CASES, ids=[c[0] for c in CASES])
def test_fused_state_matches_reference(target, monkeypatch, name, over, shape, kind, dtype, chunks, steps):
    """Mixed prefill + decode sequence: the fused state equals the reference after every append."""
    _, device = target
    F, FA = _mods(target)
    cfg = RO.OSCARConfig(**dict(SMALL, **over))
    B, H, D = shape
    assert FA.supported(cfg, D)
    spy = _Spy(monkeypatch, FA)
    _run_sequence(F, cfg, _calib(kind, H, D, seed=len(name)), B, H, D, dtype, chunks, steps, device)
    assert spy.calls == 2 * (len(chunks) + steps)                           # one launch for K, one for V


def test_triton_append_launch_kept_per_shape(target, monkeypatch):
    """The Triton append's launch is kept per call shape (``_launch.site``): the 1-token steps after the
    window is full share one ``Launch`` per K and V (only T0 and first move: not specialized), and any two calls that
    share a key pass the same value in every other integer argument (the key covers what Triton specializes
    on: a missing one would run a binary compiled for another value). The prefill's launch is another."""
    if target[0] != "triton":
        pytest.skip("the Triton append's launch plan")
    from kvq.fast.triton import _launch as L

    _, device = target
    F, FA = _mods(target)
    keys, seen = {}, []
    real_site, real_call = L.site, L.Launch.__call__

    def site(*args):
        la = real_site(*args)
        keys[id(la)] = args[-1]
        return la

    def call(self, args, stream, device_index):                 # records the append's calls, then launches
        if id(self) in keys:
            seen.append((keys[id(self)], self, tuple(args[8:])))      # after the 8 tensors (or addresses)
        return real_call(self, args, stream, device_index)

    monkeypatch.setattr(L.Launch, "__call__", call)
    monkeypatch.setattr(FA.L, "site", site)
    cfg = RO.OSCARConfig(**SMALL, group_size=64)
    B, H, D = 1, 2, 64
    _run_sequence(F, cfg, _calib("shared", H, D), B, H, D, np.float16, [20], 6, device)
    assert len(seen) == 2 * 7
    steps = seen[2:]
    for kv in (0, 1):                                       # K and V: their clips differ (0.9, 0.8): two keys
        assert len({s[0] for s in steps[kv::2]}) == 1 and seen[kv][0] != steps[kv][0]
        assert len({id(s[1]) for s in steps[kv::2]}) == 1                  # one Launch: one compiled kernel
    assert steps[0][0] != steps[1][0]
    moving = (9, 12)                                        # T0 and first among the integer arguments
    assert [s[2][moving[0]] for s in steps[::2]] == list(range(20, 26))
    for i, a in enumerate(seen):
        for b in seen[i + 1:]:
            if a[0] == b[0]:
                assert all(x == y for j, (x, y) in enumerate(zip(a[2], b[2])) if j not in moving), (a[2], b[2])


def test_fused_equals_unfused(target):
    """The fused and the unfused path give the same state bit for bit (random chunks), validation on and
    off; with validation off also when a rotation overflows fp16 (inf in the FP16 buffers, NaN scales)."""
    _, device = target
    F, _ = _mods(target)
    cfg = RO.OSCARConfig(**dict(SMALL, group_size=16, page_size=8))
    B, H, D = 2, 2, 32
    calib = _calib("per_head", H, D, seed=3)
    k_ok, v = _kv(B, H, 40, D, np.float32, seed=4)
    k_over = k_ok.copy()
    k_over[1, 0, 9, :] = 3e4                                                # |k R| overflows fp16
    chunks = [7, 1, 13, 1, 9, 1, 1]
    for validate in (True, False):
        k = k_ok if validate else k_over
        states = []
        for fused in (True, False):
            O.FUSED_APPEND = fused
            try:
                with C.validation(validate):
                    fs, t = F.init(cfg, B, H, D), 0
                    for n in chunks:
                        F.append(cfg, calib, fs, _t(k[:, :, t:t + n], device), _t(v[:, :, t:t + n], device))
                        t += n
            finally:
                O.FUSED_APPEND = True
            states.append(fs)
        assert_same_state(states[0], states[1], f"validate={validate}: ")
        if not validate:                                                    # the overflow reached a page
            assert not bool(torch.isfinite(states[0].k_scale).all())


def test_old_window_tokens_leave_in_the_same_launch(target, monkeypatch):
    """The race case: appends whose new tokens overwrite the ring slots of old window tokens that leave
    (1-token decode steps with a full window; a chunk that pushes out the whole window while some new
    tokens go straight to pages; a partly filled window), checked after every append."""
    _, device = target
    F, FA = _mods(target)
    cfg = RO.OSCARConfig(sink=2, window=8, group_size=32, page_size=4, max_tokens=128)
    B, H, D = 2, 2, 64
    spy = _Spy(monkeypatch, FA)
    calib = _calib("per_head", H, D, seed=7)
    # 2 + 5 (window partly filled), +6 (3 old leave, 3 new overwrite them), +1 x 2, +2 and +4 (every new
    # token overwrites a leaving old one: Triton's 2- and 4-row tiles, where a reshaped quantile once
    # miscompiled on the GPU), +1, +11 (all 8 old leave, 3 new straight to pages), then 1-token steps
    # across page boundaries
    _run_sequence(F, cfg, calib, B, H, D, np.float16, [7, 6, 1, 1, 2, 4, 1, 11], 9, device, seed=11)
    assert spy.calls == 2 * 17


def test_quantile_ties_and_gpu_code_paths(target, monkeypatch):
    """Integer-valued tokens through the identity rotation: many tied |x| (zeros, -0.0, equal magnitudes
    of both signs, exact .5 ties after scaling) at the quantile's order statistics. On the interpreter also
    with INTERP_SHORTCUTS off: the GPU's code paths (a program per (batch, head) tile, the rotation loop,
    the bisection selection), then a per-head rotation through them."""
    _, device = target
    F, FA = _mods(target)
    cfg = RO.OSCARConfig(**dict(SMALL, group_size=32))
    B, H, D = 2, 1, 64
    calib = RO.identity_calibration(D, 0.9, 0.75)
    rng = np.random.default_rng(5)
    T = 30
    k = rng.integers(-3, 4, (B, H, T, D)).astype(np.float32)
    v = (rng.integers(-2, 3, (B, H, T, D)) * 0.5).astype(np.float32)
    k[0, 0, 13] = 0.0
    k[1, 0, 14, ::2] = -0.0
    v[0, 0, 15] = 7.0                                                     # a constant token
    modes = (True, False) if target[0] == "triton" and device == "cpu" else (None,)
    for short in modes:
        if short is not None:
            monkeypatch.setattr(FA, "INTERP_SHORTCUTS", short)
        rs, fs = RO.init(cfg, B, H, D), F.init(cfg, B, H, D)
        t = 0
        for n in ((11, 4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 6) if short is not False else (11, 4, 1, 1, 7)):
            RO.append(cfg, calib, rs, k[:, :, t:t + n], v[:, :, t:t + n])
            F.append(cfg, calib, fs, _t(k[:, :, t:t + n], device), _t(v[:, :, t:t + n], device))
            t += n
            assert_same_state(fs, rs, f"shortcuts={short}, T={t}: ")
    if modes[-1] is False:                                                  # GPU paths, per-head R, fp32 in
        cfg = RO.OSCARConfig(**dict(SMALL, group_size=16, page_size=8))
        _run_sequence(F, cfg, _calib("per_head", 2, 32, seed=2), 1, 2, 32, np.float32, [14], 2, device)


def test_overflow_bound_falls_back(target, monkeypatch):
    """While validation is on the fused kernel runs only where |x|_2 * max_j |R_j|_2 proves fp16(x R)
    finite. A token whose rotation overflows raises the reference's error and leaves the state unchanged;
    a huge token whose bound fails but whose rotation fits is appended (unfused path); a large token
    within the bound goes through the fused kernel; both equal the reference."""
    _, device = target
    F, FA = _mods(target)
    cfg = RO.OSCARConfig(**dict(SMALL, group_size=64))
    B, H, D = 2, 2, 64
    calib = RO.identity_calibration(D, 0.9, 0.8)
    k, v = _kv(B, H, 20, D, np.float32, seed=2)
    rs, fs = RO.init(cfg, B, H, D), F.init(cfg, B, H, D)
    RO.append(cfg, calib, rs, k[:, :, :14], v[:, :, :14])
    F.append(cfg, calib, fs, _t(k[:, :, :14], device), _t(v[:, :, :14], device))
    spy = _Spy(monkeypatch, FA)
    before = fs.copy()
    over = k[:, :, 14:15].copy()
    over[1, 0, 0, 3] = 7e4                                                 # identity R: k R = 7e4 > 65504
    assert_same_error(lambda: RO.append(cfg, calib, rs, over, v[:, :, 14:15]),
                      lambda: F.append(cfg, calib, fs, _t(over, device), _t(v[:, :, 14:15], device)))
    assert_same_state(fs, before, "after the overflow: ")
    assert spy.calls == 0
    huge = k[:, :, 14:16].copy()
    huge[0, 1, 0, :4] = 4e4                                                # |x| = 8e4: the bound fails, x R fits
    RO.append(cfg, calib, rs, huge, v[:, :, 14:16])
    F.append(cfg, calib, fs, _t(huge, device), _t(v[:, :, 14:16], device))
    assert spy.calls == 0
    assert_same_state(fs, rs, "huge token, unfused: ")
    big = k[:, :, 16:18].copy()
    big[1, 1, 1, 7] = 6e4                                                  # the bound holds: fused
    RO.append(cfg, calib, rs, big, v[:, :, 16:18])
    F.append(cfg, calib, fs, _t(big, device), _t(v[:, :, 16:18], device))
    assert spy.calls == 2
    assert_same_state(fs, rs, "large token, fused: ")


def test_unsupported_configuration_takes_the_unfused_path(target, monkeypatch):
    """A head dim / group the fused kernel does not take (D = 96; groups too small for the backend's
    layout) still appends, through the unfused path, bit-exact."""
    _, device = target
    F, FA = _mods(target)
    spy = _Spy(monkeypatch, FA)
    ran = 0
    for over, D in ((dict(group_size=32), 96), (dict(group_size=2), 32), (dict(group_size=4), 256)):
        cfg = RO.OSCARConfig(**dict(SMALL, **over))
        if FA.supported(cfg, D):
            continue
        _run_sequence(F, cfg, _calib("shared", 1, D), 1, 1, D, np.float16, [14], 2, device)
        ran += 1
    assert ran >= 2 and spy.calls == 0


@pytest.mark.parametrize("G", [128, 64])
def test_fused_state_paper_config_gpu(target, monkeypatch, G):
    """GPU only: the paper's sizes (sink 64, window 256, pages of 128, D = 128, 2 KV heads, B = 2): prefills
    of 300 and 700 tokens (whole pages, several tiles per head), then 1-token steps across a page boundary."""
    _, device = target
    if device == "cpu":
        pytest.skip("sizes for the GPU (the interpreter runs the small configurations)")
    F, FA = _mods(target)
    cfg = RO.OSCARConfig(sink=64, window=256, group_size=G, page_size=128, max_tokens=2048)
    spy = _Spy(monkeypatch, FA)
    _run_sequence(F, cfg, _calib("per_head", 2, 128, seed=G), 2, 2, 128, np.float16, [300, 700], 150, device)
    assert spy.calls == 2 * 152
