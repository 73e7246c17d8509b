"""Autograder of assignment 5 (a Triton unpack + dequantize kernel).

Runs the submission on CPU torch tensors through Triton's interpreter (``TRITON_INTERPRET=1``, set here
before triton is imported) and asserts BIT-EXACT parity with
``kvq.reference.packing.unpack_dequantize`` (numerics contract rules 3 and 6) for 2 and 4 bits, several
group sizes, odd numbers of groups and edge cases; also that ``dequantize_kernel`` is a ``@triton.jit``
function and that ``dequantize`` launches it with ``enable_fp_fusion=False``. Failures name the first
differing element with its code, scale and min.

    python assignments/05_triton_dequantize/autograde.py [--solution | --file F]

The interpreter computes with NumPy, so passing here does not prove GPU bit-exactness (no FMA
contraction can happen on the CPU); run the same checks on a GPU for that.
"""

import os
import pathlib
import sys

os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported (by the submission or here)

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))     # the repository, for kvq

import grading  # noqa: E402
from kvq.reference import packing  # noqa: E402

# (bits, group_size, number of groups per row); odd group counts, a group boundary inside a byte (2, 6, 2)
CASES = {2: [(4, 1), (8, 3), (16, 5), (32, 3), (64, 1), (12, 3), (6, 2)],
         4: [(2, 3), (8, 1), (16, 3), (32, 5), (64, 3), (6, 5)]}


def _interpreting():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise AssertionError("triton was imported before TRITON_INTERPRET=1 was set; run this autograder "
                             "as a script (or set the variable before importing triton)")


def _run(sub, packed, scale, mn, bits, G):
    """Call the submission on torch CPU tensors; return its output as a NumPy fp16 array."""
    with np.errstate(over="ignore"):                                  # the interpreter's fp16 overflow -> inf
        out = sub.dequantize(torch.from_numpy(packed), torch.from_numpy(scale), torch.from_numpy(mn), bits, G)
    assert isinstance(out, torch.Tensor), f"dequantize returned {type(out).__name__}; expected a torch.Tensor"
    assert out.dtype == torch.float16, f"dequantize returned dtype {out.dtype}; expected torch.float16"
    return out.detach().cpu().numpy()


