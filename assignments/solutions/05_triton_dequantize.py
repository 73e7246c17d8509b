"""Reference solution of assignment 5: unpack 2- / 4-bit codes and dequantize them in one Triton kernel.

Written from the numerics contract (kvq/reference/numerics.py: dequantization and packing), independently of
``kvq.fast.triton.packing`` and ``kvq.reference.packing`` (which the autograder uses to check it).
One program handles BLOCK consecutive output elements of the flattened (rows, n) output.
"""

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def dequantize_kernel(packed_ptr, scale_ptr, mn_ptr, out_ptr, N, NG, TOTAL, G,
                      BITS: tl.constexpr, PER: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)      # flat output index
    mask = e < TOTAL
    row = e // N
    j = e % N                                                           # element index within the row
    byte = tl.load(packed_ptr + row * (N // PER) + j // PER, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((j % PER) * BITS)) & ((1 << BITS) - 1)            # the i-th code in bits [b*i, b*i+b)
    g = row * NG + j // G
    s = tl.load(scale_ptr + g, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(mn_ptr + g, mask=mask, other=0.0).to(tl.float32)
    x = code.to(tl.float32) * s                                         # one rounded multiply ...
    x = x + m                                                           # ... then one rounded add
    x = tl.where(x > 65504.0, 65504.0, tl.where(x < -65504.0, -65504.0, x))   # fp16 saturates (NaN passes)
    tl.store(out_ptr + e, x.to(tl.float16), mask=mask)                  # round to nearest even


def dequantize(packed, scale, mn, bits, group_size):
    """Unpack ``packed`` (rows, n // (8 // bits)) uint8 along the last axis and dequantize in groups of
    ``group_size``: ``fp16(float32(code) * scale + mn)``, scale / mn (rows, n // group_size) fp16.
    Returns a (rows, n) float16 tensor on packed's device."""
    if bits not in (2, 4):
        raise ValueError(f"bits={bits!r} is not supported; choose 2 or 4")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    per = 8 // bits
    rows, nb = packed.shape
    n = nb * per
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or n % group_size:
        raise ValueError(f"group_size={group_size!r} does not divide the row length n={n}")
    ng = n // group_size
    for name, t in (("scale", scale), ("mn", mn)):
        if tuple(t.shape) != (rows, ng):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {(rows, ng)}")
    packed, scale, mn = packed.contiguous(), scale.contiguous(), mn.contiguous()
    out = torch.empty((rows, n), dtype=torch.float16, device=packed.device)
    total = rows * n
    if total:
        dequantize_kernel[(triton.cdiv(total, BLOCK),)](packed, scale, mn, out, n, ng, total, group_size,
                                                        BITS=bits, PER=per, BLOCK=BLOCK,
                                                        enable_fp_fusion=False)
    return out
