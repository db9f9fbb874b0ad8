"""The engine manifest (``popcompile.json``): what an engine folder holds, checked by every runtime.

Plain data and json: no torch import, so a deployed runtime can read it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import EngineError
from ..kv import KVLayout

MANIFEST = "popcompile.json"
FORMAT = "popcompile-engine"
FORMAT_VERSION = 2
#: versions this popcompile reads: 1 (before ``boundary``: always "separate") and 2
READABLE_VERSIONS = (1, 2)
#: how POP's boundary token x_N reaches the full model (docs/kv.md):
#:   folded    the prefill graph takes x_1..x_N, runs x_N alone through the deep layers and returns its logits
#:   separate  the prefill graph takes x_1..x_{N-1}; the decode graph runs x_N over their rows
BOUNDARIES = ("folded", "separate")
GRAPH_INPUTS = ("input_ids", "position_ids", "attention_mask")


@dataclass(frozen=True)
class GraphEntry:
    file: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    bytes: int
    sha256: str


@dataclass(frozen=True)
class EngineManifest:
    model: dict                # name, kind, path, sha256, model_type
    num_layers: int
    cut: int
    kv_layout: KVLayout
    graphs: dict               # "prefill" | "decode" -> GraphEntry
    weights: dict              # file, bytes
    dtype: str
    versions: dict
    eos_token_ids: tuple[int, ...] = ()
    target: str = "onnx"
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)
    # Written by `popcompile build-trt` (exporters/tensorrt.py, TrtSection): plans, TensorRT version, GPU
    # compute capability and optimization profiles. Empty for a folder without TensorRT engines; older
    # manifests have no such key and read as empty.
    tensorrt: dict = field(default_factory=dict)
    boundary: str = "separate"  # version 1 manifests have no key: their prefill graphs are "separate"

    def __post_init__(self) -> None:
        if self.boundary not in BOUNDARIES:
            raise EngineError(f"manifest boundary={self.boundary!r} is not one of {BOUNDARIES}: re-export the engine")
        if not 1 <= self.cut <= self.num_layers:
            raise EngineError(f"manifest cut={self.cut} is out of range 1..{self.num_layers}")
        if set(self.graphs) != {"prefill", "decode"}:
            raise EngineError(f"manifest graphs must be prefill and decode, found {sorted(self.graphs)}")

    def to_json(self) -> str:
        data = asdict(self)
        data["kv_layout"] = self.kv_layout.to_dict()
        return json.dumps(data, indent=2, sort_keys=True)

    def write(self, folder: Path) -> None:
        (Path(folder) / MANIFEST).write_text(self.to_json() + "\n")

    @classmethod
    def read(cls, folder: str | Path) -> "EngineManifest":
        """Read and validate ``folder/popcompile.json``; EngineError names the problem and the fix."""
        path = Path(folder) / MANIFEST
        if not Path(folder).is_dir():
            raise EngineError(f"engine folder {folder} does not exist: run `popcompile export MODEL --out {folder}`")
        if not path.is_file():
            raise EngineError(f"{folder} is not a popcompile engine folder (no {MANIFEST}): re-export it")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise EngineError(f"{path} is corrupt ({err.msg} at line {err.lineno}): re-export the engine") from None
        return cls.from_dict(data, folder)

    @classmethod
    def from_dict(cls, data: dict, folder: str | Path = "?") -> "EngineManifest":
        if data.get("format") != FORMAT:
            raise EngineError(f"{folder}: not a popcompile engine (format {data.get('format')!r})")
        if data.get("format_version") not in READABLE_VERSIONS:
            raise EngineError(
                f"{folder}: engine format version {data.get('format_version')} is not supported by this "
                f"popcompile (version {FORMAT_VERSION}): re-export the model with this version")
        try:
            data = dict(data)
            data["kv_layout"] = KVLayout.from_dict(data["kv_layout"])
            data["graphs"] = {k: GraphEntry(**{**g, "inputs": tuple(g["inputs"]), "outputs": tuple(g["outputs"])})
                              for k, g in data["graphs"].items()}
            data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
            return cls(**data)
        except (KeyError, TypeError, ValueError) as err:
            raise EngineError(f"{folder}: manifest is incomplete or malformed ({err}): re-export the engine") from None

    def expected_inputs(self) -> tuple[str, ...]:
        return (*GRAPH_INPUTS, *self.kv_layout.past_names)

    def has_logits(self, graph: str) -> bool:
        """The decode graph returns logits; the prefill graph too when the boundary is folded into it."""
        return graph == "decode" or self.boundary == "folded"

    def expected_outputs(self, graph: str) -> tuple[str, ...]:
        present = tuple(self.kv_layout.present_names)
        return ("logits", *present) if self.has_logits(graph) else present
