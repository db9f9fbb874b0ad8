"""Export both graphs to an ONNX engine folder that shares one weights file and one KV layout.

    engines/NAME/
      popcompile.json           manifest (engine/manifest.py)
      prefill.onnx, decode.onnx graphs; every initializer is external data in weights.bin
      vision.onnx               a vision-language model's vision tower (engine/vision.py), in weights.bin too
      weights.bin               each distinct tensor once: the graphs share it
      tokenizer.json, tokenizer_config.json, generation_config.json, config.json (the HF config)

A writer only: ``write_engine`` fills the staged folder the driver (driver.py) hands it from what the
compile made (targets.Compiled: the graph pair, the model's tokenizer and configs, the provenance) and
returns the folder's manifest; staging, locking, the threshold, writing the manifest (once) and the
rename are the driver's.

Memory: both graphs are exported unoptimised (their weights are the model's tensors), their weight slices
(a fused qkv_proj's K/V rows that a pruned layer keeps: ``fold_weight_slices``) and transposes folded once
for both (``fold_weight_transposes``: what torch.onnx's optimiser would do with a second float32 copy of every
projection), then each is optimised, saved with external data and read back
without it (scratch.py); the rewrites and the quantiser read one tensor at a time and move what they make
back out to disk. A model built without its weights (``LoadedModel.lazy``) has each read from its checkpoint
as it is saved; a loaded one has its storage freed as its transposes are made (``release``: the driver's
own). So the writer holds about one tensor at a time beyond the model.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import onnx
import torch

from ..config import WeightQuantization
from ..engine.manifest import EngineManifest, GraphEntry, format_version, sha256_file
from ..engine.vision import VISION_INPUTS, VISION_OUTPUTS
from ..errors import UnsupportedModelError
from ..frontend.arch import attention_softcap
from ..frontend.lazy import LazyWeights
from ..frontend.models import LoadedModel
from ..frontend.vision import vision_record, vision_spec
from ..ort_passes import ORT_PASSES, OrtContext
from ..ort_passes.graph import tensor_array
from ..passes.prefill import GraphPair
from .moe import fold_weight_gathers, translation_table
from .quantize import Quantised, quantize_weights
from .scratch import INLINE_BYTES, Scratch, external, nbytes
from .steps import ONNX_WRITE_STEPS, onnx_write_steps

OPSET = 20
WEIGHTS = "weights.bin"
VISION_FILE = "vision.onnx"
_ALIGN = 64
SCRATCH = ".scratch"


@dataclass
class _Writing:
    """What the ONNX writer's steps (steps.ONNX_WRITE_STEPS) read and fill in, in order."""

    folder: Path
    loaded: LoadedModel
    pair: GraphPair
    quantization: WeightQuantization
    release: bool = False  # the model's weights may be freed once the graphs are exported
    scratch: Scratch | None = None
    decode: onnx.ModelProto | None = None
    prefill: onnx.ModelProto | None = None
    attention: dict = field(default_factory=dict)  # the manifest's entry: empty unless fused
    weights_bytes: int = 0
    vision: onnx.ModelProto | None = None  # a vision-language model's vision graph
    pending: dict = field(default_factory=dict)  # file name -> torch.onnx's program, not yet optimised
    lowering: str = "standard"  # the attention lowering, which a mixture of experts follows (moe.py)

    @property
    def graphs(self) -> dict[str, onnx.ModelProto]:
        """The files to write: both text graphs, and the vision graph where there is one."""
        vision = {VISION_FILE: self.vision} if self.vision is not None else {}
        return {"decode.onnx": self.decode, "prefill.onnx": self.prefill, **vision}


def _export_decode(w: _Writing) -> None:
    """torch.onnx's program of the decode graph, not yet optimised: its weights are the model's tensors."""
    w.pending["decode.onnx"] = _exported(w.pair.decode, *_names(w.pair, with_logits=True), optimize=False,
                                         lowering=w.lowering)


