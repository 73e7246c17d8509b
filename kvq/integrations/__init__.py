"""kvq.integrations: kvq's cache methods behind one registry, and as Hugging Face transformers caches.

Two modules, imported on demand (importing this package imports neither torch nor transformers):

``kvq.integrations.methods``
    ``METHODS`` (the method names of the papers: "FP16", "KIVI-K2V2", "Kitty", "OSCAR", "AQUA-KV",
    "BitDecoding-2", ...), ``configure`` (a method's config adapted to a model's head_dim and capacity),
    ``bits_per_element`` (the memory accounting) and ``KVStore`` (every layer of one batch's compressed
    cache, on the reference, Triton or CuPy backend).

``kvq.integrations.transformers``
    ``KVQCache`` and its per-family factories (``KIVICache``, ``KittyCache``, ``OSCARCache``,
    ``AquaKVCache``, ``BitDecodingCache``, ``FP16Cache``, ``make_cache``): ``transformers`` Cache
    objects to pass as ``cache=`` (older transformers: ``past_key_values=``) to ``model(...)`` and
    ``model.generate(...)``.

    from kvq.integrations.transformers import make_cache
    cache = make_cache("KIVI-K2V2", model)
    out = model.generate(input_ids, cache=cache, max_new_tokens=64)
"""
