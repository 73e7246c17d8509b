"""kvq.fast.cupy: the raw-CUDA backend (CUDA C++ sources beside the modules, compiled by CuPy / NVRTC).

Same module and function names as ``kvq.reference`` (``quant``, ``packing``, ``attention``, the caches
``kivi`` / ``kitty`` / ``oscar`` / ``aqua_cache``, ...), on torch CUDA tensors, launched on torch's current stream; quantization and packing agree with the reference
bit for bit. Importing this package (or its modules) does not import CuPy: kernels are compiled on
first use (``_loader``) and cached on disk by CuPy.

    from kvq.fast.cupy.packing import quantize_pack
    packed, scale, mn = quantize_pack(k, bits=2, group_size=128, axis=2)      # per-channel keys
    out, lse = kvq.fast.decode_attention(q, [(k, v)], backend="cupy")
"""

__all__ = ["quant", "packing", "attention", "paged", "kivi", "kitty", "rotate", "oscar_quant", "oscar_append",
           "oscar", "oscar_decode", "hadamard", "higgs", "aqua", "aqua_cache"]