def _export_prefill(w: _Writing) -> None:
    """The prefill graph likewise; then both graphs' weight transposes folded once for the two (the model's
    storage freed tensor by tensor where it is the driver's), both optimised and saved to the scratch folder
    with external data, and read back without it."""
    w.pending["prefill.onnx"] = _exported(w.pair.prefill, *_names(w.pair, w.pair.boundary == "folded"),
                                          optimize=False, lowering=w.lowering)
    lazy = w.loaded.lazy
    fold_weight_slices(list(w.pending.values()), lazy=lazy)
    fold_weight_transposes(list(w.pending.values()), free=w.release, read=lazy.read if lazy else None)
    fold_weight_gathers(list(w.pending.values()), read=lazy.read if lazy else None)
    if lazy is not None:
        read_lazily(list(w.pending.values()), lazy)
    for name in list(w.pending):
        program = w.pending.pop(name)
        program.optimize()  # what torch.onnx.export(optimize=True) runs, its transposes folded already
        proto = w.scratch.save(program, name)
        del program
        canonical_dims(proto)
        w.decode, w.prefill = (proto, w.prefill) if name == "decode.onnx" else (w.decode, proto)
    if w.release and vision_spec(w.loaded.model.config) is None:  # a VLM's record reads its vision tower
        release_weights(w.loaded.model)


def _export_vision(w: _Writing) -> None:
    from ..frontend.vision_encoder import capture_vision_encoder

    program = capture_vision_encoder(w.loaded.model)
    w.vision = program_to_onnx(program, list(VISION_INPUTS), list(VISION_OUTPUTS), scratch=w.scratch,
                               name=VISION_FILE)


def _fuse(w: _Writing) -> None:
    w.decode, w.prefill, w.attention = fuse_for_ort(w.decode, w.prefill, w.pair, scratch=w.scratch)
    check_capped_attention(w.loaded.model.config, w.attention["layers"])


def check_capped_attention(config, layers: dict[str, dict[str, int]]) -> None:
    """UnsupportedModelError where the model's attention scores are soft-capped (arch.attention_softcap) and a
    graph's layers (``layers``: graph -> attention form -> count, lower_for_ort's) took a fused form:
    onnxruntime's attention ops here have no cap, so a fused layer would silently drop it. Capture writes
    capped attention as plain ops (capture.softcapped_attention) that no fusion matches today."""
    cap = attention_softcap(config)
    fused = {graph: n for graph, forms in layers.items()
             if (n := sum(count for form, count in forms.items() if form != "standard"))}
    if cap is not None and fused:
        graph, count = next(iter(fused.items()))
        raise UnsupportedModelError(
            f"{count} soft-capped attention layer(s) of the {graph} graph were fused into onnxruntime "
            f"attention, which has no cap (attn_logit_softcapping={cap}): export with --attention standard")


def _quantize(w: _Writing) -> None:
    store = w.scratch.store if w.scratch else None
    quantised = Quantised(store)  # the weights both graphs read are quantised once
    w.decode, w.prefill = (quantize_weights(proto, w.quantization, store, quantised)
                           for proto in (w.decode, w.prefill))


def _write_folder(w: _Writing) -> None:
    w.weights_bytes = write_shared(w.folder, w.graphs)
    if w.scratch is not None:
        w.scratch.remove()
    # onnxruntime's SimplifiedLayerNormalization sits in the default domain, unknown to the checker
    for name in w.graphs:
        if not w.attention or name == VISION_FILE:
            onnx.checker.check_model(str(w.folder / name))
    w.loaded.tokenizer.save_pretrained(w.folder)
    w.loaded.model.generation_config.save_pretrained(w.folder)
    w.loaded.model.config.to_json_file(w.folder / "config.json")  # geometry for cost models and tools


#: what each of steps.ONNX_WRITE_STEPS does, by name (the names are that list's, in its order)
_RUN = dict(zip((step.name for step in ONNX_WRITE_STEPS),
                (_export_decode, _export_prefill, _export_vision, _fuse, _quantize, _write_folder),
                strict=True))


