"""Tensor helpers shared by the store (``kvq.integrations.methods``) and the method families
(``kvq.integrations.families``): argument checks, torch imported on first use, conversions between the
reference's arrays and the fast tier's tensors, the FP16-buffer rule, the output cast, and the copy of a
state into a larger one. A module of its own so that the families and the store, which dispatches
through them, do not import each other.

This module imports NumPy only; torch (and the fast tier, for :func:`to_out`) when a helper needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import numpy as np


def check_pos_int(name: str, v) -> int:
    """``v`` as an int when it is a positive integer (bool excluded); ValueError naming ``name`` otherwise.
    The check of every size argument of ``configure``, ``KVStore`` and the HF caches."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


@functools.cache
def fast_common():
    """The module ``kvq.fast.common``, imported on first use and kept (a model's step asks for it per layer)."""
    return importlib.import_module("kvq.fast.common")


def import_torch():
    """The ``torch`` module, imported on first use (this module imports NumPy and kvq.reference only)."""
    import torch
    return torch


def to_numpy(a):
    """A reference array or a fast-tier tensor as a NumPy array (uint16 tensors included)."""
    torch = import_torch()
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        if a.dtype == torch.uint16:
            return a.view(torch.int16).numpy().view(np.uint16)
        return a.numpy()
    return np.asarray(a)


def checked_half(t, dtype, name: str, scan: bool = True):
    """Torch tensor ``t`` rounded to the 16-bit ``dtype``, refusing NaN / inf input and overflow (the
    methods' rule for what enters an FP16 buffer). ``scan=False`` (a store made with ``validate=False``): the
    rounding only, with no value read on the host (each scan of a CUDA tensor waits for the GPU)."""
    torch = import_torch()
    if not scan:
        return t.to(dtype)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or inf")
    y = t.to(dtype)
    if not bool(torch.isfinite(y).all()):
        raise ValueError(f"{name} overflows {str(dtype).replace('torch.', '')} (|x| > "
                         f"{torch.finfo(dtype).max:g}); the FP16 buffers cannot hold it")
    return y


def to_out(x, dtype):
    """Dequantized fp32 ``x`` in ``dtype``: float16 saturates finite values beyond +-65504 (the numerics
    contract's ``to_out``, on torch tensors ``kvq.fast.common.to_out``: a group holding 65504 has a top code
    whose fp32 value rounds to inf in fp16)."""
    return fast_common().to_out(x, dtype)


def copy_state(old, new, cfg):
    """``new`` (an empty state from ``init(cfg, ...)``, larger in capacity only) holding ``old``'s contents:
    every array of ``old`` copied into the leading block of the same array of ``new`` (page pools and tables
    grow along one axis; the used part of each is a prefix, the rest keeps ``init``'s fill), every other field
    (length, page counters, shape) taken from ``old``, and ``cfg`` recorded."""
    fields = {}
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if f.name == "cfg":
            fields[f.name] = cfg
        else:
            fields[f.name] = _copy_into(a, b, f.name)
    return dataclasses.replace(new, **fields)


def _copy_into(a, b, name: str):
    """``a`` copied into the leading block of ``b`` (arrays, or dicts of them); other values: ``a``."""
    torch = import_torch()
    if isinstance(a, dict):
        return {k: _copy_into(a[k], b[k], f"{name}.{k}") for k in a}
    if isinstance(a, (np.ndarray, torch.Tensor)):
        if tuple(a.shape) == tuple(b.shape):
            return a
        if a.ndim != b.ndim or any(x > y for x, y in zip(a.shape, b.shape)):
            raise AssertionError(f"state array {name} cannot grow from {tuple(a.shape)} to {tuple(b.shape)}")
        b[tuple(slice(0, x) for x in a.shape)] = a
        return b
    return a
