"""The prompt length from which POP pays: ``min_prompt_tokens`` from a measured speedup curve.

POP saves the deep layers' attention and MLP on x_1..x_{N-1}; on a short prompt that saving is small
next to the fixed cost of a call (the LM head, the weights read for x_N, the runtime's overhead), and
POP still costs quality. So a prompt shorter than ``min_prompt_tokens`` is prefilled by the full model.

The rule (docs/prompt_length.md): the shortest measured length whose speedup (full TTFT / POP TTFT,
medians of interleaved repetitions) is at least its bar, and from which every longer measured length also
is. The bar is ``min_speedup`` (default 1.2), or half the gain of the cut's FLOP bound at that length
where that is less (``speedup_bar``: a cut bounded at 1.15x passes at 1.075x). A dip below ``min_speedup``
at a longer length moves the threshold past the dip: one lucky short measurement cannot switch POP on for
the lengths where it was seen not to pay.

    lengths   16   32   64   128  256  512  1024 2048
    speedup  0.9  1.22 1.15 1.25 1.3  1.35 1.4  1.45   -> 128 (32 passes, but 64 does not)
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from .errors import ConfigError

#: POP's quality cost is paid at every length; below ~1.2x its gain is within this CPU's run-to-run noise
#: (single rows swing by ~0.1x) and short chat prompts are where users read answers most closely.
#: docs/prompt_length.md: 64 tokens for both shipped models' onnxruntime engines (1.1x would give 16-32).
DEFAULT_MIN_SPEEDUP = 1.2
#: a cut whose FLOP bound is low: the bar is this share of the bound's gain where that is below min_speedup
BOUND_SHARE = 0.5
#: the threshold where none is measured (the torch.compile backend, the vLLM plugin): the rule above on the
#: torch backend's curve gives 16 (SmolLM2) and 64 (Gemma 3), the onnxruntime engines' 64 for both; the larger
FIXED_MIN_PROMPT_TOKENS = 64
#: a min_prompt_tokens of 0: POP for every prompt (the runtime's generation loop when nobody asks otherwise)
ALWAYS_POP = 0


def is_token_count(value: object) -> bool:
    """The one rule for a min_prompt_tokens value: an integer >= 0 (numpy's too; not a bool). 0: POP for
    every prompt."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def uses_pop(prompt_tokens, min_prompt_tokens):
    """The one rule that picks a prefill: POP for a prompt of ``prompt_tokens`` when it is at least
    ``min_prompt_tokens``, the full model below. Elementwise on numpy arrays (the vLLM runner's batch)."""
    return prompt_tokens >= min_prompt_tokens


def speedup_bar(min_speedup: float, flop_bound: float | None = None) -> float:
    """The speedup a length must reach: ``min_speedup``, or half the FLOP bound's gain at that length where
    that is less (a shallow cut, e.g. the quality floor's 4 of 30 layers, bounds POP at 1.15x: a 1.2x bar
    would switch it off at every length)."""
    if flop_bound is None:
        return min_speedup
    return min(min_speedup, 1 + BOUND_SHARE * (flop_bound - 1))


def choose_min_prompt_tokens(measurements: Mapping[int, float],
                             min_speedup: float = DEFAULT_MIN_SPEEDUP,
                             bounds: Mapping[int, float] | None = None) -> int:
    """The shortest measured prompt length from which every measured speedup reaches its bar
    (``speedup_bar``: ``min_speedup``, or half the FLOP bound's gain where ``bounds`` gives a smaller one).

    ``measurements``: prompt length (tokens) -> measured speedup of POP over full (> 0); ``bounds``: the
    same lengths -> the cut's FLOP bound. ConfigError when the measurements are malformed or when even the
    longest measured length is below its bar (POP pays nowhere that was measured: the fix is a measurement
    at longer prompts, or an explicit threshold).
    """
    _check(measurements, min_speedup)
    bounds = bounds or {}
    chosen = None
    for tokens in sorted(measurements, reverse=True):  # longest first: walk down while every length pays
        if measurements[tokens] < speedup_bar(min_speedup, bounds.get(tokens)):
            break
        chosen = tokens
    if chosen is None:
        longest = max(measurements)
        raise ConfigError(
            f"POP's measured speedup at the longest measured prompt ({longest} tokens: "
            f"{measurements[longest]:.3f}x) is below its bar "
            f"({speedup_bar(min_speedup, bounds.get(longest)):.3f}x): no length pays; measure "
            f"longer prompts or give min_prompt_tokens explicitly")
    return chosen


def _check(measurements: Mapping[int, float], min_speedup: float) -> None:
    if not isinstance(measurements, Mapping) or not measurements:
        raise ConfigError("measurements must be a non-empty mapping of prompt length -> speedup, "
                          f"got {measurements!r}")
    for tokens, speedup in measurements.items():
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ConfigError(f"prompt length {tokens!r} must be an int >= 1 (tokens)")
        if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or not math.isfinite(speedup) \
                or speedup <= 0:
            raise ConfigError(f"speedup {speedup!r} at {tokens} tokens must be a finite number > 0 "
                              "(full TTFT / POP TTFT)")
    if isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)) \
            or not math.isfinite(min_speedup) or min_speedup <= 0:
        raise ConfigError(f"min_speedup={min_speedup!r} must be a finite number > 0 (e.g. 1.1)")
