"""Sampling defaults from an engine's generation_config.json, under the user's options (no torch).

Like transformers' ``generate`` (and vLLM, onnxruntime-genai), a model's generation_config.json
sets the default decoding: ``do_sample`` false or absent means greedy; ``temperature``, ``top_k``
and ``top_p`` are the sampling values. An option the user gives wins over the file, and giving a
sampling option (``--temperature``/``--top-k``/``--top-p``) asks for sampling. A value neither
gives is off (temperature 1, top_k 0, top_p 1; transformers would add top_k 50 when sampling
without one, vLLM adds nothing: popcompile applies only what someone asked for). Temperature 0
means greedy. ``SamplingChoice.to_dict`` records every value used and where it came from, for
``run --json``. Keys of the file that change decoding and that popcompile does not apply
(``repetition_penalty`` ...) are listed in ``ignored``, never dropped silently.

The Python API follows the same rule (``engine_sampling``): ``generate(prompt)`` and
``generate(prompt, {"max_new_tokens": 200})`` decode as the engine's file says, a dict's
temperature/top_k/top_p ask for sampling, ``"greedy": True``/``False`` decides outright; a
``SamplingConfig`` is used exactly as given.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, EngineError
from .sampling import SamplingConfig, sampling_config

__all__ = ["SamplingChoice", "SamplingOptions", "engine_sampling", "resolve_sampling"]

FILE = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_k", "top_p")
#: the value of each sampling key that changes nothing (transformers' and popcompile's "off")
NEUTRAL: dict[str, float | int] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
#: generation_config keys that change decoding in transformers and that popcompile does not apply,
#: with the value that changes nothing (None: any value but None changes decoding)
UNAPPLIED: dict[str, Any] = {"repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0,
                             "no_repeat_ngram_size": 0, "num_beams": 1, "epsilon_cutoff": 0.0,
                             "eta_cutoff": 0.0, "penalty_alpha": None}


def _real(value: Any) -> bool:
    """A finite number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    """An integer >= 0 (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


#: key -> (valid value, what a valid value is)
_RULES = {
    "temperature": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (0 = greedy)"),
    "top_k": (_count, "an integer >= 0 (0 = off)"),
    "top_p": (lambda v: _real(v) and 0 < v <= 1, "a number in (0, 1] (1 = off)"),
    "seed": (_count, "an integer >= 0"),
}


@dataclass(frozen=True)
class SamplingOptions:
    """What the user asked for (None: not given; ``greedy=False`` asks to sample). Checked here, before
    any engine is loaded."""

    greedy: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        for key, (valid, meaning) in _RULES.items():
            value = getattr(self, key)
            if value is not None and not valid(value):
                raise ConfigError(f"--{key.replace('_', '-')} must be {meaning}, got {value!r}")
        if self.greedy is not None and not isinstance(self.greedy, bool):
            raise ConfigError(f"greedy must be True, False or None, got {self.greedy!r}")
        if self.greedy and self.given:
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in self.given)
            raise ConfigError(f"--greedy cannot be combined with {flags}: choose one")

    @property
    def given(self) -> dict[str, float | int]:
        """The sampling values the user gave."""
        values = {key: getattr(self, key) for key in SAMPLING_KEYS}
        return {key: value for key, value in values.items() if value is not None}


@dataclass(frozen=True)
class SamplingChoice:
    """The decoding a generation uses: greedy, or sampling with these values; ``sources`` says where
    each came from (a flag, the file or "off"), ``ignored`` the file's keys popcompile does not apply."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    sources: dict[str, str] = field(default_factory=dict)
    ignored: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert set(self.sources) >= {"greedy", *SAMPLING_KEYS}, self.sources

    def config(self, max_new_tokens: int = 64, stop: tuple[str, ...] = ()) -> SamplingConfig:
        """The runtime's ``SamplingConfig`` (temperature passed as chosen: 0 is greedy there too)."""
        return SamplingConfig(greedy=self.greedy, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed, max_new_tokens=max_new_tokens, stop=stop)

    def to_dict(self) -> dict[str, Any]:
        """For ``run --json``: greedy, or the sampling values and seed; their sources; what was ignored."""
        used = {} if self.greedy else {key: getattr(self, key) for key in (*SAMPLING_KEYS, "seed")}
        sources = {key: self.sources[key] for key in ("greedy", *used) if key in self.sources}
        return {"greedy": self.greedy, **used, "sources": sources, "ignored": dict(self.ignored)}


