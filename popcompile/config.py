"""What a POP compile is asked for: ``PopConfig``, validated once; the one place a cut is resolved.

    PopConfig(cut=None, prune_ratio=None,     which layers are pruned: cut = first pruned layer, or
              boundary="folded",              L - floor(L * prune_ratio) (default 1/3; resolve_cut)
              kv_calibration="auto",          KVCalibration: none | auto | ridge | distill | a file
                                              from `popcompile calibrate`
              dtype="float32", max_seq=None,  engine precision, KV buffer length
                                              (None: min(4096, model limit): engine.kv.DEFAULT_MAX_SEQ)
              min_prompt_tokens="auto",       prompts shorter than this prefill in full ("auto": measured)
              kv_fit=KVFitConfig())           how auto / ridge / distill fit (steps, windows, ridge, ...)

Every entry point builds one (the CLI from flags, ``torch.compile`` from ``options=``, Python users
directly) and hands it to the driver (``driver.py``) or the backend (``dynamo.py``). An object that
exists is valid for any model; ``resolve_cut`` checks it against the model's depth once it is known.
Nothing here imports torch.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .engine.manifest import BOUNDARIES
from .errors import ConfigError
from .threshold import is_token_count

DEFAULT_PRUNE_RATIO = 1 / 3
#: engine precisions: the graphs' weights, activations, KV inputs/outputs and logits all take this dtype
DTYPES = ("float32", "float16")
#: capture traces 3 new tokens over 4 cached ones (capture.example_inputs): a shorter buffer cannot be
#: exported
MIN_MAX_SEQ = 8
KV_MODES = ("none", "auto", "ridge", "distill", "file")
#: the modes that fit on the built-in corpus while compiling (export only: the torch.compile backend
#: refuses them)
FITTED_MODES = ("auto", "ridge", "distill")
#: weight formats of an ONNX engine: float (the engine's dtype) or onnxruntime's MatMulNBits blocks
WEIGHT_FORMATS = ("float", "int8", "int4")
#: how an onnx engine's attention is lowered: onnxruntime's fused contrib ops, standard ONNX ops (any
#: runtime), or auto: decided per dtype by exporters.targets.OnnxTarget.lowering
ATTENTION_LOWERINGS = ("auto", "fused", "standard")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_prune_ratio(value: object) -> bool:
    """The one rule for a share of layers to prune: a finite number, 0 <= value < 1 (not a bool)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0.0 <= value < 1.0)


def check_cut_choice(cut: object, prune_ratio: object) -> None:
    """The one check of a requested cut before the model's depth is known: ``cut`` an integer >= 1 or
    ``prune_ratio`` a share (is_prune_ratio), not both; ConfigError naming the flag and the keyword."""
    if cut is not None and prune_ratio is not None:
        raise ConfigError("give either cut or prune_ratio (--cut / --prune-ratio), not both")
    if cut is not None and (not _is_int(cut) or cut < 1):
        raise ConfigError(f"{_named('cut', cut)} is not a layer index: give an integer >= 1")
    if prune_ratio is not None and not is_prune_ratio(prune_ratio):
        raise ConfigError(f"{_named('prune_ratio', prune_ratio)} is out of range: use 0 <= ratio < 1")


def resolve_cut(num_layers: int, cut: int | None = None, prune_ratio: float | None = None) -> int:
    """The first pruned layer: ``cut`` as given, else ``L - floor(L * prune_ratio)`` (default 1/3).

    ``cut == num_layers`` prunes nothing. Raises ConfigError (a ValueError) on values of the wrong type
    or out of range.
    """
    check_cut_choice(cut, prune_ratio)
    if cut is None:
        ratio = DEFAULT_PRUNE_RATIO if prune_ratio is None else prune_ratio
        # The small epsilon keeps 1/3 of 30 layers at exactly 10 despite float rounding.
        cut = num_layers - math.floor(num_layers * ratio + 1e-9)
    if not cut <= num_layers:
        raise ConfigError(f"cut={cut} is out of range for a model with {num_layers} layers: "
                          f"use 1..{num_layers}")
    return cut


