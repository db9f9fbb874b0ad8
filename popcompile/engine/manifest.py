"""The engine manifest (``popcompile.json``): what an engine folder holds, checked by every runtime.

Plain data and json: no torch import, so a deployed runtime can read it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import MISSING, asdict, dataclass, field, replace
from pathlib import Path

from ..errors import ConfigError, EngineError
from ..fsutil import atomic_write
from .kv import KV_DTYPES, KVLayout
from .vision import VISUAL_EMBEDS, VisionSection
from .vllm_folder import is_vllm_folder

MANIFEST = "popcompile.json"
FORMAT = "popcompile-engine"
FORMAT_VERSION = 3
#: a vision-language engine's version (a ``vision`` section; text graphs with M-RoPE positions and image
#: features): a version-3 runtime would feed its graphs text inputs, so it refuses 4. Text engines stay 3.
VISION_FORMAT_VERSION = 4
#: versions this popcompile reads: 1 (before ``boundary``: always "separate"), 2, 3
#: (``attention.shared_kv``: a graph may read and write the KV buffer in place; a version-2 runtime would bind
#: it wrongly, so it refuses 3) and 4 (``vision``)
READABLE_VERSIONS = (1, 2, 3, 4)


def format_version(vision: bool) -> int:
    """The version a new engine's manifest is written with: VISION_FORMAT_VERSION with a vision section."""
    return VISION_FORMAT_VERSION if vision else FORMAT_VERSION


def is_engine_manifest(data: object) -> bool:
    """The one rule for "this JSON is a popcompile engine's manifest": an object whose ``format`` is FORMAT
    (its version is then checked by ``is_readable_version``)."""
    return isinstance(data, dict) and data.get("format") == FORMAT


def is_readable_version(value: object) -> bool:
    """The one rule for a manifest's ``format_version``: one of READABLE_VERSIONS (an int, not a bool)."""
    return _is_int(value) and value in READABLE_VERSIONS
#: how POP's boundary token x_N reaches the full model (docs/kv.md):
#:   folded    the prefill graph takes x_1..x_N, runs x_N alone through the deep layers and returns its logits
#:   separate  the prefill graph takes x_1..x_{N-1}; the decode graph runs x_N over their rows
BOUNDARIES = ("folded", "separate")
GRAPH_INPUTS = ("input_ids", "position_ids", "attention_mask")
GRAPHS = ("prefill", "decode")
#: a manifest is a few KB (more with TensorRT profiles); a larger popcompile.json is not one
MAX_MANIFEST_BYTES = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
RE_EXPORT = "re-export the engine (`popcompile export MODEL --out FOLDER --force`)"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return _is_int(value) and value >= 0


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def is_file_name(value: object) -> bool:
    """One plain file name: a manifest names only files of its own folder (no path, no ``..``)."""
    return (isinstance(value, str) and value not in ("", ".", "..") and len(value) <= 255
            and not any(c in value for c in "/\\\0"))


def _is_names(value: object) -> bool:
    return isinstance(value, tuple) and all(isinstance(v, str) for v in value)


#: the weights entry's keys -> (test, what the value must be); manifests written before weights were
#: hashed have no sha256 (engine/verify.py then checks the size only, with a warning)
_WEIGHTS_FIELDS = {
    "file": (is_file_name, "a file name inside the engine folder (no path)"),
    "bytes": (_is_count, "an integer >= 0"),
    "sha256": (_is_sha256, "a sha256 of 64 lowercase hex digits"),
}


def _check_weights(value: object) -> None:
    if not isinstance(value, dict):
        raise EngineError(f"weights={_short(value)} must be an object of {', '.join(_WEIGHTS_FIELDS)}")
    _check_keys(value, set(_WEIGHTS_FIELDS), {"file", "bytes"}, "weights")
    for name, (test, what) in _WEIGHTS_FIELDS.items():
        if name in value and not test(value[name]):
            raise EngineError(f"weights.{name}={_short(value[name])} must be {what}")