def write_engine(tmp: Path, loaded: LoadedModel, pair: GraphPair, provenance: dict,
                 step: Callable[[str], None], quantization: WeightQuantization,
                 attention: str, release: bool = False) -> EngineManifest:
    """Both graphs, the shared weights, the tokenizer and HF config files into ``tmp``, through
    steps.ONNX_WRITE_STEPS (each reported to ``step``); returns their manifest (not written: the driver
    writes it once). ``attention`` as the target resolved it (OnnxTarget.lowering): fused, norms and
    attention as onnxruntime's contrib ops (ort_passes/__init__.py), or standard. ``provenance``: the
    manifest's ``extra`` (how the K/V weights and the cut were chosen). ``release``: the model is the
    driver's own, its weights freed once the graphs are exported (the module docstring's memory)."""
    writing = _Writing(tmp, loaded, pair, quantization, release, Scratch(tmp / SCRATCH), lowering=attention)
    vision = vision_spec(loaded.model.config) is not None
    for write_step in onnx_write_steps(attention, quantization.bits is not None, vision):
        step(write_step.name)
        _RUN[write_step.name](writing)
    section = {}
    if vision:
        record = vision_record(loaded.model, loaded.tokenizer, loaded.source.path)
        section = {"graph": asdict(_graph_entry(tmp / VISION_FILE)), **record}
    return _manifest(tmp, loaded, pair, writing.weights_bytes, provenance, vision=section,
                     format_version=format_version(vision),
                     quantization=quantization.to_manifest(), attention=writing.attention)


def to_onnx(program, pair: GraphPair, *, with_logits: bool, scratch: Scratch | None = None,
            name: str = "graph.onnx") -> onnx.ModelProto:
    """One graph to ONNX with the KV layout's names and canonical dynamic dimension names (its weights in
    ``scratch`` where given: ``program_to_onnx``)."""
    proto = program_to_onnx(program, *_names(pair, with_logits), scratch=scratch, name=name)
    canonical_dims(proto)
    return proto


def _names(pair: GraphPair, with_logits: bool) -> tuple[list[str], list[str]]:
    """A text graph's input and output names: the interface's, then the KV layout's."""
    layout = pair.layout
    return [*pair.inputs, *layout.past_names], (["logits"] if with_logits else []) + layout.present_names


def _exported(program, inputs: list[str], outputs: list[str], *, optimize: bool, lowering: str = "standard"):
    """torch.onnx's dynamo exporter on ``program`` (its ONNXProgram), with these tensor names; a mixture of
    experts' op lowered as ``lowering`` says (moe.py)."""
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its stages
        return torch.onnx.export(program, (), dynamo=True, input_names=inputs, output_names=outputs,
                                 opset_version=OPSET, optimize=optimize, verify=False, report=False,
                                 custom_translation_table=translation_table(lowering))


def program_to_onnx(program, inputs: list[str], outputs: list[str], *, scratch: Scratch | None = None,
                    name: str = "graph.onnx") -> onnx.ModelProto:
    """An exported program to ONNX (torch.onnx's dynamo exporter, optimised) with these tensor names. With
    ``scratch``, saved there as ``name`` with external data and read back without it (scratch.py): the
    weights are never one protobuf in memory."""
    onnx_program = _exported(program, inputs, outputs, optimize=True)
    if scratch is None:
        return onnx_program.model_proto
    path = scratch.folder / name
    onnx_program.save(path, external_data=True)
    del onnx_program
    return scratch.load(path)


