"""What the CLI writes on stderr in a log besides its one-line error: progress (progress.LogBar: a line as
each step begins, a line per 10% of a count, a closing line; commands/fitprogress.py: the fit's estimate and
its lines). ``error_lines(stderr)``: the rest, which a refusal keeps to one line."""
from __future__ import annotations

import re

PROGRESS = re.compile(r"\S+ \d+/\d+: .+, \d+ s"                # a step begins (export 3/9: capture, 12 s)
                      r"|[^:]+: \d+/\d+ \S+ \(\d+%\), \d+ s.*"  # a share of a count, the fit's too
                      r"|\S+: done, \d+ \S+ in \d+ s")          # the end of a bar that ran to the end


def error_lines(stderr: str) -> list[str]:
    """stderr's non-blank lines that are not progress."""
    return [line for line in stderr.splitlines() if line.strip() and not PROGRESS.fullmatch(line)]
