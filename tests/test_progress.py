"""Progress where stderr is not a terminal (CI logs, nohup, notebooks): lines with elapsed seconds, never
silence (progress.py; the K/V fit's own lines: commands/fitprogress.py)."""
from __future__ import annotations

import io

from popcompile.progress import LogBar, progress_bar


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bar_of_steps_prints_each_step_as_it_begins_and_the_total_time():
    out, clock = io.StringIO(), Clock()
    with LogBar(3, "export", "step", stream=out, clock=clock) as bar:
        for i, name in enumerate(("load", "capture", "write manifest")):
            if i:
                bar.update(1)
            clock.now += 2 * i
            bar.set_description(name)
        bar.update(bar.total - bar.n)
    assert out.getvalue().splitlines() == ["export 1/3: load, 0 s", "export 2/3: capture, 2 s",
                                           "export 3/3: write manifest, 6 s", "export: done, 3 steps in 6 s"]


def test_a_bar_of_counts_prints_a_line_per_tenth_and_nothing_after_a_failure():
    out, clock = io.StringIO(), Clock()
    with LogBar(118, "greedy", "prompt", stream=out, clock=clock) as bar:
        for _ in range(118):
            clock.now += 1
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[0] == "greedy: 12/118 prompt (10%), 12 s"
    assert lines[4] == "greedy: 59/118 prompt (50%), 59 s"
    assert lines[-1] == "greedy: done, 118 prompts in 118 s"
    out = io.StringIO()
    try:
        with LogBar(4, "analyze", "seq", stream=out) as bar:
            bar.update(1)
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert "done" not in out.getvalue()


def test_a_terminal_gets_tqdm_and_anything_else_the_lines():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(progress_bar(3, "x", stream=io.StringIO()), LogBar)
    bar = progress_bar(3, "x", stream=Terminal())
    assert type(bar).__name__ == "tqdm"
    bar.close()
