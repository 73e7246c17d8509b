"""The ``arrays`` / ``copy`` of a cache state whose arrays are all plain dataclass fields (OSCAR, BitDecoding).

    @dataclass
    class MyState(FlatArrays):
        k: np.ndarray
        length: int = 0
"""

from __future__ import annotations

import dataclasses

import numpy as np


class FlatArrays:
    """Mixin for a dataclass state: every ``np.ndarray`` field by name, and a deep copy of those arrays."""

    def arrays(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)}

    def copy(self):
        return dataclasses.replace(self, **{n: a.copy() for n, a in self.arrays().items()})
