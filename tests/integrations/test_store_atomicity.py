"""KVStore never changes on a rejected call (issue 36, items 2, 3 and 5).

Before every rejected ``append`` / ``update`` the whole store is snapshot (every layer's state arrays and
length, AQUA-KV's waiting tokens, the FP16 tensors and their dtype, the memo) and compared bit for bit
after; a retry then appends once, and the store equals a fresh one fed only the accepted calls. AQUA-KV's
cross-layer commit is undone when it fails, so later appends to every layer work.
"""

import numpy as np
import pytest
import torch

from kvq.integrations import methods as M
from kvq.reference import aqua, aqua_cache

from .small import SMALL

B, H, D, L = 1, 2, 64, 3                   # head_dim 64: every method serves it (BitDecoding-2 included)
F = H * D


def _tokens(T, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, T, D)).astype(dtype) for _ in range(2))


def _big(T, seed=0):
    """Finite fp16 keys near 6e4: undone from RoPE (a rotation of channel pairs) they leave fp16's range."""
    k = np.full((B, H, T, D), 6e4, np.float16)
    k[..., ::2] = -6e4
    return k, _tokens(T, seed, np.float16)[1]


def _store(name, backend="reference", device=None, calibration=None, n_layers=L, max_tokens=64, **kw):
    fam = M.METHODS[name].family
    if calibration is None and fam in ("oscar", "aqua"):
        calibration = "identity"
    return M.KVStore(name, n_layers=n_layers, batch=B, kv_heads=H, head_dim=D, max_tokens=max_tokens,
                     backend=backend, device=device, calibration=calibration, **{**SMALL[name], **kw})


