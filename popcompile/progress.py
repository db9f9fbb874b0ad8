"""Progress on stderr that shows on a terminal and in a log alike (CI, nohup, a notebook, a pipe).

    progress_bar(total, desc, unit)   a tqdm bar on a terminal; elsewhere a ``LogBar``, the same interface
                                      (n, total, update, set_description, set_postfix, write, close, with),
                                      printing lines instead of redrawing one

A ``LogBar`` prints a line when its description changes (a command's next step: ``export 3/8: capture,
12 s``), a line per ``every`` of its total (``greedy: 59/118 prompt (50%), 40 s``) and, when it ends
complete, one line with the whole time; each with the seconds since it started. ``tqdm(disable=None)``, what
every bar was before, printed nothing at all there. The K/V fit draws its own (commands/fitprogress.py, the
same rule). No popcompile imports: every layer may show progress.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO


def is_terminal(stream: TextIO) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def progress_bar(total: int | None = None, desc: str = "", unit: str = "it", *, stream: TextIO | None = None,
                 leave: bool = True, every: float = 0.1):
    """A tqdm bar on ``stream`` (default stderr) when it is a terminal, else a ``LogBar``."""
    stream = stream or sys.stderr
    if is_terminal(stream):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream, leave=leave)
    return LogBar(total, desc, unit, stream=stream, every=every)


class LogBar:
    """tqdm's interface as lines, for a stream that is not a terminal (see the module docstring)."""

    def __init__(self, total: int | None = None, desc: str = "", unit: str = "it", *,
                 stream: TextIO | None = None, every: float = 0.1, clock=time.monotonic):
        self.total, self.title, self.desc, self.unit = total, desc, desc, unit
        self.stream, self.every, self.clock = stream or sys.stderr, every, clock
        self.n, self.start, self.shown, self.closed, self.stepped = 0, clock(), 0, False, False

    def __enter__(self) -> LogBar:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(complete=kind is None)

    def elapsed(self) -> float:
        return self.clock() - self.start

    def set_description(self, desc: str, refresh: bool = True) -> None:
        """A step of a command begins: one line, ``TITLE i/N: STEP, S s``."""
        if desc == self.desc:
            return
        self.desc, self.stepped = desc, True
        where = f" {self.n + 1}/{self.total}" if self.total else ""
        self.write(f"{self.title}{where}: {desc}, {self.elapsed():.0f} s")

    def set_postfix(self, *args, **kwargs) -> None:
        """tqdm's; a log line says enough."""

    def update(self, count: int = 1) -> None:
        self.n += count
        if not self.total or self.stepped:  # no total to share; a bar of steps says each step instead
            return
        share = int(self.n / self.total / self.every + 1e-9)
        if share > self.shown and self.n < self.total:
            self.shown = share
            self.write(f"{self.desc}: {self.n}/{self.total} {self.unit} ({100 * self.n // self.total}%), "
                       f"{self.elapsed():.0f} s")

    def write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def close(self, complete: bool = True) -> None:
        """One last line with the whole time, if it ran to the end."""
        if self.closed:
            return
        self.closed = True
        if complete and self.total and self.n >= self.total:
            units = self.unit if self.total == 1 or self.unit.endswith("s") else f"{self.unit}s"
            self.write(f"{self.title}: done, {self.total} {units} in {self.elapsed():.0f} s")
