"""kvq.reference: every algorithm in readable NumPy, written to be read beside its paper.

Never imports torch, triton, cupy or kvq.fast (a test enforces it).

    from kvq.reference import quant, packing
    codes, scale, mn = quant.quantize(x, bits=2, group_size=128, axis=-1)
    packed = packing.pack(codes, bits=2, axis=-1)
"""

from . import (aqua, aqua_cache, aqua_probes, attention, hadamard, higgs, kitty, kivi, memory,  # noqa: F401
               metrics, model, numerics, oscar, packing, paged, quant, rotations)
