"""Export targets, registered by name: what ``compile(..., target=NAME)`` writes into the staged folder.

    "onnx"      prefill.onnx + decode.onnx over one weights.bin (exporters/onnx.py); runs on onnxruntime;
                attention and norms fused into its contrib ops (ort_passes/attention.py) unless
                ``OnnxTarget(attention="standard")``;
                ``OnnxTarget(WeightQuantization("int4"))``: int8/int4 MatMulNBits weights
                (exporters/quantize.py)
    "tensorrt"  the same ONNX folder, then prefill.plan + decode.plan built from it (exporters/tensorrt.py);
                runs on the TensorRT runtime; needs an NVIDIA GPU and the ``tensorrt`` package
    "vllm"      a Hugging Face folder naming a POP class (exporters/vllm.py) that vLLM serves with the
                plugin in popcompile.vllm_plugin; no graphs (vLLM runs the model), no manifest

A target is a frozen dataclass holding its own build options. The driver calls, in order:
``preflight(config)`` (before the model loads: fail in a second, not after minutes), ``for_config(config)``
(what depends on the config, resolved once), ``check_model(loaded)`` (once the model is loaded, before the
cut's search and the fits: a model the target cannot serve is refused then), ``write(folder, compiled,
step)`` (into the staged folder, returning the folder's record: an EngineManifest, or a ServingFolder; the
driver sets its threshold and writes it, once) and names ``runtime`` to measure ``min_prompt_tokens`` with
(None: the folder has no popcompile runtime). ``write`` sees no config: only ``Compiled``, what the compile
decided and made. ``graphs``: whether the driver captures the model and runs the POP pass for it. Heavy
imports (torch, onnx, tensorrt) happen inside ``write``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Union

from ..config import ATTENTION_LOWERINGS, PopConfig, WeightQuantization
from ..engine.manifest import GRAPH_INPUTS as TEXT_INPUTS
from ..engine.manifest import EngineManifest
from ..errors import ConfigError
from .steps import ONNX_STEPS, onnx_write_steps
from .tensorrt import PLAN_STEPS, TrtBuildConfig

VLLM_WRITE_STEP = "write vLLM folder"

if TYPE_CHECKING:
    from ..frontend.models import LoadedModel
    from ..kvfit.calibrate import KVFit
    from ..passes.prefill import GraphPair
    from .vllm import ServingFolder

Step = Callable[[str], None]


@dataclass(frozen=True)
class Compiled:
    """What a compile hands its target to write, every decision made (the target reads no config).

    ``loaded``: the model in the engine's dtype (its tokenizer and configs go into every folder; the vllm
    target saves its weights); ``cut``: the first pruned layer; ``pair``: the decode and prefill graphs
    (None for a target with ``graphs = False``); ``fit``: POP+ weights (None: the pruned layers' own
    projections); ``provenance``: how the K/V weights and the cut were chosen (the manifest's ``extra``);
    ``disposable``: the compile loaded the model itself, so a writer may free its weights once it has made
    what it needs of them."""

    loaded: LoadedModel
    cut: int
    pair: GraphPair | None
    fit: KVFit | None
    provenance: dict = field(default_factory=dict)
    disposable: bool = False


@dataclass(frozen=True)
class OnnxTarget:
    """The ONNX engine folder (the default); ``weights``: float, or int8/int4 MatMulNBits
    (exporters/quantize.py); ``attention``: fused (onnxruntime's GroupQueryAttention and fused norms,
    ort_passes/attention.py), standard (plain ONNX ops, which other runtimes and ``build-trt`` take) or
    auto (the default: fused for float32 graphs, standard for float16 ones, where onnxscript's fusions leave
    norms of mixed types)."""

    weights: WeightQuantization = field(default_factory=WeightQuantization)
    attention: str = "auto"
    name = "onnx"
    runtime = "onnxruntime"
    graphs = True

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_LOWERINGS:
            raise ConfigError(f"--attention {self.attention!r} (attention={self.attention!r}) is not an "
                              f"attention lowering: choose one of {', '.join(ATTENTION_LOWERINGS)}")

    @property
    def steps(self) -> tuple[str, ...]:
        """The write steps; an unresolved target (no ``for_config`` yet) counts those of the default dtype."""
        return tuple(step.name for step in onnx_write_steps(self.lowering(PopConfig.dtype),
                                                            self.weights.bits is not None))

    def lowering(self, dtype: str) -> str:
        """fused or standard, for graphs of ``dtype``: the one place "auto" is decided."""
        if self.attention == "auto":
            return "fused" if dtype == "float32" else "standard"
        return self.attention

    def for_config(self, config: PopConfig) -> OnnxTarget:
        """This target with its attention lowering resolved for ``config``'s dtype (the driver resolves it
        once, after ``preflight``, so that the steps it lists are the steps that run)."""
        return replace(self, attention=self.lowering(config.dtype))

    def check_model(self, loaded: LoadedModel) -> None:
        """Nothing to check before capture (which refuses what it cannot trace, e.g. frontend/experts.py)."""

    def preflight(self, config: PopConfig) -> None:
        """Quantised weights and fused attention only over float32 graphs: onnxruntime's CPU kernels run
        float16 through casts, and the fusions give float16 graphs norms of mixed types that do not load."""
        if self.attention == "fused" and config.dtype != "float32":
            raise ConfigError(f"--attention fused with --dtype {config.dtype}: onnxruntime's fused attention "
                              "is written for float32 graphs: drop --attention (auto keeps float16 graphs "
                              "standard)")
        if self.weights.bits is not None and config.dtype != "float32":
            raise ConfigError(f"--weights {self.weights.format} with --dtype {config.dtype}: int8/int4 "
                              "weights are quantised from float32 graphs: drop --dtype (float32 is the "
                              "default)")

    def write(self, folder: Path, compiled: Compiled, step: Step) -> EngineManifest:
        from .onnx import write_engine

        return write_engine(folder, compiled.loaded, compiled.pair, compiled.provenance, step, self.weights,
                            self.lowering(compiled.pair.layout.dtype), release=compiled.disposable)


@dataclass(frozen=True)
class TensorRTTarget:
    """The ONNX folder plus TensorRT plans built from it on this machine's GPU."""

    build: TrtBuildConfig = field(default_factory=TrtBuildConfig)
    name = "tensorrt"
    runtime = "tensorrt"
    steps = ONNX_STEPS + PLAN_STEPS
    graphs = True

    def for_config(self, config: PopConfig) -> TensorRTTarget:
        return self

    def preflight(self, config: PopConfig) -> None:
        from ..engine.tensorrt import require_gpu

        require_gpu()  # TensorRTUnavailable naming what is missing, before the long ONNX export

    def check_model(self, loaded: LoadedModel) -> None:
        """As the ONNX target: capture refuses what it cannot trace."""

    def write(self, folder: Path, compiled: Compiled, step: Step) -> EngineManifest:
        from ..errors import UnsupportedModelError
        from .tensorrt import plan_engines

        if compiled.pair.inputs != TEXT_INPUTS:
            raise UnsupportedModelError(
                "TensorRT plans for vision-language models (a vision plan, image inputs in the runtime) are "
                "not built yet: export --target onnx --attention standard; `popcompile check DIR --target "
                "tensorrt` checks its three graphs for TensorRT")
        manifest = OnnxTarget(attention="standard").write(folder, compiled, step)
        return plan_engines(folder, manifest, self.build, step, force=True)


