"""Specs and mutations: how the battery turns one valid call into many bad ones.

A :class:`Spec` names a public function (``"quant.quantize"``, looked up in ``kvq.reference`` or in
``kvq.fast.triton`` by the :class:`Tier`), a builder ``base(d, tier) -> make`` (``make()`` returns the
keyword arguments of a valid call, fresh objects every time, so that a twin call sees identical input),
and its arguments with a *kind* each. A kind maps to a list of :class:`Mut` (mutations): NaN, inf, wrong
dtype, wrong device, wrong number of dimensions, ``True`` where an int is expected, negative sizes,
unsupported bits, another method's config or state, ... Each mutation says what must happen: ``ERROR``
(a clear error naming the argument) or ``OK_OR_ERROR`` (a clear error, or the result of the call on the
canonical form of the input, e.g. a float64 array equal in value to the float32 one).

:func:`run_case` builds the call, applies one mutation, and hands it to ``Recorder.call`` with the states
to snapshot (the spec's ``states`` arguments): a rejected call must leave them bit-identical; an accepted
one must leave them as the canonical twin call does.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ._core import ERROR, OK_OR_ERROR, all_finite, any_nonfinite, results_close, snapshot, snapshot_diff, to_numpy


class Skip(Exception):
    """A mutation that does not apply to this value (e.g. NaN in an integer array)."""


# ---------------------------------------------------------------------------------------------------
# tiers


class Tier:
    """Where a spec's function lives and what arrays it takes: NumPy (reference) or torch CPU tensors
    (Triton under the interpreter)."""

    def __init__(self, name: str):
        self.name = name
        self.ref = name == "reference"

    def __repr__(self):
        return f"Tier({self.name!r})"

    def mod(self, m: str):
        return importlib.import_module(("kvq.reference." if self.ref else "kvq.fast.triton.") + m)

    def fn(self, label: str):
        m, _, f = label.rpartition(".")
        obj = self.mod(m)
        return getattr(obj, f)

    def arr(self, a):
        """A NumPy array as this tier's array (a CPU tensor for Triton); other values unchanged."""
        if self.ref or not isinstance(a, np.ndarray):
            return a
        import torch

        return torch.from_numpy(np.ascontiguousarray(a).copy())

    def init(self, m: str, *args):
        """``<tier>.m.init(*args)``, on the CPU for Triton (``device="cpu"`` where init takes a device)."""
        f = self.mod(m).init
        if not self.ref and "device" in inspect.signature(f).parameters:
            return f(*args, device="cpu")
        return f(*args)


REFERENCE, TRITON = Tier("reference"), Tier("triton")


def is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "detach")


def np_of(x):
    n = to_numpy(x)
    if n is None:
        raise Skip("not an array")
    return np.array(n)


def like(x, a: np.ndarray):
    """NumPy ``a`` in the container of ``x`` (tensor or array)."""
    if is_tensor(x):
        import torch

        return torch.from_numpy(np.ascontiguousarray(a).copy())
    return a


# ---------------------------------------------------------------------------------------------------
# mutations


@dataclass
class Mut:
    """One way to break (or to re-express) an argument."""

    id: str
    apply: Callable  # (value, ctx) -> new value; raises Skip when it does not apply
    expect: str = ERROR
    canonical: Callable | None = None  # (base value, ctx) -> equivalent good value, for OK_OR_ERROR
    oracle: Callable | None = None  # (result, ctx) -> None | why, for OK_OR_ERROR without canonical
    also: tuple = ()  # further words an error about this mutation may name
    rtol: float = 1e-3  # tolerance of the comparison with the canonical call


@dataclass
class Ctx:
    tier: Tier
    kwargs: dict
    arg: "Arg"
    make: Callable | None = None  # rebuilds the valid call's kwargs (a twin)
    extra_method: str | None = None


def _set_first(x, value):
    a = np_of(x)
    if a.dtype.kind != "f" or a.size == 0:
        raise Skip("no float element")
    a = a.copy()
    a.flat[0] = value
    return like(x, a)


def _astype(x, dtype):
    a = np_of(x)
    if is_tensor(x):
        import torch

        t = {
            "float64": torch.float64,
            "int32": torch.int32,
            "bool": torch.bool,
            "complex64": torch.complex64,
            "bfloat16": torch.bfloat16,
            "int64": torch.int64,
            "float32": torch.float32,
            "float16": torch.float16,
            "uint8": torch.uint8,
        }[dtype]
        return x.detach().clone().to(t)
    if dtype == "bfloat16":
        raise Skip("NumPy has no bfloat16")
    with np.errstate(all="ignore"):
        return a.astype(dtype)


