"""choose_min_prompt_tokens: the documented rule on hand-made curves, and its refusals."""
from __future__ import annotations

import pytest

from popcompile.errors import ConfigError
from popcompile.threshold import DEFAULT_MIN_SPEEDUP, choose_min_prompt_tokens, speedup_bar

LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def curve(*speedups: float) -> dict[int, float]:
    return dict(zip(LENGTHS, speedups))


def choose(speedups) -> int:
    """The rule's mechanics at a 1.1x bar (the default bar is tested on its own)."""
    return choose_min_prompt_tokens(speedups, min_speedup=1.1)


def test_default_bar_is_1_2_and_gives_the_documented_thresholds():
    # docs/prompt_length.md, onnxruntime engines (16..2048 tokens): both land at 64 with the 1.2x bar
    smollm2 = curve(1.075, 1.181, 1.306, 1.381, 1.300, 1.510, 1.379, 1.551)
    gemma = curve(1.133, 1.101, 1.207, 1.253, 1.346, 1.423, 1.371, 1.541)
    assert DEFAULT_MIN_SPEEDUP == 1.2
    assert choose_min_prompt_tokens(smollm2) == choose_min_prompt_tokens(gemma) == 64
    assert (choose(smollm2), choose(gemma)) == (32, 16)


def test_a_shallow_cut_passes_at_half_its_flop_bounds_gain():
    """The quality floor's SmolLM2 cut (4 of 30 layers) is bounded at ~1.15x: a 1.2x bar would switch POP off
    everywhere; half the bound's gain (1.07x) is the bar instead. A deep cut keeps 1.2x."""
    shallow = {256: 1.142, 512: 1.144, 1024: 1.145, 2048: 1.145}  # the FLOP bound at cut 26 by length
    measured = {256: 0.93, 512: 1.08, 1024: 1.09, 2048: 1.10}
    assert choose_min_prompt_tokens(measured, bounds=shallow) == 512
    assert speedup_bar(1.2, 1.145) == pytest.approx(1.0725) and speedup_bar(1.2, 1.9) == 1.2
    assert speedup_bar(1.2) == 1.2
    with pytest.raises(ConfigError):
        choose_min_prompt_tokens(measured)  # without the bounds: the 1.2x bar, which nothing reaches


def test_shortest_length_from_which_every_longer_one_pays():
    assert choose(curve(0.8, 0.95, 1.05, 1.12, 1.2, 1.3, 1.4, 1.45)) == 128


def test_a_dip_moves_the_threshold_past_it():
    # 32 passes, 64 does not: POP must not switch on at 32 and off again at 64.
    assert choose(curve(0.9, 1.12, 1.05, 1.15, 1.2, 1.3, 1.4, 1.45)) == 128


def test_a_dip_at_a_long_length_leaves_only_the_lengths_after_it():
    assert choose(curve(1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.05, 1.3)) == 2048


def test_every_length_pays_gives_the_shortest():
    assert choose(curve(1.1, 1.2, 1.2, 1.3, 1.3, 1.4, 1.4, 1.5)) == 16


def test_exactly_min_speedup_counts_as_paying():
    assert choose({64: 1.0999, 128: 1.1, 256: 1.3}) == 128


def test_min_speedup_is_a_parameter():
    speedups = curve(0.9, 1.0, 1.05, 1.12, 1.2, 1.3, 1.4, 1.45)
    assert choose_min_prompt_tokens(speedups, min_speedup=1.0) == 32
    assert choose_min_prompt_tokens(speedups, min_speedup=1.25) == 512


def test_order_of_the_mapping_does_not_matter():
    speedups = curve(0.8, 0.95, 1.05, 1.12, 1.2, 1.3, 1.4, 1.45)
    assert choose(dict(reversed(list(speedups.items())))) == 128


def test_no_length_pays_names_the_longest_measurement():
    with pytest.raises(ConfigError, match=r"2048 tokens: 1\.050x\) is below its bar \(1\.100x\).*explicitly"):
        choose(curve(0.8, 0.9, 1.2, 1.2, 1.2, 1.2, 1.2, 1.05))


@pytest.mark.parametrize("bad", [{}, {0: 1.2}, {True: 1.2}, {16.0: 1.2}, {16: 0.0}, {16: float("nan")},
                                 {16: "1.2"}, [(16, 1.2)]])
def test_malformed_measurements_are_refused(bad):
    with pytest.raises(ConfigError):
        choose_min_prompt_tokens(bad)


@pytest.mark.parametrize("bad", [0, -1.1, float("inf"), True])
def test_malformed_min_speedup_is_refused(bad):
    with pytest.raises(ConfigError, match="min_speedup"):
        choose_min_prompt_tokens({16: 1.2}, min_speedup=bad)
