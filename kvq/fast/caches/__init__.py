"""The fast tier's shared cache logic: one layer beneath both backends.

kvq has four columns. ``kvq.reference`` states each method in NumPy beside its paper; this package holds the
fast tier's shared logic on torch tensors (states, append routing, flush and eviction, checks, codecs,
predictors), written once; ``kvq.fast.triton`` and ``kvq.fast.cupy`` bind it to their kernels (Triton JIT
kernels and raw CUDA sources). A backend's method module (``kvq.fast.<backend>.kivi``, ...) is a thin
binding: the reference's signature and docstring, this layer's logic, the backend's kernels passed in as
an ``Ops`` table (``codecs.Ops``, ``oscar.OscarOps``, ...).

Modules (each names the reference module and paper section it follows):

* ``paged``: the paged state of KIVI and Kitty (sink, FP16 window, packed pages), append and dequantize.
* ``codecs``: how a key page is quantized and packed (``KIVICodec``, ``KittyCodec``), and the ``Ops`` table.
* ``sensitivity``: Kitty's channel sensitivity and boost choice.
* ``oscar``: OSCAR's rotated state (calibrated rotations, clipping, append, decode routing).
* ``bitdecoding`` / ``bitdecoding_cache``: BitDecoding's page layout and its cache.
* ``higgs``: HIGGS vector quantization (AQUA-KV's codec).
* ``aqua`` / ``aqua_cache``: AQUA-KV's predictors and its cache.

Shared checks and device helpers of every fast module are in ``kvq.fast.common``.
"""