@dataclass(frozen=True)
class KVCalibration:
    """POP+ replacement K/V projections for the pruned layers (kvfit/calibrate.py):

    ``none``     plain POP, the paper's (the layers' own k/v projections of h_cut)
    ``ridge``    POP+: fitted in closed form at compile time on the built-in corpus (2 min on CPU)
    ``distill``  POP++: the ridge fit, then trained on KL(full || POP) of the full model's first greedy
                 tokens (distill.py; 4-5 min on CPU; text models)
    ``auto``     export's default: the best fit this model has, distill for a text model, ridge for a
                 vision-language model (kvfit.fit.fit_method; docs/results.md "Greedy agreement")
    ``file``     a fit from ``popcompile calibrate`` (its cut must be the compile's)
    """

    mode: str = "none"
    path: Path | None = None

    def __post_init__(self) -> None:
        if self.mode not in KV_MODES:
            raise ConfigError(f"kv_calibration mode {self.mode!r} is not one of {', '.join(KV_MODES)}: "
                              "give one of them (file with a path)")
        if (self.mode == "file") != (self.path is not None):
            raise ConfigError("kv_calibration: a path goes with mode 'file' and only with it")

    @property
    def fits_now(self) -> bool:
        """True for the modes fitted while compiling (FITTED_MODES), False for none and a file."""
        return self.mode in FITTED_MODES

    @classmethod
    def of(cls, value: Any) -> KVCalibration:
        """From what users write: None/"none"/False, "auto"/True, "ridge", "distill", a path (str or Path), or
        a KVCalibration."""
        if isinstance(value, KVCalibration):
            return value
        if value is None or value is False or value == "none":
            return cls("none")
        if value is True or value == "auto":
            return cls("auto")
        if value in ("ridge", "distill"):
            return cls(value)
        if isinstance(value, (str, Path)) and str(value):
            path = Path(value)
            if not path.is_file():
                raise ConfigError(f"KV calibration file {path} does not exist: give auto, none, ridge, "
                                  "distill, or a file from `popcompile calibrate MODEL --out FILE`")
            return cls("file", path)
        raise ConfigError(f"kv_calibration={value!r} is not valid: give auto, none, ridge, distill, or a "
                          "file from `popcompile calibrate`")

    def __str__(self) -> str:
        return str(self.path) if self.path is not None else self.mode


@dataclass(frozen=True)
class WeightQuantization:
    """Weight-only quantisation of an ONNX engine's matmuls (exporters/quantize.py): ``format`` float keeps
    the weights in the engine's dtype; int8/int4 store every MatMul weight (and the LM head) in blocks of
    ``block_size`` input channels, one scale each (symmetric), as onnxruntime's ``MatMulNBits``.
    ``accuracy_level`` is that op's compute type on CPU: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8
    activations (the fastest on x86, onnxruntime-genai's CPU default)."""

    format: str = "float"
    block_size: int = 32
    accuracy_level: int = 4

    def __post_init__(self) -> None:
        if self.format not in WEIGHT_FORMATS:
            raise ConfigError(f"{_named('weights', self.format)} is not a weight format: choose one of "
                              f"{', '.join(WEIGHT_FORMATS)}")
        if not (_is_int(self.block_size) and 16 <= self.block_size <= 256
                and self.block_size & (self.block_size - 1) == 0):
            raise ConfigError(f"{_named('block_size', self.block_size)} is not valid: give a power of two "
                              "from 16 to 256 (32 is onnxruntime-genai's CPU default)")
        if not (_is_int(self.accuracy_level) and 0 <= self.accuracy_level <= 4):
            raise ConfigError(f"{_named('accuracy_level', self.accuracy_level)} is not valid: give 0..4 "
                              "(4: int8 activations, the fastest on CPU)")

    @property
    def bits(self) -> int | None:
        """4 or 8; None for float weights."""
        return {"int8": 8, "int4": 4}.get(self.format)

    def to_manifest(self) -> dict:
        """The manifest's ``quantization`` entry: empty for float weights."""
        if self.bits is None:
            return {}
        return {"format": self.format, "op": "com.microsoft.MatMulNBits", "bits": self.bits,
                "block_size": self.block_size, "accuracy_level": self.accuracy_level, "symmetric": True}


def _named(field: str, value: object) -> str:
    """``--max-seq 4 (max_seq=4)``: the culprit as the CLI flag and the Python keyword both."""
    return f"--{field.replace('_', '-')} {value!r} ({field}={value!r})"


