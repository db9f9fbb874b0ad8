"""The ``popcompile`` command: subcommands from ``popcompile.commands.COMMANDS``.

Errors a user can fix (``popcompile.errors.PopcompileError``) exit with code 2 and one line naming the
problem and the fix (no traceback; ``--debug`` shows it). Any other exception is a bug and shows its traceback.
Heavy imports (torch, transformers) happen inside the commands that need them.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading

from .commands import COMMANDS
from .commands.common import CliError
from .errors import PopcompileError

__all__ = ["CliError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="popcompile", description=(
        "Prefill-Only Pruning compiler: export a decoder LLM as a pruned prefill graph and its untouched "
        "decode graph sharing one KV layout, and run them."))
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of user errors too (bugs always show theirs)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"popcompile.commands.{name}").register(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like SIGINT so that every ``finally`` (staged folders, temp files, locks) runs."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def _sigterm_raises():
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _sigterm_raises():
            args.handler(args)
    except PopcompileError as err:  # only these are the user's to fix; anything else is a bug: traceback
        if args.debug:
            raise
        one_line = " ".join(str(err).splitlines())  # wrapped library messages can span lines
        print(f"popcompile {args.command}: error: {one_line}", file=sys.stderr)
        return 2
    except Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
