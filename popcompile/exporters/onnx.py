"""Export both graphs to an ONNX engine folder that shares one weights file and one KV layout.

    engines/NAME/
      popcompile.json           manifest (engine/manifest.py)
      prefill.onnx, decode.onnx graphs; every initializer is external data in weights.bin
      weights.bin               each distinct tensor once: the graphs share it
      tokenizer.json, tokenizer_config.json, generation_config.json, config.json (the HF config)

The folder is written next to its destination as ``.NAME.PID.partial`` and renamed into place only
when complete, so a failed export leaves nothing behind and never replaces a good folder. ``force``
replaces only a popcompile engine folder (its manifest readable), in one atomic exchange, once the new
one is complete; ``.NAME.lock`` (fsutil.destination_lock) makes a second export to the same folder fail
at once. Options, the destination and a calibration file are checked before the model loads.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import importlib.metadata
import io
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import onnx
import torch

from ..calibrate import KVFit, check_fit, check_fit_shapes, default_batches, fit_kv, load_fit
from ..engine.manifest import EngineManifest, GraphEntry, sha256_file
from ..errors import ConfigError
from ..fsutil import destination_lock, staged_folder
from ..models import LoadedModel, load_model
from ..passes.pop import KVWeights, resolve_cut
from ..pipeline import GraphPair, build_graphs
from .checks import DTYPES, check_options, check_output_folder

OPSET = 20
WEIGHTS = "weights.bin"
_ALIGN = 64
# Small constants (shapes, axes) stay inside the graph: shape inference and parsers read them there.
_INLINE_BYTES = 1024


def export(
    model: str | LoadedModel, out_dir: str | Path, *, cut: int | None = None,
    prune_ratio: float | None = None, max_seq: int | None = None, force: bool = False,
    kv_calibration: str | Path | None = "auto", progress: Callable[[str], None] | None = None,
    cut_choice: dict | None = None,
    dtype: str = "float32", boundary: str = "folded", min_prompt_tokens: int | str = "auto",
) -> EngineManifest:
    """Load (if given a name), capture, run the POP pass and write the engine folder ``out_dir``.

    ``dtype="float16"`` casts the model (a copy, when the caller passed a loaded one) before capture,
    so weights, activations, the KV signature (``KVLayout.dtype``) and logits are float16; the
    models' norms and RoPE tables still compute in float32 internally, as in PyTorch. POP+ weights are
    fitted in float32 first, then cast. ``cut_choice``: how an automatic cut was chosen (method and
    measured figures), recorded in the manifest's ``extra``. onnxruntime's CPU provider refuses float16 engines
    (docs/benchmarks.md says why): run them with ``provider="cuda"``. ``boundary``: "folded" (default: the
    prefill graph takes x_1..x_N and returns x_N's logits, one call to the first token) or "separate"
    (x_1..x_{N-1}; the decode graph runs x_N), recorded in the manifest (docs/kv.md).
    ``min_prompt_tokens``: prompts shorter than this prefill in full (0: POP for every prompt); "auto"
    (default) measures POP against full on the written folder with onnxruntime (seconds) and takes
    threshold.py's rule (docs/prompt_length.md); the measurement goes in ``extra``. A float16 engine,
    which onnxruntime's CPU provider refuses, records 0 with a warning.
    """
    out_dir = Path(out_dir)
    check_options(dtype=dtype, boundary=boundary, max_seq=max_seq, cut=cut, prune_ratio=prune_ratio,
                  min_prompt_tokens=min_prompt_tokens)
    check_output_folder(out_dir, force)
    fit_file = _fit_file(kv_calibration)  # a bad file fails now, not after the model loads
    with destination_lock(out_dir):
        check_output_folder(out_dir, force)  # again: another export may have finished while we waited
        step = progress or (lambda name: None)
        step("load")
        owned = not isinstance(model, LoadedModel)
        loaded = load_model(model) if owned else model
        step("capture + POP pass")
        _check_max_seq(loaded, max_seq)
        cut = resolve_cut(loaded.model.config.num_hidden_layers, cut=cut, prune_ratio=prune_ratio)
        fit = kv_fit(loaded, cut, fit_file if fit_file is not None else kv_calibration)
        network = cast_model(loaded.model, dtype, in_place=owned)
        kv_weights = fit and cast_weights(fit.weights, dtype)
        pair = build_graphs(network, cut=cut, max_seq=max_seq, kv_weights=kv_weights, boundary=boundary)
        with staged_folder(out_dir, replace=force) as tmp:
            manifest = _write_folder(tmp, loaded, pair, fit, cut_choice, step)
            value, record = (measure_min_prompt_tokens(tmp, manifest, step) if min_prompt_tokens == "auto"
                             else (min_prompt_tokens, None))
            manifest = manifest.with_min_prompt_tokens(value, record)
            manifest.write(tmp)
            check_output_folder(out_dir, force)  # nothing but an engine folder is ever swapped out
    return manifest


def _write_folder(tmp: Path, loaded: LoadedModel, pair: GraphPair, fit: KVFit | None, cut_choice: dict | None,
                  step: Callable[[str], None]) -> EngineManifest:
    step("export decode graph")
    decode = to_onnx(pair.decode, pair, with_logits=True)
    step("export prefill graph")
    prefill = to_onnx(pair.prefill, pair, with_logits=pair.boundary == "folded")
    step("write engine folder")
    weights_bytes = write_shared(tmp, {"decode.onnx": decode, "prefill.onnx": prefill})
    for name in ("decode.onnx", "prefill.onnx"):
        onnx.checker.check_model(str(tmp / name))
    loaded.tokenizer.save_pretrained(tmp)
    loaded.model.generation_config.save_pretrained(tmp)
    loaded.model.config.to_json_file(tmp / "config.json")  # geometry for cost models and tools
    manifest = _manifest(tmp, loaded, pair, weights_bytes, fit, cut_choice)
    manifest.write(tmp)
    return manifest


def measure_min_prompt_tokens(folder: Path, manifest: EngineManifest,
                              step: Callable[[str], None] = lambda name: None) -> tuple[int, dict]:
    """``min_prompt_tokens="auto"``: the threshold measured on ``folder`` with onnxruntime, and its record."""
    if manifest.dtype != "float32":
        note = "onnxruntime's CPU provider refuses float16 engines: POP for every prompt; give --min-prompt-tokens N"
        warnings.warn(f"--min-prompt-tokens auto: {note}", stacklevel=3)
        return 0, {"method": "not measured", "note": note}
    from ..runtime.compare import measured_min_prompt_tokens
    from ..runtime.ort import PopSession
    from ..runtime.verify import HashCache

    step("measure min_prompt_tokens")
    value, record = measured_min_prompt_tokens(PopSession(folder, hash_cache=HashCache(None)), "onnxruntime-cpu")
    if "note" in record:
        warnings.warn(f"--min-prompt-tokens auto: {record['note']}", stacklevel=3)
    return value, record


def _check_max_seq(loaded: LoadedModel, max_seq: int | None) -> None:
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if max_seq is not None and isinstance(limit, int) and max_seq > limit:
        raise ConfigError(f"--max-seq {max_seq} exceeds the model's max_position_embeddings={limit}: "
                          f"give at most {limit}")


def cast_model(model: torch.nn.Module, dtype: str, *, in_place: bool) -> torch.nn.Module:
    """``model`` with its parameters in ``dtype``; a copy unless ``in_place``.

    Floating buffers (RoPE's ``inv_freq``) stay float32: rounded to float16, ``inv_freq * position``
    is off by whole radians at positions in the thousands. The caller's model is never changed
    unless ``in_place``: casting float32 -> float16 -> float32 loses precision.
    """
    target = getattr(torch, dtype)
    if all(p.dtype == target for p in model.parameters()):
        return model
    model = model if in_place else copy.deepcopy(model)
    kept = [(module, name, buffer) for module in model.modules()
            for name, buffer in module.named_buffers(recurse=False) if buffer.is_floating_point()]
    model.to(target)  # replaces every tensor; ``kept`` still holds the originals
    for module, name, buffer in kept:
        setattr(module, name, buffer.float())
    return model


def cast_weights(weights: KVWeights, dtype: str) -> KVWeights:
    """POP+ replacement projections in the engine's dtype (they are fitted in float32)."""
    target = getattr(torch, dtype)
    return {layer: {name: dataclasses.replace(
                p, weight=p.weight.to(target), bias=None if p.bias is None else p.bias.to(target))
                    for name, p in parts.items()}
            for layer, parts in weights.items()}


def to_onnx(program, pair: GraphPair, *, with_logits: bool) -> onnx.ModelProto:
    """One graph to ONNX with the KV layout's names and canonical dynamic dimension names."""
    layout = pair.layout
    inputs = ["input_ids", "position_ids", "attention_mask", *layout.past_names]
    outputs = (["logits"] if with_logits else []) + layout.present_names
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its stages
        onnx_program = torch.onnx.export(
            program, (), dynamo=True, input_names=inputs, output_names=outputs,
            opset_version=OPSET, optimize=True, verify=False, report=False,
        )
    proto = onnx_program.model_proto
    canonical_dims(proto)
    return proto


def canonical_dims(proto: onnx.ModelProto) -> None:
    """Rename the exporter's symbols (s10, s15 + s70, ...) to batch/seq/past/total, the same in every graph."""
    roles = {"input_ids": ("batch", "seq"), "attention_mask": ("batch", "total")}
    names: dict[str, str] = {}
    for value in proto.graph.input:
        wanted = roles.get(value.name) or (("batch", None, "past", None) if value.name.startswith("past_") else ())
        for dim, name in zip(value.type.tensor_type.shape.dim, wanted):
            if name and dim.dim_param:
                names.setdefault(dim.dim_param, name)
    for value in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]


def write_shared(folder: Path, graphs: dict[str, onnx.ModelProto]) -> int:
    """Move every initializer of every graph into one weights file, each distinct tensor once."""
    offsets: dict[bytes, tuple[int, int]] = {}
    with open(folder / WEIGHTS, "wb") as blob:
        for name, proto in graphs.items():
            for tensor in proto.graph.initializer:
                if _nbytes(tensor) >= _INLINE_BYTES:
                    _externalize(tensor, blob, offsets)
            onnx.save_model(proto, str(folder / name))
        return blob.tell()


def _nbytes(tensor: onnx.TensorProto) -> int:
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _externalize(tensor: onnx.TensorProto, blob, offsets: dict[bytes, tuple[int, int]]) -> None:
    raw = onnx.numpy_helper.to_array(tensor).tobytes()
    key = hashlib.sha256(raw + str((tensor.data_type, tuple(tensor.dims))).encode()).digest()
    if key not in offsets:
        blob.write(b"\0" * (-blob.tell() % _ALIGN))
        offsets[key] = (blob.tell(), len(raw))
        blob.write(raw)
    offset, length = offsets[key]
    onnx.external_data_helper.set_external_data(tensor, WEIGHTS, offset=offset, length=length)
    tensor.ClearField("raw_data")
    for field in ("float_data", "int32_data", "int64_data", "double_data"):
        tensor.ClearField(field)
    tensor.data_location = onnx.TensorProto.EXTERNAL


def kv_fit(loaded: LoadedModel, cut: int, kv_calibration: str | Path | KVFit | None) -> KVFit | None:
    """None/"none": plain POP (the paper's); "auto" (export's default, docs/results.md says why): fit POP+
    on the built-in corpus now; else a file from `popcompile calibrate` (or its loaded KVFit)."""
    layers = loaded.model.config.num_hidden_layers
    if kv_calibration in (None, "none") or cut == layers:
        return None
    if kv_calibration == "auto":
        with torch.no_grad():
            return fit_kv(loaded.model, default_batches(loaded.tokenizer), cut)
    fit = kv_calibration if isinstance(kv_calibration, KVFit) else load_fit(kv_calibration)
    check_fit(fit, cut, layers)
    check_fit_shapes(fit, loaded.model)
    return fit


def _fit_file(kv_calibration: str | Path | KVFit | None) -> KVFit | None:
    """The calibration file's fit, loaded and checked for finite values (None for auto/none)."""
    if kv_calibration in (None, "none", "auto") or isinstance(kv_calibration, KVFit):
        return None
    return load_fit(kv_calibration)


def _manifest(folder: Path, loaded: LoadedModel, pair: GraphPair, weights_bytes: int,
              fit: KVFit | None, cut_choice: dict | None) -> EngineManifest:
    graphs = {}
    for name in ("prefill", "decode"):
        path = folder / f"{name}.onnx"
        proto = onnx.load(str(path), load_external_data=False)
        graphs[name] = GraphEntry(
            file=path.name, inputs=tuple(v.name for v in proto.graph.input),
            outputs=tuple(v.name for v in proto.graph.output), bytes=path.stat().st_size,
            sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    eos = loaded.model.generation_config.eos_token_id
    source = loaded.source
    return EngineManifest(
        model={"name": source.name, "kind": source.kind, "path": source.path, "sha256": source.sha256,
               "model_type": loaded.model.config.model_type},
        num_layers=pair.num_layers, cut=pair.cut, kv_layout=pair.layout, graphs=graphs,
        weights={"file": WEIGHTS, "bytes": weights_bytes, "sha256": sha256_file(folder / WEIGHTS)},
        dtype=pair.layout.dtype,
        versions=_versions(), extra={"kv_calibration": asdict(fit.info) if fit else None, "cut_choice": cut_choice},
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        boundary=pair.boundary,
    )


def _versions() -> dict[str, str]:
    names = ("popcompile", "torch", "transformers", "onnx", "onnxscript")
    return {name: importlib.metadata.version(name) for name in names}
