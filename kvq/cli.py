"""The `kvq` command line: `demo`, `eval`, `calibrate`, `bench`, `figures` (each takes `--help`).

    kvq demo
    kvq calibrate oscar --model runs/tiny-lm --out oscar.safetensors
    kvq eval ppl --model runs/tiny-lm --calib-oscar oscar.safetensors --json
    kvq eval attention                                  # the packaged MiniLM, real English text
    python -m kvq demo --tokens 1024

A bad invocation (an unknown option, a number out of range, an output that cannot be written, a GPU
asked of a machine without one, a calibration file that is not one) is refused before any work: one
line ``<prog>: error: <message>`` on stderr and exit status 2 (``kvq.commands.CommandError``); errors
of the work itself are reported by each command (exit status 1), and anything else keeps its traceback.

Output read only in part (``kvq eval ... | head``, ``kvq figures --list | head -3``): when the reader
closes the pipe, the command stops quietly, with no traceback and exit status 141 (128 + SIGPIPE, what
a shell reports for a process that a closed pipe ends), for every subcommand alike.
"""

from __future__ import annotations

import os
import sys

COMMANDS = {
    "demo": ("kvq.demo", "quantize a synthetic KV cache per-channel / per-token at 2 and 4 bits"),
    "eval": ("kvq.commands.eval", "perplexity / attention errors of the methods on a real model"),
    "calibrate": ("kvq.commands.calibrate", "fit OSCAR / AQUA-KV calibrations on a model, write a checked file"),
    "bench": ("kvq.commands.bench", "time quantize+pack and decode attention per method on this machine"),
    "figures": ("kvq.commands.figures", "draw the library's figures (synthetic or real MiniLM activations)"),
}


#: exit status when stdout's reader went away (128 + SIGPIPE, as a shell reports it)
CLOSED_PIPE_STATUS = 141


def main(argv=None) -> int:
    """``kvq COMMAND [options]``: run one subcommand; returns the exit status.

    A closed stdout (the reader of a pipe exited, e.g. ``| head``) ends the command with
    :data:`CLOSED_PIPE_STATUS` and no traceback: stdout is flushed here, inside the guard, so that the
    error cannot surface later at interpreter exit, and then pointed at ``os.devnull``.
    """
    try:
        try:
            return _dispatch(argv)
        finally:                               # also when a subcommand exits (argparse's --help)
            sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        return CLOSED_PIPE_STATUS


def _stdout_to_devnull() -> None:
    """Point the process's stdout at ``os.devnull``, so that the final flush at exit writes nowhere
    instead of raising again (Python's documented recipe for SIGPIPE; a stdout with no file
    descriptor, such as a test's capture, is left alone)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _dispatch(argv) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvq COMMAND [options]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:10s} {text}")
        return 0 if argv else 2
    if argv[0] == "--version":
        from kvq import __version__
        print(f"kvq {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"kvq: error: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    from kvq.commands import CommandError, report

    try:
        return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
    except CommandError as e:                  # a bad invocation found before any work: one line, status 2
        return report(e)


if __name__ == "__main__":
    raise SystemExit(main())