@dataclass(frozen=True)
class PopConfig:
    """The whole request of one compile (see the module docstring); validated on construction."""

    cut: int | None = None
    prune_ratio: float | None = None
    boundary: str = "folded"
    kv_calibration: KVCalibration | str | Path | bool | None = "auto"
    dtype: str = "float32"
    max_seq: int | None = None
    min_prompt_tokens: int | str = "auto"
    #: how auto / ridge / distill fit the pruned layers' K/V at compile time (ridge, windows, distill steps)
    kv_fit: "KVFitConfig" = field(default_factory=lambda: KVFitConfig())
    #: how an automatic cut was chosen (method, figures): recorded in the manifest's ``extra``
    cut_choice: Mapping[str, Any] | None = field(default=None, compare=False)
    #: choose the cut at compile time: the deepest that keeps the full model's answer (quality/floor.py)
    quality_floor: QualityFloor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_calibration", KVCalibration.of(self.kv_calibration))
        check_cut_choice(self.cut, self.prune_ratio)
        if self.dtype not in DTYPES:
            raise ConfigError(f"{_named('dtype', self.dtype)} is not supported: "
                              f"choose one of {', '.join(DTYPES)}")
        if self.boundary not in BOUNDARIES:
            raise ConfigError(f"{_named('boundary', self.boundary)} is not supported: choose one of "
                              f"{', '.join(BOUNDARIES)}")
        if self.max_seq is not None and (not _is_int(self.max_seq) or self.max_seq < MIN_MAX_SEQ):
            raise ConfigError(f"{_named('max_seq', self.max_seq)} is too small: "
                              f"give an integer >= {MIN_MAX_SEQ}")
        if not (self.min_prompt_tokens == "auto" or is_token_count(self.min_prompt_tokens)):
            raise ConfigError(f"{_named('min_prompt_tokens', self.min_prompt_tokens)} is not valid: "
                              "give auto (measure at export) or an integer >= 0 (0: POP for every prompt)")
        if self.quality_floor is not None and not isinstance(self.quality_floor, QualityFloor):
            raise ConfigError(f"quality_floor={self.quality_floor!r} is not a QualityFloor: give "
                              "QualityFloor(min_agreement=...) or None")
        if self.quality_floor is not None and (self.cut is not None or self.prune_ratio is not None):
            raise ConfigError("quality_floor chooses the cut (--cut auto); cut / prune_ratio (--cut N, "
                              "--prune-ratio R) fix it: give one")
        if self.quality_floor is not None and self.kv_calibration.path is not None:
            raise ConfigError(f"quality_floor chooses the cut (--cut auto), but the calibration file "
                              f"{self.kv_calibration.path} was fitted for one cut: give that cut (--cut N), "
                              "or kv_calibration auto to fit at the chosen cut")
        if not isinstance(self.kv_fit, KVFitConfig):
            raise ConfigError(f"kv_fit={self.kv_fit!r} is not a KVFitConfig: give "
                              "KVFitConfig(distill=DistillConfig(steps=...)) or leave the default")

    def resolve_cut(self, num_layers: int) -> int:
        """The first pruned layer for a model of ``num_layers`` layers (ConfigError when out of range)."""
        return resolve_cut(num_layers, cut=self.cut, prune_ratio=self.prune_ratio)