def fold_weight_transposes(programs: list, *, free: bool,
                           read: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
    """Fold each ``Transpose(W, perm=[1, 0])`` of a 2-D weight it alone reads into the initializer ``W.T``
    (named as its output, as onnxscript's constant folding does: it always folds a transpose of a weight it
    is the single reader of), in every graph of ``programs`` (unoptimised ONNXPrograms) at once: a weight
    the graphs share is transposed once. With ``free``, the model's storage of each weight is released as
    soon as it is transposed and no graph reads it otherwise, so the model and its transposed copy never
    both exist whole. ``read``: a weight's values from a placeholder (``LazyWeights.read``: the model was
    built without its weights). Returns how many were folded."""
    import onnx_ir as ir

    def tensor(value) -> torch.Tensor | None:
        raw = getattr(value.const_value, "raw", None)
        return raw if isinstance(raw, torch.Tensor) else None

    readers: dict[int, int] = {}  # storage -> how many initializers of all graphs read it
    sites: dict[int, list] = {}  # storage -> the foldable transposes of it: (graph, node, weight)
    for program in programs:
        graph = program.model.graph
        for value in graph.initializers.values():
            if tensor(value) is not None:
                key = tensor(value).untyped_storage().data_ptr()
                readers[key] = readers.get(key, 0) + 1
        for node in graph:
            weight = node.inputs[0] if node.op_type == "Transpose" and node.domain == "" else None
            if (weight is not None and weight.is_initializer() and len(weight.uses()) == 1
                    and tensor(weight) is not None and tensor(weight).dim() == 2
                    and list(node.attributes.get_ints("perm", [])) == [1, 0]):
                key = tensor(weight).untyped_storage().data_ptr()
                sites.setdefault(key, []).append((graph, node, weight))
    for key, found in sites.items():
        transposed: dict[tuple, object] = {}
        for graph, node, weight in found:
            raw, out = tensor(weight), node.outputs[0]
            view = (raw.storage_offset(), tuple(raw.shape), raw.stride())
            dtype, shape = weight.const_value.dtype, ir.Shape(tuple(raw.shape)[::-1])
            if read is not None:  # a placeholder: read and transposed when saved, one tensor at a time
                const = ir.LazyTensor(
                    lambda raw=raw: ir.Tensor(read(raw).detach().t().contiguous().numpy()),
                    dtype=dtype, shape=shape, name=out.name)
            else:
                if view not in transposed:
                    transposed[view] = raw.detach().t().contiguous().numpy()
                const = ir.Tensor(transposed[view], name=out.name)
            value = ir.Value(name=out.name, shape=shape, type=out.type or ir.TensorType(dtype),
                             const_value=const)
            ir.convenience.replace_all_uses_with(out, value)
            graph.remove(node, safe=True)
            graph.initializers.pop(weight.name)
            graph.register_initializer(value)
        if free and read is None and len(found) == readers[key]:  # (a placeholder holds nothing to free)
            _free(tensor(found[0][2]))
    return sum(len(found) for found in sites.values())


def fold_weight_slices(programs: list, *, lazy: LazyWeights | None = None) -> int:
    """Fold each ``Slice(W, constant starts, ends[, axes[, unit steps]])`` of a weight into an initializer of
    its own, named as the Slice's output, in every graph of ``programs`` (unoptimised ONNXPrograms): a fused
    qkv_proj's K and V rows that a pruned layer keeps (passes/fused.py), so the prefill graph stores those
    rows and not the whole projection (the decode graph keeps it whole). A weight no node reads any more
    leaves its graph. The new initializer is a view of the model's tensor (``fold_weight_transposes``, next,
    transposes it and may free the storage with the whole's), for a placeholder one of its own
    (``LazyWeights.part``). Returns how many were folded."""
    import onnx_ir as ir

    folded = 0
    for program in programs:
        graph = program.model.graph
        for node in list(graph):
            if node.op_type != "Slice" or node.domain != "":
                continue
            data, *bounds = node.inputs
            weight = data is not None and data.is_initializer()
            raw = getattr(data.const_value, "raw", None) if weight else None
            values = [None if v is None else _flat_ints(v) for v in bounds]
            starts, ends, axes, steps = (values + [None] * 4)[:4]
            if not isinstance(raw, torch.Tensor) or starts is None or ends is None or any(
                    v is None for v, given in zip((axes, steps), bounds[2:]) if given is not None):
                continue
            axes = list(range(len(starts))) if axes is None else axes
            if any(step != 1 for step in steps or ()):
                continue
            index = [slice(None)] * raw.dim()
            for axis, start, end in zip(axes, starts, ends):
                index[axis % raw.dim()] = slice(start, end)  # ONNX clamps as Python does
            part = lazy.part(raw, tuple(index)) if lazy is not None else raw[tuple(index)]
            if lazy is None or lazy.key(raw) is None:
                part = part if part.is_contiguous() else part.contiguous()
            out = node.outputs[0]
            const = type(data.const_value)(part, name=out.name)
            value = ir.Value(name=out.name, shape=ir.Shape(tuple(part.shape)),
                             type=out.type or ir.TensorType(const.dtype), const_value=const)
            ir.convenience.replace_all_uses_with(out, value)
            graph.remove(node, safe=True)
            graph.register_initializer(value)
            if not data.uses():
                graph.initializers.pop(data.name)
            folded += 1
    return folded


def _flat_ints(value) -> list[int] | None:
    """An integer constant's values, flattened: an initializer, a Constant node's output, or either through
    the Reshape, Unsqueeze, Squeeze, Cast or Identity that torch.onnx puts around a scalar; else None."""
    const, producer = value.const_value, value.producer()
    if const is None and producer is not None and producer.domain == "":
        if producer.op_type == "Constant":
            attribute = next(iter(producer.attributes.values()), None)
            if attribute is None or attribute.name not in ("value", "value_int", "value_ints"):
                return None
            found = attribute.value
            if attribute.name == "value_int":
                return [int(found)]
            if attribute.name == "value_ints":
                return list(found)
            array = found.numpy()
            return array.astype(int).ravel().tolist() if array.dtype.kind in "iu" else None
        if producer.op_type in ("Reshape", "Unsqueeze", "Squeeze", "Cast", "Identity") and producer.inputs:
            return _flat_ints(producer.inputs[0])
        return None
    if const is None:
        return None
    array = const.numpy()
    return array.astype(int).ravel().tolist() if array.dtype.kind in "iu" else None


def read_lazily(programs: list, lazy: LazyWeights) -> None:
    """Every initializer of ``programs`` that is a placeholder (a model built without its weights) read from
    its checkpoint when it is used (optimised, saved), one tensor at a time, never kept."""
    import onnx_ir as ir

    for program in programs:
        for value in program.model.graph.initializers.values():
            raw = getattr(value.const_value, "raw", None)
            if isinstance(raw, torch.Tensor) and lazy.key(raw) is not None:
                tensor = value.const_value
                value.const_value = ir.LazyTensor(
                    lambda raw=raw: ir.Tensor(lazy.read(raw).detach().contiguous().numpy()),
                    dtype=tensor.dtype, shape=tensor.shape, name=tensor.name)


def _free(tensor: torch.Tensor) -> None:
    try:
        tensor.untyped_storage().resize_(0)
    except RuntimeError:  # not resizable (memory-mapped): left
        pass


def release_weights(model: torch.nn.Module) -> None:
    """Free the storage of every parameter and buffer of ``model`` (and of every tensor sharing it: the
    captured programs'): the exported graphs hold the weights now. The model is unusable afterwards; only a
    model the driver loaded is released. Storage that cannot be resized (memory-mapped) is left."""
    for tensor in [*model.parameters(), *model.buffers()]:
        _free(tensor)


def canonical_dims(proto: onnx.ModelProto) -> None:
    """Rename the exporter's symbols (s10, s15 + s70, ...) to batch/seq/past/total, the same in every
    graph."""
    roles = {"input_ids": ("batch", "seq"), "attention_mask": ("batch", "total")}
    names: dict[str, str] = {}
    for value in proto.graph.input:
        past = ("batch", None, "past", None) if value.name.startswith("past_") else ()
        wanted = roles.get(value.name) or past
        for dim, name in zip(value.type.tensor_type.shape.dim, wanted):
            if name and dim.dim_param:
                names.setdefault(dim.dim_param, name)
    for value in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]


