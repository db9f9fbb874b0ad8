"""The K/V fit's progress on stderr, the one drawing for ``export`` and ``calibrate``.

``FitProgress`` takes the events ``kvfit.fit.fit_on_tokens`` reports: the ``FitPlan`` first (its line: the
estimate; its fallback to POP+, one line), then ``DistillProgress`` per phase (ridge: tokens, teacher:
windows, train: steps). On a terminal a tqdm bar per phase; elsewhere (a log, CI) a line per ~10% of each
phase with the seconds since the fit started, so that a long fit is never silent.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

#: DistillProgress.phase -> (unit, description) of its bar
PHASES = {"ridge": ("tok", "calibrate (POP+, ridge)"),
          "teacher": ("win", "full model (ridge fit, distillation's inputs)"),
          "train": ("step", "distill (POP++)"),
          "floor ridge": ("tok", "quality floor: POP+ at every cut"),
          "floor search": ("prompt", "quality floor: every cut"),
          "floor check": ("prompt", "quality floor: the shipped fit")}


class FitProgress:
    """A callable for ``fit_progress`` / ``progress``; close it (or use it as a context manager) after."""

    def __init__(self, stream: TextIO | None = None, *, leave: bool = True):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.leave, self.bar, self.phase, self.tenth = leave, None, None, 0
        self.start = time.monotonic()

    def __enter__(self) -> FitProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, event) -> None:
        if hasattr(event, "line"):  # the FitPlan
            self.start = time.monotonic()
            self._print(event.line())
            if event.fallback:
                self._print(event.fallback)
            return
        if event.phase != self.phase:
            self.close()
            self.phase, self.tenth = event.phase, 0
            if self.tty:
                from tqdm import tqdm

                unit, desc = PHASES.get(event.phase, ("", event.phase))
                self.bar = tqdm(total=event.total, unit=unit, desc=desc, file=self.stream, leave=self.leave)
        if self.bar is not None:
            self.bar.update(event.done - self.bar.n)
            if event.loss is not None:
                self.bar.set_postfix(kl=f"{event.loss:.4f}", held_out=f"{event.held_out:.4f}", refresh=False)
            return
        tenth = 10 * event.done // max(event.total, 1)
        if tenth > self.tenth:
            self.tenth = tenth
            unit, desc = PHASES.get(event.phase, ("", event.phase))
            kl = "" if event.loss is None else f", KL {event.loss:.4f}, held-out {event.held_out:.4f}"
            share = 100 * event.done // max(event.total, 1)
            self._print(f"{desc}: {event.done}/{event.total} {unit} ({share}%), "
                        f"{time.monotonic() - self.start:.0f} s{kl}")

    def _print(self, line: str) -> None:
        if self.tty:
            from tqdm import tqdm

            tqdm.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
