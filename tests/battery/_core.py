"""The battery's judge: run one call, classify what happened, and count it.

A call with bad input must end in one of two ways:

* a **clear error**: an exception of an allowed type (ValueError, TypeError, IndexError,
  NotImplementedError; ``kvq.calibration.CalibrationFileError`` is a ValueError) raised by a ``raise``
  statement of kvq itself (not by NumPy, torch, Triton or the interpreter inside a kvq line), whose
  message names the offending argument (one of a list of names, matched as a whole word);
* a **correct result**, where the case allows one: the result passes the case's oracle (equal to the
  result of the same call on the canonical form of the input, or a property such as "finite").

Anything else is a failure of one of these causes (``CAUSES``): ``accepted`` (bad input taken silently),
``wrong_result``, ``unclear_error`` (another type, or not raised by kvq: a NumPy broadcast error, a
KeyError, a bare assert, a torch internal error), ``unnamed_error`` (a kvq error that does not name the
argument), ``state_changed`` (a rejected call left a cache state different from before, compared byte for
byte), ``jammed`` (after a rejected call, a good call gives another result than on an untouched twin),
``hang`` and ``crash`` (the process died; the Triton tier runs in a child process for this reason).

Every call is counted in ``FIGURES`` (calls tried, clear errors, correct results, states checked) and
every failure is kept in ``FAILURES``; ``conftest.py`` writes both out when asked to.

    rec = Recorder("reference", "quant.quantize")
    rec.call("x:nan", lambda: quantize(x, 2, 4), names=("x",), expect=ERROR)
    rec.assert_clean()
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import math
import os
import re
import threading
import traceback
from collections import Counter
from pathlib import Path

import numpy as np

import kvq

#: exception types a clear kvq error may have (CalibrationFileError is a ValueError)
ALLOWED = (ValueError, TypeError, IndexError, NotImplementedError)
#: failure causes, in the order the report lists them
CAUSES = ("crash", "hang", "state_changed", "jammed", "accepted", "wrong_result", "unclear_error", "unnamed_error")
#: messages that are never clear, whoever raises them
UNCLEAR_MESSAGES = (
    "could not be broadcast",
    "is out of bounds for axis",
    "has no attribute",
    "unsupported operand type",
    "object is not subscriptable",
    "object is not iterable",
    "'NoneType'",
    "cannot reshape array",
    "invalid literal for",
    "not supported between instances",
    "unhashable type",
    "maximum recursion",
    "list index out of range",
    "too many indices",
    "only integers, slices",
    "argument must be a string or a real number",
)

KVQ_DIR = Path(kvq.__file__).resolve().parent

FIGURES: Counter = Counter()  # calls, clear_errors, correct_results, states_checked, failures, per tier
FAILURES: list = []  # one dict per failed call
FUNCTIONS: set = set()  # (tier, function) pairs called

ERROR = "error"  # the call must raise a clear error
OK_OR_ERROR = "ok_or_error"  # a clear error, or a result that passes the oracle


# ---------------------------------------------------------------------------------------------------
# was it raised by kvq?


def _innermost(exc: BaseException):
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def origin(exc: BaseException) -> tuple[str, int]:
    """(file, line) where ``exc`` was raised: the innermost frame of its traceback."""
    tb = _innermost(exc)
    return ("?", 0) if tb is None else (tb.tb_frame.f_code.co_filename, tb.tb_lineno)


@functools.lru_cache(maxsize=4096)
def _raise_offsets(code) -> frozenset:
    return frozenset(i.offset for i in dis.get_instructions(code) if i.opname in ("RAISE_VARARGS", "RERAISE"))


def raised_by_kvq(exc: BaseException) -> bool:
    """True if the innermost frame is a kvq source file executing a ``raise`` statement (read from the
    bytecode that ran, so that a source file edited since does not matter)."""
    tb = _innermost(exc)
    if tb is None:
        return False
    code = tb.tb_frame.f_code
    try:
        p = Path(code.co_filename).resolve()
    except OSError:
        return False
    if KVQ_DIR not in p.parents:
        return False
    return tb.tb_lasti in _raise_offsets(code)


def _short_origin(exc: BaseException) -> str:
    path, line = origin(exc)
    p = Path(path)
    try:
        rel = p.resolve().relative_to(KVQ_DIR.parent)
    except (ValueError, OSError):
        parts = p.parts
        rel = Path(*parts[-3:]) if len(parts) >= 3 else p
    return f"{rel}:{line}"


def names_argument(message: str, names) -> bool:
    """Whether ``message`` names one of ``names`` as a whole word (case-insensitive)."""
    for n in names:
        if re.search(r"(?<![A-Za-z0-9_])" + re.escape(n) + r"(?![A-Za-z0-9_])", message, re.IGNORECASE):
            return True
    return False


def judge_exception(exc: BaseException, names) -> tuple[str | None, str]:
    """(cause or None if clear, a one-line description)."""
    msg = str(exc)
    head = msg.splitlines()[0][:300] if msg else ""
    desc = f"{type(exc).__name__} at {_short_origin(exc)}: {head}"
    if not isinstance(exc, ALLOWED):
        return "unclear_error", desc
    if not raised_by_kvq(exc):
        return "unclear_error", desc
    if any(u in msg for u in UNCLEAR_MESSAGES):
        return "unclear_error", desc
    if names and not names_argument(msg, names):
        return "unnamed_error", desc + f"  [expected a name among {list(names)}]"
    return None, desc


# ---------------------------------------------------------------------------------------------------
# snapshots of states (byte for byte)


def _torch():
    import torch

    return torch


def _arr_key(a):
    """A comparable fingerprint of an array or tensor: kind, dtype, shape, device, bytes."""
    if isinstance(a, np.ndarray):
        return ("nd", a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes())
    torch = _torch()
    t = a.detach()
    dev = str(t.device)
    if t.device.type == "meta":
        return ("t", str(t.dtype), tuple(t.shape), dev, b"")
    t = t.cpu().contiguous().reshape(-1)
    return ("t", str(t.dtype), tuple(a.shape), dev, t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _is_tensor(x) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "detach") and hasattr(x, "dtype")


def _walk(x, path: str, out: dict, seen: set, depth: int = 0):
    if depth > 8:
        out[path] = repr(type(x))
        return
    if isinstance(x, np.ndarray) or _is_tensor(x):
        out[path] = _arr_key(x)
        return
    if isinstance(x, (bool, np.bool_)):
        out[path] = ("bool", bool(x))
        return
    if isinstance(x, (int, np.integer)):
        out[path] = ("int", int(x))
        return
    if isinstance(x, (float, np.floating)):
        out[path] = ("float", repr(float(x)))
        return
    if isinstance(x, str):
        out[path] = ("str", x)
        return
    if isinstance(x, (bytes, complex, type(None), np.generic)):
        out[path] = repr(x)
        return
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        out[path] = ("str", np.dtype(x).name)
        return
    if id(x) in seen:
        out[path] = "<cycle>"
        return
    seen = seen | {id(x)}
    if isinstance(x, dict):
        out[path + "#keys"] = repr(sorted(map(str, x)))
        for k, v in x.items():
            _walk(v, f"{path}[{k!r}]", out, seen, depth + 1)
        return
    if isinstance(x, (list, tuple)):
        out[path + "#len"] = len(x)
        for i, v in enumerate(x):
            _walk(v, f"{path}[{i}]", out, seen, depth + 1)
        return
    special = _special_snapshot(x)
    if special is not None:
        for k, v in special.items():
            _walk(v, f"{path}.{k}", out, seen, depth + 1)
        return
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            _walk(getattr(x, f.name), f"{path}.{f.name}", out, seen, depth + 1)
        if hasattr(x, "arrays"):
            try:
                arrays = x.arrays()
            except Exception as e:  # noqa: BLE001  (a broken state is itself a finding)
                arrays = {"<arrays() failed>": repr(e)}
            _walk(arrays, f"{path}.arrays()", out, seen, depth + 1)
        return
    r = repr(x)
    out[path] = r[:200] if " at 0x" not in r else f"<{type(x).__module__}.{type(x).__qualname__}>"


#: attributes of a KVStore that are derived data (memoised reads, decode caches), not state
_STORE_DERIVED = {"_memo", "dequantize_calls", "_chunks", "_aqua_all", "_mod", "spec"}


def _special_snapshot(x):
    """KVStore, KVQCache (and its layers): the attributes that hold state."""
    cls = type(x).__name__
    mod = type(x).__module__
    if cls == "KVStore" and mod.startswith("kvq."):
        return {k: v for k, v in vars(x).items() if k not in _STORE_DERIVED}
    if mod.startswith("kvq.integrations.transformers"):
        if hasattr(x, "_store") and hasattr(x, "layers"):
            return {
                "store": x._store,
                "method": x.method,
                "max_tokens": x.max_tokens,
                "layers_initialized": [bool(getattr(l, "is_initialized", False)) for l in x.layers],
            }
    if isinstance(x, os.PathLike):
        return {"path": os.fspath(x)}
    return None


def snapshot(obj) -> dict:
    """Every array (bytes, dtype, shape, device) and counter reachable from a state object."""
    out = {}
    _walk(obj, "", out, set())
    return out


def snapshot_diff(a: dict, b: dict, limit: int = 6) -> list:
    """Paths whose value differs between two snapshots."""
    keys = sorted(set(a) | set(b))
    diff = [k or "<root>" for k in keys if a.get(k, "<absent>") != b.get(k, "<absent>")]
    return diff[:limit] + ([f"... {len(diff) - limit} more"] if len(diff) > limit else [])


# ---------------------------------------------------------------------------------------------------
# comparing results


def to_numpy(x):
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, np.generic):
        return np.asarray(x)
    if _is_tensor(x):
        torch = _torch()
        if x.device.type == "meta":
            return None
        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        if t.dtype == torch.uint16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()
    return None


def _is_scalar(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating, np.bool_)) or (isinstance(x, np.ndarray) and x.ndim == 0)


def results_close(a, b, rtol: float = 1e-3) -> str | None:
    """None if ``a`` equals ``b`` (floats to ``rtol`` of b's magnitude, NaN equal to NaN), else why not."""
    if _is_scalar(a) and _is_scalar(b):
        fa, fb = float(a), float(b)
        if math.isnan(fa) and math.isnan(fb):
            return None
        return None if (fa == fb or math.isclose(fa, fb, rel_tol=rtol)) else f"{a!r} vs {b!r}"
    na, nb = to_numpy(a), to_numpy(b)
    if na is not None or nb is not None:
        if na is None or nb is None:
            return f"{type(a).__name__} vs {type(b).__name__}"
        if na.shape != nb.shape:
            return f"shape {na.shape} vs {nb.shape}"
        if na.dtype.kind in "fc" or nb.dtype.kind in "fc":
            fa, fb = na.astype(np.float64), nb.astype(np.float64)
            if not np.array_equal(np.isnan(fa), np.isnan(fb)):
                return "NaN positions differ"
            m = ~np.isnan(fb)
            if not np.array_equal(np.isinf(fa[m]), np.isinf(fb[m])):
                return "inf positions differ"
            fin = m & np.isfinite(fb)
            scale = float(np.max(np.abs(fb[fin]))) if fin.any() else 0.0
            if fin.any() and not np.allclose(fa[fin], fb[fin], rtol=rtol, atol=rtol * scale + 1e-30):
                return f"values differ (max |diff| {float(np.max(np.abs(fa[fin] - fb[fin]))):.3g})"
            return None
        return None if np.array_equal(na, nb) else "values differ"
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and not isinstance(a, type):
        diff = snapshot_diff(snapshot(a), snapshot(b))
        return None if not diff else f"states differ at {diff}"
    if isinstance(a, dict) and isinstance(b, dict):
        if sorted(a) != sorted(b):
            return f"keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            why = results_close(a[k], b[k], rtol)
            if why:
                return f"[{k!r}] {why}"
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            why = results_close(x, y, rtol)
            if why:
                return f"[{i}] {why}"
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    if isinstance(a, (int, float, np.number)) and isinstance(b, (int, float, np.number)):
        return None if math.isclose(float(a), float(b), rel_tol=rtol) else f"{a!r} vs {b!r}"
    try:
        return None if a == b else f"{a!r:.80} vs {b!r:.80}"
    except Exception:  # noqa: BLE001
        return f"{type(a).__name__} not comparable"


def all_finite(result) -> str | None:
    """None if every float array in ``result`` is finite, else where not."""
    bad = []

    def walk(x, path):
        n = to_numpy(x)
        if n is not None:
            if (
                n.dtype.kind in "fc"
                and n.size
                and not np.all(np.isfinite(n.astype(np.complex128 if n.dtype.kind == "c" else np.float64)))
            ):
                bad.append(path or "result")
            return
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}[{k!r}]")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
        elif isinstance(x, float) and not math.isfinite(x):
            bad.append(path or "result")

    walk(result, "")
    return None if not bad else f"non-finite values in {', '.join(bad[:4])}"


