"""The one compile driver: a model and a PopConfig in, an engine folder out.

    compile(model, PopConfig(...), out="engines/x", target="onnx")
      load       models.load_model            a shipped name, a .gguf, a HF folder (or a LoadedModel)
      calibrate  config.resolve_cut,           the cut for this model's depth; POP+ weights (none | auto | distill
                 distill.kv_fit               | file); distill reports a "distill" step of its own (minutes)
      capture    capture.capture              the decode graph (torch.export, explicit KV interface)
      POP pass   passes.prefill.pop_graphs    the prefill graph (passes/boundary.py or passes/pop.py)
      export     exporters.targets.TARGETS    ONNX (+ TensorRT plans), or a vLLM folder (no capture, no
                                              POP pass: vLLM runs the model), written into a staged folder
      threshold  runtime.open_session         min_prompt_tokens measured on the new folder ("auto")
      manifest   engine.manifest              written last; the staged folder is renamed into place

Everything that can be checked before the model loads is: the config (on construction), the target
(``preflight``: a GPU for TensorRT), the destination and a calibration file. The folder is staged
next to ``out`` and swapped in only when complete (fsutil.staged_folder): a failure leaves nothing,
``force`` replaces only an engine folder. This module reads no flags and prints nothing: the CLI
(commands/export.py) builds the PopConfig and shows ``progress``.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from .config import PopConfig, resolve_cut
from .engine.manifest import BOUNDARIES, EngineManifest
from .errors import ConfigError
from .exporters.checks import check_output_folder
from .exporters.targets import Target, target_for
from .frontend.capture import capture
from .frontend.models import LoadedModel, load_model
from .fsutil import destination_lock, staged_folder
from .kvfit.calibrate import KVFit, read_fit
from .kvfit.distill import DISTILL_STEP, kv_fit
from .passes.pop import KVWeights
from .passes.prefill import GraphPair, pop_graphs

if TYPE_CHECKING:
    from .exporters.vllm import ServingFolder

STEPS = ("load", "calibrate", "capture", "POP pass")
MEASURE_STEP = "measure min_prompt_tokens"


def compile(model: str | Path | LoadedModel, config: PopConfig | None = None, *, out: str | Path,  # noqa: A001
            target: str | Target = "onnx", force: bool = False,
            progress: Callable[[str], None] | None = None) -> EngineManifest | ServingFolder:
    """Compile ``model`` with POP into the engine folder ``out``; returns its manifest (module docstring), for
    the vllm target a ServingFolder."""
    config, target, out = config or PopConfig(), target_for(target), Path(out)
    step = progress or (lambda name: None)
    target.preflight(config)
    check_output_folder(out, force)
    early_fit = read_fit(config.kv_calibration)  # a bad file fails now, not after the model loads
    with destination_lock(out):
        check_output_folder(out, force)  # again: another export may have finished while we waited
        step("load")
        loaded, owned = (model, False) if isinstance(model, LoadedModel) else (load_model(model), True)
        step("calibrate")
        cut, fit = calibrate(loaded, config, early_fit, step)
        model = cast_model(loaded.model, config.dtype, in_place=owned)
        pair = graphs(model, config, cut, fit, step) if target.graphs else None
        if not target.graphs and model is not loaded.model:
            loaded = dataclasses.replace(loaded, model=model)
        with staged_folder(out, replace=force) as tmp:
            manifest = target.write(tmp, loaded, cut, pair, fit, config, step)
            if target.runtime is not None:
                manifest = with_min_prompt_tokens(tmp, manifest, config, target, step)
            check_output_folder(out, force)  # nothing but an engine folder is ever swapped out
    return manifest


def graphs(model: torch.nn.Module, config: PopConfig, cut: int, fit: KVFit | None,
           step: Callable[[str], None]) -> GraphPair:
    """The captured decode graph and its POP prefill graph."""
    step("capture")
    captured = capture(model, max_seq=config.max_seq)
    step("POP pass")
    return pop_graphs(captured, cut, fit and cast_weights(fit.weights, config.dtype), config.boundary)


def build_graphs(
    model: torch.nn.Module, *, cut: int | None = None, prune_ratio: float | None = None,
    max_seq: int | None = None, kv_weights: KVWeights | None = None, boundary: str = "folded",
) -> GraphPair:
    """Capture ``model`` and derive its prefill graph (capture + POP pass, no export): cut and boundary are
    validated before any tracing."""
    if boundary not in BOUNDARIES:
        raise ConfigError(f"boundary={boundary!r} is not one of {', '.join(BOUNDARIES)}")
    cut = resolve_cut(model.config.num_hidden_layers, cut=cut, prune_ratio=prune_ratio)
    return pop_graphs(capture(model, max_seq=max_seq), cut, kv_weights, boundary)


def steps(config: PopConfig, target: str | Target = "onnx") -> list[str]:
    """The names ``compile`` reports to ``progress``, in order (for a progress bar's total)."""
    target = target_for(target)
    measure = [MEASURE_STEP] if config.min_prompt_tokens == "auto" and target.runtime is not None else []
    distill = [DISTILL_STEP] if config.kv_calibration.mode == "distill" else []  # after "calibrate"
    named = [*(STEPS if target.graphs else STEPS[:2])]
    return [*named[:2], *distill, *named[2:], *target.steps, *measure]


def calibrate(loaded: LoadedModel, config: PopConfig, fit: KVFit | None = None,
              step: Callable[[str], None] | None = None) -> tuple[int, KVFit | None]:
    """The cut for this model and its POP+ weights (ConfigError / InputError before any tracing)."""
    check_max_seq(loaded, config.max_seq)
    cut = config.resolve_cut(loaded.model.config.num_hidden_layers)
    return cut, kv_fit(loaded.model, loaded.tokenizer, cut, config.kv_calibration, fit, step=step)


def check_max_seq(loaded: LoadedModel, max_seq: int | None) -> None:
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if max_seq is not None and isinstance(limit, int) and max_seq > limit:
        raise ConfigError(f"--max-seq {max_seq} exceeds the model's max_position_embeddings={limit}: "
                          f"give at most {limit}")


def with_min_prompt_tokens(folder: Path, manifest: EngineManifest, config: PopConfig, target: Target,
                           step: Callable[[str], None]) -> EngineManifest:
    """The manifest with its threshold: as configured, or measured on ``folder`` with the target's runtime
    (threshold.py's rule); written to ``folder``."""
    value, record = config.min_prompt_tokens, None
    if value == "auto" and target.runtime == "onnxruntime" and manifest.dtype != "float32":
        note = "onnxruntime's CPU provider refuses float16 engines: POP for every prompt; give --min-prompt-tokens N"
        warnings.warn(f"--min-prompt-tokens auto: {note}", stacklevel=3)
        value, record = 0, {"method": "not measured", "note": note}
    elif value == "auto":
        step(MEASURE_STEP)
        value, record = measure_min_prompt_tokens(folder, target.runtime)
    manifest = manifest.with_min_prompt_tokens(value, record)
    manifest.write(folder)
    return manifest


def measure_min_prompt_tokens(folder: Path, runtime: str) -> tuple[int, dict]:
    from .engine.verify import HashCache
    from .runtime import open_session
    from .runtime.compare import measured_min_prompt_tokens

    label = "onnxruntime-cpu" if runtime == "onnxruntime" else runtime
    value, record = measured_min_prompt_tokens(open_session(folder, runtime=runtime, hash_cache=HashCache(None)),
                                               label)
    if "note" in record:
        warnings.warn(f"--min-prompt-tokens auto: {record['note']}", stacklevel=4)
    return value, record


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


def export(model: str | Path | LoadedModel, out_dir: str | Path, *, force: bool = False,
           progress: Callable[[str], None] | None = None, target: str | Target = "onnx", **config) -> EngineManifest:
    """``compile(model, PopConfig(**config), out=out_dir, target=target)``: the keyword form of the driver
    (``cut``, ``prune_ratio``, ``boundary``, ``kv_calibration``, ``dtype``, ``max_seq``, ``min_prompt_tokens``,
    ``cut_choice``: PopConfig's fields)."""
    return compile(model, PopConfig(**config), out=out_dir, force=force, progress=progress, target=target)
