"""The registry of the battery: every spec, by label ("module.function")."""

from __future__ import annotations

import functools

from .specs_aqua import all_aqua_specs
from .specs_arrays import ARRAY_SPECS
from .specs_caches import all_cache_specs


@functools.lru_cache(maxsize=None)
def all_specs() -> tuple:
    specs = tuple(ARRAY_SPECS) + tuple(all_cache_specs()) + tuple(all_aqua_specs())
    labels = [s.label for s in specs]
    dup = {x for x in labels if labels.count(x) > 1}
    assert not dup, dup
    return specs


def by_label() -> dict:
    return {s.label: s for s in all_specs()}