def any_nonfinite(result) -> bool:
    return all_finite(result) is not None


# ---------------------------------------------------------------------------------------------------
# running calls


class Hang(Exception):
    """Raised by :func:`call_with_timeout` when the call does not return."""


def call_with_timeout(thunk, seconds: float, unblock=None):
    """Run ``thunk`` in a thread; if it is still running after ``seconds``, call ``unblock()`` repeatedly
    for up to 10 s (it must make the thread move on, e.g. by opening the other end of a FIFO: a loader
    may open the file more than once) and raise :class:`Hang`."""
    box = {}

    def target():
        try:
            box["result"] = thunk()
        except BaseException as e:  # noqa: BLE001
            box["exc"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        if unblock is not None:
            for _ in range(100):
                unblock()
                th.join(0.1)
                if not th.is_alive():
                    break
        raise Hang(f"did not return within {seconds:g} s")
    if "exc" in box:
        raise box["exc"]
    return box.get("result")


class Recorder:
    """Runs and judges the calls of one test; ``assert_clean()`` fails the test with every failure."""

    def __init__(self, tier: str, fn: str):
        self.tier, self.fn = tier, fn
        self.failures = []
        self.counts = Counter()
        FUNCTIONS.add((tier, fn))

    # -- bookkeeping

    def _count(self, key: str, n: int = 1):
        self.counts[key] += n
        FIGURES[key] += n
        FIGURES[f"{self.tier}:{key}"] += n

    def fail(self, case: str, cause: str, detail: str):
        rec = {"tier": self.tier, "fn": self.fn, "case": case, "cause": cause, "detail": detail[:600]}
        self.failures.append(rec)
        FAILURES.append(rec)
        self._count("failures")

    def add_external(self, outcome: dict):
        """Count a call judged elsewhere (the Triton child process): ``outcome`` has counts and failures."""
        for k, v in outcome.get("counts", {}).items():
            self._count(k, v)
        for f in outcome.get("failures", []):
            self.failures.append(f)
            FAILURES.append(f)

    # -- one call

    def call(
        self,
        case: str,
        thunk,
        *,
        names=(),
        expect: str = ERROR,
        oracle=None,
        states=(),
        followup=None,
        timeout: float | None = None,
        unblock=None,
    ):
        """Run ``thunk()`` and judge it.

        names: words the error message may use for the offending argument.
        expect: ERROR (bad input: must raise) or OK_OR_ERROR (a result is fine if ``oracle(result)``
            returns None; the oracle returns a string saying what is wrong otherwise).
        states: objects whose snapshot must be unchanged when the call raises.
        followup: ``() -> str | None``, run after a rejected call: a good call on the victim compared
            with an untouched twin (None: the same).
        Returns ("error", exc) or ("ok", result).
        """
        self._count("calls")
        before = [snapshot(s) for s in states]
        try:
            if timeout is None:
                result = thunk()
            else:
                result = call_with_timeout(thunk, timeout, unblock)
        except Hang as e:
            self.fail(case, "hang", str(e))
            return "hang", e
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001  (judging any exception is the point)
            cause, desc = judge_exception(exc, names)
            clean = cause is None
            if cause is not None:
                self.fail(case, cause, desc)
            if states:
                self._count("states_checked")
                for i, (s, b) in enumerate(zip(states, before)):
                    diff = snapshot_diff(b, snapshot(s))
                    if diff:
                        clean = False
                        self.fail(case, "state_changed", f"after {desc}: state {i} changed at {diff}")
            if followup is not None:
                why = followup()
                if why:
                    clean = False
                    self.fail(case, "jammed", f"after {desc}: {why}")
            if clean:
                self._count("clear_errors")
            return "error", exc
        if expect == ERROR:
            self.fail(case, "accepted", f"returned {_describe(result)} instead of raising")
            return "ok", result
        try:
            why = oracle(result) if oracle is not None else None
        except Exception as e:  # noqa: BLE001  (a result the oracle cannot read)
            why = f"the result could not be checked: {type(e).__name__}: {str(e)[:200]}"
        if why:
            self.fail(case, "wrong_result", why)
        else:
            self._count("correct_results")
        return "ok", result

    def check(self, case: str, ok: bool, cause: str, detail: str):
        """A property of good input (streaming equals bulk, ...): counted as a call."""
        self._count("calls")
        if ok:
            self._count("correct_results")
        else:
            self.fail(case, cause, detail)

    def assert_clean(self):
        if self.failures:
            lines = [f"{len(self.failures)} failing call(s) of {self.tier} {self.fn}:"]
            seen = set()
            for f in self.failures:
                key = (f["case"], f["cause"], f["detail"][:120])
                if key in seen:
                    continue
                seen.add(key)
                lines.append(f"  [{f['cause']}] {f['case']}: {f['detail']}")
                if len(lines) > 12:
                    lines.append("  ...")
                    break
            raise AssertionError("\n".join(lines))


def _describe(result) -> str:
    if _is_tensor(result) and result.device.type == "meta":
        return f"a tensor on the meta device {tuple(result.shape)}"
    n = to_numpy(result)
    if n is not None:
        return f"an array {n.dtype} {n.shape}"
    if isinstance(result, (tuple, list)):
        return f"a {type(result).__name__} of {len(result)}"
    r = repr(result)
    return f"{type(result).__name__} {r[:60]}"


def import_keeping_env(name: str):
    """Import module ``name`` and put ``os.environ`` back as it was (importing transformers sets
    TORCHINDUCTOR_CACHE_DIR; a test module must not change the environment of the tests after it)."""
    import importlib

    before = dict(os.environ)
    try:
        return importlib.import_module(name)
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def format_exc_short(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[:300]