@dataclass(frozen=True)
class QualityFloor:
    """How ``--cut auto`` chooses the cut (quality/floor.py): the deepest cut whose POP keeps the full
    model's first generated token on at least ``min_agreement`` of ``prompts`` built-in held-out prompts
    (quality/prompts.py), measured teacher-forced over ``continuation`` greedy tokens with POP+ weights
    fitted at every candidate cut on ``search_tokens`` calibration tokens; candidates from L-1 down to
    ``L - floor(L * max_prune)``. The fit that ships is then made at the chosen cut and measured again."""

    min_agreement: float = 0.95
    prompts: int = 64
    continuation: int = 32
    search_tokens: int = 16384
    max_prune: float = 0.5

    def __post_init__(self) -> None:
        if not (isinstance(self.min_agreement, (int, float)) and not isinstance(self.min_agreement, bool)
                and 0.0 <= self.min_agreement <= 1.0):
            raise ConfigError(f"--min-agreement {self.min_agreement} must be a share within 0..1 "
                              f"(default {QualityFloor.min_agreement})")
        for name, low in (("prompts", 1), ("continuation", 1), ("search_tokens", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ConfigError(f"QualityFloor.{name}={value!r} must be an integer >= {low} "
                                  f"(default {getattr(QualityFloor, name)})")
        if not is_prune_ratio(self.max_prune) or self.max_prune == 0:
            raise ConfigError(f"QualityFloor.max_prune={self.max_prune!r} must be a share in (0, 1) "
                              f"(default {QualityFloor.max_prune})")

    def candidates(self, num_layers: int) -> list[int]:
        """The cuts searched, shallowest first: L-1 .. L - floor(L * max_prune) (at least 1)."""
        deepest = max(1, num_layers - math.floor(num_layers * self.max_prune + 1e-9))
        return list(range(num_layers - 1, deepest - 1, -1))


DISTILL_TARGETS = ("greedy", "document")
DISTILL_SELECT = ("greedy", "kl")


@dataclass(frozen=True)
class DistillConfig:
    """POP++ (kvfit/distill.py), how to distil: Adam ``steps`` at ``lr`` (one window each), windows
    shuffled and split with ``seed``; ``continuation`` scored tokens per window; ``held_out`` share of the
    windows scored every ``eval_every`` steps; stop after ``patience`` scores without improvement.

    ``targets``         "greedy": the scored tokens are the full model's own greedy continuation of the
                        window (what a user's first tokens are); "document": the window's last
                        ``continuation`` tokens (teacher-forced text)
    ``boundary_weight`` the first scored token's (the boundary's prediction, the first generated token) weight
                        in the loss against 1 for each later one
    ``vocab_top_k``     the KL runs over the union of the teacher's top-k tokens of every scored row (0: the
                        whole vocabulary); the teacher's logits there are computed once
    ``windows``         how many windows of the built-in text (kvfit/fit.builtin_tokens) at most
    ``select``          "greedy": keep the weights with the longest held-out matched prefix of greedy tokens
                        (ties: lower KL); "kl": the lowest held-out KL
    """

    steps: int = 900
    lr: float = 1e-4  # 3e-4 never beat the ridge fit on Gemma 3 (docs/results.md, POP++)
    seed: int = 0
    continuation: int = 16
    held_out: float = 0.25
    eval_every: int = 50
    patience: int = 4
    targets: str = "greedy"
    boundary_weight: float = 4.0
    vocab_top_k: int = 64
    select: str = "greedy"
    windows: int = 64

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("seed", 0), ("continuation", 1), ("eval_every", 1), ("patience", 1),
                          ("vocab_top_k", 0), ("windows", 2)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ConfigError(f"{self._label(name, value)} must be an integer >= {low} "
                                  f"(default {getattr(DistillConfig, name)})")
        for name in ("lr", "boundary_weight"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{self._label(name, value)} must be a finite number > 0 "
                                  f"(default {getattr(DistillConfig, name)})")
        if not (isinstance(self.held_out, (int, float)) and 0 < self.held_out < 1):
            raise ConfigError(f"{self._label('held_out', self.held_out)} must be a share in (0, 1) "
                              f"(default {DistillConfig.held_out})")
        for name, choices in (("targets", DISTILL_TARGETS), ("select", DISTILL_SELECT)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{self._label(name, getattr(self, name))} must be one of "
                                  f"{', '.join(choices)} (default {getattr(DistillConfig, name)})")

    @staticmethod
    def _label(field: str, value: object) -> str:
        """The culprit: as ``_named`` for the fields ``popcompile calibrate`` has flags for, else as a
        keyword."""
        return _named(field, value) if field in ("steps", "lr", "seed") else f"{field}={value!r}"


#: how a K/V fit is made: the closed-form ridge fit (POP+), or that fit trained on KL(full || POP) (POP++)
FIT_METHODS = ("ridge", "distill")
#: a bias on every refitted k/v projection, per method, when none is asked for: off for ridge (it lowered
#: greedy chat agreement), on for distill (the configuration measured; docs/results.md, POP++)
DEFAULT_FIT_BIAS = {"ridge": False, "distill": True}
#: where a K/V fit may run (KVFitConfig.device): auto = cuda when torch sees a GPU, else cpu; cuda:N also
FIT_DEVICES = ("auto", "cpu", "cuda", "mps")
_FIT_DEVICE = re.compile(r"auto|cpu|mps|cuda(:[0-9]+)?")
#: seconds a K/V fit may take unless told otherwise (KVFitConfig.budget_s says why this value)
DEFAULT_CALIBRATION_BUDGET_S = 600.0


@dataclass(frozen=True)
class KVFitConfig:
    """How the pruned layers' K/V weights are fitted (kvfit/): the one owner of every fitting default, read
    by ``popcompile calibrate``, export's ``--kv-calibration auto | distill``, eval's pop-kvfit / pop-distill.

    ``method``     ridge | distill (FIT_METHODS)
    ``ridge``      the regulariser, relative to mean diag(X^T X)
    ``bias``       fit a bias for every k/v projection (True), only where the model's has one (False), or
                   None: the method's default (DEFAULT_FIT_BIAS)
    ``seq_len``    tokens per calibration window of the ridge fit; ``max_tokens``: calibration tokens at most
    ``distill``    how distill trains (DistillConfig: steps, lr, seed, ...); read by distill only
    ``device``     where the fit runs (FIT_DEVICES): auto (a CUDA GPU when torch sees one, else the CPU),
                   cpu, cuda, cuda:N, mps; the model is moved there for the fit, the weights come back on
                   the CPU (kvfit/budget.py resolves it: EnvironmentUnavailable when it is absent)
    ``budget_s``   seconds the fit may take (None: no limit). Before it starts, its time is estimated
                   (kvfit/budget.py: the fit's FLOPs over the device's measured speed); distill whose
                   estimate exceeds it falls back to the ridge fit (POP+), said in one line and recorded in
                   the manifest; a fit that runs out stops with the best weights so far (distill: the best
                   held-out score; ridge: the tokens seen). Default 600 s: the default POP++ fit of a 135M
                   model on two CPU cores (4-5 min) fits with room for the estimate's error, and by the
                   estimate's arithmetic so does an 8B fit on one GPU; a 1B model's distillation on a CPU
                   (over half an hour) or an 8B one's (hours) becomes POP+, with a line saying so
    """

    method: str = "ridge"
    ridge: float = 1e-3
    bias: bool | None = None
    seq_len: int = 512
    max_tokens: int = 65536
    distill: DistillConfig = field(default_factory=DistillConfig)
    device: str = "auto"
    budget_s: float | None = DEFAULT_CALIBRATION_BUDGET_S

    def __post_init__(self) -> None:
        if self.method not in FIT_METHODS:
            raise ConfigError(f"{_named('method', self.method)} is not a fitting method: choose one of "
                              f"{', '.join(FIT_METHODS)}")
        if not (isinstance(self.ridge, (int, float)) and not isinstance(self.ridge, bool)
                and math.isfinite(self.ridge) and self.ridge >= 0):
            raise ConfigError(f"--ridge {self.ridge} must be a finite number >= 0 "
                              f"(default {KVFitConfig.ridge})")
        if not isinstance(self.bias, (bool, type(None))):
            raise ConfigError(f"bias={self.bias!r} must be True (fit a bias for every projection), "
                              "False (only where the model's projection has one) or None (the method's "
                              "default)")
        for name in ("seq_len", "max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{_named(name, value)} must be an integer >= 1 "
                                  f"(default {getattr(KVFitConfig, name)})")
        if not isinstance(self.distill, DistillConfig):
            raise ConfigError(f"distill={self.distill!r} is not a DistillConfig: "
                              "give DistillConfig(steps=...)")
        if not (isinstance(self.device, str) and _FIT_DEVICE.fullmatch(self.device)):
            raise ConfigError(f"{_named('device', self.device)} is not a device: give one of "
                              f"{', '.join(FIT_DEVICES)} (cuda:N: GPU N)")
        if self.budget_s is not None and not (isinstance(self.budget_s, (int, float))
                                              and not isinstance(self.budget_s, bool)
                                              and math.isfinite(self.budget_s) and self.budget_s > 0):
            raise ConfigError(f"--calibration-budget {self.budget_s!r} (budget_s={self.budget_s!r}) must be "
                              f"a number of seconds > 0, or none for no limit (default "
                              f"{DEFAULT_CALIBRATION_BUDGET_S:g})")

    @property
    def fits_bias(self) -> bool:
        """Whether every k/v projection gets a bias: ``bias`` as given, else the method's default."""
        return DEFAULT_FIT_BIAS[self.method] if self.bias is None else self.bias
