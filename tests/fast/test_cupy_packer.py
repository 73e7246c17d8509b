"""The packers of ``kvq.fast.cupy._loader.Prepared`` launches: compiled once per argument pattern, each launch
with its own constants (runs without a GPU: packing is host work)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvq.fast.cupy._loader as L  # noqa: E402


class _Fn:
    name = "k"


def _params(prep, values) -> bytes:
    buf, params = prep.pack(values)
    return buf.raw[:params - ctypes.addressof(buf)]


def _expected(prep, values) -> bytes:
    buf, params = L.pack_args(prep.bind(values))
    return buf.raw[:params - ctypes.addressof(buf)]


def test_same_pattern_shares_code_keeps_its_constants():
    """Two launches whose arguments differ only in their constants (a plan for another cache length) share
    the packer's compiled code, and each packs its own constants."""
    types = {0: torch.Tensor, 1: np.float32}
    a = L.Prepared(_Fn(), (1,), (32,), (L.Slot(0), np.int32(5), L.Slot(1), np.int64(7)), 0, types)
    b = L.Prepared(_Fn(), (1,), (32,), (L.Slot(0), np.int32(6), L.Slot(1), np.int64(2 ** 40)), 0, types)
    assert a._packer.__code__ is b._packer.__code__
    values = (0x7F00_0000_1000, 0.5)
    assert _params(a, values) == _expected(a, values)
    assert _params(b, values) == _expected(b, values)
    assert _params(a, values) != _params(b, values)


def test_other_pattern_other_code():
    """A different layout of Slots and constants gets its own packer code."""
    types = {0: torch.Tensor, 1: np.int32}
    a = L.Prepared(_Fn(), (1,), (32,), (L.Slot(0), np.int32(5), L.Slot(1)), 0, types)
    b = L.Prepared(_Fn(), (1,), (32,), (L.Slot(0), L.Slot(1), np.int32(5)), 0, types)
    assert a._packer.__code__ is not b._packer.__code__
    values = (4096, 3)
    assert _params(a, values) == _expected(a, values)
    assert _params(b, values) == _expected(b, values)
