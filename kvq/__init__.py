"""kvq: low-bit KV-cache quantization with a readable NumPy reference and bit-exact GPU kernels.

    import kvq.reference as ref
    codes, scale, mn = ref.quant.quantize(k, bits=2, group_size=128, axis=2)
    from kvq.fast import quantize            # the same function on torch CUDA tensors
"""

__version__ = "0.1.0"