def _short(value: object) -> str:
    """repr() cut to 60 characters: a damaged manifest's value can be megabytes."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_fields(obj: object, table: dict) -> None:
    """EngineError naming the first field of ``obj`` whose value fails its test in ``table``."""
    for name, (test, what) in table.items():
        value = getattr(obj, name)
        if not test(value):
            raise EngineError(f"{name}={_short(value)} must be {what}")


#: GraphEntry field -> (test, what the value must be)
_GRAPH_FIELDS = {
    "file": (is_file_name, "a file name inside the engine folder (no path)"),
    "inputs": (_is_names, "a list of tensor names"),
    "outputs": (_is_names, "a list of tensor names"),
    "bytes": (_is_count, "an integer >= 0"),
    "sha256": (_is_sha256, "a sha256 of 64 lowercase hex digits"),
}


@dataclass(frozen=True)
class GraphEntry:
    file: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    bytes: int
    sha256: str

    def __post_init__(self) -> None:
        _check_fields(self, _GRAPH_FIELDS)


#: EngineManifest field -> (test, what the value must be): every value a manifest can hold is checked
_MANIFEST_FIELDS = {
    "model": (lambda v: isinstance(v, dict), "an object"),
    "num_layers": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "cut": (_is_int, "an integer"),
    "kv_layout": (lambda v: isinstance(v, KVLayout), "a KV layout"),
    "graphs": (lambda v: isinstance(v, dict) and sorted(v) == sorted(GRAPHS)
               and all(isinstance(g, GraphEntry) for g in v.values()),
               "the prefill and decode graph entries"),
    "weights": (lambda v: isinstance(v, dict), "an object of file, bytes and sha256"),
    "dtype": (lambda v: isinstance(v, str) and v in KV_DTYPES, f"one of {', '.join(KV_DTYPES)}"),
    "versions": (lambda v: isinstance(v, dict), "an object"),
    "eos_token_ids": (lambda v: isinstance(v, tuple) and all(map(_is_count, v)), "a list of token ids"),
    "target": (lambda v: isinstance(v, str), "a string"),
    "format": (lambda v: v == FORMAT, repr(FORMAT)),
    "format_version": (is_readable_version, f"one of {READABLE_VERSIONS}"),
    "extra": (lambda v: isinstance(v, dict), "an object"),
    "tensorrt": (lambda v: isinstance(v, dict), "an object"),
    "boundary": (lambda v: isinstance(v, str) and v in BOUNDARIES, f"one of {', '.join(BOUNDARIES)}"),
    "quantization": (lambda v: isinstance(v, dict), "an object"),
    "attention": (lambda v: isinstance(v, dict) and v.get("lowering", "onnxruntime") == "onnxruntime"
                  and isinstance(v.get("shared_kv", []), list)
                  and set(v.get("shared_kv", [])) <= set(GRAPHS),
                  "an object whose lowering is onnxruntime and whose shared_kv lists graphs "
                  "(or empty: standard ONNX ops)"),
    "vision": (lambda v: isinstance(v, dict), "an object"),
}


@dataclass(frozen=True)
class EngineManifest:
    model: dict                # name, kind, path, sha256, model_type; a hub id: revision (commit)
    num_layers: int
    cut: int
    kv_layout: KVLayout
    graphs: dict               # "prefill" | "decode" -> GraphEntry
    weights: dict              # file, bytes, sha256 (absent in manifests written before weights were hashed)
    dtype: str
    versions: dict
    eos_token_ids: tuple[int, ...] = ()
    target: str = "onnx"
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)
    # Written by `popcompile build-trt` (exporters/tensorrt.py; its schema is engine/tensorrt.py's
    # TrtSection): plans, TensorRT version, GPU compute capability and optimization profiles. Empty for a
    # folder without TensorRT engines; older manifests have no such key and read as empty.
    tensorrt: dict = field(default_factory=dict)
    boundary: str = "separate"  # version 1 manifests have no key: their prefill graphs are "separate"
    # Prompts shorter than this prefill in full (POP gains ~nothing there and costs quality); 0: always POP.
    # Chosen at export (`export --min-prompt-tokens`, docs/prompt_length.md); older manifests read as 0.
    min_prompt_tokens: int = 0
    # Weight-only quantisation (config.WeightQuantization.to_manifest: format, op, bits, block_size, ...);
    # empty for float weights and in manifests written before engines could be quantised.
    quantization: dict = field(default_factory=dict)
    # Attention lowered to onnxruntime's contrib ops (ort_passes/attention.py: lowering, ops, and per graph
    # the layers in GroupQueryAttention / MultiHeadAttention / standard ops); empty: standard ONNX ops, which
    # any runtime takes (the tensorrt target's, and manifests written before attention was fused).
    # ``shared_kv``: the graphs whose present outputs are the whole buffer, written in place
    # (ort_passes/shared_kv.py, docs/kv.md).
    attention: dict = field(default_factory=dict)
    # A vision-language engine's vision graph, image processing and image tokens (engine/vision.py); empty
    # for a text engine.
    vision: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.min_prompt_tokens, bool) or not isinstance(self.min_prompt_tokens, int) \
                or self.min_prompt_tokens < 0:
            raise EngineError(f"manifest min_prompt_tokens={_short(self.min_prompt_tokens)} "
                              f"must be an integer >= 0")
        _check_fields(self, _MANIFEST_FIELDS)
        _check_weights(self.weights)
        if self.vision:
            VisionSection.from_manifest(self.vision)
        if bool(self.vision) != (self.format_version == VISION_FORMAT_VERSION):
            which = "with" if self.vision else "without"
            raise EngineError(f"format_version={self.format_version} {which} a vision section: a "
                              f"vision-language engine is version {VISION_FORMAT_VERSION}, others earlier")
        if not 1 <= self.cut <= self.num_layers:
            raise EngineError(f"manifest cut={self.cut} is out of range 1..{self.num_layers}")
        if self.kv_layout.num_layers != self.num_layers or self.kv_layout.dtype != self.dtype:
            raise EngineError(f"kv_layout (num_layers={self.kv_layout.num_layers}, "
                              f"dtype={self.kv_layout.dtype}) "
                              f"disagrees with num_layers={self.num_layers}, dtype={self.dtype}")
        for name, entry in self.graphs.items():
            if entry.inputs != self.expected_inputs() or entry.outputs != self.expected_outputs(name):
                raise EngineError(f"graphs.{name}: its inputs/outputs are not those kv_layout and boundary="
                                  f"{self.boundary} describe ({', '.join(self.expected_inputs()[:4])}, ...)")

    def to_json(self) -> str:
        data = asdict(self)
        data["kv_layout"] = self.kv_layout.to_dict()
        return json.dumps(data, indent=2, sort_keys=True)

    def with_min_prompt_tokens(self, value: int, record: dict | None) -> "EngineManifest":
        """This manifest with the threshold ``value``; ``record`` (how it was chosen) in ``extra``."""
        return replace(self, min_prompt_tokens=value, extra={**self.extra, "min_prompt_tokens": record})

    def write(self, folder: Path) -> None:
        atomic_write(Path(folder) / MANIFEST, self.to_json() + "\n")

    @classmethod
    def read(cls, folder: str | Path) -> "EngineManifest":
        """Read and validate ``folder/popcompile.json``; EngineError names the problem and the fix.

        Total: any content of the file gives a manifest or an EngineError, never another exception."""
        if not isinstance(folder, (str, os.PathLike)):
            raise ConfigError(f"an engine folder is a path, got {_short(folder)}")
        if not Path(folder).is_dir():
            raise EngineError(f"engine folder {folder} does not exist: "
                              f"run `popcompile export MODEL --out {folder}`")
        if not (Path(folder) / MANIFEST).is_file() and is_vllm_folder(folder):
            raise EngineError(f"{folder} is a vLLM folder (export --target vllm), not an engine folder: "
                              f"serve it with `vllm serve {folder}`, "
                              f"or export --target onnx for popcompile's runtimes")
        if not (Path(folder) / MANIFEST).is_file():
            raise EngineError(f"{folder} is not a popcompile engine folder (no {MANIFEST}): re-export it")
        return cls.from_dict(_read_json(engine_file(folder, MANIFEST, "manifest")), folder)

    @classmethod
    def from_dict(cls, data: dict, folder: str | Path = "?") -> "EngineManifest":
        where = Path(folder) / MANIFEST
        if not isinstance(data, dict):
            raise EngineError(f"{where} holds a JSON {type(data).__name__}, not an object: {RE_EXPORT}")
        if not is_engine_manifest(data):
            raise EngineError(f"{folder}: not a popcompile engine (format {_short(data.get('format'))})")
        version = data.get("format_version")
        if not is_readable_version(version):
            raise EngineError(
                f"{folder}: engine format version {_short(version)} is not supported by this "
                f"popcompile (version {FORMAT_VERSION}): re-export the model with this version")
        try:
            return cls(**_typed(cls, data))
        except EngineError as err:
            raise EngineError(f"{where}: {err}: {RE_EXPORT}") from None

    def weights_sha256(self) -> str | None:
        """The weights file's sha256; None for manifests written before weights were hashed."""
        return self.weights.get("sha256")

    def expected_inputs(self) -> tuple[str, ...]:
        visual = (VISUAL_EMBEDS,) if self.vision else ()
        return (*GRAPH_INPUTS, *visual, *self.kv_layout.past_names)

    def vision_section(self, folder: object = "?") -> VisionSection | None:
        """The checked vision section; None for a text engine."""
        return VisionSection.from_manifest(self.vision, folder) if self.vision else None

    def has_logits(self, graph: str) -> bool:
        """The decode graph returns logits; the prefill graph too when the boundary is folded into it."""
        return graph == "decode" or self.boundary == "folded"

    def shares_kv(self, graph: str) -> bool:
        """Whether ``graph``'s present outputs are its past with the new rows written after it (bound to the
        buffer: written in place), not the new rows alone (ort_passes/shared_kv.py)."""
        return graph in self.attention.get("shared_kv", ())

    def expected_outputs(self, graph: str) -> tuple[str, ...]:
        present = tuple(self.kv_layout.present_names)
        return ("logits", *present) if self.has_logits(graph) else present