def _rint_f32(x, ctx):
    a = np_of(x).astype(np.float64)
    with np.errstate(all="ignore"):
        return like(x, np.trunc(a).astype(np.int32).astype(np.float32))


def _bool_f32(x, ctx):
    return like(x, np_of(x).astype(bool).astype(np.float32))


def _noncontig(x, ctx):
    a = np_of(x)
    if a.ndim == 0 or a.size < 2:
        raise Skip("too small")
    if is_tensor(x):
        import torch

        big = torch.zeros(tuple(a.shape[:-1]) + (a.shape[-1] * 2,), dtype=x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    big = np.zeros(a.shape[:-1] + (a.shape[-1] * 2,), a.dtype)
    big[..., ::2] = a
    return big[..., ::2]


def _meta_device(x, ctx):
    if not is_tensor(x):
        raise Skip("reference tier")
    return x.detach().to("meta")


def _numpy_instead(x, ctx):
    if not is_tensor(x):
        raise Skip("reference tier")
    return np_of(x)


def _torch_instead(x, ctx):
    if is_tensor(x):
        raise Skip("fast tier")
    import torch

    return torch.from_numpy(np_of(x).copy())


def _drop_dim(x, ctx):
    a = np_of(x)
    if a.ndim == 0:
        raise Skip("0-d")
    return like(x, np.ascontiguousarray(a[..., 0]) if a.ndim > 1 else a[0])


def _add_dim(x, ctx):
    return like(x, np_of(x)[None])


def _scalar(x, ctx):
    a = np_of(x)
    return like(x, np.array(a.flat[0] if a.size else 0, a.dtype))


def _strings(x, ctx):
    if is_tensor(x):
        raise Skip("torch has no string tensors")
    return np.full(np_of(x).shape, "a")


def _huge(x, ctx):
    a = np_of(x)
    if a.dtype.kind != "f" or a.size == 0:
        raise Skip("not float")
    b = a.astype(np.float32).copy()
    b.flat[0] = 1e6
    return like(x, b)


def _to_list(x, ctx):
    if is_tensor(x):
        raise Skip("fast tier")
    return np_of(x).tolist()


def _same(x, ctx):
    return x


def _nonfinite_oracle(result, ctx):
    return None if any_nonfinite(result) else "NaN / inf input gave an all-finite result (silently wrong)"


def _finite_oracle(result, ctx):
    return all_finite(result)


def data_muts(finite: str = "raise", fixed_ndim: bool = True, scalar_ok: bool = False, layout: bool = False):
    """Mutations of a float data array (keys, values, activations, matrices). ``finite``: "raise" (NaN /
    inf must be refused) or "propagate" (a result holding NaN / inf is fine); ``layout``: a reshaping
    helper that may take any dtype."""
    nf = dict(expect=ERROR) if finite == "raise" else dict(expect=OK_OR_ERROR, oracle=_nonfinite_oracle)
    anyd = dict(expect=OK_OR_ERROR, oracle=lambda r, c: None) if layout else {}
    muts = [
        Mut("nan", lambda x, c: _set_first(x, np.nan), **nf),
        Mut("inf", lambda x, c: _set_first(x, np.inf), **nf),
        Mut("f64", lambda x, c: _astype(x, "float64"), OK_OR_ERROR, canonical=_same),
        Mut("int32", lambda x, c: _astype(x, "int32"), OK_OR_ERROR, canonical=_rint_f32),
        Mut("bool", lambda x, c: _astype(x, "bool"), OK_OR_ERROR, canonical=_bool_f32),
        Mut("complex", lambda x, c: _astype(x, "complex64"), **anyd),
        Mut("strings", _strings, **anyd),
        Mut("none", lambda x, c: None),
        Mut("list", _to_list, OK_OR_ERROR, canonical=_same),
        Mut("torch_tensor", _torch_instead, OK_OR_ERROR, canonical=_same),
        Mut("numpy_array", _numpy_instead, OK_OR_ERROR, canonical=_same),
        Mut("meta_device", _meta_device),
        Mut(
            "bf16",
            lambda x, c: _astype(x, "bfloat16") if is_tensor(x) else (_ for _ in ()).throw(Skip("np")),
            OK_OR_ERROR,
            canonical=lambda x, c: like(x, np_of(_astype(x, "bfloat16")).astype(np.float32)),
            rtol=1e-2,
        ),
        Mut("noncontig", _noncontig, OK_OR_ERROR, canonical=_same),
        Mut("huge_1e6", _huge, OK_OR_ERROR, oracle=_finite_oracle, also=("scale", "min", "meta_dtype", "float16")),
    ]
    if not scalar_ok:
        muts.append(Mut("scalar", _scalar, also=("axis", "dimension", "dimensions", "scalar", "0-d", "ndim")))
    if fixed_ndim:
        muts += [Mut("ndim-1", _drop_dim), Mut("ndim+1", _add_dim)]
    return muts


def int_muts(lo: int = 1, *, none_ok: bool = False, bad=(), huge_ok: bool = False):
    """Mutations of an int argument (bits, sizes, counts). ``bad``: further unsupported values."""

    def val(v):
        return lambda x, c: v

    muts = [
        Mut("True", val(True)),
        Mut("False", lambda x, c: False if lo > 0 else (_ for _ in ()).throw(Skip("0 valid"))),
        Mut(
            "float",
            lambda x, c: (
                float(x)
                if isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                else (_ for _ in ()).throw(Skip("not int"))
            ),
        ),
        Mut("str", lambda x, c: str(x)),
        Mut("neg", val(min(-1, lo - 1))),
        Mut(
            "np_int64",
            lambda x, c: (
                np.int64(x)
                if isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                else (_ for _ in ()).throw(Skip("not int"))
            ),
            OK_OR_ERROR,
            canonical=_same,
        ),
        Mut("nan", val(float("nan"))),
    ]
    if lo > 0:
        muts.append(Mut("zero", val(0)))
    if not none_ok:
        muts.append(Mut("none", val(None)))
    if huge_ok:
        muts.append(Mut("huge", val(2**62)))
    for b in bad:
        muts.append(Mut(f"bad_{b}", val(b)))
    return muts


def axis_muts():
    return [
        Mut("out_of_range", lambda x, c: 7),
        Mut("neg_out_of_range", lambda x, c: -8),
        Mut("True", lambda x, c: True),
        Mut("float", lambda x, c: 1.0),
        Mut("none", lambda x, c: None),
        Mut("np_int64", lambda x, c: np.int64(x), OK_OR_ERROR, canonical=_same),
    ]


def ratio_muts(lo_open: bool = True, none_ok: bool = False):
    muts = [
        Mut("nan", lambda x, c: float("nan")),
        Mut("inf", lambda x, c: float("inf")),
        Mut("neg", lambda x, c: -0.5),
        Mut("above_1", lambda x, c: 1.5),
        Mut("True", lambda x, c: True),
        Mut("str", lambda x, c: "0.9"),
        Mut("np_float64", lambda x, c: np.float64(x), OK_OR_ERROR, canonical=_same),
    ]
    if lo_open:
        muts.append(Mut("zero", lambda x, c: 0.0))
    if not none_ok:
        muts.append(Mut("none", lambda x, c: None))
    return muts


def dtype_muts(allowed=("float16", "float32"), none_ok: bool = False):
    muts = [
        Mut("int8", lambda x, c: "int8"),
        Mut("bogus", lambda x, c: "bogus"),
        Mut("int", lambda x, c: 16),
        Mut("True", lambda x, c: True),
        Mut("np_int32", lambda x, c: np.int32),
    ]
    if "float64" not in allowed:
        muts.append(Mut("float64", lambda x, c: "float64"))
    if not none_ok:
        muts.append(Mut("none", lambda x, c: None))
    alias = {"float16": np.float16, "float32": np.float32}
    muts.append(
        Mut(
            "np_alias",
            lambda x, c: alias.get(str(x), None) or (_ for _ in ()).throw(Skip("no alias")),
            OK_OR_ERROR,
            canonical=_same,
        )
    )
    return muts


def scale_muts():
    """The softmax scale (None or a real number)."""
    return [
        Mut("nan", lambda x, c: float("nan")),
        Mut("inf", lambda x, c: float("inf")),
        Mut("str", lambda x, c: "0.1"),
        Mut("True", lambda x, c: True),
        Mut("complex", lambda x, c: 1j),
        Mut("array", lambda x, c: np.ones(3, np.float32)),
        Mut("np_float64", lambda x, c: np.float64(0.25), OK_OR_ERROR, canonical=lambda x, c: 0.25),
    ]


def choice_muts(none_ok: bool = False):
    muts = [Mut("bogus", lambda x, c: "bogus"), Mut("int", lambda x, c: 5), Mut("empty", lambda x, c: "")]
    if not none_ok:
        muts.append(Mut("none", lambda x, c: None))
    return muts


def codes_muts(bits_arg: str | None = "bits", fixed_ndim: bool = False):
    """uint8 codes / packed bytes."""

    def out_of_range(x, c):
        bits = c.kwargs.get(bits_arg) if bits_arg else None
        if not isinstance(bits, int) or bits >= 8:
            raise Skip("no range")
        a = np_of(x).copy()
        a.flat[0] = 2**bits
        return like(x, a)

    muts = [
        Mut("int64", lambda x, c: _astype(x, "int64"), OK_OR_ERROR, canonical=_same),
        Mut("float32", lambda x, c: _astype(x, "float32")),
        Mut("none", lambda x, c: None),
        Mut("numpy_array", _numpy_instead, OK_OR_ERROR, canonical=_same),
        Mut("meta_device", _meta_device),
        Mut("scalar", _scalar, also=("axis", "dimension", "dimensions", "scalar", "0-d", "ndim")),
    ]
    if bits_arg:
        muts.append(Mut("out_of_range", out_of_range))
    if fixed_ndim:
        muts += [Mut("ndim-1", _drop_dim), Mut("ndim+1", _add_dim)]
    return muts


def meta_muts():
    """Stored scale / minimum arrays."""

    def drop_last(x, c):
        a = np_of(x)
        if a.ndim == 0 or a.shape[-1] < 2:
            raise Skip("too small")
        return like(x, np.ascontiguousarray(a[..., :-1]))

    return [
        Mut("nan", lambda x, c: _set_first(x, np.nan), OK_OR_ERROR, oracle=_nonfinite_oracle),
        Mut("wrong_shape", drop_last),
        Mut("int32", lambda x, c: _astype(x, "int32"), OK_OR_ERROR, canonical=_rint_f32),
        Mut("none", lambda x, c: None),
        Mut("f64", lambda x, c: _astype(x, "float64"), OK_OR_ERROR, canonical=_same),
        Mut("numpy_array", _numpy_instead, OK_OR_ERROR, canonical=_same),
        Mut("meta_device", _meta_device),
    ]


def object_muts(none_ok: bool = False):
    """An argument that must be an object of a given kind (config, state, calibration)."""
    muts = [Mut("str", lambda x, c: "bogus"), Mut("int", lambda x, c: 3), Mut("dict", lambda x, c: {})]
    if not none_ok:
        muts.append(Mut("none", lambda x, c: None))
    return muts


KINDS = {
    "data": data_muts,
    "int": int_muts,
    "axis": axis_muts,
    "ratio": ratio_muts,
    "dtype": dtype_muts,
    "scale": scale_muts,
    "choice": choice_muts,
    "codes": codes_muts,
    "meta": meta_muts,
    "object": object_muts,
}


@dataclass
class Arg:
    """An argument of a spec: its kind (``KINDS``, with options) and extra spec-specific mutations.

    names: words an error about this argument may use (default: the argument's name).
    alts: further :class:`Mut` (e.g. another method's state, a head dim that does not fit).
    only: restrict the kind's mutations to these ids (the Triton tier runs a handful per function).
    """

    name: str
    kind: str | None = None
    opts: dict = field(default_factory=dict)
    names: tuple = ()
    alts: list = field(default_factory=list)

    def muts(self):
        out = list(KINDS[self.kind](**self.opts)) if self.kind else []
        return out + list(self.alts)

    def words(self):
        return self.names or (self.name,)


@dataclass
class Spec:
    """A public function and how to call it well (``base``) and badly (``args``).

    label: "module.function" (or "module.Class" for a constructor); fn: override of the lookup
        (``fn(tier) -> callable``).
    base: ``(d, tier) -> make``, ``make() -> kwargs`` of a valid call (fresh objects each time).
    states: names of arguments holding cache states (snapshotted around rejected calls).
    check: ``(result, kwargs, tier) -> None | why``, a property of every accepted result.
    truth: ``(kwargs) -> expected result`` for accepted calls (overrides the canonical twin).
    tiers: where the function exists ("reference", "triton").
    """

    label: str
    base: Callable
    args: list
    states: tuple = ()
    check: Callable | None = None
    truth: Callable | None = None
    tiers: tuple = ("reference",)
    fn: Callable | None = None
    fast_only: dict = field(default_factory=dict)  # arg name -> mutation ids run on the Triton tier

    def callable(self, tier: Tier):
        return self.fn(tier) if self.fn is not None else tier.fn(self.label)

    def cases(self, tier: Tier):
        """(arg name, mutation id) pairs of this spec on ``tier``."""
        out = [("-", "base")]
        for a in self.args:
            out += [(a.name, i) for i in self.mut_ids(a, tier)]
        return out

    def mut_ids(self, a: "Arg", tier: Tier):
        ids = [m.id for m in a.muts()]
        if not tier.ref:
            keep = self.fast_only.get(a.name, FAST_DEFAULT)
            if self.label.split(".")[0] in FAST_GOOD_MODULES or self.label.endswith(".append"):
                keep = tuple(keep) + FAST_GOOD
            alts = [i for i in ids if i.startswith("alt:")]
            if not self.label.endswith(".append"):
                alts = alts[:FAST_ALTS]  # every alternative of an append; a few elsewhere
            return [i for i in ids if i in keep or i in alts]
        return [i for i in ids if i not in FAST_SPECIFIC]

    def groups(self, tier: Tier):
        """(arg name or "-", [mutation ids]) per argument: one test each."""
        return [("-", ["base"])] + [(a.name, self.mut_ids(a, tier)) for a in self.args if self.mut_ids(a, tier)]


#: mutations run on the Triton tier by default (each launch under the interpreter is slow)
FAST_DEFAULT = ("nan", "numpy_array", "meta_device", "ndim-1", "True", "neg", "bogus", "out_of_range", "wrong_shape")
#: good-input re-expressions (bfloat16, strided views) run on the Triton tier for the kernels that read raw data
FAST_GOOD = ("bf16", "noncontig")
FAST_GOOD_MODULES = ("quant", "packing", "attention", "hadamard", "higgs")
FAST_ALTS = 3
#: mutations that only make sense on the Triton tier
FAST_SPECIFIC = ("numpy_array", "meta_device", "bf16")


def alt(id_: str, fn, expect: str = ERROR, canonical=None, oracle=None) -> Mut:
    """A spec-specific mutation: ``fn(value, ctx)`` gives the bad value (ids start with ``alt:``)."""
    return Mut("alt:" + id_, fn, expect, canonical, oracle)


# ---------------------------------------------------------------------------------------------------
# running one case


def run_case(rec, spec: Spec, tier: Tier, arg_name: str, mut_id: str, d) -> None:
    """Build a valid call with draws ``d``, apply mutation ``mut_id`` to ``arg_name``, judge the call."""
    fn = spec.callable(tier)
    make = spec.base(d, tier)
    kwargs = make()
    case = "base" if mut_id == "base" else f"{arg_name}:{mut_id}"
    if mut_id == "base":
        try:
            result = fn(**kwargs)
        except Exception as e:  # noqa: BLE001  (a valid call must not raise)
            rec.check(case, False, "wrong_result", f"a valid call raised {type(e).__name__}: {str(e)[:300]}")
            return
        why = spec.check(result, kwargs, tier) if spec.check else None
        if why is None and spec.truth is not None:
            why = results_close(result, spec.truth(make()))
        rec.check(case, why is None, "wrong_result", f"a valid call: {why}")
        return
    arg = next(a for a in spec.args if a.name == arg_name)
    mut = next(m for m in arg.muts() if m.id == mut_id)
    ctx = Ctx(tier, kwargs, arg, make)
    try:
        kwargs[arg_name] = mut.apply(kwargs.get(arg_name), ctx)
    except Skip:
        return
    states = [
        kwargs[n]
        for n in spec.states
        if n in kwargs and kwargs[n] is not None and not isinstance(kwargs[n], (str, int, float, dict))
    ]

    def oracle(result):
        if spec.check is not None:
            why = spec.check(result, kwargs, tier)
            if why:
                return why
        if spec.truth is not None:
            try:
                want = spec.truth(kwargs)
            except Exception:  # noqa: BLE001  (no truth for this input)
                want = None
            if want is not None:
                why = results_close(result, want)
                return None if why is None else f"result differs from the truth: {why}"
        if mut.oracle is not None:
            return mut.oracle(result, ctx)
        if mut.canonical is not None:
            twin = make()
            twin[arg_name] = mut.canonical(twin.get(arg_name), Ctx(tier, twin, arg, make))
            try:
                ref = fn(**twin)
            except Exception as e:  # noqa: BLE001
                return f"(the canonical twin call raised {type(e).__name__}: {str(e)[:200]})"
            why = results_close(result, ref, mut.rtol)
            if why:
                return f"result differs from the canonical call's: {why}"
            for n in spec.states:
                if n in kwargs and n in twin and kwargs[n] is not None:
                    diff = snapshot_diff(snapshot(twin[n]), snapshot(kwargs[n]))
                    if diff:
                        return f"state {n} differs from the canonical call's at {diff}"
        return None

    rec.call(
        case,
        lambda: fn(**kwargs),
        names=arg.words() + tuple(mut.also),
        expect=mut.expect,
        oracle=oracle if mut.expect == OK_OR_ERROR else None,
        states=states,
    )
