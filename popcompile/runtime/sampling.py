"""Token sampling and stop conditions shared by the runtimes (numpy only).

``Sampler`` turns one decode step's logits ``[B, V]`` into next-token ids ``[B]``;
``StopChecker`` tracks which batch rows have finished (eos token or stop string); ``StopStrings`` watches
one row's streamed text for stop strings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

from ..errors import ConfigError, EngineError

__all__ = ["SamplingConfig", "Sampler", "StopChecker", "StopStrings", "sampling_config"]


@dataclass(frozen=True)
class SamplingConfig:
    """How next tokens are chosen and when generation stops.

    ``greedy`` takes the argmax and ignores temperature/top_k/top_p.  Otherwise the
    logits are divided by ``temperature``, cut to the ``top_k`` best (0 = off), cut to
    the nucleus of probability ``top_p`` (1 = off) and sampled with ``seed``.
    ``temperature=0`` means greedy (the limit of sampling as the temperature falls, and what most
    tools mean by it): the config then reads ``greedy=True``. Every invalid value is a ConfigError.
    """

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, (test, what) in _CHECKS.items():
            if not test(getattr(self, name)):
                raise ConfigError(f"{name} must be {what}, got {getattr(self, name)!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ConfigError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.temperature == 0:
            object.__setattr__(self, "greedy", True)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite int or float (not a bool, not inf or nan)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
        and math.isfinite(value)


#: SamplingConfig field -> (test, what the value must be)
_CHECKS = {
    "greedy": (lambda v: isinstance(v, (bool, np.bool_)), "True or False"),
    "temperature": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0 (0 = greedy)"),
    "top_k": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0 = off)"),
    "top_p": (lambda v: _is_real(v) and 0 < v <= 1, "a number in (0, 1] (1 = off)"),
    "max_new_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "seed": (lambda v: v is None or (_is_int(v) and v >= 0), "None or an integer >= 0"),
    "stop": (lambda v: isinstance(v, (str, list, tuple)), "a string or a list of strings"),
}


def sampling_config(value: SamplingConfig | Mapping | None) -> SamplingConfig:
    """What ``generate(..., sampling)`` takes: a SamplingConfig, a mapping of its fields, or None
    (the defaults)."""
    if value is None or isinstance(value, SamplingConfig):
        return value or SamplingConfig()
    if not isinstance(value, Mapping):
        raise ConfigError("sampling must be a SamplingConfig or a dict of its fields, "
                          f"got {type(value).__name__}")
    known = [f.name for f in fields(SamplingConfig)]
    unknown = [key for key in value if key not in known]
    if unknown:
        raise ConfigError(f"unknown sampling options {unknown}: choose from {', '.join(known)}")
    return SamplingConfig(**value)


class Sampler:
    """Choose next tokens from logits according to a ``SamplingConfig``.

    Owns a ``numpy.random.Generator`` seeded from ``config.seed``, so a given seed
    and sequence of logits always yields the same tokens.
    """

    def __init__(self, config: SamplingConfig) -> None:
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """logits ``[B, V]`` (any float dtype) -> token ids ``[B]`` int64."""
        x = np.asarray(logits, dtype=np.float64)
        if x.ndim != 2:
            raise ValueError(f"logits must have shape [batch, vocab], got {x.shape}")
        if np.isnan(x).any():
            raise EngineError("the engine's logits contain NaN (a float16 overflow, or a damaged engine): "
                              "export it with --dtype float32, or re-export it")
        if self.config.greedy:
            return np.argmax(x, axis=-1).astype(np.int64)
        probs = self.probabilities(x)
        return sample_from(probs, self.rng)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """logits ``[B, V]`` -> the float64 distribution ``[B, V]`` sampling draws from."""
        cfg = self.config
        x = np.asarray(logits, dtype=np.float64) / cfg.temperature
        if cfg.top_k:
            x = top_k_filter(x, cfg.top_k)
        probs = softmax(x)
        if cfg.top_p < 1.0:
            probs = top_p_filter(probs, cfg.top_p)
        return probs


def softmax(x: np.ndarray) -> np.ndarray:
    """``[B, V]`` -> row-wise softmax ``[B, V]`` float64; -inf entries get probability 0."""
    x = np.asarray(x, dtype=np.float64)
    peak = x.max(axis=-1, keepdims=True)
    if not np.isfinite(peak).all():
        raise EngineError("every row of the engine's logits needs at least one finite value "
                          "(float16 overflow?): export it with --dtype float32, or re-export it")
    e = np.exp(x - peak)
    return e / e.sum(axis=-1, keepdims=True)


def top_k_filter(x: np.ndarray, k: int) -> np.ndarray:
    """``[B, V]`` logits -> copy with everything below the k-th largest set to -inf.

    Ties with the k-th value are kept (like transformers' TopKLogitsWarper).
    """
    vocab = x.shape[-1]
    if k >= vocab:
        return x
    kth = np.partition(x, vocab - k, axis=-1)[:, vocab - k : vocab - k + 1]  # [B, 1]
    return np.where(x < kth, -np.inf, x)


_TOP_P_SLACK = 1e-9


def top_p_filter(probs: np.ndarray, top_p: float) -> np.ndarray:
    """``[B, V]`` probabilities -> renormalized nucleus ``[B, V]``.

    Keeps the smallest set of most likely tokens whose cumulative probability
    reaches ``top_p``, and always at least the most likely token.  Cumulative sums
    within ``_TOP_P_SLACK`` of ``top_p`` count as reaching it, so float rounding
    (0.5 + 0.3 summing to 0.79999...) does not add a token.
    """
    order = np.argsort(-probs, axis=-1, kind="stable")  # [B, V] most likely first
    ranked = np.take_along_axis(probs, order, axis=-1)
    before = np.cumsum(ranked, axis=-1) - ranked  # mass of the better-ranked tokens
    keep_ranked = before < top_p - _TOP_P_SLACK
    keep_ranked[:, 0] = True
    keep = np.zeros_like(keep_ranked)
    np.put_along_axis(keep, order, keep_ranked, axis=-1)
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum(axis=-1, keepdims=True)


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``[B, V]`` probabilities -> one draw per row ``[B]`` int64 (inverse CDF).

    Tokens of probability 0 are never drawn.
    """
    cdf = np.cumsum(probs, axis=-1)  # [B, V]
    u = rng.random(probs.shape[0]) * cdf[:, -1]  # [B], scaled in case of rounding
    ids = (cdf > u[:, None]).argmax(axis=-1)
    return ids.astype(np.int64)


class StopChecker:
    """Track which batch rows have finished generating.

    A row finishes when it produces one of ``eos_token_ids`` or when its generated text reaches one of
    the ``stop`` strings (its ``StopStrings`` says so).  ``finish_reasons[row]`` is then ``"eos"`` or
    ``"stop"`` (None while the row is running).
    """

    def __init__(
        self, eos_token_ids: Iterable[int], stop: Sequence[str] = (), batch_size: int = 1
    ) -> None:
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        self.finish_reasons: list[str | None] = [None] * batch_size

    @property
    def finished(self) -> list[bool]:
        """Per row: has it finished."""
        return [reason is not None for reason in self.finish_reasons]

    @property
    def all_finished(self) -> bool:
        """Whether every row has finished."""
        return all(self.finished)

    def update(self, row: int, token_id: int, stopped: bool = False) -> bool:
        """Record ``row``'s new token and whether its text reached a stop string; return whether it finished.

        Rows that already finished stay finished with their first reason.
        """
        if self.finish_reasons[row] is None:
            if int(token_id) in self.eos_token_ids:
                self.finish_reasons[row] = "eos"
            elif stopped:
                self.finish_reasons[row] = "stop"
        return self.finish_reasons[row] is not None

    def trim(self, text: str) -> str:
        """``text`` cut just before its first stop string (unchanged if none occurs)."""
        at = find_stop(text, self.stop)
        return text if at < 0 else text[:at]


def find_stop(text: str, stop: Sequence[str]) -> int:
    """Index of the earliest of the ``stop`` strings in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits, default=-1)


class StopStrings:
    """One row's watch for stop strings over text that arrives in pieces, in time linear in the text.

    ``feed(piece)`` returns the text now safe to show: never a stop string, nor a tail that may begin one
    (held back until the next pieces decide). Only that held-back tail is searched again, so a long
    output costs no more per token than a short one.

        stop "###":   feed("a #") -> "a "    feed("#") -> ""    feed("# b") -> ""   (hit: "a " was all)
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(stop)
        self.hit = False
        self._pending = ""  # not shown yet: shorter than the longest stop string, or empty

    def feed(self, piece: str) -> str:
        if self.hit:
            return ""
        pending = self._pending + piece
        at = find_stop(pending, self.stop)
        if at >= 0:
            self.hit, self._pending = True, ""
            return pending[:at]
        keep = len(pending) - _stop_prefix_length(pending, self.stop)
        self._pending = pending[keep:]
        return pending[:keep]


def _stop_prefix_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that begins one of the ``stop`` strings (0: none)."""
    longest = min(max((len(s) for s in stop), default=1) - 1, len(text))
    for length in range(longest, 0, -1):
        if any(s.startswith(text[-length:]) for s in stop):
            return length
    return 0
