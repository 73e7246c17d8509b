"""kvq.fast.caches.oscar copies a calibration's rotations to the device once (so decode makes no host-to-device
copy and can be captured in a CUDA graph); the cache is keyed on the array object, device and transpose, and an
entry lives as long as its array."""

from __future__ import annotations

import numpy as np
import torch

from kvq.fast.caches import oscar as _oscar


def test_rotation_copied_once_per_array():
    rng = np.random.default_rng(0)
    R = np.linalg.qr(rng.standard_normal((2, 8, 8)))[0].astype(np.float32)
    dev = torch.device("cpu")
    a, b = _oscar._rot(R, dev), _oscar._rot(R, dev)
    assert a is b and torch.equal(a, torch.from_numpy(R))
    t = _oscar._rot(R, dev, transpose=True)
    assert t is not a and torch.equal(t, torch.from_numpy(np.swapaxes(R, -1, -2).copy()))
    R2 = R.copy()                                       # equal values, another object: its own entry
    assert _oscar._rot(R2, dev) is not a and torch.equal(_oscar._rot(R2, dev), a)


def test_rotations_stay_while_their_arrays_live_and_go_with_them():
    """A model's step visits every layer's rotations in turn (R_K, R_V, R_V^T per layer): each stays on the
    device as long as its array lives, however many layers there are (a bounded LRU smaller than that
    missed every one at every step), and goes when the array is freed."""
    import gc
    dev = torch.device("cpu")
    arrays = [np.eye(4, dtype=np.float32) * (i + 1) for i in range(300)]
    first = [(_oscar._rot(A, dev), _oscar._rot(A, dev, True)) for A in arrays]
    again = [(_oscar._rot(A, dev), _oscar._rot(A, dev, True)) for A in arrays]
    assert all(x is y for a, b in zip(first, again) for x, y in zip(a, b))
    assert first[7][1].dtype == torch.float32 and torch.equal(first[7][1], torch.from_numpy(arrays[7].T.copy()))
    ids = {id(A) for A in arrays}
    assert ids <= set(_oscar._ROT_CACHE)
    del arrays, first, again
    gc.collect()
    assert not ids & set(_oscar._ROT_CACHE)


def test_a_decode_step_copies_no_rotation_to_the_device(monkeypatch):
    """The append puts the decode's rotations (R_K, R_V^T) on the device, so that decode steps make no
    host-to-device copy (from pageable memory it synchronizes): every make() of the cache happens before."""
    from kvq.fast.caches import oscar as FO
    from kvq.integrations import methods as M
    store = M.KVStore("OSCAR", n_layers=3, batch=1, kv_heads=2, head_dim=32, max_tokens=64, backend="triton",
                      calibration="identity", device="cpu", sink=2, window=8, group_size=32)
    rng = np.random.default_rng(0)
    k = torch.from_numpy(rng.standard_normal((1, 2, 12, 32)).astype(np.float32))
    for layer in range(3):
        store.append(layer, k, k)
    made = []
    real = FO._per_array

    def spy(cache, key, R, make):
        return real(cache, key, R, lambda: made.append(key) or make())

    monkeypatch.setattr(FO, "_per_array", spy)
    q = torch.from_numpy(rng.standard_normal((1, 4, 1, 32)).astype(np.float32)).half()
    for layer in range(3):
        store.decode_attention(layer, q)
    assert made == []


def test_rotations_of_a_calibration_are_made_once():
    """``_rotations``: one record per calibration object and device, made of ``_rot``'s tensors: R_K and R_V as
    the calibration holds them (the appends'), R_K and R_V^T as contiguous (H_R, D, D) (the decodes'), for a
    shared (D, D) and a per-head (H, D, D) calibration; it goes when the calibration is freed."""
    import gc

    from kvq.reference import oscar as RO

    rng = np.random.default_rng(1)
    dev = torch.device("cpu")
    for lead in ((), (3,)):
        RK, RV = (np.linalg.qr(rng.standard_normal(lead + (8, 8)))[0].astype(np.float32) for _ in range(2))
        calib = RO.OSCARCalibration(RK, RV)
        r = _oscar._rotations(calib, dev)
        assert _oscar._rotations(calib, dev) is r
        assert r.R_K is _oscar._rot(RK, dev) and r.R_V is _oscar._rot(RV, dev)
        h = lead[0] if lead else 1
        assert r.R_K3.shape == r.R_Vt3.shape == (h, 8, 8) and r.R_K3.is_contiguous() and r.R_Vt3.is_contiguous()
        assert torch.equal(r.R_K3, torch.from_numpy(RK).reshape(h, 8, 8))
        assert torch.equal(r.R_Vt3, torch.from_numpy(np.swapaxes(RV, -1, -2).copy()).reshape(h, 8, 8))
        assert _oscar._decode_rotations(calib, dev) == (r.R_K3, r.R_Vt3)
        assert _oscar._decode_rotations(calib, dev, rotate_back=False)[1] is None
        key = id(calib)
        assert key in _oscar._CALIB_CACHE
        del calib, r
        gc.collect()
        assert key not in _oscar._CALIB_CACHE