def file_defaults(generation_config: Mapping[str, Any], origin: str = FILE) -> dict[str, Any]:
    """do_sample and the sampling values the file sets (None and absent keys left out).
    EngineError naming ``origin`` for a value of the wrong type or out of range."""
    found = {key: generation_config.get(key) for key in ("do_sample", *SAMPLING_KEYS)}
    found = {key: value for key, value in found.items() if value is not None}
    if "do_sample" in found and not isinstance(found["do_sample"], bool):
        raise EngineError(f"{origin}: do_sample must be true or false, got {found['do_sample']!r}: "
                          "fix the file")
    for key in SAMPLING_KEYS:
        valid, meaning = _RULES[key]
        if key in found and not valid(found[key]):
            raise EngineError(f"{origin}: {key} must be {meaning}, got {found[key]!r}: fix the file")
    return found


def unapplied(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The file's decoding keys popcompile does not apply, where they are set to change decoding."""
    return {key: generation_config[key] for key, neutral in UNAPPLIED.items()
            if generation_config.get(key, neutral) not in (neutral, None)}


def _mode(options: SamplingOptions, file: Mapping[str, Any]) -> tuple[bool, str]:
    """(greedy, why): --greedy (or greedy=False), then a sampling option given, then the file's do_sample."""
    if options.greedy is not None:
        return options.greedy, "--greedy" if options.greedy else "greedy=False"
    if options.given:
        return False, ", ".join(f"--{k.replace('_', '-')}" for k in options.given)
    if "do_sample" in file:
        return not file["do_sample"], f"{FILE} do_sample={str(file['do_sample']).lower()}"
    return True, f"default: {FILE} sets no do_sample"


def resolve_sampling(generation_config: Mapping[str, Any], options: SamplingOptions = SamplingOptions(),
                     origin: str = FILE) -> SamplingChoice:
    """The decoding for ``options`` over the engine's ``generation_config`` (see the module docstring)."""
    file = file_defaults(generation_config, origin)
    greedy, why = _mode(options, file)
    values, sources = {}, {"greedy": why}
    for key in SAMPLING_KEYS:
        flag = f"--{key.replace('_', '-')}"
        for source, table in ((flag, options.given), (FILE, file), ("off", NEUTRAL)):
            if key in table:
                values[key], sources[key] = table[key], source
                break
    if values["temperature"] == 0 and not greedy:
        greedy, sources["greedy"] = True, f"temperature 0 ({sources['temperature']})"
    sources["seed"] = "--seed" if options.seed is not None else "none: a new random seed"
    seed = None if options.seed is None else int(options.seed)
    return SamplingChoice(greedy=greedy, temperature=float(values["temperature"]), top_k=int(values["top_k"]),
                          top_p=float(values["top_p"]), seed=seed, sources=sources,
                          ignored=unapplied(generation_config))


def engine_sampling(generation_config: Mapping[str, Any], sampling: SamplingConfig | Mapping | None = None,
                    origin: str = FILE) -> SamplingConfig:
    """What a session's ``generate(prompts, sampling)`` runs with: a ``SamplingConfig`` as given; None or
    a dict of SamplingConfig fields over the engine's generation_config defaults (module docstring)."""
    if sampling is not None and not isinstance(sampling, Mapping):
        return sampling_config(sampling)  # a SamplingConfig, or a ConfigError naming the wrong type
    given = dict(sampling or {})
    sampling_config(given)  # unknown keys and bad values: ConfigError naming the field
    choice = {key: given.pop(key) for key in ("greedy", *SAMPLING_KEYS, "seed") if key in given}
    return resolve_sampling(generation_config, SamplingOptions(**choice), origin).config(**given)
