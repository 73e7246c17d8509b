"""The `kvq` command line. Subcommands: `demo` (more arrive with the evaluation issue).

    kvq demo
    python -m kvq demo --tokens 1024
"""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("kvq.demo", "quantize a synthetic KV cache per-channel / per-token at 2 and 4 bits"),
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
        print(f"kvq: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
