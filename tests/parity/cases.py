"""Inputs for the parity tests: shapes per layout and device, value kinds that stress the contract.

Every case yields the same data twice: a torch tensor for the fast tier and a NumPy array for the
reference (float16 as float16; bfloat16 as the float32 values it holds exactly, which is how the
reference takes bf16; float32 as float32).

    x_t, x_np = make_input("ties", shape, axis, G, bits, symmetric, torch.float16, "cpu", seed=3)
    assert_bits_equal(fast_codes, ref_codes, "codes")

Value kinds (``KINDS``):
  normal    N(0, 3^2) values;
  ties      groups built so that (x - mn) / scale hits k + 0.5 exactly (mn = 0, mx = qmax * s, s a power
            of two; symmetric: max |x| = q * s, values (k + 0.5) * s of both signs, -0.5, -1.5, -2.5 among
            them), so round-half-to-even decides every code;
  const     constant groups (scale 0), among them +0.0, -0.0 and negative constants;
  huge16    values near the float16 limit (|x| up to 6e4; symmetric 3e4) with float16 metadata;
  huge32    |x| ~ 1e30 with float32 metadata (float32 / bfloat16 input);
  tiny16    |x| ~ 1e-6 with float16 metadata: scale and min are float16 subnormals;
  tiny32    |x| ~ 1e-30 with float32 metadata;
  denorm32  |x| ~ 1e-39: float32 subnormal inputs (float32 / bfloat16 input), float32 metadata;
  negzero   -0.0 and +0.0 inside groups, groups of all -0.0, groups whose minimum is -0.0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KINDS = ("normal", "ties", "const", "huge16", "huge32", "tiny16", "tiny32", "denorm32", "negzero")
#: value kind -> metadata dtype it is meant for
META_OF = {"huge32": np.float32, "tiny32": np.float32, "denorm32": np.float32}
LAYOUTS = ("last", "middle", "first")

# (shape, axis, group size) per layout; CPU (interpreter) shapes are small, GPU shapes larger. None of
# the sizes is a multiple of the kernels' block sizes where it can avoid it: odd row counts, inner
# sizes 5 / 7 / 72, group sizes 40 / 96 that are not powers of two.
SHAPES = {
    "cpu": {
        "last": ((3, 5, 96), -1, 96),            # 15 groups of 96 contiguous channels
        "middle": ((2, 1, 80, 5), 2, 40),         # per-channel groups of 40 tokens, inner 5
        "first": ((24, 7), 0, 8),                 # groups along the outermost axis, inner 7
    },
    "cuda": {
        "last": ((3, 7, 129, 96), -1, 32),        # 8127 rows x 3 groups of 32
        "middle": ((2, 3, 384, 72), 2, 128),      # per-channel keys, inner 72 (not a power of two)
        "first": ((256, 5, 33), 0, 64),           # outer 1, inner 165
    },
}


def shape_for(layout: str, device: str):
    return SHAPES["cuda" if device == "cuda" else "cpu"][layout]


def input_dtype_for(kind: str, dtype: torch.dtype) -> torch.dtype:
    """float16 cannot hold 1e30 or float32 subnormals: those kinds use float32 instead."""
    if kind in ("huge32", "denorm32", "tiny32") and dtype == torch.float16:
        return torch.float32
    return dtype


def meta_for(kind: str, index: int):
    """Metadata dtype of a case: the kind's own, else float16 and float32 alternately."""
    if kind in META_OF:
        return META_OF[kind]
    if kind in ("huge16", "tiny16"):
        return np.float16
    return (np.float16, np.float32)[index % 2]


