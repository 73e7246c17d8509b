"""A planned Triton launch: Triton's dispatch on the first call, the compiled kernel's launcher after it.

Triton's ``kernel[grid](*args)`` binds and specializes every argument, looks the binary up and launches it,
on every call: about 20-40 us of Python per launch, most of an eager decode call's host time
(``lab/2026-11-29-eager-host/NOTE.md``). A ``Launch`` is one launch site of a plan cached per call shape
(``kvq.fast.triton.paged.decode_plan``): its grid, the kernel's constexprs and options are the plan's. Its
first call goes through Triton's dispatch, which compiles or finds the binary and returns it; the launch keeps
it. Later calls hand their arguments to that binary's launcher directly: the binary Triton's dispatch would
pick, because all that its choice reads is fixed by the plan's key (the integer arguments' values, the
tensors' dtypes, the constexprs and options) or checked by the plan (every tensor 16-byte aligned: the
plan is ``fast`` only then). Triton's dispatch is taken instead under the interpreter, while Triton's launch
hooks are set (profilers), and where the current CUDA device is not the plan's.

    L = Launch(kernel, grid, {"D": 128, ...}, {"num_warps": 4}, fast=plan_is_aligned)
    L(tensor_args, None, device_index)          # Triton's dispatch; keeps the compiled kernel
    L(address_args, current_stream(device_index), device_index)    # its launcher (None: not allowed now)

A plan is kept per call shape, so a decode at a new length (every model step) makes new launches. Their first
call does not go back to Triton's dispatch where a launch of an earlier plan compiled the same binary: the
compiled kernels are kept by what decides the binary (the kernel, its constexprs and options, and what
Triton specializes the arguments on: ``spec_key``), and a new launch takes its kernel from there (``COMPILED``).

Without a plan of its own, a call site keeps its launches by ``site`` (the caller names the key, as the token
append does) or by ``launch(kernel, grid, *args, **kw)``, a drop-in for ``kernel[grid](*args, **kw)`` that
reads the key from the arguments (the OSCAR and BitDecoding decodes, the FP16 partial and merge kernels,
the rotations).
"""

from __future__ import annotations

import functools
import operator

import torch

try:                                        # Triton >= 3.4: the launch hooks are knobs
    from triton import knobs as _knobs
except ImportError:                         # before: attributes of CompiledKernel
    _knobs = None

from .quant import interpreting

_RAW_STREAM = []          # the driver's current-stream function, taken at the first fast launch (CUDA only)

#: a tensor's device address, and its dtype (applied over a call's tensors with ``map``)
PTR = torch.Tensor.data_ptr
DTYPE = operator.attrgetter("dtype")

#: the launches ``site`` keeps (least recently used dropped): one per kernel and call shape
SITE_CACHE_SIZE = 256

#: compiled kernels kept for launches to share, keyed by (kernel, constexprs, options, ``spec_key``, device
#: index): one entry per binary, as Triton's own cache keeps one per binary (the binaries themselves are
#: Triton's; this holds references)
COMPILED: dict = {}


def aligned(ptrs) -> bool:
    """Whether every address in ``ptrs`` is 16-byte aligned (what Triton specializes a pointer on)."""
    return not functools.reduce(operator.or_, ptrs, 0) & 15


def device_index(device: torch.device) -> int:
    """The CUDA device's index (the current device's where it names none); -1 for the CPU (interpreter)."""
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=SITE_CACHE_SIZE)
def site(kernel, grid: tuple, consts: tuple, options: tuple, fast: bool, key: tuple) -> "Launch":
    """The ``Launch`` of ``kernel`` over ``grid`` with the constexprs and options ``consts`` / ``options``
    (tuples of (name, value)), kept per these and ``key``: every other value Triton's dispatch specializes
    the call on (the values of the integer arguments it specializes, the type of those it does not, the
    tensors' dtypes, the device); ``fast``: every tensor of the call is 16-byte aligned."""
    return Launch(kernel, grid, dict(consts), dict(options), fast)


def current_stream(device_index: int):
    """The raw current stream of CUDA device ``device_index`` when a compiled kernel may be launched on it
    directly (it is the current device and no launch hook is set), else None (take Triton's dispatch)."""
    if _knobs is not None:
        rt = _knobs.runtime
    else:
        from triton.compiler import CompiledKernel as rt
    if _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook):
        return None
    if torch.cuda.current_device() != device_index:
        return None
    if not _RAW_STREAM:
        from triton.runtime import driver
        _RAW_STREAM.append(driver.active.get_current_stream)
    return _RAW_STREAM[0](device_index)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: a non-empty ``HookChain`` (Triton 3.6, 3.7) or any other object."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