def _bits(a):
    """An array or tensor as (dtype, shape, bytes): equal exactly when bit-identical."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        a = a.view(torch.int16) if a.dtype == torch.bfloat16 else a
        a = M.to_numpy(a)
    a = np.asarray(a)
    return str(a.dtype), a.shape, a.tobytes()


def snapshot(store, memo: bool = True) -> dict:
    """Everything a KVStore holds: per layer its length, waiting tokens (AQUA-KV) and state arrays (the one
    cross-layer state for AQUA-KV), the FP16 tensors and dtype; with ``memo`` the memo's keys and the
    dequantize counter (what a store fed other calls may differ in)."""
    fam = store.spec.family
    snap = {}
    for l in range(store.n_layers):
        snap[l, "length"] = store.length(l)
        if memo:
            snap[l, "memo"] = sorted(map(str, store._memo[l]))
        if fam == "fp16":
            st = store.state(l)
            snap[l, "kv"] = None if st is None else tuple(_bits(t) for t in st)
        elif fam == "aqua":
            snap[l, "waiting"] = tuple(None if p is None else _bits(p)
                                       for p in (store._pending_k[l], store._pending_v[l]))
        else:
            snap[l, "state"] = store.state(l).length, {n: _bits(a) for n, a in store.state_arrays(l).items()}
    if fam == "fp16":
        snap["fp_dtype"] = store._fp_dtype
    if fam == "aqua":
        snap["state"] = store.state(0).length, {n: _bits(a) for n, a in store.state_arrays(0).items()}
    if memo:
        snap["dequantize_calls"] = store.dequantize_calls
    return snap


def assert_rejected(store, call, err, match=None):
    """``call()`` raises ``err`` (matching ``match``) and leaves ``store`` bit-identical."""
    before = snapshot(store)
    with pytest.raises(err, match=match):
        call()
    assert snapshot(store) == before


def _bad_calls(store, k, v):
    """(label, call, error) of calls ``store`` must reject, built from good tokens k, v (B, H, T, D)."""
    nan, inf = k.copy(), v.copy()
    nan[0, 0, 0, 0] = np.nan
    inf[0, 1, -1, 3] = np.inf
    full = np.zeros((B, H, store.max_tokens, D), np.float32)
    t = torch.from_numpy
    return [
        ("NaN k", lambda: store.append(0, nan, v), ValueError),
        ("inf v", lambda: store.append(1, k, inf), ValueError),
        ("fp16 overflow", lambda: store.append(0, k * 1e6, v), ValueError),
        ("head dim", lambda: store.append(0, k[..., :16], v[..., :16]), ValueError),
        ("k / v shapes", lambda: store.append(0, k, v[:, :, :1]), ValueError),
        ("int dtype", lambda: store.append(0, k.astype(np.int32), v), TypeError),
        ("capacity", lambda: store.append(0, full, full), ValueError),
        ("layer", lambda: store.append(store.n_layers, k, v), IndexError),
        ("update dtype 'fp16'", lambda: store.update(0, k, v, dtype="fp16"), TypeError),
        ("update dtype int8", lambda: store.update(0, k, v, dtype=torch.int8), TypeError),
        ("update NaN fp16", lambda: store.update(1, t(nan).half(), t(v).half(), dtype=torch.float16), ValueError),
        ("NaN bf16", lambda: store.append(2, t(nan).bfloat16(), t(v).bfloat16()), ValueError),
        ("keys_values dtype", lambda: store.keys_values(0, np.float16), TypeError),
    ]


# ---------------------------------------------------------------------------------------------------
# every method: rejected calls change nothing, and the store goes on as if they never happened


@pytest.mark.parametrize("name", list(M.METHODS))
def test_rejected_calls_change_nothing(name):
    store, fresh = _store(name), _store(name)
    good = [_tokens(5, l) for l in range(L)] + [_tokens(2, 9)]
    for s in (store, fresh):
        for l in range(L):
            s.append(l, *good[l])                                 # a history (AQUA-KV: committed)
        s.append(0, *good[L])                                     # AQUA-KV: layer 0's tokens wait
    for label, call, err in _bad_calls(store, *_tokens(3, 20)):
        before = snapshot(store)
        with pytest.raises(err):
            call()
        assert snapshot(store) == before, label
    more = [_tokens(2, 30 + l) for l in range(L)]
    for s in (store, fresh):
        s.append(1, *good[L])
        s.append(2, *good[L])
        for l in range(L):
            s.update(l, *more[l], dtype="float16")
    assert snapshot(store, memo=False) == snapshot(fresh, memo=False)
    for l in range(L):
        assert all(torch.equal(a, b) for a, b in zip(store.keys_values(l), fresh.keys_values(l)))


@pytest.mark.parametrize("name", ["FP16", "KIVI-K2V2", "OSCAR", "AQUA-KV"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", torch.float16, None])
def test_update_dtype_is_checked_first_and_a_retry_appends_once(name, dtype):
    store = _store(name, n_layers=1)
    k, v = _tokens(3, 0)
    for bad in ("fp16", "half", np.float16, torch.int32, torch.complex64, 16):
        assert_rejected(store, lambda: store.update(0, k, v, dtype=bad), TypeError, "is not an output dtype")
    K, V = store.update(0, k, v, dtype=dtype)
    want = M._out_dtype(dtype)
    assert store.length(0) == 3 and K.dtype == V.dtype == want and K.shape == (B, H, 3, D)
    assert torch.equal(K, store.keys_values(0, want)[0])
    assert M._out_dtype(None) == torch.float32 and M._out_dtype("bfloat16") == torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# FP16: NaN / inf refused whatever the input dtype; the dtype is fixed by the first accepted append


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_store_refuses_nan_and_inf_in_its_own_dtype(dtype):
    store = _store("FP16")
    k = torch.randn(B, H, 4, D, dtype=dtype)
    store.append(0, k, k)
    assert store.state(0)[0].dtype == dtype
    for bad in (float("nan"), float("inf"), float("-inf")):
        kb = k.clone()
        kb[0, 1, 2, 3] = bad
        assert_rejected(store, lambda: store.append(0, kb, k), ValueError, "k contains NaN or inf")
        assert_rejected(store, lambda: store.update(1, k, kb), ValueError, "v contains NaN or inf")
        assert_rejected(store, lambda: store.append(0, kb.numpy() if dtype == torch.float16 else kb.float().numpy(),
                                                    k), ValueError, "k contains NaN or inf")
    if dtype == torch.bfloat16:                                   # overflow against bf16's range, named so
        huge = torch.full((B, H, 1, D), 3.4e38)
        assert_rejected(store, lambda: store.append(0, huge, huge), ValueError,
                        r"k overflows bfloat16 \(\|x\| > 3.38953e\+38\)")
    else:
        huge = torch.full((B, H, 1, D), 7e4)
        assert_rejected(store, lambda: store.append(0, huge, huge), ValueError,
                        r"k overflows float16 \(\|x\| > 65504\)")


def test_fp16_store_dtype_is_fixed_by_the_first_accepted_append():
    store = _store("FP16")
    kb = torch.randn(B, H, 4, D).bfloat16()
    bad = kb.clone()
    bad[0, 0, 0, 0] = float("nan")
    assert_rejected(store, lambda: store.append(0, bad, kb), ValueError, "k contains NaN or inf")
    assert store._fp_dtype is None and store.state(0) is None
    k16 = torch.randn(B, H, 4, D).half()
    store.append(0, k16, k16)                                     # the first accepted append: fp16
    assert store._fp_dtype == torch.float16 and torch.equal(store.state(0)[0], k16)
    store.append(1, kb, kb)                                       # later bf16 input: stored as fp16
    assert store.state(1)[0].dtype == torch.float16


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("name", ["FP16", "AQUA-KV"])
def test_store_never_aliases_the_input(name, kind):
    """FP16 tensors and AQUA-KV's waiting tokens are the store's own copies of fp16 input."""
    store = _store(name, n_layers=2)
    k16 = np.random.default_rng(0).standard_normal((B, H, 3, D)).astype(np.float16)
    k = torch.from_numpy(k16.copy()) if kind == "torch" else k16.copy()
    store.append(0, k, k)
    k[...] = 0                                                    # the caller reuses its buffer
    K, V = store.keys_values(0)
    assert np.array_equal(K.numpy(), k16.astype(np.float32)) and np.array_equal(V.numpy(), k16.astype(np.float32))


# ---------------------------------------------------------------------------------------------------
# AQUA-KV: refused by the append that brings the tokens where the layer alone decides; else the
# commit fails and is undone, and every later append works


def _aqua_equal(store, fresh):
    assert snapshot(store, memo=False) == snapshot(fresh, memo=False)
    for l in range(L):
        assert all(torch.equal(a, b) for a, b in zip(store.keys_values(l), fresh.keys_values(l)))


def _zero_predictors(nan_at=None):
    """Finite all-zero predictors for layers 1..L-1 (every residual is the token itself, but the layers are
    predicted: the append cannot judge them); ``nan_at=(which, l)`` puts a NaN weight in one of them."""
    fk = [None] + [aqua.Predictor((np.zeros((F, F), np.float32),), np.zeros(F, np.float32)) for _ in range(1, L)]
    fv = [None] + [aqua.Predictor((np.zeros((2 * F, F), np.float32),), np.zeros(F, np.float32)) for _ in range(1, L)]
    if nan_at is not None:
        which, l = nan_at
        (fk if which == "f_key" else fv)[l].mats[0][3, 5] = np.nan
    return aqua.AquaPredictors(tuple(fk), tuple(fv))


@pytest.mark.parametrize("layer", [1, L - 1])
def test_aqua_keys_beyond_fp16_pre_rope_are_refused_by_their_append(layer):
    """Identity calibration: a layer's key residual is its pre-RoPE key. Keys near 6e4 leave fp16 once
    undone from RoPE; the uniform backbone's fp16 minimum overflows. The append refuses them: the store
    is unchanged, not jammed, and the bare method refuses the same tokens at its commit."""
    name = "AQUA-KV-uniform"
    store, fresh = _store(name), _store(name)
    good = [_tokens(20, l) for l in range(L)]                     # 4 sink + one chunk of 16
    for l in range(layer):
        store.append(l, *good[l])
    assert_rejected(store, lambda: store.append(layer, *_big(20)), ValueError,
                    f"k cannot be compressed by {name} at layer {layer}: undone from RoPE .*overflows float16")
    assert_rejected(store, lambda: store.update(layer, *_big(20), dtype=torch.float16), ValueError, "undone from RoPE")
    for l in range(layer, L):
        store.append(l, *good[l])
    for l in range(L):
        fresh.append(l, *good[l])
    _aqua_equal(store, fresh)
    # the method itself cannot take them: the store refuses exactly what its commit would
    st = aqua_cache.init(store.cfg, L, B, H, D)
    ks = [g[0].astype(np.float16) for g in good]
    ks[layer] = _big(20)[0]
    with pytest.raises(ValueError, match="overflows float16 metadata"):
        aqua_cache.append(store.cfg, store.calibration, st, np.stack(ks), np.stack([g[1] for g in good]))


@pytest.mark.parametrize("name", ["AQUA-KV-uniform", "AQUA-KV"])
def test_aqua_big_keys_the_method_takes_are_accepted(name):
    """Keys near 6e4 in the sink (kept fp16), and past it where the quantizer copes (HIGGS' RMS scale of
    whole RoPE pairs stays within fp16): accepted, as the bare method accepts them."""
    store = _store(name)
    sink = store.cfg.sink
    for l in range(L):
        store.append(l, *_big(sink))                              # the sink: never quantized
    T = store.cfg.buffer if name == "AQUA-KV" else 0
    for l in range(L if T else 0):
        store.append(l, *_big(T))                                 # HIGGS: one chunk of them, compressed
    assert store.state(0).length == sink + T and all(store.pending(l) == 0 for l in range(L))


@pytest.mark.parametrize("via", ["append", "update"])
def test_aqua_failed_commit_is_undone(via):
    """The last layer is predicted, so its append cannot judge its keys; the commit it completes fails (the
    residual's fp16 minimum overflows). The store is as before that call, and appending good tokens to
    the last layer (and then every layer) works and equals a fresh store fed only the good tokens."""
    name = "AQUA-KV-uniform"
    P = _zero_predictors()
    store, fresh = _store(name, calibration=P), _store(name, calibration=P)
    good = [_tokens(20, l) for l in range(L)]
    for l in range(L - 1):
        store.append(l, *good[l])
    store.keys_values(0)                                          # a memo entry, to be kept
    call = getattr(store, via)
    assert_rejected(store, lambda: call(L - 1, *_big(20)), ValueError,
                    f"{name} could not compress the 20 token.s. of every layer that this append completed, so "
                    f"the append was undone: .*overflows float16 metadata")
    assert store.pending(0) == 20 and store.pending(L - 1) == 0 and store.state(0).length == 0
    out = call(L - 1, *good[L - 1])
    for l in range(L - 1):
        fresh.append(l, *good[l])
    want = getattr(fresh, via)(L - 1, *good[L - 1])
    if via == "update":                                           # read before the commit, as fresh's
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    more = [_tokens(17, 50 + l) for l in range(L)]                # every layer goes on (another chunk)
    for s in (store, fresh):
        for l in range(L):
            s.append(l, *more[l])
    _aqua_equal(store, fresh)
    assert store.state(0).length == 37


@pytest.mark.parametrize("which", ["f_key", "f_value"])
def test_aqua_nan_predictors_are_refused_up_front(which):
    with pytest.raises(ValueError, match=rf"AQUA-KV calibration {which}\[2\] has NaN or inf weights"):
        _store("AQUA-KV", calibration=_zero_predictors(nan_at=(which, 2)))


def test_aqua_commit_failing_on_nan_predictions_is_undone():
    """Predictors that turn NaN after the store was built (its public ``calibration`` replaced): the commit
    fails on NaN residuals and is undone; with good predictors back, the same store goes on."""
    P = _zero_predictors()
    store, fresh = _store("AQUA-KV", calibration=P), _store("AQUA-KV", calibration=P)
    good = [_tokens(20, l) for l in range(L)]
    for l in range(L - 1):
        store.append(l, *good[l])
    store.calibration = _zero_predictors(nan_at=("f_key", 1))
    assert_rejected(store, lambda: store.append(L - 1, *good[L - 1]), ValueError, "AQUA-KV could not compress")
    assert_rejected(store, lambda: store.update(L - 1, *good[L - 1]), ValueError, "NaN")
    store.calibration = P
    for s in (store, fresh):
        for l in range(L - 1 if s is store else 0, L):
            s.append(l, *good[l])
    _aqua_equal(store, fresh)
    assert store.state(0).length == 20


# ---------------------------------------------------------------------------------------------------
# the Triton store (the CPU interpreter here, CUDA on the GPU machine): the same rules


@pytest.mark.parametrize("name", ["FP16", "KIVI-K2V2", "AQUA-KV-uniform"])
def test_triton_store_rejected_calls_change_nothing(triton_device, name):
    store = _store(name, backend="triton", device=triton_device, n_layers=2)
    k, v = (torch.from_numpy(a).to(triton_device) for a in _tokens(5, 0, np.float16))
    for l in range(2):
        store.append(l, k, v)
    nan = k.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert_rejected(store, lambda: store.append(0, nan, v), ValueError, "NaN")
    assert_rejected(store, lambda: store.update(0, k, v, dtype="fp16"), TypeError, "is not an output dtype")
    assert_rejected(store, lambda: store.append(1, k.float(), v[:, :, :2]), ValueError, "same shape")
    if name == "AQUA-KV-uniform":
        big = torch.from_numpy(_big(20)[0]).to(triton_device)
        assert_rejected(store, lambda: store.append(1, big, big), ValueError, "undone from RoPE")
    K, V = store.update(0, k, v, dtype="float16")
    assert store.length(0) == 10 and K.dtype == torch.float16
    other, k2 = _store(name, backend="triton", device=triton_device, n_layers=2), k.clone()
    other.append(0, k2, k2)                   # kept in fp16 (AQUA-KV: waiting), never in the caller's memory
    k2.zero_()
    assert torch.equal(other.keys_values(0)[0], k.float())


@pytest.mark.parametrize("name", ["KIVI-K2V2", "Kitty"])
def test_triton_paged_store_appends_without_checking_twice(triton_device, name, monkeypatch):
    """The store's fast KIVI / Kitty appends go through ``kvq.fast.caches.paged.append_checked``: the paged
    cache's own checks of the state and of k, v (``_check_append``), which the store has made, are not made
    again; the state equals the checked ``append``'s bit for bit, one token at a time included; NaN, inf
    and fp16 overflow are still refused before anything changes, while validation is on."""
    from kvq.fast.caches import paged as FP
    seen = {"checked": 0, "check": 0}
    real_checked, real_check = FP.append_checked, FP._check_append

    def checked(*a):
        seen["checked"] += 1
        return real_checked(*a)

    def check(*a):
        seen["check"] += 1
        return real_check(*a)

    monkeypatch.setattr(FP, "append_checked", checked)
    monkeypatch.setattr(FP, "_check_append", check)
    store = _store(name, backend="triton", device=triton_device, n_layers=1)
    mod = store._family.mod
    direct = mod.init(store.cfg, B, H, D, device=store.devices[0])
    toks = [tuple(torch.from_numpy(a).to(triton_device) for a in _tokens(T, 40 + T, np.float16)) for T in (7, 1, 1, 3)]
    for k, v in toks:
        store.append(0, k, v)
        mod.append(store.cfg, direct, k, v)
    assert seen == {"checked": len(toks), "check": len(toks)}          # the direct appends' checks only
    got, want = store.state(0), direct
    assert got.length == want.length == 12
    for n, a in got.arrays().items():
        assert _bits(a) == _bits(want.arrays()[n]), n
    k, v = toks[1]
    nan, inf = k.clone(), v.clone()
    nan[0, 0, 0, 0] = float("nan")
    inf[0, 1, 0, 3] = float("inf")
    assert store.validate                                              # KVStore's default: scans on
    assert_rejected(store, lambda: store.append(0, nan, v), ValueError, "NaN")
    assert_rejected(store, lambda: store.append(0, k, inf), ValueError, "inf")
    assert_rejected(store, lambda: store.append(0, k.float() * 1e6, v.float()), ValueError, "overflows float16")
