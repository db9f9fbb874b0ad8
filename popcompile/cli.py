"""The ``popcompile`` command: subcommands from ``popcompile.commands.COMMANDS``.

Errors a user can fix (``popcompile.errors.PopcompileError``) exit with code 2 and one line naming the
problem and the fix (no traceback; ``--debug`` shows it). Any other exception is a bug and shows its
traceback.
Heavy imports (torch, transformers) happen inside the commands that need them.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading

from . import __version__
from .commands import COMMANDS
from .commands.common import CliError, require_extras
from .errors import PopcompileError

__all__ = ["CliError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="popcompile", description=(
        "Prefill-Only Pruning compiler: export a decoder LLM as a pruned prefill graph and its untouched "
        "decode graph sharing one KV layout, and run them."))
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of user errors too (bugs always show theirs)")
    parser.add_argument("--version", action="version", version=f"popcompile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"popcompile.commands.{name}").register(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like SIGINT so that every ``finally`` (staged folders, temp files, locks) runs."""


_EXCEPTION_FOR = {signal.SIGTERM: Terminated, signal.SIGINT: KeyboardInterrupt}
_RETRY_S = 0.05


def _inside_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _raise_for_signal(signum, frame) -> None:
    """Raise the signal's exception, but never inside an import.

    An exception thrown into an extension module's initialisation kills the interpreter (``import onnx``
    interrupted by SIGTERM: SIGSEGV, and the staged folder and lock stay behind). Inside an import the
    signal is sent again a moment later, until it lands between imports.
    """
    if _inside_import(frame):
        threading.Timer(_RETRY_S, os.kill, (os.getpid(), signum)).start()
        return
    raise _EXCEPTION_FOR[signum]()


@contextlib.contextmanager
def _signals_raise():
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = {signum: signal.signal(signum, _raise_for_signal) for signum in _EXCEPTION_FOR
                if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler)}  # not if ignored
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:  # `popcompile info E | head -1`: the reader left; say nothing more, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush too
        return 128 + signal.SIGPIPE


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)  # --help and --version print here
    try:
        with _signals_raise():
            require_extras(args.command)
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
