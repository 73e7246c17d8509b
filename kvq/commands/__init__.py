"""kvq.commands: the implementations of ``kvq`` subcommands that need torch / transformers (imported on demand),
and what they share: the JSON result writer, and the checks every command runs on its arguments BEFORE any
work (a bad invocation ends in one line on stderr and exit status 2, never a traceback after minutes).

    p = Parser(prog="kvq demo"); p.add_argument("--outliers", type=non_negative_int)   # argparse: one-line errors
    check_out_file(args.out, "--out")                  # CommandError unless the file can be written
    with usage_errors("kvq eval ppl"): validate(args)  # kvq's ValueError / OSError -> CommandError

``kvq.cli.main`` turns a :class:`CommandError` into ``<prog>: error: <message>`` and exit status 2; the
commands' own ``main`` does the same where it is called directly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import stat
import sys

__all__ = ["emit", "CommandError", "Parser", "usage_errors", "report", "one_line", "positive_int",
           "non_negative_int", "positive_float", "non_negative_float", "ratio", "int_in", "check_out_file",
           "check_out_dir", "check_device", "check_dtype", "check_model", "check_text_source",
           "check_calibration_file", "model_config"]


def emit(result: dict, *, out: str | None, as_json: bool, printer) -> None:
    """A command's result: written as JSON to ``out`` (if given), then printed as JSON (``--json``) or by
    ``printer(result)`` (the human-readable table)."""
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        printer(result)


# ---------------------------------------------------------------------------------------------------
# bad invocations: one line, exit status 2


class CommandError(ValueError):
    """A bad invocation, found before any work: reported as ``<prog>: error: <message>`` (one line) with
    exit status 2 by ``kvq.cli.main`` or :func:`report`."""

    def __init__(self, message: str, prog: str = "kvq"):
        super().__init__(one_line(message))
        self.prog = prog


def one_line(message) -> str:
    """``message`` as one line (newlines and runs of blanks folded into single spaces)."""
    return re.sub(r"\s+", " ", str(message)).strip()


def report(error: CommandError) -> int:
    """Print ``error`` as ``<prog>: error: <message>`` on stderr; returns 2 (the exit status)."""
    print(f"{error.prog}: error: {error}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def usage_errors(prog: str):
    """Inside: kvq's ValueError / TypeError / OSError (a CalibrationFileError is a ValueError) become a
    :class:`CommandError` of ``prog``. For argument validation only: errors of the work itself keep their
    type (and a genuine bug its traceback)."""
    try:
        yield
    except CommandError:
        raise
    except (ValueError, TypeError, OSError) as e:
        raise CommandError(str(e) or type(e).__name__, prog) from e


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line: ``<prog>: error: <message> (see <prog>
    --help)`` on stderr and exit status 2 (argparse's usage block is left to ``--help``). Sub-parsers made
    by ``add_subparsers`` are Parsers too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)\n")


# ---------------------------------------------------------------------------------------------------
# argparse types: numbers in range (argparse names the option in its message)


def _int(text) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def positive_int(text) -> int:
    """An int >= 1."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def non_negative_int(text) -> int:
    """An int >= 0."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return v


def int_in(lo: int, hi: int, why: str = ""):
    """An argparse type: an int in [lo, hi] (``why`` explains the bound in the message)."""
    def parse(text) -> int:
        v = _int(text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}]{why}, got {text!r}")
        return v
    parse.__name__ = f"int in [{lo}, {hi}]"
    return parse


def positive_float(text) -> float:
    """A finite float > 0."""
    v = _float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def non_negative_float(text) -> float:
    """A finite float >= 0."""
    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
    return v


def ratio(text) -> float:
    """A float in (0, 1] (a clip ratio, a probability that may not be 0)."""
    v = _float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be a ratio in (0, 1], got {text!r}")
    return v


# ---------------------------------------------------------------------------------------------------
# checks of paths, devices, models (raise CommandError)


def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _writable_dir(folder: str, what: str, option: str, prog: str) -> None:
    """``folder`` exists and is writable, or it can be created (its nearest existing ancestor is a
    writable directory)."""
    base = _nearest_existing(folder)
    if not os.path.isdir(base):
        raise CommandError(f"{option} {what}: {base} is not a directory", prog)
    if not os.access(base, os.W_OK | os.X_OK):
        raise CommandError(f"{option} {what}: the directory {base} is not writable", prog)


def check_out_file(path, option: str = "--out", prog: str = "kvq") -> None:
    """CommandError unless ``path`` can be written as a file: not a directory or other non-regular file,
    writable if it exists, in a directory that exists (or can be created) and is writable."""
    if path is None:
        return
    path = os.fspath(path)
    if not path:
        raise CommandError(f"{option} is empty", prog)
    if os.path.lexists(path):
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            raise CommandError(f"{option} {path}: cannot be written ({e.strerror or e})", prog) from None
        if stat.S_ISDIR(mode):
            raise CommandError(f"{option} {path}: is a directory, not a file", prog)
        if not stat.S_ISREG(mode):
            raise CommandError(f"{option} {path}: is not a regular file", prog)
        if not os.access(path, os.W_OK):
            raise CommandError(f"{option} {path}: is not writable", prog)
        return
    _writable_dir(os.path.dirname(os.path.abspath(path)), path, option, prog)


def check_out_dir(path, option: str = "--out", prog: str = "kvq") -> None:
    """CommandError unless ``path`` is a writable directory or one that can be created."""
    path = os.fspath(path)
    if not path:
        raise CommandError(f"{option} is empty", prog)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CommandError(f"{option} {path}: exists and is not a directory", prog)
    _writable_dir(path, path, option, prog)


def check_device(device, option: str = "--device", prog: str = "kvq") -> None:
    """CommandError unless ``device`` is None, "cpu", "cuda" or "cuda:N" and, for CUDA, torch sees that GPU."""
    if device is None or device == "cpu":
        return
    m = re.fullmatch(r"cuda(?::(\d+))?", str(device))
    if m is None:
        raise CommandError(f"{option} {device!r}: expected cpu, cuda or cuda:N", prog)
    try:
        import torch
    except ImportError:
        raise CommandError(f"{option} {device}: needs torch (pip install 'kvq-cache[fast]', or pip install -e '.[fast]' in a checkout)", prog) from None
    if not torch.cuda.is_available():
        raise CommandError(f"{option} {device}: torch sees no CUDA GPU on this machine (use {option} cpu)", prog)
    n = torch.cuda.device_count()
    if m.group(1) is not None and int(m.group(1)) >= n:
        raise CommandError(f"{option} {device}: this machine has {n} CUDA device{'s' if n != 1 else ''}", prog)


def check_dtype(dtype, option: str = "--dtype", prog: str = "kvq") -> None:
    """CommandError unless ``dtype`` is None, "auto" or the name of a torch floating-point dtype."""
    if dtype is None or dtype == "auto":
        return
    import torch

    if not isinstance(getattr(torch, str(dtype), None), torch.dtype) or not getattr(torch, dtype).is_floating_point:
        raise CommandError(f"{option} {dtype!r}: expected auto or a torch floating-point dtype name (float32, "
                           f"float16, bfloat16)", prog)


def model_config(name) -> dict | None:
    """The ``config.json`` of a local model directory as a dict; None for a hub id (nothing to read)."""
    path = os.path.expanduser(os.fspath(name))
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        return None
    try:
        with open(cfg) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_model(name, option: str = "--model", prog: str = "kvq") -> None:
    """CommandError for a ``--model`` that can be neither a local model directory nor a hub id: an existing
    file, a directory without config.json, or a path (absolute, ./, ~, two slashes) that does not exist."""
    from kvq.integrations.models import looks_like_path

    name = os.fspath(name)
    if not name:
        raise CommandError(f"{option} is empty", prog)
    path = os.path.expanduser(name)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise CommandError(f"{option} {name}: is a file; expected a model directory or a hub id", prog)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CommandError(f"{option} {name}: has no config.json (not a saved Hugging Face model directory)",
                               prog)
    elif looks_like_path(name):
        raise CommandError(f"{option} {name}: no such model directory", prog)


def check_text_source(source, names, option: str = "--source", prog: str = "kvq") -> None:
    """CommandError unless ``source`` is one of ``names`` or a readable regular text file."""
    if source in names:
        return
    if not os.path.exists(source):
        raise CommandError(f"{option} {source!r}: not one of {', '.join(names)} and no such file", prog)
    if not os.path.isfile(source):
        raise CommandError(f"{option} {source}: is not a regular file", prog)
    if not os.access(source, os.R_OK):
        raise CommandError(f"{option} {source}: is not readable", prog)


def check_calibration_file(path, kind: str, option: str, prog: str = "kvq", backbone: str | None = None) -> dict:
    """The metadata of the calibration file ``path`` (``kvq.calibration.inspect`` without reading its
    tensors: a regular safetensors file of kvq's schema); CommandError unless it holds a ``kind``
    calibration (and, for AQUA-KV, one of the ``backbone`` type given). The full check against the
    model's shape comes when the model's geometry is known."""
    from kvq import calibration

    try:
        meta = calibration.inspect(path, verify=False)
    except (ValueError, TypeError) as e:                # CalibrationFileError: names the path and the problem
        raise CommandError(f"{option} {e}", prog) from e
    if meta["kind"] != kind:
        raise CommandError(f"{option} {path}: holds a {meta['kind']!r} calibration, not {kind!r}", prog)
    if backbone is not None:
        fields = meta["config"].get("fields") if isinstance(meta["config"], dict) else None
        got = fields.get("backbone") if isinstance(fields, dict) else None
        got = got.get("type") if isinstance(got, dict) else None
        if got != backbone:
            raise CommandError(f"{option} {path}: was calibrated with the {got!r} backbone, not {backbone!r} "
                               f"(kvq calibrate aqua --backbone {backbone})", prog)
    return meta
