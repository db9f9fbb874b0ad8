"""The one compile driver: a model and a PopConfig in, an engine folder out.

``compile`` runs ``COMPILE_STEPS``, an ordered list of named steps over one ``Compilation`` (the state they
read and fill in); the progress bar and ``steps()`` read the names from that list:

    load                  frontend.models.load_model  a shipped name, a .gguf, a HF folder (or a LoadedModel)
    choose cut            quality.floor.search        with PopConfig.quality_floor (--cut auto): POP+ at every
                                                      candidate cut on held-out prompts; the deepest cut
                                                      that keeps the full model's first token often enough
    calibrate             config.resolve_cut,         the cut for this model's depth, resolved once; POP+
                          kvfit.fit.resolve_fit       weights (none | ridge | file | auto on a VLM)
    distill               kvfit.fit.resolve_fit       POP++ weights (minutes): distill, auto on a text model;
                                                      estimated first, on KVFitConfig.device, within its
                                                      budget (kvfit/budget.py: may fall back to POP+)
    check quality         quality.floor.check_shipped the chosen cut with the weights that ship, recorded
    (cast)                cast_model                  the model in the engine's dtype (no progress name)
    capture               frontend.capture.capture    the decode graph (torch.export, explicit KV interface)
    POP pass              passes.prefill.pop_graphs   the prefill graph (passes/boundary.py or passes/pop.py)
    <the target's steps>  exporters.targets.TARGETS  ONNX (+ TensorRT plans), or a vLLM folder, written into
                                                      a staged folder from ``Compiled`` (no config); each
                                                      target names its own steps and returns the record
    measure ...           runtime.open_session        min_prompt_tokens: as configured, or "auto" measured
                                                      on the new folder (threshold.FIXED_MIN_PROMPT_TOKENS
                                                      where the target has no popcompile runtime)
    write manifest        record.write                the folder's record, written once

A target with ``graphs = False`` (vllm: vLLM runs the model) skips capture and the POP pass. Everything that
can be checked before the model loads is: the config (on construction), the target (``preflight``: a GPU for
TensorRT), the destination and a calibration file. The folder is staged next to ``out`` and swapped in only
when complete (fsutil.staged_folder): a failure leaves nothing, ``force`` replaces only an engine folder. This
module reads no flags and prints nothing: the CLI (commands/export.py) builds the PopConfig and shows
``progress``.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from .config import PopConfig, resolve_cut
from .engine.manifest import BOUNDARIES, EngineManifest
from .errors import ConfigError
from .exporters.checks import check_output_folder
from .exporters.steps import WRITE_MANIFEST
from .exporters.targets import Compiled, Target, target_for
from .frontend.capture import CapturedModel, capture
from .frontend.models import LoadedModel, load_model
from .frontend.vision import check_cut as check_vision_cut
from .frontend.vision import is_vision_language
from .fsutil import destination_lock, staged_folder
from .kvfit.budget import available_memory
from .kvfit.calibrate import KVFit, load_file_fit
from .kvfit.fit import DISTILL_STEP, fit_method, resolve_fit
from .passes.pop import KVWeights
from .passes.prefill import GraphPair, pop_graphs
from .quality.floor import CutQuality, FloorSearch, Note, check_shipped
from .quality.floor import estimate_s as floor_estimate_s
from .quality.floor import search as floor_search
from .stepmeter import StepMeter, StepRecord, rss_bytes  # noqa: F401  (StepRecord, rss_bytes: public here)
from .threshold import FIXED_MIN_PROMPT_TOKENS

if TYPE_CHECKING:
    from .exporters.vllm import ServingFolder

MEASURE_STEP = "measure min_prompt_tokens"


@dataclass
class Compilation:
    """One compile's state: the request, then what each step of ``COMPILE_STEPS`` fills in, in order."""

    source: str | Path | LoadedModel
    config: PopConfig
    target: Target
    out: Path
    force: bool
    report: Callable[[str], None]
    fit_progress: Callable | None = None  # the K/V fit's events (kvfit.fit.fit_on_tokens): plan, progress
    revision: str | None = None           # a hub id's branch, tag or commit (load)
    early_fit: KVFit | None = None        # a calibration file, read before the model loads
    loaded: LoadedModel | None = None     # load; calibrate replaces its model by the cast one
    owned: bool = False                   # load: the driver loaded the model, so it may cast it in place
    floor: FloorSearch | None = None      # choose cut: the quality floor's measurements and choice
    shipped: CutQuality | None = None     # check quality: the chosen cut with the fit that ships
    choice: dict | None = None            # choose cut: the record of a skipped search
    cut: int | None = None                # calibrate: the first pruned layer, resolved once
    fit: KVFit | None = None              # calibrate or distill: the pruned layers' K/V weights (None: own)
    captured: CapturedModel | None = None  # capture
    pair: GraphPair | None = None         # POP pass: decode and prefill graphs
    folder: Path | None = None            # the staged folder the target writes into
    manifest: EngineManifest | ServingFolder | None = None  # the target's record, then with its threshold

    @property
    def model_folder(self) -> str | None:
        """Where the model was loaded from (a VLM's preprocessor_config.json sizes its calibration images)."""
        return getattr(self.loaded.source, "path", None)

    def compiled(self) -> Compiled:
        """What the target writes: every decision made, no config."""
        choice = self.config.cut_choice and dict(self.config.cut_choice)
        if self.floor is not None:
            third = resolve_cut(self.floor.num_layers)
            choice = self.floor.record(self.shipped, self.fit.info.method if self.fit else "none", third)
        elif self.choice is not None:
            choice = self.choice
        provenance = {"kv_calibration": dataclasses.asdict(self.fit.info) if self.fit else None,
                      "cut_choice": choice}
        if self.fit is not None and self.fit.record is not None:  # fitted now: how, where, how long
            provenance["kv_fit"] = dict(self.fit.record)
        return Compiled(self.loaded, self.cut, self.pair, self.fit, provenance, disposable=self.owned)


