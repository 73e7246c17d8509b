"""Draws for the bad-input battery: shapes, dtypes, values and configurations.

One small interface, :class:`Draw`, is used by every case builder in ``specs.py``: ``d.int(lo, hi)``,
``d.choice(seq)``, ``d.seed()``. The reference tier draws through hypothesis (:class:`HypothesisDraw`,
inside ``@given(st.data())``); the Triton tier, which runs in a child process under the interpreter, draws
from a seeded NumPy generator (:class:`SeededDraw`) so that the child rebuilds exactly the case the parent
names. Values come from :func:`values`, a few deliberately different distributions (normal, wide
magnitudes, constant groups, ties on a grid) built from a seed, so that a builder's ``make()`` can rebuild
identical inputs for a twin run.

    @given(data=st.data())
    def run(data):
        d = HypothesisDraw(data)
        shape = (d.int(1, 2), d.choice((1, 2)), d.int(1, 9), d.choice((16, 32)))
        x = values(d.seed(), shape, np.float16, d.choice(STYLES))
"""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

#: value distributions a builder may draw
STYLES = ("normal", "wide", "const", "ties", "small")

#: settings of every hypothesis loop of the battery: deterministic, no shrinking (failures are collected
#: per example, not raised), no example database (the battery never writes into the repository)
BATTERY_SETTINGS = settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
)


class Draw:
    """What a case builder may ask for."""

    def int(self, lo: int, hi: int) -> int:  # inclusive bounds
        raise NotImplementedError

    def choice(self, seq):
        raise NotImplementedError

    def seed(self) -> int:
        return self.int(0, 2**31 - 1)

    def fork(self) -> "Draw":
        """A draw that replays this one's answers from the start (every mutation of an argument breaks
        the same valid call)."""
        return self


class HypothesisDraw(Draw):
    """Draws through a hypothesis ``st.data()`` object; :meth:`fork` replays the recorded answers, so that
    every mutation of one example breaks the same valid call (hypothesis draws only the first time)."""

    def __init__(self, data, tape=None):
        self.data = data
        self.tape = [] if tape is None else tape
        self.pos = 0
        self.replay = tape is not None

    def _next(self, strategy_fn):
        if self.pos < len(self.tape):
            v = self.tape[self.pos]
        else:
            v = self.data.draw(strategy_fn())
            self.tape.append(v)
        self.pos += 1
        return v

    def int(self, lo: int, hi: int) -> int:
        return self._next(lambda: st.integers(lo, hi))

    def choice(self, seq):
        seq = list(seq)
        return seq[self._next(lambda: st.integers(0, len(seq) - 1))]

    def fork(self) -> "HypothesisDraw":
        return HypothesisDraw(self.data, self.tape)


class SeededDraw(Draw):
    """Draws from a NumPy generator seeded by a string (a case id): the same id, the same case."""

    def __init__(self, key: str):
        self.key = key
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
        self.rng = np.random.default_rng(seed)

    def int(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def choice(self, seq):
        seq = list(seq)
        return seq[int(self.rng.integers(0, len(seq)))]

    def fork(self) -> "SeededDraw":
        return SeededDraw(self.key)


def values(seed: int, shape, dtype=np.float16, style: str = "normal") -> np.ndarray:
    """Finite values of ``shape`` in ``dtype`` (float16 / float32), reproducible from ``seed``.

    normal: N(0, 1); wide: N(0, 1) times powers of ten from 1e-3 to 1e3 per element; const: every element
    equal; ties: multiples of 0.5 in [-4, 4] (exact .5 ties after scaling); small: N(0, 1e-3).
    """
    rng = np.random.default_rng(seed)
    shape = tuple(int(s) for s in shape)
    if style == "normal":
        x = rng.standard_normal(shape)
    elif style == "wide":
        x = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, size=shape)
    elif style == "const":
        x = np.full(shape, float(rng.standard_normal()))
    elif style == "ties":
        x = rng.integers(-8, 9, size=shape) * 0.5
    elif style == "small":
        x = rng.standard_normal(shape) * 1e-3
    else:
        raise ValueError(style)
    return np.asarray(x, dtype=np.float64).astype(dtype)


def orthogonal(seed: int, D: int, lead=()) -> np.ndarray:
    """A random orthogonal float32 matrix (D, D) (or ``lead + (D, D)``), by QR of a Gaussian matrix."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(int(np.prod(lead, dtype=np.int64)) if lead else 1):
        q, r = np.linalg.qr(rng.standard_normal((D, D)))
        out.append(q * np.sign(np.diag(r)))
    m = np.stack(out).astype(np.float32)
    return m.reshape(tuple(lead) + (D, D)) if lead else m[0]


def draw_kv_shape(d: Draw, head_dims=(16, 32), t_max: int = 9):
    """(B, H_kv, T, D) of a small cache append."""
    return d.int(1, 2), d.choice((1, 2)), d.int(1, t_max), d.choice(head_dims)