@dataclass(frozen=True)
class VllmTarget:
    """A Hugging Face folder that vLLM serves with POP (popcompile.vllm_plugin); vLLM is not needed to write
    it."""

    name = "vllm"
    runtime = None
    steps = (VLLM_WRITE_STEP,)
    graphs = False

    def for_config(self, config: PopConfig) -> VllmTarget:
        return self

    def preflight(self, config: PopConfig) -> None:
        """Options that shape popcompile's own engines mean nothing to vLLM: refused, not ignored."""
        if config.boundary != "folded":
            raise ConfigError(f"--boundary {config.boundary} (boundary={config.boundary!r}) lays out ONNX "
                              "graphs; in vLLM the last prompt token always runs the full model: drop it for "
                              "--target vllm")
        if config.max_seq is not None:
            raise ConfigError(f"--max-seq {config.max_seq} (max_seq={config.max_seq}) sizes popcompile's KV "
                              "buffers; vLLM pages its own: give vLLM max_model_len instead, for --target "
                              "vllm")

    def check_model(self, loaded: LoadedModel) -> None:
        """A model the plugin has no POP class for, or would not serve as transformers computes it
        (exporters/vllm.py ``pop_architecture``), is refused before the cut's search and the fits."""
        from .vllm import pop_architecture

        pop_architecture(loaded)

    def write(self, folder: Path, compiled: Compiled, step: Step) -> ServingFolder:
        from .vllm import write_folder

        step(VLLM_WRITE_STEP)
        return write_folder(folder, compiled.loaded, compiled.cut, compiled.fit)


Target = Union[OnnxTarget, TensorRTTarget, VllmTarget]
TARGETS: dict[str, type] = {"onnx": OnnxTarget, "tensorrt": TensorRTTarget, "vllm": VllmTarget}


def target_for(target: str | Target) -> Target:
    """A target object from its registered name (with default options), or the object itself."""
    if isinstance(target, tuple(TARGETS.values())):
        return target
    if isinstance(target, str) and target in TARGETS:
        return TARGETS[target]()
    raise ConfigError(f"target={target!r} is not an export target: choose one of {', '.join(TARGETS)} "
                      "(or pass a target object such as TensorRTTarget(TrtBuildConfig(precision='fp16')))")
