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
"""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("kvq.demo", "quantize a synthetic KV cache per-channel / per-token at 2 and 4 bits"),
    "eval": ("kvq.commands.eval", "perplexity / attention errors of the methods on a real model"),
    "calibrate": ("kvq.commands.calibrate", "fit OSCAR / AQUA-KV calibrations on a model, write a checked file"),
    "bench": ("kvq.commands.bench", "time quantize+pack and decode attention per method on this machine"),
    "figures": ("kvq.commands.figures", "draw the library's figures (synthetic or real MiniLM activations)"),
}


def main(argv=None) -> int:
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
