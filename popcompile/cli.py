"""The ``popcompile`` command: subcommands from ``popcompile.commands.COMMANDS``.

Errors a user can fix (``popcompile.errors.PopcompileError``) exit with one line naming the problem and the
fix (no traceback; ``--debug`` shows it): code 3 when this machine lacks what the request needs
(``EnvironmentUnavailable``: no GPU, no TensorRT, a missing extra), so that a script can tell a skip from
a mistake; code 2 for every other (an option, an input, a model, an engine folder, an output), as argparse's
usage errors. Any other exception is a bug and shows its traceback. ``EXIT_CODES`` is the one table.
Heavy imports (torch, transformers) happen inside the commands that need them.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import textwrap
import threading

from . import __version__
from .commands import COMMANDS
from .commands.common import CliError, require_extras
from .errors import EnvironmentUnavailable, PopcompileError

__all__ = ["CliError", "EXIT_CODES", "EXIT_UNAVAILABLE", "EXIT_USER_ERROR", "build_parser", "main"]

#: a mistake the user can fix: an option, an input, a model, an engine folder, an output (argparse's too)
EXIT_USER_ERROR = 2
#: this machine lacks what the request needs (errors.EnvironmentUnavailable): a skip, not a mistake
EXIT_UNAVAILABLE = 3
#: every exit code popcompile gives, as `popcompile --help` lists them
EXIT_CODES = {
    0: "done",
    1: "`check` found what the target does not support",
    EXIT_USER_ERROR: "a mistake to fix: an option, an input, a model, an engine folder or an output (one "
                     "line on stderr names it and the fix)",
    EXIT_UNAVAILABLE: "this machine lacks what the request needs: an NVIDIA GPU, TensorRT, onnxruntime-gpu, "
                      "a pip extra (one line names it)",
    128 + signal.SIGINT: "interrupted (Ctrl-C)",
    128 + signal.SIGPIPE: "stdout's reader left (`popcompile info E | head -1`)",
    128 + signal.SIGTERM: "terminated (SIGTERM)",
}


def build_parser() -> argparse.ArgumentParser:
    codes = "\n".join(textwrap.fill(meaning, 78, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
                      for code, meaning in EXIT_CODES.items())
    parser = argparse.ArgumentParser(prog="popcompile", description=(
        "Prefill-Only Pruning compiler: export a decoder LLM as a pruned prefill graph and its untouched "
        "decode graph sharing one KV layout, and run them."), epilog=f"exit codes:\n{codes}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
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
        return EXIT_UNAVAILABLE if isinstance(err, EnvironmentUnavailable) else EXIT_USER_ERROR
    except Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