@dataclass(frozen=True)
class CompileStep:
    """A named step of ``compile``: ``run`` reads and fills in the Compilation. ``applies``: whether it runs
    for a (config, target); ``staged``: it writes into the staged output folder; ``names``: the progress names
    it reports (default its own name; the target's write step reports the target's steps itself)."""

    name: str
    run: Callable[[Compilation], None]
    applies: Callable[[PopConfig, Target], bool] = lambda config, target: True
    staged: bool = False
    names: Callable[[Target], tuple[str, ...]] | None = None

    def progress_names(self, target: Target) -> tuple[str, ...]:
        return (self.name,) if self.names is None else self.names(target)


def _load(c: Compilation) -> None:
    """The model (its --max-seq checked at once), read straight in the engine's dtype where nothing runs
    it in float32 first (no K/V fit to compute: none or a file); a bf16 checkpoint read as float16 rounds
    as the cast would. Then, for a target that writes graphs, it is built without its weights
    (``load_model(lazy=True)``, ``_loads_lazily``): a ridge fit reads one layer's weights at a time,
    capture traces shapes only, and the ONNX writer reads each weight from the checkpoint as it writes it.
    Otherwise float32, cast after the fits."""
    owned = not isinstance(c.source, LoadedModel)
    if owned:
        direct = _reads_in_engine_dtype(c.config)
        dtype = getattr(torch, c.config.dtype) if direct else torch.float32
        c.loaded = load_model(c.source, dtype=dtype, revision=c.revision,
                              lazy=_loads_lazily(c.config, c.target))
    else:
        c.loaded = c.source
    c.owned = owned
    check_max_seq(c.loaded, c.config.max_seq)  # before the floor's search and the fits, minutes at scale
    c.target.check_model(c.loaded)  # e.g. vLLM: a model the plugin does not serve


def _loads_lazily(config: PopConfig, target: Target) -> bool:
    """Whether the model is built without its weights (frontend.lazy): for a target that writes graphs,
    when the engine's dtype is the one the model is read in (no fit: the engine's; a fit: float32, which
    the fit streams layer by layer, kvfit.fit.held). A float16 engine with a fit loads whole (the cast
    after the fit needs real weights)."""
    return target.graphs and (_reads_in_engine_dtype(config) or config.dtype == "float32")


