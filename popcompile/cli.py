"""The ``popcompile`` command: subcommands from ``popcompile.commands.COMMANDS``.

Errors a user can fix exit with code 2 and one line naming the problem and the fix (no traceback).
Heavy imports (torch, transformers) happen inside the commands that need them.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .commands import COMMANDS
from .commands.common import CliError

__all__ = ["CliError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="popcompile", description=(
        "Prefill-Only Pruning compiler: export a decoder LLM as a pruned prefill graph and its untouched "
        "decode graph sharing one KV layout, and run them."))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"popcompile.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except (CliError, ValueError, FileNotFoundError) as err:  # EngineError is a ValueError
        print(f"popcompile {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