def write_shared(folder: Path, graphs: dict[str, onnx.ModelProto]) -> int:
    """Move every initializer of every graph into one weights file, each distinct tensor once (read one at a
    time, from memory or a scratch file)."""
    offsets: dict[bytes, tuple[int, int]] = {}
    with open(folder / WEIGHTS, "wb") as blob:
        for name, proto in graphs.items():
            for tensor in proto.graph.initializer:
                if nbytes(tensor) >= INLINE_BYTES:
                    _externalize(tensor, blob, offsets)
            onnx.save_model(proto, str(folder / name))
        return blob.tell()


def _externalize(tensor: onnx.TensorProto, blob, offsets: dict[bytes, tuple[int, int]]) -> None:
    raw = tensor_array(tensor).tobytes()
    key = hashlib.sha256(raw + str((tensor.data_type, tuple(tensor.dims))).encode()).digest()
    if key not in offsets:
        blob.write(b"\0" * (-blob.tell() % _ALIGN))
        offsets[key] = (blob.tell(), len(raw))
        blob.write(raw)
    offset, length = offsets[key]
    external(tensor, WEIGHTS, offset, length)


def _manifest(folder: Path, loaded: LoadedModel, pair: GraphPair, weights_bytes: int,
              provenance: dict, **sections) -> EngineManifest:
    """The manifest of the written folder; ``sections``: the writer's other fields (quantization, attention,
    vision, format_version)."""
    graphs = {name: _graph_entry(folder / f"{name}.onnx") for name in ("prefill", "decode")}
    eos = loaded.model.generation_config.eos_token_id
    source = loaded.source
    return EngineManifest(
        model={"name": source.name, "kind": source.kind, "path": source.path, "sha256": source.sha256,
               "model_type": loaded.model.config.model_type,
               **({"revision": source.revision} if getattr(source, "revision", None) else {})},
        num_layers=pair.num_layers, cut=pair.cut, kv_layout=pair.layout, graphs=graphs,
        weights={"file": WEIGHTS, "bytes": weights_bytes, "sha256": sha256_file(folder / WEIGHTS)},
        dtype=pair.layout.dtype,
        versions=_versions(),
        extra=dict(provenance),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        boundary=pair.boundary,
        **sections,
    )