def _reads_in_engine_dtype(config: PopConfig) -> bool:
    """No K/V fit runs the model (it is computed in float32): the model may load in the engine's dtype."""
    return config.kv_calibration.mode in ("none", "file")


def _calibrate(c: Compilation) -> None:
    """The cut for this model; POP+ weights unless distill (its own step); the model in the engine's dtype.
    ConfigError / InputError before any tracing."""
    text = c.loaded.model.config.get_text_config()  # a vision-language model's text decoder
    c.cut = c.floor.cut if c.floor is not None else c.config.resolve_cut(text.num_hidden_layers)
    check_vision_cut(c.loaded.model.config, c.cut)
    if fit_method(c.loaded.model, c.config.kv_calibration) != "distill":  # distill: its own step
        c.fit = resolve_fit(c.loaded.model, c.loaded.tokenizer, c.cut, c.config.kv_calibration, c.early_fit,
                            config=c.config.kv_fit, folder=c.model_folder, progress=c.fit_progress,
                            lazy=c.loaded.lazy)


def _distill(c: Compilation) -> None:
    if fit_method(c.loaded.model, c.config.kv_calibration) == "distill":
        c.fit = resolve_fit(c.loaded.model, c.loaded.tokenizer, c.cut, c.config.kv_calibration,
                            config=c.config.kv_fit, folder=c.model_folder, progress=c.fit_progress,
                            lazy=c.loaded.lazy)


def _choose_cut(c: Compilation) -> None:
    """The quality floor's search (quality/floor.py) on the whole model: a model built without its weights
    reads them now (the search runs it many times). Skipped, in one line and in the manifest, for the
    paper's third when the weights do not fit in memory or the estimate exceeds the calibration budget."""
    model, lazy, floor = c.loaded.model, c.loaded.lazy, c.config.quality_floor
    report = c.fit_progress or _warn
    fit, fitted = dataclasses.replace(c.config.kv_fit, method="ridge"), c.config.kv_calibration.fits_now
    need = 0 if lazy is None else lazy.placeholder_bytes(model)
    estimate, budget = floor_estimate_s(model, floor, fitted=fitted, seq_len=fit.seq_len), fit.budget_s
    if is_vision_language(model):
        why = ("its prompts are text only and this is a vision-language model (--cut auto --budget B "
               "chooses with analyze, on image+text)")
    elif need > (free := available_memory()):
        why = (f"the model's float32 weights ({need / 2**30:.1f} GiB) exceed the memory available "
               f"({free / 2**30:.1f} GiB)")
    elif budget is not None and estimate > budget:
        why = f"its estimate (~{estimate / 60:.0f} min) exceeds --calibration-budget {budget:.0f} s"
    else:
        why = None
    if why is not None:
        skipped = (f"quality floor skipped: {why}; cut at the paper's third (--cut N or --prune-ratio R to "
                   "choose)")
        c.choice = {"method": "quality floor", "skipped": skipped}
        report(Note(skipped))
        return
    report(Note(f"choosing the cut: the quality floor ({floor.min_agreement:.0%} of {floor.prompts} held-out "
                f"prompts), ~{estimate / 60:.0f} min estimated"))
    if lazy is not None:
        lazy.materialise(model)
    with torch.no_grad():
        c.floor = floor_search(model, c.loaded.tokenizer, floor, fitted=fitted, ridge=fit.ridge,
                               bias=fit.fits_bias, seq_len=fit.seq_len, progress=c.fit_progress)
    report(Note(c.floor.summary()))


def _warn(note: Note) -> None:
    warnings.warn(note.line(), stacklevel=3)


def _check_quality(c: Compilation) -> None:
    if c.floor is not None:
        c.shipped = check_shipped(c.loaded.model, c.floor, c.fit and c.fit.weights, c.fit_progress)


def _cast(c: Compilation) -> None:
    """The model in the engine's dtype (after the fits, which run in float32); a copy unless the driver owns
    it."""
    model = cast_model(c.loaded.model, c.config.dtype, in_place=c.owned)
    if model is not c.loaded.model:
        c.loaded = dataclasses.replace(c.loaded, model=model)