def _typed(cls: type, data: dict) -> dict:
    """The manifest's JSON -> EngineManifest keywords (lists to tuples, nested objects to their classes)."""
    fields = cls.__dataclass_fields__
    required = {name for name, f in fields.items() if f.default is f.default_factory is MISSING}
    _check_keys(data, set(fields), required, "the manifest")
    data = dict(data)
    try:
        data["kv_layout"] = KVLayout.from_dict(data["kv_layout"])
    except ConfigError as err:
        raise EngineError(f"kv_layout: {err}") from None
    graphs = data["graphs"]
    if not isinstance(graphs, dict) or sorted(graphs) != sorted(GRAPHS):
        found = sorted(graphs) if isinstance(graphs, dict) else _short(graphs)
        raise EngineError(f"graphs must be an object of exactly {' and '.join(GRAPHS)}, found {found}")
    data["graphs"] = {name: _graph_entry(name, entry) for name, entry in graphs.items()}
    data["eos_token_ids"] = _tuple(data.get("eos_token_ids", []))
    return data


def _graph_entry(name: str, entry: object) -> GraphEntry:
    fields = set(GraphEntry.__dataclass_fields__)
    if not isinstance(entry, dict):
        raise EngineError(f"graphs.{name}={_short(entry)} must be an object of {', '.join(sorted(fields))}")
    _check_keys(entry, fields, fields, f"graphs.{name}")
    try:
        return GraphEntry(**{**entry, "inputs": _tuple(entry["inputs"]), "outputs": _tuple(entry["outputs"])})
    except EngineError as err:
        raise EngineError(f"graphs.{name}.{err}") from None