def _check(sub, packed, scale, mn, bits, G, what):
    want = packing.unpack_dequantize(packed, scale, mn, bits, G, axis=-1, out_dtype=np.float16)
    got = _run(sub, packed, scale, mn, bits, G)
    assert got.shape == want.shape, f"{what}: output shape {got.shape}, expected {want.shape}"
    bad = got.view(np.uint16) != want.view(np.uint16)                  # bit patterns: -0.0, NaN, inf included
    if np.any(bad):
        r, j = (int(i) for i in np.argwhere(bad)[0])
        per = 8 // bits
        code = (int(packed[r, j // per]) >> (bits * (j % per))) & ((1 << bits) - 1)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} values differ; first at [{r}, {j}] (group {j // G}, "
            f"code {code}, scale {float(scale[r, j // G])!r}, mn {float(mn[r, j // G])!r}): got "
            f"{float(got[r, j])!r} (0x{int(got.view(np.uint16)[r, j]):04x}), expected {float(want[r, j])!r} "
            f"(0x{int(want.view(np.uint16)[r, j]):04x})")


def _parity(sub, bits, seed):
    _interpreting()
    rng = np.random.default_rng(seed)
    for G, ng in CASES[bits]:
        n, rows = G * ng, 3
        x = (rng.standard_normal((rows, n)) * rng.uniform(0.1, 20.0, (rows, 1)) + rng.uniform(-5, 5, (rows, 1)))
        packed, scale, mn = packing.quantize_pack(x.astype(np.float16), bits, G, axis=-1)   # a real cache
        _check(sub, packed, scale, mn, bits, G, f"{bits}-bit, group_size={G}, {ng} group(s), quantized data")
        packed = rng.integers(0, 256, (rows, n // (8 // bits)), dtype=np.uint8)               # any bytes
        scale = rng.uniform(0.0, 3.0, (rows, ng)).astype(np.float16)
        mn = rng.uniform(-40.0, 40.0, (rows, ng)).astype(np.float16)
        _check(sub, packed, scale, mn, bits, G, f"{bits}-bit, group_size={G}, {ng} group(s), random bytes")


def part_parity_2bit(sub):
    _parity(sub, 2, 50)


def part_parity_4bit(sub):
    _parity(sub, 4, 51)


def part_edges(sub):
    """Zero scale (-> exactly mn), ties in the fp16 rounding, fp16 overflow to inf, -0.0 min, one row."""
    _interpreting()
    for bits in (2, 4):
        per, qmax = 8 // bits, (1 << bits) - 1
        G, ng = 2 * per, 3
        n = G * ng
        codes = np.tile(np.arange(n) % (qmax + 1), (4, 1)).astype(np.uint8)
        packed = packing.pack(codes, bits, axis=-1)
        scale = np.array([[0.0, 2.0 ** -11, 1000.0],            # zero scale; 1 + k*2^-11 hits fp16 ties
                          [2.0 ** -24, 0.5, 0.0],               # subnormal scale
                          [3.0, 0.0, 2.0 ** -11],
                          [65504.0, 1.0, 0.25]], dtype=np.float16)
        mn = np.array([[7.0, 1.0, 65504.0],                     # 65504 + 1000*k overflows fp16 -> inf
                       [-0.0, -1.5, -0.0],                      # -0.0 min: +0.0 * s + -0.0 = +0.0
                       [-65504.0, 2048.0, 1.0],
                       [0.0, -3.0, -0.25]], dtype=np.float16)
        _check(sub, packed, scale, mn, bits, G, f"{bits}-bit edge cases (zero scale, ties, overflow, -0.0)")
        _check(sub, packed[1:2], scale[1:2], mn[1:2], bits, G, f"{bits}-bit, a single row")
        _check(sub, packed, scale[:, :1].copy(), mn[:, :1].copy(), bits, n, f"{bits}-bit, one group per row (group_size = n)")


def part_bad_input(sub):
    packed = torch.zeros((2, 4), dtype=torch.uint8)
    meta = torch.zeros((2, 2), dtype=torch.float16)
    for bits, G, what in ((3, 4, "bits=3"), (8, 4, "bits=8"), (2, 5, "group_size=5 (does not divide n=16)"),
                          (4, 3, "group_size=3 (does not divide n=8)")):
        try:
            sub.dequantize(packed, meta, meta, bits, G)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"dequantize with {what} raised {type(e).__name__}: {e}; expected ValueError") from None
        raise AssertionError(f"dequantize with {what} returned; expected ValueError")


def _is_jit(fn):
    from triton.runtime import JITFunction, KernelInterface
    try:
        from triton.runtime.interpreter import InterpretedFunction      # what @triton.jit gives under the interpreter
    except ImportError:                                                 # pragma: no cover (other Triton versions)
        InterpretedFunction = JITFunction
    for _ in range(5):                                                  # unwrap @triton.autotune / heuristics
        if isinstance(fn, (JITFunction, InterpretedFunction)):
            return True
        if not (isinstance(fn, KernelInterface) and hasattr(fn, "fn")):
            return False
        fn = fn.fn
    return False


class _Spy:
    """Stands in for ``sub.dequantize_kernel``: records the keyword arguments of every launch."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append(kwargs)
            return launch(*args, **kwargs)
        return run

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def part_is_triton(sub):
    _interpreting()
    kernel = getattr(sub, "dequantize_kernel", None)
    assert kernel is not None, "the submission defines no dequantize_kernel"
    assert _is_jit(kernel), (f"dequantize_kernel is a {type(kernel).__name__}, not a @triton.jit function "
                             f"(a NumPy or torch reimplementation does not count)")
    spy = _Spy(kernel)
    sub.dequantize_kernel = spy
    try:
        rng = np.random.default_rng(52)
        packed = rng.integers(0, 256, (2, 8), dtype=np.uint8)
        scale = rng.uniform(0, 2, (2, 2)).astype(np.float16)
        mn = rng.uniform(-2, 2, (2, 2)).astype(np.float16)
        _check(sub, packed, scale, mn, 4, 8, "4-bit, group_size=8 (launch check)")
    finally:
        sub.dequantize_kernel = kernel
    assert spy.launches, "dequantize never launched dequantize_kernel[grid](...); the values must come from the kernel"
    for kw in spy.launches:
        assert kw.get("enable_fp_fusion") is False, (
            f"dequantize_kernel was launched with enable_fp_fusion={kw.get('enable_fp_fusion', '<not given>')!r}; "
            f"pass enable_fp_fusion=False (numerics contract rule 5: no FMA contraction on the GPU)")


PARTS = [
    ("2-bit parity, several group sizes, odd group counts", 3, part_parity_2bit),
    ("4-bit parity, several group sizes, odd group counts", 3, part_parity_4bit),
    ("edge cases: zero scale, fp16 ties, overflow, -0.0", 2, part_edges),
    ("bad bits / group size raise ValueError", 1, part_bad_input),
    ("a @triton.jit kernel launched with enable_fp_fusion=False", 1, part_is_triton),
]

if __name__ == "__main__":
    raise SystemExit(grading.main(PARTS, pathlib.Path(__file__).parent))
