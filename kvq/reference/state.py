"""What every cache state shares: ``arrays`` / ``copy``, the configuration it was made with, and the
checks that run before a call may touch it (shared by the reference and both fast tiers).

A state is a dataclass of arrays plus host counters, and it records the configuration its ``init``
made it with (``cfg``: not an array, so ``arrays()`` and the parity comparisons leave it out). Every
``append`` / ``dequantize`` / ``decode_attention`` calls :func:`check_state` first: the state must be
this method's (this tier's class, made with this method's configuration class) and the ``cfg`` given
must equal the state's, so that buffers sized for one configuration are never read or written at the
offsets of another. A state built field by field (no ``cfg``: another tier's arrays wrapped) is
checked array by array against the layout ``init(cfg)`` gives instead. The ``check_*`` helpers validate
configuration fields in ``__post_init__`` (a bool is not an int; sizes are ints in range; names are
strings).

    @dataclass
    class MyState(FlatArrays):
        k: np.ndarray
        length: int = 0
        cfg: object = cfg_field()                   # set by init
    check_state(st, cfg, MyConfig, MyState)         # first thing append / dequantize / decode do
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np


def cfg_field():
    """The ``cfg`` field of a state dataclass: the configuration ``init`` made it with (None: not
    recorded); not an array, left out of ``repr`` and of state equality."""
    return dataclasses.field(default=None, repr=False, compare=False)


#: the family name of a configuration class, where it is not the class name without "Config"
_FAMILY = {"AquaConfig": "AQUA-KV"}

#: configuration class -> the ``init`` of its method's module (:func:`register_layout`)
_LAYOUTS: dict = {}


def register_layout(cfg_type: type, init) -> None:
    """Name ``init`` (``init(cfg, *state.shape)``) as the layout of ``cfg_type``'s states, for
    :func:`check_layout`. Each method's module registers its own, beside its ``init``, so that this module
    imports no method (the methods import it)."""
    _LAYOUTS[cfg_type] = init


class FlatArrays:
    """Mixin for a dataclass state: every ``np.ndarray`` field by name, and a deep copy of those arrays."""

    def arrays(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)}

    def copy(self):
        return dataclasses.replace(self, **{n: a.copy() for n, a in self.arrays().items()})


# ---------------------------------------------------------------------------------------------------
# a state against the configuration a call names


def family(cfg_type: type) -> str:
    """The method a configuration class configures: "KIVI", "Kitty", "OSCAR", "BitDecoding", "AQUA-KV"."""
    name = cfg_type.__name__
    return _FAMILY.get(name, name[:-len("Config")] if name.endswith("Config") else name)


def _qualname(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def same_config(a, b) -> bool:
    """Field-by-field equality of two configurations (frozen dataclasses, nested ones included);
    array-valued fields (a HIGGS grid) compare by dtype, shape and values."""
    if a is b:
        return True
    if dataclasses.is_dataclass(a) or dataclasses.is_dataclass(b):
        return type(a) is type(b) and all(same_config(getattr(a, f.name), getattr(b, f.name))
                                           for f in dataclasses.fields(a))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:                                   # incomparable values are different values
        return False


def config_diff(cfg, own) -> list[str]:
    """``field=value (state: value)`` for every field where ``cfg`` differs from ``own`` (same class)."""
    return [f"{f.name}={getattr(cfg, f.name)!r} (state: {getattr(own, f.name)!r})"
            for f in dataclasses.fields(cfg) if not same_config(getattr(cfg, f.name), getattr(own, f.name))]


def check_config(cfg, cfg_type: type) -> None:
    """``cfg`` must be a ``cfg_type`` (TypeError naming both): the first check of an ``init``."""
    if not isinstance(cfg, cfg_type):
        raise TypeError(f"cfg must be a {cfg_type.__name__} ({family(cfg_type)}), got {type(cfg).__name__}")


def check_state(state, cfg, cfg_type: type, state_type: type) -> None:
    """Raise unless ``cfg`` is a ``cfg_type``, ``state`` a ``state_type`` made by ``init`` with a
    ``cfg_type``, and ``cfg`` equal to the configuration the state was made with (``state.cfg``).

    TypeError: another method's configuration, another class of state (another tier's, or another
    method's), a state made with another method's configuration (a Kitty cache given to KIVI).
    ValueError: another configuration of the same method (the fields that differ are named), or a
    state that does not record its configuration and whose arrays do not fit ``cfg``
    (:func:`check_layout`), or a token counter ``state.length`` outside [0, max_tokens]. Writes nothing.
    """
    check_config(cfg, cfg_type)
    if not isinstance(state, state_type):
        raise TypeError(f"state must be a {_qualname(state_type)} (a {family(cfg_type)} cache made by this tier's "
                        f"init), got {_qualname(type(state))}")
    own = getattr(state, "cfg", None)
    if own is None:                                     # built field by field: its arrays against cfg
        check_layout(state, cfg)
    elif own is not cfg:                                # (the common case: the state's own object)
        if not isinstance(own, cfg_type):
            raise TypeError(f"state is a {family(type(own))} cache (made with a {type(own).__name__}); this "
                            f"function takes a {family(cfg_type)} cache")
        diff = config_diff(cfg, own)
        if diff:
            raise ValueError(f"cfg differs from the configuration the state was made with: {'; '.join(diff)}. A "
                             f"cache keeps the configuration of its init: pass state.cfg")
    n = getattr(state, "length", None)
    bad_type = type(n) is not int and (isinstance(n, bool) or not isinstance(n, (int, np.integer)))
    if bad_type or not 0 <= n <= cfg.max_tokens:
        raise ValueError(f"state.length={n!r} must be an int in [0, max_tokens={cfg.max_tokens}] (the counter "
                         f"was changed by hand?)")


def _dtype(a) -> str:
    return str(a.dtype).replace("torch.", "")


def check_layout(state, cfg) -> None:
    """A state that does not record its configuration (built field by field, e.g. around another tier's
    arrays): every array must have the name, shape and dtype that the reference ``init(cfg, *state.shape)``
    gives it (the fast tiers' states hold the same fields), else ValueError. Allocates that layout
    (zeros) once per call: the path of hand-built states only. The layout is the ``init`` that ``cfg``'s
    method registered (:func:`register_layout`)."""
    init = next((_LAYOUTS[t] for t in type(cfg).__mro__ if t in _LAYOUTS), None)     # a subclass: its method's
    if init is None:
        raise TypeError(f"no state layout is registered for {type(cfg).__name__} (register_layout)")
    shape = tuple(getattr(state, "shape", ()))
    try:
        want = {n: (tuple(a.shape), _dtype(a)) for n, a in init(cfg, *shape).arrays().items()}
    except (TypeError, ValueError) as err:
        raise ValueError(f"state does not record its configuration (state.cfg is None), and cfg does not fit its "
                         f"shape {shape}: {err}") from None
    have = {n: (tuple(a.shape), _dtype(a)) for n, a in state.arrays().items()}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            raise ValueError(f"state does not record its configuration (state.cfg is None), and its arrays do not "
                             f"fit cfg: {name} is {have.get(name)} (shape, dtype), cfg needs {want.get(name)}; "
                             f"make the cache with init")


def check_dims(**dims) -> None:
    """Every keyword must be a positive int (a bool is not): an ``init``'s batch, kv_heads, head_dim, ..."""
    for name, v in dims.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


# ---------------------------------------------------------------------------------------------------
# configuration fields (``__post_init__``)


def check_int(owner, name: str, lo: int = 0, *, optional: bool = False) -> None:
    """Field ``name`` of ``owner`` is an int >= lo (a bool is not an int), or None when ``optional``."""
    v = getattr(owner, name)
    if optional and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be {'None or ' if optional else ''}an int >= {lo}, got {v!r}")


def check_real(owner, name: str, lo: float, hi: float = math.inf, *, lo_open: bool = False,
               optional: bool = False) -> None:
    """Field ``name`` is a finite real number (not a bool, not a string) in [lo, hi] ((lo, hi] when
    ``lo_open``), or None when ``optional``."""
    v = getattr(owner, name)
    if optional and v is None:
        return
    ok = (not isinstance(v, (bool, np.bool_)) and isinstance(v, numbers.Real) and math.isfinite(float(v))
          and (float(v) > lo if lo_open else float(v) >= lo) and float(v) <= hi)
    if not ok:
        lo_s = "(" if lo_open else "["
        raise ValueError(f"{name}={v!r} must be {'None or ' if optional else ''}a finite real number in "
                         f"{lo_s}{lo}, {hi}]")


def check_bool(owner, name: str) -> None:
    """Field ``name`` is a bool (True / False; NumPy's bool too)."""
    v = getattr(owner, name)
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {v!r}")


def check_str(owner, name: str) -> None:
    """Field ``name`` is a string (a configuration's display name)."""
    v = getattr(owner, name)
    if not isinstance(v, str):
        raise ValueError(f"{name} must be a str, got {v!r}")


def check_host_device(device) -> None:
    """The reference ``init``'s ``device`` (the twin of the fast tiers' argument): NumPy arrays live on the
    host, so None or "cpu"."""
    if device is not None and str(device) != "cpu":
        raise ValueError(f"device={device!r}: the reference tier keeps its NumPy arrays on the host (None or "
                         f"'cpu'); kvq.fast places caches on a GPU")
