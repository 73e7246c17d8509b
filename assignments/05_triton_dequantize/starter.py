"""Assignment 5: a Triton kernel that unpacks 2- / 4-bit codes and dequantizes them (see README.md).

Keep the names and the signatures: the autograder launches ``dequantize`` and checks that it runs
``dequantize_kernel`` (a ``@triton.jit`` function) with ``enable_fp_fusion=False``. Without a GPU, run
with ``TRITON_INTERPRET=1`` set before triton is imported (the autograder does) on CPU tensors.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def dequantize_kernel(packed_ptr, scale_ptr, mn_ptr, out_ptr, N, NG, TOTAL, G,
                      BITS: tl.constexpr, PER: tl.constexpr, BLOCK: tl.constexpr):
    """One program per BLOCK output elements of the flattened (rows, N) output.

    packed_ptr: uint8 (rows, N // PER), code i of a byte in bits [BITS*i, BITS*i + BITS);
    scale_ptr, mn_ptr: fp16 (rows, NG), NG = N // G groups of G consecutive elements per row;
    out_ptr: fp16 (rows, N); TOTAL = rows * N; PER = 8 // BITS codes per byte.
    Each element: ``fp16(float32(code) * scale + mn)``, the multiply and the add rounded separately.
    """
    pass    # TODO: write the kernel body (the wrapper below raises until you do)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int,
               group_size: int) -> torch.Tensor:
    """Unpack and dequantize ``packed`` along its last axis.

    packed: torch uint8 (rows, n // (8 // bits)); scale, mn: torch float16 (rows, n // group_size).
    bits: 2 or 4 (anything else: ValueError); group_size must divide n (else ValueError).
    Returns a torch float16 (rows, n) tensor, bit-identical to
    ``kvq.reference.packing.unpack_dequantize(packed, scale, mn, bits, group_size, axis=-1)``.
    Launch ``dequantize_kernel`` with ``enable_fp_fusion=False`` (numerics contract rule 5).
    """
    raise NotImplementedError
