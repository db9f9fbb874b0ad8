"""Sampler, SamplingConfig and StopChecker (numpy only)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from popcompile.runtime.sampling import Sampler, SamplingConfig, StopChecker, StopStrings, softmax

# Frequencies of DRAWS samples from a 6-token distribution: each frequency's standard error
# is at most sqrt(0.25 / 20000) = 0.0035, so 0.02 is > 5 sigma (flaky < 1e-6 per token).
DRAWS = 20000
FREQ_TOL = 0.02


def _logits(batch=3, vocab=50, seed=0):
    return np.random.default_rng(seed).normal(0, 3, size=(batch, vocab)).astype(np.float32)


def _frequencies(config, logits, draws=DRAWS):
    """Empirical distribution of `draws` samples from one row of logits, [V]."""
    sampler = Sampler(config)
    batch = np.repeat(logits[None, :], draws, axis=0)  # one big batch: [draws, V]
    ids = sampler(batch)
    return np.bincount(ids, minlength=logits.shape[-1]) / draws


def test_greedy_is_argmax():
    logits = _logits()
    out = Sampler(SamplingConfig())(logits)
    assert out.dtype == np.int64 and out.shape == (3,)
    np.testing.assert_array_equal(out, logits.argmax(-1))


def test_seed_determinism():
    config = SamplingConfig(greedy=False, temperature=1.3, top_k=20, top_p=0.9, seed=1234)
    steps = [_logits(seed=s) for s in range(20)]
    a, b = Sampler(config), Sampler(config)
    np.testing.assert_array_equal(np.stack([a(x) for x in steps]), np.stack([b(x) for x in steps]))
    other = Sampler(SamplingConfig(greedy=False, temperature=1.3, top_k=20, top_p=0.9, seed=4321))
    assert not np.array_equal(np.stack([a(x) for x in steps]), np.stack([other(x) for x in steps]))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_k_1_is_greedy(temperature):
    logits = _logits(batch=8)
    sampler = Sampler(SamplingConfig(greedy=False, top_k=1, temperature=temperature, seed=0))
    for _ in range(10):
        np.testing.assert_array_equal(sampler(logits), logits.argmax(-1))


def test_tiny_top_p_is_greedy():
    logits = _logits(batch=8)
    sampler = Sampler(SamplingConfig(greedy=False, top_p=1e-9, temperature=2.0, seed=0))
    for _ in range(10):
        np.testing.assert_array_equal(sampler(logits), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_frequencies_match_softmax(temperature):
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -np.inf])
    freq = _frequencies(SamplingConfig(greedy=False, temperature=temperature, seed=7), logits)
    expected = softmax((logits / temperature)[None])[0]
    assert np.abs(freq - expected).max() <= FREQ_TOL
    assert freq[-1] == 0.0  # a -inf logit is never drawn


def test_top_k_frequencies():
    logits = np.array([2.0, 1.5, 1.0, 0.9, 0.0, -0.5])
    freq = _frequencies(SamplingConfig(greedy=False, top_k=3, seed=3), logits)
    expected = np.zeros(6)
    expected[:3] = softmax(logits[None, :3])[0]
    assert np.abs(freq - expected).max() <= FREQ_TOL
    assert freq[3:].sum() == 0.0


def test_top_p_frequencies():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.8 keeps exactly the first two (0.5 + 0.3 >= 0.8).
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    freq = _frequencies(SamplingConfig(greedy=False, top_p=0.8, seed=5), np.log(probs))
    assert np.abs(freq - np.array([0.625, 0.375, 0.0, 0.0])).max() <= FREQ_TOL
    assert freq[2:].sum() == 0.0
    # Just above 0.8 the third token joins the nucleus.
    freq = _frequencies(SamplingConfig(greedy=False, top_p=0.81, seed=5), np.log(probs))
    assert freq[2] > 0.1 and freq[3] == 0.0


def test_accepts_float16_logits_and_rejects_bad_shapes():
    logits = _logits().astype(np.float16)
    out = Sampler(SamplingConfig(greedy=False, seed=0))(logits)
    assert out.shape == (3,) and out.dtype == np.int64
    with pytest.raises(ValueError, match="shape"):
        Sampler(SamplingConfig())(np.zeros(5))
    with pytest.raises(ValueError, match="NaN"):
        Sampler(SamplingConfig())(np.array([[0.0, np.nan]]))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"seed": -3}, "seed"),
    ],
)
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def test_temperature_zero_is_greedy():
    config = SamplingConfig(greedy=False, temperature=0.0, seed=3)
    logits = _logits()
    assert config.greedy and np.array_equal(Sampler(config)(logits), logits.argmax(axis=-1))


def test_config_stop_becomes_tuple():
    assert SamplingConfig(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingConfig(stop="END").stop == ("END",)


def test_stop_checker_eos_and_stop_strings():
    checker = StopChecker(eos_token_ids=[2, 7], stop=("###", "\nUser:"), batch_size=3)
    assert not checker.update(0, 5)
    assert checker.update(0, 7)  # eos id
    assert not checker.update(1, 5, stopped=False)
    assert checker.update(1, 5, stopped=True)  # its text reached a stop string
    assert not checker.update(2, 5)
    assert checker.finished == [True, True, False]
    assert checker.finish_reasons == ["eos", "stop", None]
    assert not checker.all_finished
    assert checker.update(0, 5)  # stays finished
    assert checker.update(2, 2)
    assert checker.all_finished


def test_stop_checker_trim():
    checker = StopChecker([0], stop=("###", "\nUser:"))
    assert checker.trim("answer\nUser: next ### x") == "answer"
    assert checker.trim("a ### b\nUser:") == "a "
    assert checker.trim("no stop here") == "no stop here"


def test_stop_strings_hold_back_what_may_begin_a_stop_string():
    stops = StopStrings(("###", "\nUser:"))
    assert stops.feed("partial #") == "partial "  # '#' may begin '###'
    assert stops.feed("x") == "#x"  # it did not
    assert stops.feed("line\nUs") == "line"
    assert stops.feed("er: more") == "" and stops.hit
    assert stops.feed("after") == ""
    assert StopStrings().feed("anything") == "anything"


@given(st.lists(st.sampled_from(["a", "#", "##", "b#", "\n", "User", ":", " "]), max_size=30))
def test_stop_strings_show_exactly_the_trimmed_text(pieces):
    """Whatever the split into pieces, what is shown (plus the held tail at the end) is the text cut
    before its first stop string, and a hit is reported exactly when the text holds one."""
    stop = ("###", "\nUser:")
    stops = StopStrings(stop)
    shown = "".join(stops.feed(p) for p in pieces)
    text = "".join(pieces)
    checker = StopChecker([], stop)
    assert stops.hit == (checker.trim(text) != text)
    assert (shown + ("" if stops.hit else stops._pending)) == checker.trim(text)
