"""kvq.fast.caches.oscar copies a calibration's rotations to the device once (so decode makes no host-to-device
copy and can be captured in a CUDA graph); the cache is keyed on the array object, device and transpose."""

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


def test_rotation_cache_is_bounded():
    dev = torch.device("cpu")
    arrays = [np.eye(4, dtype=np.float32) * (i + 1) for i in range(_oscar._ROT_CACHE_SIZE + 10)]
    for A in arrays:
        _oscar._rot(A, dev)
    assert len(_oscar._ROT_CACHE) <= _oscar._ROT_CACHE_SIZE
    assert torch.equal(_oscar._rot(arrays[0], dev), torch.from_numpy(arrays[0]))    # evicted, copied again