class Launch:
    """One launch of a planned call: ``kernel`` (a ``@triton.jit`` function) over ``grid`` with the
    constexprs ``consts`` and launch ``options`` (num_warps, ...), all fixed by the plan; ``fast``: the
    plan's tensors are all 16-byte aligned, so its compiled kernel may be reused (module docstring)."""

    __slots__ = ("kernel", "grid", "consts", "options", "fast", "compiled", "tail", "_run", "_binary")

    def __init__(self, kernel, grid: tuple, consts: dict, options: dict, fast: bool):
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.consts = consts
        self.options = options
        self.fast = bool(fast) and not interpreting()
        self.compiled = None              # Triton's compiled kernel, once a first call has returned it
        self.tail = ()                    # the constexprs after the positional arguments, in order
        self._run = None                  # (launcher, function handle, packed metadata) of ``compiled``
        # what, besides the arguments, decides the binary (the COMPILED key's head); None: never shared
        self._binary = ((kernel, tuple(sorted(consts.items())), tuple(sorted(options.items())))
                        if self.fast else None)

    def __call__(self, args: tuple, stream, device_index: int) -> None:
        """Launch over ``args``, the kernel's positional (non-constexpr) arguments: with ``stream`` (from
        ``current_stream``; the launch holds its compiled kernel) on it by the compiled kernel's launcher,
        pointers as device addresses or tensors; else, pointers as tensors, by the kernel an earlier launch
        compiled for the same binary (``COMPILED``), or through Triton's dispatch on the current stream (the
        first call keeps the compiled kernel where the launch is ``fast``, and shares it)."""
        if stream is not None:
            run, g = self._run, self.grid
            run[0](g[0], g[1], g[2], stream, run[1], run[2], None, None, None, *args, *self.tail)
            return
        key = None
        if self._binary is not None and self._run is None:
            spec = spec_key(self.kernel, args)
            if spec is not None:
                key = (self._binary, spec[0], device_index)
                hit = COMPILED.get(key)
                if hit is not None:
                    stream = current_stream(device_index)
                    if stream is not None:                  # no hook, the plan's device current
                        self._hold(*hit)
                        run, g = self._run, self.grid
                        run[0](g[0], g[1], g[2], stream, run[1], run[2], None, None, None, *args, *self.tail)
                        return
        k = self.kernel[self.grid](*args, **self.consts, **self.options)
        if self.fast and self._run is None and k is not None and hasattr(k, "packed_metadata"):
            self._hold(k, self._tail(len(args)))
            if key is not None:
                COMPILED[key] = (k, self.tail)

    def _hold(self, k, tail: tuple) -> None:
        """Keep the compiled kernel ``k`` (its launcher, handle and metadata) and the constexprs ``tail``."""
        self.tail = tail
        self.compiled = k
        self._run = (k.run, k.function, k.packed_metadata)

    def _tail(self, n_args: int) -> tuple:
        """The kernel's parameters after the ``n_args`` positional ones, as Triton's binder passes them to
        the launcher: the constexprs given, else their defaults."""
        out = []
        for p in self.kernel.params[n_args:]:
            name = p.name
            if name in self.consts:
                out.append(self.consts[name])
            elif p.has_default:
                out.append(p.default)
            else:
                raise TypeError(f"{self.kernel.fn.__name__}: no value for parameter {name!r}")
        return tuple(out)


