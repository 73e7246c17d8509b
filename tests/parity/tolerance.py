"""The tolerance rule for order-dependent reductions (DESIGN.md section 3 / numerics contract rule 7).

A fast result ``fast`` of an operation whose float32 result depends on the summation order is compared
with the float64 truth ``truth``: its error may be at most twice the error of a float32 reference
computed in a different order (``ref32``, the NumPy reference run on float32 inputs), plus one rounding
step of the output dtype at the tensor's magnitude (the spacing of that dtype at ``max |truth|``).
Errors are taken in the max norm over the tensor.

    check_close(out, truth, ref32, torch.float16, "out")
"""

from __future__ import annotations

import math

import numpy as np
import torch

#: unit roundoff x 2 (the spacing of the dtype at 1.0) per output dtype
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def step_at(magnitude: float, dtype) -> float:
    """One rounding step (ulp) of ``dtype`` at ``magnitude``: 2**floor(log2 m) * eps."""
    eps = _EPS[_name(dtype)]
    if magnitude <= 0 or not math.isfinite(magnitude):
        return eps
    return 2.0 ** math.floor(math.log2(magnitude)) * eps


def _f64(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().double().numpy()
    return np.asarray(a, dtype=np.float64)


def check_close(fast, truth, ref32, out_dtype, what: str) -> dict:
    """Assert ``max|fast - truth| <= 2 max|ref32 - truth| + step_at(max|truth|, out_dtype)``.

    Infinite entries (an lse of -inf for an empty segment) must match exactly; NaN fails.
    Returns the numbers, for messages.
    """
    f, t, r = _f64(fast), _f64(truth), _f64(ref32)
    assert f.shape == t.shape == r.shape, (what, f.shape, t.shape, r.shape)
    fin = ~np.isinf(t)
    return check_within(f, t, float(np.max(np.abs(r[fin] - t[fin]), initial=0.0)), out_dtype, what)


def check_within(fast, truth, ref_err: float, out_dtype, what: str) -> dict:
    """``check_close`` with the float32 reference's error given as a number ``ref_err`` (for instance the
    median over several summation orders, where one order's error is a noisy yardstick)."""
    f, t = _f64(fast), _f64(truth)
    assert f.shape == t.shape, (what, f.shape, t.shape)
    assert not np.isnan(f).any(), f"{what}: fast result has NaN"
    inf = np.isinf(t)
    assert np.array_equal(np.isinf(f), inf) and np.array_equal(f[inf], t[inf]), \
        f"{what}: infinite entries differ from the truth"
    fin = ~inf
    if not fin.any():
        return {"err": 0.0, "bound": 0.0}
    err = float(np.max(np.abs(f[fin] - t[fin])))
    mag = float(np.max(np.abs(t[fin])))
    bound = 2.0 * ref_err + step_at(mag, out_dtype)
    assert err <= bound, (f"{what}: max error {err:.3g} > bound {bound:.3g} (= 2 x float32-reference error "
                          f"{ref_err:.3g} + one {_name(out_dtype)} step at magnitude {mag:.3g})")
    return {"err": err, "bound": bound}
