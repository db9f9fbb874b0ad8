"""The manifest's "tensorrt" section: what `popcompile build-trt` records and TrtSession reads.

    popcompile.json
      "tensorrt": {                         written by exporters/tensorrt.py (build_engines)
        "plans":    {"prefill": {"file": "prefill.plan", "bytes", "sha256"}, "decode": {...}},
        "profiles": {"prefill": [Profile.to_dict()], "decode": [step, prompt]},   profile-index order
        "sentinel_rows": 1,                 rows in front of the KV buffer (always masked)
        "decode_kv": "static" | "gather",   how the runtime binds the KV buffer to the decode plan
        "tensorrt_version", "gpu", "compute_capability", "precision", "workspace_gb", "max_batch",
        "onnx_sha256", "timing_cache", "build_seconds"
      }

Plain data and validation (``TrtSection``, ``Profile``, ``ShapeRange``, ``check_section``) plus the one
question both the builder and the runtime ask before touching TensorRT: ``require_gpu`` (a look at
the machine with ``shutil.which`` and ``importlib.util.find_spec``; it never imports tensorrt).
No tensorrt, onnx or torch import: an engine folder's section can be read and checked anywhere.
"""
from __future__ import annotations

import importlib.util
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import EngineError, EnvironmentUnavailable
from .manifest import EngineManifest

PLANS = {"prefill": "prefill.plan", "decode": "decode.plan"}
SENTINEL_ROWS = 1
DECODE_KV = ("static", "gather")


class TensorRTUnavailable(EnvironmentUnavailable, ValueError):
    """TensorRT cannot run on this machine (no NVIDIA GPU/CUDA, or no ``tensorrt`` package)."""


def require_gpu() -> None:
    """Raise TensorRTUnavailable (a ValueError) with one line when TensorRT cannot run on this machine."""
    missing = []
    if shutil.which("nvidia-smi") is None:
        missing.append("no NVIDIA GPU/CUDA driver (nvidia-smi not found)")
    if importlib.util.find_spec("tensorrt") is None:
        missing.append("no `tensorrt` package")
    if missing:
        raise TensorRTUnavailable(
            "TensorRT engines need an NVIDIA GPU with CUDA and the `tensorrt` Python package "
            f"(pip install \"popcompile[gpu]\"), and this machine has {' and '.join(missing)}: here run "
            "`popcompile export MODEL --out DIR` (ONNX, runs on CPU with onnxruntime) and "
            "`popcompile check DIR --target tensorrt` to verify the graphs before moving to a GPU machine")


@dataclass(frozen=True)
class ShapeRange:
    """min <= opt <= max, elementwise, same rank; every dim >= 1 (no zero-length dims in a profile)."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.min) == len(self.opt) == len(self.max):
            raise ValueError(f"shape range of mixed ranks: {self.min}, {self.opt}, {self.max}")
        if not all(1 <= lo <= mid <= hi for lo, mid, hi in zip(self.min, self.opt, self.max)):
            raise ValueError(f"shape range needs 1 <= min <= opt <= max per dim: "
                             f"{self.min}, {self.opt}, {self.max}")

    def covers(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.min) and all(lo <= d <= hi
                                                   for lo, d, hi in zip(self.min, shape, self.max))


@dataclass(frozen=True)
class Profile:
    name: str                        # "prefill" | "step" | "prompt"
    shapes: dict                     # input name -> ShapeRange

    def to_dict(self) -> dict:
        """Plain json data (lists, not tuples): equal to what reading the manifest back gives."""
        return {"name": self.name,
                "shapes": {k: {p: list(getattr(v, p)) for p in ("min", "opt", "max")}
                           for k, v in self.shapes.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        shapes = {k: ShapeRange(*(tuple(v[p]) for p in ("min", "opt", "max")))
                  for k, v in data["shapes"].items()}
        return cls(data["name"], shapes)


@dataclass(frozen=True)
class TrtSection:
    """The manifest's "tensorrt" section: what was built, where, how, and from which ONNX graphs."""

    tensorrt_version: str
    gpu: str
    compute_capability: str
    precision: str
    workspace_gb: float
    max_batch: int
    sentinel_rows: int
    decode_kv: str                 # "static" (no sliding-window layers) | "gather": see runtime/trt.py
    plans: dict                    # "prefill" | "decode" -> {"file", "bytes", "sha256"}
    profiles: dict                 # "prefill" | "decode" -> [Profile.to_dict(), ...] in profile-index order
    onnx_sha256: dict              # graph -> sha256 of the ONNX file the plan was built from
    timing_cache: str
    build_seconds: dict

    def __post_init__(self) -> None:
        if self.decode_kv not in DECODE_KV:
            raise EngineError(f"tensorrt.decode_kv must be one of {DECODE_KV}, got {self.decode_kv!r}")
        if set(self.plans) != set(PLANS) or set(self.profiles) != set(PLANS):
            raise EngineError(f"tensorrt section must describe {sorted(PLANS)}, found {sorted(self.plans)}")

    def profile_list(self, engine: str) -> tuple[Profile, ...]:
        return tuple(Profile.from_dict(p) for p in self.profiles[engine])

    @classmethod
    def from_manifest(cls, manifest: EngineManifest, folder: str | Path = "?") -> "TrtSection":
        if not manifest.tensorrt:
            raise EngineError(f"{folder} has no TensorRT engines: "
                              f"run `popcompile build-trt {folder}` on a GPU machine")
        try:
            return cls(**manifest.tensorrt)
        except TypeError as err:
            raise EngineError(f"{folder}: the manifest's tensorrt section is malformed ({err}): "
                              f"run `popcompile build-trt {folder} --force`") from None


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: TrtSection field -> (test, what the value must be), for the fields the runtime reads
_SECTION_FIELDS = {
    "tensorrt_version": (lambda v: isinstance(v, str), "a string"),
    "gpu": (lambda v: isinstance(v, str), "a string"),
    "compute_capability": (lambda v: isinstance(v, str), "a string"),
    "workspace_gb": (_is_real, "a number"),
    "max_batch": (lambda v: is_count(v) and v >= 1, "an integer >= 1"),
    "sentinel_rows": (lambda v: is_count(v) and v >= 1, "an integer >= 1"),
    "plans": (lambda v: isinstance(v, dict), "an object of prefill and decode plans"),
    "profiles": (lambda v: isinstance(v, dict) and all(isinstance(p, list) for p in v.values()),
                 "an object of prefill and decode profile lists"),
}


def check_section(folder: Path, section: TrtSection) -> None:
    """EngineError unless the manifest's tensorrt section has the types the runtime reads (profiles parse)."""
    fix = f"rebuild the plans with `popcompile build-trt {folder} --force`"
    for name, (test, what) in _SECTION_FIELDS.items():
        value = getattr(section, name)
        if not test(value):
            raise EngineError(f"{folder}: the manifest's tensorrt.{name}={value!r:.60} must be {what}: {fix}")
    try:
        for engine in PLANS:
            section.profile_list(engine)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise EngineError(f"{folder}: the manifest's tensorrt.profiles do not parse ({err!r:.80}): "
                          f"{fix}") from None