class Plan:
    """What the planned decodes (``kvq.fast.triton.paged``, ``oscar_decode``, ``bitdecoding_decode``) share: the
    launches of one call shape (``launches``) on CUDA device ``dev_index``, and one fp32 scratch buffer per
    call of ``n_buf`` elements, cut into regions that start at ``offsets`` and have ``shapes`` (a shape None:
    a region this plan does not use). ``ready``: every launch holds its compiled kernel. A subclass names its
    own fields in ``__slots__``; the constructor sets every slot of the class's hierarchy from ``kw``
    (missing: None) and ``ready`` False.

        stream = p.stream()                         # None: tensors, through Triton's dispatch
        buf = p.scratch(device)
        o_part, m_part, l_part = p.regions(buf, stream)
        ...launches...(args, stream, p.dev_index)
        p.settle(stream)
    """

    __slots__ = ("dev_index", "launches", "n_buf", "offsets", "shapes", "ready")

    def __init__(self, **kw):
        for cls in type(self).__mro__:
            for name in getattr(cls, "__slots__", ()):
                setattr(self, name, kw.get(name))
        if self.launches is None:
            self.launches = ()
        self.ready = False

    def stream(self):
        """The raw stream to launch on by address (``current_stream``) once the plan is ready, else None."""
        return current_stream(self.dev_index) if self.ready else None

    def scratch(self, device) -> torch.Tensor:
        """A new fp32 scratch buffer of ``n_buf`` elements on ``device`` (a call's own: its partials)."""
        return torch.empty(self.n_buf, dtype=torch.float32, device=device)

    def regions(self, buf: torch.Tensor, stream) -> tuple:
        """``buf``'s regions: device addresses where ``stream`` is given, else views of their shapes (None
        for a shape None)."""
        if stream is not None:
            b0 = buf.data_ptr()
            return tuple(b0 + 4 * x for x in self.offsets)
        return tuple(None if shape is None else buf[x:x + _numel(shape)].view(shape)
                     for x, shape in zip(self.offsets, self.shapes))

    def settle(self, stream) -> None:
        """After a call through Triton's dispatch (``stream`` None): ready once every launch holds its kernel."""
        if stream is None and not self.ready:
            self.ready = all(x.compiled is not None for x in self.launches)


def _numel(shape: tuple) -> int:
    return functools.reduce(operator.mul, shape, 1)


def launch(kernel, grid: tuple, *args, **kw) -> None:
    """``kernel[grid](*args, **kw)`` by a kept ``Launch`` (``site``): the key is what Triton's dispatch
    specializes on, read from the arguments (each tensor's dtype and 16-byte alignment, each int's and
    bool's value, None; of an int parameter marked ``do_not_specialize`` only its range, i32 / i64 / u64, so
    that a length moving every step keeps one launch); floats (never specialized) pass per call. ``kw``: the
    constexprs and the launch options (num_warps, ...), every non-constexpr argument positional. An argument of another kind (e.g. a
    tuple) takes Triton's dispatch. After a site's first call the compiled kernel takes the addresses."""
    if interpreting():
        kernel[grid](*args, **kw)
        return
    spec = spec_key(kernel, args)
    if spec is None:
        kernel[grid](*args, **kw)
        return
    key, ptrs = spec
    names = _params(kernel)[0]
    consts = tuple((k, v) for k, v in kw.items() if k in names)
    options = tuple((k, v) for k, v in kw.items() if k not in names)
    dev_index = _args_device(args)
    la = site(kernel, tuple(grid), consts, options, aligned(ptrs), (key, dev_index))
    stream = current_stream(dev_index) if la.compiled is not None else None
    if stream is None:
        la(args, None, dev_index)
    else:
        it = iter(ptrs)
        la(tuple(next(it) if isinstance(a, torch.Tensor) else a for a in args), stream, dev_index)


def spec_key(kernel, args) -> tuple | None:
    """``(key, addresses)``: what Triton's dispatch specializes a call of ``kernel`` over the positional
    ``args`` on (each tensor's dtype and 16-byte alignment, each int's and bool's value, None; of an int
    parameter marked ``do_not_specialize`` only its range, i32 / i64 / u64, so that a length moving every step
    keeps one binary; floats, never specialized, by their type), and the tensors' addresses. None where an
    argument is of another kind (e.g. a tuple): Triton's dispatch decides."""
    key = []
    ptrs = []
    loose = _params(kernel)[1]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            p = a.data_ptr()
            ptrs.append(p)
            key.append((a.dtype, not p & 15))
        elif type(a) is int and i < len(loose) and loose[i]:
            key.append(_int_kind(a))            # do_not_specialize: Triton keys only its type (i32 / i64 / u64)
        elif a is None or isinstance(a, (bool, int)):
            key.append(a)                       # (True == 1: bool and int values kept apart by their type)
            key.append(type(a))
        elif isinstance(a, float):
            key.append(float)
        else:
            return None
    return tuple(key), ptrs


@functools.lru_cache(maxsize=None)
def _params(kernel) -> tuple:
    """(the kernel's parameter names, per parameter whether it is ``do_not_specialize``)."""
    return (frozenset(p.name for p in kernel.params),
            tuple(bool(getattr(p, "do_not_specialize", False)) for p in kernel.params))


def _int_kind(v: int) -> tuple:
    """The type Triton gives an int argument it does not specialize on: i32, i64 or u64 by its range."""
    return ("int", -2 ** 31 <= v < 2 ** 31, -2 ** 63 <= v < 2 ** 63)


def _args_device(args) -> int:
    """The device index of the first tensor among ``args`` (-1: the CPU, or no tensor)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return device_index(a.device)
    return -1
