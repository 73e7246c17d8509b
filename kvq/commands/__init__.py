"""kvq.commands: the implementations of ``kvq`` subcommands that need torch / transformers (imported on demand)."""

from __future__ import annotations

import json
import os


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