def _capture(c: Compilation) -> None:
    c.captured = capture(c.loaded.model, max_seq=c.config.max_seq)


def _pop_pass(c: Compilation) -> None:
    weights = c.fit and cast_weights(c.fit.weights, c.config.dtype)
    c.pair = pop_graphs(c.captured, c.cut, weights, c.config.boundary)


def _write(c: Compilation) -> None:
    c.manifest = c.target.write(c.folder, c.compiled(), c.report)


def _threshold(c: Compilation) -> None:
    c.manifest = with_min_prompt_tokens(c.folder, c.manifest, c.config, c.target, c.report)


def _write_manifest(c: Compilation) -> None:
    c.manifest.write(c.folder)


def _graphs(config: PopConfig, target: Target) -> bool:
    return target.graphs


def _floors(config: PopConfig, target: Target) -> bool:
    return config.quality_floor is not None


def _distills(config: PopConfig, target: Target) -> bool:
    """distill, and auto (which distils a text model; the model is not loaded yet when steps are listed)."""
    return config.kv_calibration.mode in ("distill", "auto")


#: the compile, in order (module docstring). ``steps()`` and the progress bar read the names from here.
COMPILE_STEPS = (
    CompileStep("load", _load),
    CompileStep("choose cut", _choose_cut, applies=_floors),
    CompileStep("calibrate", _calibrate),
    CompileStep(DISTILL_STEP, _distill, applies=_distills),
    CompileStep("check quality", _check_quality, applies=_floors),
    CompileStep("cast", _cast, names=lambda target: ()),
    CompileStep("capture", _capture, applies=_graphs),
    CompileStep("POP pass", _pop_pass, applies=_graphs),
    CompileStep("write", _write, staged=True, names=lambda target: target.steps),
    # measures min_prompt_tokens (reported as MEASURE_STEP) when asked for and the target has a runtime
    CompileStep("threshold", _threshold, staged=True, names=lambda target: ()),
    CompileStep(WRITE_MANIFEST, _write_manifest, staged=True),
)


def compile(model: str | Path | LoadedModel, config: PopConfig | None = None, *, out: str | Path,  # noqa: A001
            target: str | Target = "onnx", force: bool = False,
            progress: Callable[[str], None] | None = None, fit_progress: Callable | None = None,
            revision: str | None = None,
            measured: Callable[[StepRecord], None] | None = None) -> EngineManifest | ServingFolder:
    """Compile ``model`` with POP into the engine folder ``out``; returns its manifest (module docstring), for
    the vllm target a ServingFolder. ``progress(name)`` before each step; ``fit_progress(event)`` inside the
    K/V fit (kvfit.fit.fit_on_tokens: the FitPlan with its estimate, then DistillProgress; without it a
    fallback to ridge is a warning). ``revision``: a hub id's branch, tag or commit. ``measured`` receives a
    ``StepRecord`` (wall time, peak resident memory) for each step as it ends (``StepMeter``)."""
    config, target, out = config or PopConfig(), target_for(target), Path(out)
    target.preflight(config)
    target = target.for_config(config)  # e.g. the attention lowering, decided once for this dtype
    meter = StepMeter(measured or (lambda record: None))
    c = Compilation(model, config, target, out, force, meter.reporting(progress or (lambda name: None)),
                    fit_progress=fit_progress, revision=revision)
    check_output_folder(out, force)
    c.early_fit = load_file_fit(config.kv_calibration)  # a bad file fails now, not after the model loads
    plan = [step for step in COMPILE_STEPS if step.applies(config, target)]
    with destination_lock(out), meter:
        check_output_folder(out, force)  # again: another export may have finished while we waited
        for step in (s for s in plan if not s.staged):
            _run(step, c, meter)
        with staged_folder(out, replace=force) as c.folder:
            for step in (s for s in plan if s.staged):
                _run(step, c, meter)
            check_output_folder(out, force)  # nothing but an engine folder is ever swapped out
    return c.manifest