def _graph_entry(path: Path) -> GraphEntry:
    proto = onnx.load(str(path), load_external_data=False)
    return GraphEntry(file=path.name, inputs=tuple(v.name for v in proto.graph.input),
                      outputs=tuple(v.name for v in proto.graph.output), bytes=path.stat().st_size,
                      sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def fuse_for_ort(decode: onnx.ModelProto, prefill: onnx.ModelProto, pair: GraphPair,
                 scratch: Scratch | None = None) -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    """Both graphs rewritten for onnxruntime's contrib ops by each of ``ORT_PASSES`` in turn
    (ort_passes/README.md: what each does and why it sits where it does), and the manifest's ``attention``
    entry from what they record. ``scratch``: where the weights are kept (scratch.py): a pass's large new
    initializers go there as they are made (OrtContext.store), and anything else it left in memory after it
    ran."""
    graphs, recorded = {"decode": decode, "prefill": prefill}, {}
    context = OrtContext(pair.num_layers, pair.layout, scratch.store if scratch else None)
    for ort_pass in ORT_PASSES:
        recorded.update(ort_pass.run(graphs, context))
        for proto in graphs.values() if scratch else ():
            scratch.spill(proto)
    lowering, rotary = recorded["layers"], recorded["rotary"]
    used = {op for forms in lowering.values() for op, layers in forms.items() if layers and op != "standard"}
    used |= {"RotaryEmbedding"} if any(rotary.values()) else set()
    entry = {"lowering": "onnxruntime", "ops": sorted(f"com.microsoft.{op}" for op in used),
             "layers": lowering, "shared_kv": recorded["shared_kv"], "rotary": rotary,
             "packed": recorded["packed"]}
    return graphs["decode"], graphs["prefill"], entry


def _versions() -> dict[str, str]:
    names = ("popcompile", "torch", "transformers", "onnx", "onnxscript")
    return {name: importlib.metadata.version(name) for name in names}
