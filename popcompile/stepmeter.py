"""Per-step wall time and peak resident memory of a compile (``export --json``'s "steps").

``StepMeter`` times each named step of ``driver.compile`` and samples the process's RSS while it runs;
each step ends as one ``StepRecord``.
"""
from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StepRecord:
    """One step of a compile as measured: wall seconds, and the process's resident memory (bytes): the highest
    sampled while it ran, and at its end."""

    name: str
    seconds: float
    peak_rss: int
    end_rss: int

    def to_dict(self) -> dict:
        return {"name": self.name, "seconds": round(self.seconds, 3), "peak_rss_bytes": self.peak_rss,
                "end_rss_bytes": self.end_rss}


class StepMeter:
    """Times each step of a compile and samples the process's resident set size (RSS) while it runs.

    The peak per step is *sampled*: a daemon thread reads /proc/self/statm every ``interval`` seconds (and at
    each step's start and end), so a spike shorter than the interval can be missed. getrusage's ru_maxrss (a
    process-lifetime peak, never lowered) is folded in wherever it rose during the step, so no step's peak is
    below the true peak when that peak was reached within it. Where /proc is missing (not Linux) only
    ru_maxrss is read: then each step's peak is the running peak of the process so far.
    """

    def __init__(self, sink: Callable[[StepRecord], None], interval: float = 0.02) -> None:
        self._sink, self._interval = sink, interval
        self._lock = threading.Lock()
        self._name: str | None = None
        self._started = self._peak = self._maxrss = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def reporting(self, progress: Callable[[str], None]) -> Callable[[str], None]:
        """``progress`` that also starts a record at each name."""
        def report(name: str) -> None:
            self.start(name)
            progress(name)
        return report

    def start(self, name: str) -> None:
        """Ends the step running (its record to the sink) and starts ``name``."""
        self._finish()
        rss = rss_bytes()
        with self._lock:
            self._name, self._started, self._peak, self._maxrss = name, time.perf_counter(), rss, _maxrss()

    def __enter__(self) -> StepMeter:
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="popcompile-step-meter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc[0] is None:
            self._finish()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            rss = rss_bytes()
            with self._lock:
                self._peak = max(self._peak, rss)

    def _finish(self) -> None:
        with self._lock:
            if self._name is None:
                return
            end, maxrss = rss_bytes(), _maxrss()
            peak = max(self._peak, end, maxrss if maxrss > self._maxrss or not _HAS_STATM else 0)
            record = StepRecord(self._name, time.perf_counter() - self._started, peak, end)
            self._name = None
        self._sink(record)


_HAS_STATM = os.path.exists("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """The process's resident set size now (bytes); ru_maxrss where /proc is missing."""
    if not _HAS_STATM:
        return _maxrss()
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * _PAGE


def _maxrss() -> int:
    """getrusage's lifetime peak RSS in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