def _check_keys(data: dict, known: set, required: set, what: str) -> None:
    unknown, missing = set(data) - known, required - set(data)
    if unknown or missing:
        raise EngineError(f"{what} has unknown keys {sorted(unknown)} and lacks {sorted(missing)}")


def _tuple(value: object) -> object:
    """JSON lists become tuples; anything else stays as it is, for the field checks to refuse."""
    return tuple(value) if isinstance(value, list) else value


def _read_json(path: Path) -> object:
    """The manifest file's JSON value; EngineError for anything that is not UTF-8 JSON of a sane size."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_MANIFEST_BYTES + 1)
    except OSError as err:
        raise EngineError(f"{path} cannot be read ({err.strerror}): check its permissions") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise EngineError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes, no manifest is: {RE_EXPORT}")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise EngineError(f"{path} is corrupt (not UTF-8 text): {RE_EXPORT}") from None
    except json.JSONDecodeError as err:
        raise EngineError(f"{path} is corrupt ({err.msg} at line {err.lineno}): "
                          f"re-export the engine") from None
    except (ValueError, RecursionError) as err:  # integers of > 4300 digits, nesting deeper than the parser
        raise EngineError(f"{path} is corrupt ({_short(str(err))}): {RE_EXPORT}") from None


def engine_file(folder: str | Path, name: object, key: str) -> Path:
    """``folder/name`` for the manifest entry ``key``, refused unless it resolves to a path inside ``folder``:
    no absolute path, no ``..``, no symlink that leads out of the folder (a manifest may name only its own
    files)."""
    if not is_file_name(name):
        raise EngineError(f"{folder}: {key}={_short(name)} is not a file name inside the engine folder: "
                          f"{RE_EXPORT}")
    try:
        root = Path(folder).resolve(strict=True)
        path = (root / name).resolve()
    except (OSError, RuntimeError) as err:  # RuntimeError: a symlink loop
        raise EngineError(f"{folder}: {name} ({key}) cannot be resolved ({err}): {RE_EXPORT}") from None
    if root not in path.parents:
        raise EngineError(f"{folder}: {name} ({key}) leads to {path}, outside the engine folder; "
                          "an engine folder may only use its own files: "
                          "copy the file into the folder in its place")
    return path


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