def _run(step: CompileStep, c: Compilation, meter: StepMeter) -> None:
    """One step; the meter starts a record at each name reported (a step without progress names, e.g. cast,
    is recorded under its own name; the target's write step under each of its steps' names)."""
    if step.names is None:
        c.report(step.name)
    elif not step.progress_names(c.target):
        meter.start(step.name)
    step.run(c)


def steps(config: PopConfig, target: str | Target = "onnx") -> list[str]:
    """The names ``compile`` reports to ``progress``, in order (for a progress bar's total)."""
    target = target_for(target).for_config(config)
    names = [name for step in COMPILE_STEPS if step.applies(config, target)
             for name in step.progress_names(target)]
    if config.min_prompt_tokens == "auto" and target.runtime is not None:
        names.insert(names.index(WRITE_MANIFEST), MEASURE_STEP)
    return names


def build_graphs(
    model: torch.nn.Module, *, cut: int | None = None, prune_ratio: float | None = None,
    max_seq: int | None = None, kv_weights: KVWeights | None = None, boundary: str = PopConfig.boundary,
) -> GraphPair:
    """Capture ``model`` and derive its prefill graph (capture + POP pass, no export): cut and boundary are
    validated before any tracing."""
    if boundary not in BOUNDARIES:
        raise ConfigError(f"boundary={boundary!r} is not one of {', '.join(BOUNDARIES)}")
    cut = resolve_cut(model.config.get_text_config().num_hidden_layers, cut=cut, prune_ratio=prune_ratio)
    check_vision_cut(model.config, cut)
    return pop_graphs(capture(model, max_seq=max_seq), cut, kv_weights, boundary)


def check_max_seq(loaded: LoadedModel, max_seq: int | None) -> None:
    limit = getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)
    if max_seq is not None and isinstance(limit, int) and max_seq > limit:
        raise ConfigError(f"--max-seq {max_seq} exceeds the model's max_position_embeddings={limit}: "
                          f"give at most {limit}")


def with_min_prompt_tokens(folder: Path, manifest: EngineManifest | ServingFolder, config: PopConfig,
                           target: Target, step: Callable[[str], None]) -> EngineManifest | ServingFolder:
    """The folder's record with its threshold: as configured, or "auto": measured on ``folder`` (its record
    not yet written) with the target's runtime (threshold.py's rule), FIXED_MIN_PROMPT_TOKENS where the
    target has no popcompile runtime (vLLM: nothing is measured at export, which needs no vLLM)."""
    value, record = config.min_prompt_tokens, None
    if value == "auto" and target.runtime is None:
        value = FIXED_MIN_PROMPT_TOKENS
    elif value == "auto" and target.runtime == "onnxruntime" and manifest.dtype != "float32":
        note = ("onnxruntime's CPU provider refuses float16 engines: POP for every prompt; "
                "give --min-prompt-tokens N")
        warnings.warn(f"--min-prompt-tokens auto: {note}", stacklevel=3)
        value, record = 0, {"method": "not measured", "note": note}
    elif value == "auto":
        step(MEASURE_STEP)
        value, record = measure_min_prompt_tokens(folder, target.runtime, manifest)
    return manifest.with_min_prompt_tokens(value, record)


def measure_min_prompt_tokens(folder: Path, runtime: str, manifest: EngineManifest) -> tuple[int, dict]:
    from .engine.verify import HashCache
    from .runtime import open_session
    from .runtime.compare import measured_min_prompt_tokens

    label = "onnxruntime-cpu" if runtime == "onnxruntime" else runtime
    session = open_session(folder, runtime=runtime, hash_cache=HashCache(None), manifest=manifest)
    value, record = measured_min_prompt_tokens(session, label)
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
           progress: Callable[[str], None] | None = None, target: str | Target = "onnx",
           **config) -> EngineManifest:
    """``compile(model, PopConfig(**config), out=out_dir, target=target)``: the keyword form of the driver
    (``cut``, ``prune_ratio``, ``boundary``, ``kv_calibration``, ``dtype``, ``max_seq``,
    ``min_prompt_tokens``, ``cut_choice``: PopConfig's fields)."""
    return compile(model, PopConfig(**config), out=out_dir, force=force, progress=progress, target=target)
