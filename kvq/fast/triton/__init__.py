"""kvq.fast.triton: the Triton backend, one module per reference module, same function names and signatures.

    from kvq.fast.triton import quant, packing, attention
    codes, scale, mn = quant.quantize(x, bits=2, group_size=128, axis=-1)       # x: torch CUDA tensor
    out, lse = attention.decode_attention(q, [(k, v)])
    from kvq.fast.triton import kivi                  # paged KIVI / Kitty caches (shared layout: paged.py)
    cfg = kivi.CONFIGS["KIVI-K2V2"]; st = kivi.init(cfg, 8, 8, 128); kivi.append(cfg, st, k, v)

Each function's docstring opens with "Mirrors `kvq.reference.M.f`" and names any difference. Kernels
that store bits the reference defines (codes, packed bytes, scale / min, dequantized values) follow
the numerics contract (DESIGN.md section 2) and are launched with ``enable_fp_fusion=False``; the
attention kernels are order-dependent reductions (contract rule 7) and are checked with a tolerance.

Importing this package imports no submodule (and so not Triton); ``kvq.fast.backend_module`` loads
the module it needs.
"""