def _grouped(shape, axis: int, G: int):
    axis = axis % len(shape)
    return tuple(shape[:axis]) + (shape[axis] // G, G) + tuple(shape[axis + 1:]), axis + 1


def values(kind: str, shape, axis: int, G: int, bits: int, symmetric: bool, seed: int) -> np.ndarray:
    """float32 values of the given kind, shaped ``shape``, groups of G along ``axis``."""
    rng = np.random.default_rng(seed)
    gshape, gax = _grouped(shape, axis, G)
    n_groups = int(np.prod(gshape)) // G
    # work on (groups, G): move the member axis last
    def fill(fn):
        g = fn(n_groups)                                            # (n_groups, G)
        moved = np.moveaxis(np.empty(gshape, np.float32), gax, -1)
        return np.moveaxis(g.reshape(moved.shape), -1, gax).reshape(shape).astype(np.float32)

    if kind == "normal":
        return (3 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "ties":
        def ties(ng):
            s = np.exp2(rng.integers(-6, 3, size=(ng, 1))).astype(np.float32)
            if symmetric:
                q = 2 ** (bits - 1) - 1
                k = rng.integers(-q, q, size=(ng, G)) + 0.5                  # (k + 0.5), |.| < q
                k[:, 0] = q * rng.choice([-1, 1], size=ng)                  # max |x| = q * s
                fixed = np.array([-0.5, -1.5, -2.5, 0.5, 1.5, 2.5])
                fixed = fixed[np.abs(fixed) < q] if q > 1 else np.array([-0.5, 0.5])
                m = min(len(fixed), G - 1)
                k[:, 1:1 + m] = fixed[:m]
            else:
                qmax = 2 ** bits - 1
                k = rng.integers(0, qmax, size=(ng, G)) + 0.5                # (x - 0) / s = k + 0.5
                k[:, 0] = 0.0                                               # mn = 0
                k[:, 1] = qmax                                              # mx = qmax * s
            return (k * s).astype(np.float32)
        return fill(ties)
    if kind == "const":
        def const(ng):
            c = (3 * rng.standard_normal((ng, 1))).astype(np.float32)
            c[0::4] = 0.0
            c[1::4] = -0.0
            out = np.repeat(c, G, axis=1)
            out[3::4] = 3 * rng.standard_normal((out[3::4].shape))       # some groups vary
            return out.astype(np.float32)
        return fill(const)
    if kind == "huge16":
        top = 3e4 if symmetric else 6e4
        return rng.uniform(-top, top, size=shape).astype(np.float32)
    if kind == "huge32":
        return (1e30 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "tiny16":
        return (1e-6 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "tiny32":
        return (1e-30 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "denorm32":
        return (1e-39 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "negzero":
        def negzero(ng):
            out = np.abs(rng.standard_normal((ng, G))).astype(np.float32)   # positive values
            out[:, 0] = -0.0                                                # min is -0.0 (-> +0.0)
            out[:, 1::3] = -0.0
            out[:, 2::5] = 0.0
            out[0::3] = -0.0                                                # groups of all -0.0
            neg = out[2::3]
            neg[:, 3::2] *= -1.0                                            # mixed signs, zeros inside
            neg[:, 1] = 2.0                                                 # max stays positive
            return out
        return fill(negzero)
    raise ValueError(kind)


def to_torch(v: np.ndarray, dtype: torch.dtype, device: str):
    """(torch tensor in dtype on device, the NumPy array the reference takes for the same values)."""
    t = torch.from_numpy(np.ascontiguousarray(v)).to(dtype)
    if dtype == torch.float16:
        ref = t.numpy()
    else:
        ref = t.float().numpy()
    return t.to(device), ref


def make_input(kind, shape, axis, G, bits, symmetric, dtype, device, seed=0):
    return to_torch(values(kind, shape, axis, G, bits, symmetric, seed), input_dtype_for(kind, dtype), device)


def random_codes(shape, bits: int, device: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    c = rng.integers(0, 2 ** bits, size=shape).astype(np.uint8)
    return torch.from_numpy(c).to(device), c


# ----------------------------------------------------------------------------------------------------
# bit-exact comparison


def as_bits(a) -> np.ndarray:
    """Any tensor / array as unsigned integers of its width (bf16 tensors as their float32 bits)."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        a = a.float().numpy() if a.dtype == torch.bfloat16 else a.numpy()
    a = np.ascontiguousarray(a)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return a.view(width)


def assert_bits_equal(fast, ref, what: str) -> None:
    """fast (torch) and ref (NumPy) hold the same values bit for bit; reports the first difference."""
    if isinstance(fast, torch.Tensor):
        assert tuple(fast.shape) == tuple(np.shape(ref)), f"{what}: shape {tuple(fast.shape)} != {np.shape(ref)}"
    fb, rb = as_bits(fast), as_bits(ref)
    assert fb.dtype == rb.dtype, f"{what}: width {fb.dtype} != {rb.dtype}"
    bad = np.argwhere(fb != rb)
    if len(bad):
        i = tuple(bad[0])
        fv = fast.detach().cpu().float().numpy()[i] if isinstance(fast, torch.Tensor) else fast[i]
        raise AssertionError(f"{what}: {len(bad)} of {fb.size} differ; first at {i}: fast {fv!r} "
                             f"(bits {fb[i]:#x}) vs reference {np.asarray(ref)[i]!r} (bits {rb[i]:#x})")


def assert_same_error(fn_ref, fn_fast) -> None:
    """Both calls raise, the fast tier the reference's exception: the same type and the same message."""
    with pytest.raises(Exception) as er:
        fn_ref()
    with pytest.raises(Exception) as ef:
        fn_fast()
    assert type(ef.value) is type(er.value) and str(ef.value) == str(er.value), (ef.value, er.value)
