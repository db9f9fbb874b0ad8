"""Loading an engine folder's graphs into onnxruntime, every failure an EngineError naming the file.

    verify_folder (verify.py)   both graphs and the weights inside the folder, sizes and sha256 as the
                                manifest says
    check_external_data         every initializer stored outside a graph is in the manifest's weights file
    load_graph                  onnxruntime's own failures (a graph that does not parse or type-check)
    check_signature             the graph's inputs and outputs: names, element types and the KV dims of
                                kv_layout
"""
from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from ..engine.manifest import GRAPH_INPUTS, RE_EXPORT, EngineManifest
from ..engine.vision import VISUAL_EMBEDS
from ..errors import EngineError
from .onnx_refs import ProtoError, external_refs

#: what onnxruntime raises for a graph it cannot load (its pybind exception classes derive from Exception)
ORT_ERRORS = (RuntimeError, *(v for v in vars(ort_state).values()
                              if isinstance(v, type) and issubclass(v, Exception)))
#: the ONNX element type of the KV tensors for each KVLayout dtype
KV_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)"}
LOGITS_TYPES = {"tensor(float)", "tensor(float16)"}


def check_external_data(folder: Path, graph: Path, weights: dict) -> None:
    """EngineError unless every external tensor of ``graph`` lies inside the manifest's weights file."""
    try:
        refs = external_refs(graph.read_bytes())
    except (ProtoError, RecursionError) as err:
        raise EngineError(f"{folder}: {graph.name} is not a readable ONNX file ({err}): "
                          f"{RE_EXPORT}") from None
    for ref in refs:
        if ref.location != weights["file"]:
            raise EngineError(f"{folder}: {graph.name} reads tensor data from {ref.location!r}, not from the "
                              f"manifest's weights file {weights['file']!r}: {RE_EXPORT}")
        offset, length = _count(ref.offset, 0), _count(ref.length, 0)
        if offset is None or length is None or offset + length > weights["bytes"]:
            raise EngineError(f"{folder}: {graph.name} reads bytes {ref.offset}+{ref.length} of "
                              f"{weights['file']}, which has {weights['bytes']}: {RE_EXPORT}")


def _count(text: str | None, default: int) -> int | None:
    if text is None:
        return default
    return int(text) if text.isascii() and text.isdigit() else None


def load_graph(path: Path, options: ort.SessionOptions, providers: list[str]) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except ORT_ERRORS as err:
        reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise EngineError(f"onnxruntime cannot load {path} ({reason}): {RE_EXPORT}") from None


def check_signature(folder: Path, name: str, session: ort.InferenceSession, manifest: EngineManifest) -> None:
    """EngineError unless the graph's inputs/outputs are the manifest's: names, int64 token inputs, KV tensors
    [batch, kv_heads, rows, head_dim] of kv_layout's dtype, float logits [batch, vocab]."""
    layout, file = manifest.kv_layout, manifest.graphs[name].file
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if ([a.name for a in inputs] != list(manifest.expected_inputs())
            or [a.name for a in outputs] != list(manifest.expected_outputs(name))):
        raise EngineError(f"{folder}: {name} graph's inputs/outputs differ from the manifest: {RE_EXPORT}")
    kv_type = KV_TYPES[layout.dtype]
    vision = manifest.vision_section(folder)
    for arg in [*inputs, *outputs]:
        shape = list(arg.shape)
        if arg.name == "logits":
            ok, want = arg.type in LOGITS_TYPES and len(shape) == 2, "float logits [batch, vocab]"
        elif arg.name == "position_ids" and vision is not None:  # M-RoPE: time, height, width rows
            ok = arg.type == "tensor(int64)" and shape[:1] == [3] and len(shape) == 3
            want = "int64 [3, batch, tokens]"
        elif arg.name == VISUAL_EMBEDS:
            rows = 1 + vision.deepstack
            ok = arg.type == kv_type and len(shape) == 4 and shape[0] == rows
            ok = ok and shape[3] == vision.hidden_size
            want = f"{kv_type}[{rows}, batch, tokens, {vision.hidden_size}] (the vision section)"
        elif arg.name in GRAPH_INPUTS:
            ok, want = arg.type == "tensor(int64)" and len(shape) == 2, "int64 [batch, tokens]"
        else:
            ok = arg.type == kv_type and len(shape) == 4 and shape[1] == layout.num_kv_heads \
                and shape[3] == layout.head_dim
            want = f"{kv_type}[batch, {layout.num_kv_heads}, rows, {layout.head_dim}] (kv_layout)"
        if not ok:
            raise EngineError(f"{folder}: {file} declares {arg.name} as {arg.type}{shape}, "
                              f"the manifest says {want}: the manifest does not describe this graph, "
                              f"{RE_EXPORT}")


def vocab_size(session: ort.InferenceSession) -> int | None:
    """The logits' vocabulary dimension of a graph, when it is static."""
    dims = session.get_outputs()[0].shape
    return dims[-1] if isinstance(dims[-1], int) else None
