"""TensorRT engines from an ONNX engine folder: ``prefill.plan`` and ``decode.plan`` over one KV buffer.

    engines/NAME/                  an engine folder from `popcompile export` (exporters/onnx.py), plus:
      prefill.plan, decode.plan    serialized TensorRT engines, one per graph (each holds its weights)
      timing.cache                 kernel timings: a rebuild on the same GPU and TensorRT version reuses them
      popcompile.json              gains a "tensorrt" section (its schema: engine/tensorrt.py, TrtSection)

The KV buffer the runtime (runtime/trt.py) binds to both engines has one **sentinel row** in front::

    per layer, K and V: [batch, kv_heads, 1 + max_seq, head_dim]
                                          row 0: sentinel, zeros, always masked (attention_mask column 0 = 0)
                                          row 1 + t: the token at cache position t

so every ``past`` a graph sees is >= 1 and no optimization profile has a zero-length dimension. The
graphs take the sentinel like one more left-padding column: positions come from ``position_ids`` and
the causal/sliding-window distances from cache rows, which shift together (capture.build_mask).

Optimization profiles (B = batch, S = max_seq, R = S + 1 rows; [min, opt, max])::

    engine   profile  input_ids / position_ids    past_key_values.*          attention_mask
    prefill  prefill  [B, 1..opt_seq..S-1]        [B, H, 1, D] (sentinel)    [B, 2..S]
    decode   step     [B, 1]                      [B, H, 1..opt..R, D]       [B, 2..R+1]
    decode   prompt   [B, 1..opt_seq..S-1]        [B, H, 1, D] (sentinel)    [B, 2..S]    (--full mode)

The step profile reaches R rows so that the runtime can bind the whole buffer (static decode, CUDA
graphs); its opt is R then, else opt_seq + 1. Each min/opt/max of attention_mask is past + seq of the
same point, so TensorRT's shape checks at those points see consistent shapes.

``build_engines`` runs the compatibility check and computes the profiles on any machine, then needs an
NVIDIA GPU and the ``tensorrt`` package (``engine.tensorrt.require_gpu``): without them it stops with
TensorRTUnavailable naming what is missing and what to run instead. No torch import.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from ..engine.kv import KVLayout
from ..engine.manifest import EngineManifest, sha256_file
from ..engine.tensorrt import (
    PLANS,
    SENTINEL_ROWS,
    Profile,
    ShapeRange,
    TensorRTUnavailable,
    TrtSection,
    require_gpu,
)
from ..errors import ConfigError, EngineError
from ..fsutil import atomic_write, destination_lock
from .steps import WRITE_MANIFEST

PRECISIONS = ("fp32", "fp16", "bf16")
TIMING_CACHE = "timing.cache"
#: the progress steps plan_engines reports, in order; build_engines (``build-trt``) then writes the manifest
CHECK_STEP, GPU_STEP = "check graphs", "detect GPU"
#: one build step per plan, prefill first: "build prefill.plan", "build decode.plan"
BUILD_PLAN_STEPS = {name: f"build {file}" for name, file in PLANS.items()}
PLAN_STEPS = (CHECK_STEP, GPU_STEP, *BUILD_PLAN_STEPS.values())
BUILD_STEPS = (*PLAN_STEPS, WRITE_MANIFEST)


@dataclass(frozen=True)
class TrtBuildConfig:
    """How to build the engines. ``precision`` fp32 builds a strongly typed network from the fp32 graphs
    (TF32 off: the CPU's numbers); fp16/bf16 let TensorRT 10 pick kernels of that precision (weakly typed
    networks; bf16 is the default because fp16 overflows in RMSNorm's square on large activations)."""

    precision: str = "bf16"
    workspace_gb: float = 4.0
    opt_seq: int = 1024           # the prompt length TensorRT tunes kernels for
    opt_batch: int = 1
    max_batch: int = 1
    optimization_level: int = 3   # TensorRT builder optimization level 0..5
    timing_cache: str = TIMING_CACHE  # inside the engine folder, or an absolute path

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not isinstance(self.workspace_gb, (int, float)) or not (0 < self.workspace_gb < 1024
                                                                     and math.isfinite(self.workspace_gb)):
            raise ConfigError(f"workspace_gb must be a number of GiB in (0, 1024), got {self.workspace_gb!r}")
        for name in ("opt_seq", "opt_batch", "max_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.opt_batch > self.max_batch:
            raise ConfigError(f"opt_batch={self.opt_batch} exceeds max_batch={self.max_batch}: "
                              "raise --max-batch")
        if self.optimization_level not in range(6):
            raise ConfigError(f"optimization_level must be 0..5, got {self.optimization_level!r}")
        if not isinstance(self.timing_cache, str) or not self.timing_cache:
            raise ConfigError(f"timing_cache must be a file name or path, got {self.timing_cache!r}")


def profiles(layout: KVLayout, config: TrtBuildConfig, *,
             static_decode: bool) -> dict[str, tuple[Profile, ...]]:
    """The optimization profiles of both engines (table in the module docstring), in profile-index order."""
    if layout.max_seq < 2:
        raise ValueError(f"max_seq={layout.max_seq} leaves no room for a prompt and a token: "
                         "re-export with --max-seq >= 2")
    rows = layout.max_seq + SENTINEL_ROWS
    prompt_max = layout.max_seq - 1             # the runtime refuses prompts of max_seq tokens or more
    seq = (1, min(config.opt_seq, prompt_max), prompt_max)
    sentinel = (SENTINEL_ROWS,) * 3
    step_opt = rows if static_decode else min(config.opt_seq + SENTINEL_ROWS, rows)
    return {
        "prefill": (Profile("prefill", _io(layout, config, seq, sentinel)),),
        "decode": (Profile("step", _io(layout, config, (1, 1, 1), (1, step_opt, rows))),
                   Profile("prompt", _io(layout, config, seq, sentinel))),
    }


def _io(layout: KVLayout, config: TrtBuildConfig, seq: tuple, past: tuple) -> dict[str, ShapeRange]:
    """Input shape ranges at the three points min/opt/max of (batch, seq, past); mask = past + seq."""
    batch = (1, config.opt_batch, config.max_batch)
    tokens = ShapeRange(*((b, s) for b, s in zip(batch, seq)))
    mask = ShapeRange(*((b, p + s) for b, s, p in zip(batch, seq, past)))
    kv = ShapeRange(*((b, layout.num_kv_heads, p, layout.head_dim) for b, p in zip(batch, past)))
    return {"input_ids": tokens, "position_ids": tokens, "attention_mask": mask,
            **{name: kv for name in layout.past_names}}


def has_sliding_window(folder: Path) -> bool:
    """Whether the model in the folder's config.json has sliding-window layers (as arch.layer_kinds reads
    it)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise EngineError(f"{folder}: config.json is missing: re-export the engine folder")
    config = json.loads(path.read_text())
    kinds = config.get("layer_types")
    if kinds is not None:
        return "sliding_attention" in kinds
    return bool(config.get("sliding_window"))


def section_config(section: TrtSection) -> dict:
    """The build settings a section records, to tell whether a rebuild is needed."""
    return {"precision": section.precision, "workspace_gb": section.workspace_gb,
            "max_batch": section.max_batch, "profiles": section.profiles}


# --------------------------------------------------------------------------------------------- build

def build_engines(folder: str | Path, config: TrtBuildConfig | None = None, *,
                  progress: Callable[[str], None] | None = None, force: bool = False) -> TrtSection:
    """Build both plans into ``folder`` and record them in its manifest; returns the new section.

    Up to date plans (same ONNX graphs, settings, TensorRT version and GPU) are kept unless ``force``.
    Raises EngineError for a folder TensorRT cannot take, TensorRTUnavailable (a ValueError) without an
    NVIDIA GPU or the ``tensorrt`` package."""
    config = config or TrtBuildConfig()
    folder, step = Path(folder), progress or (lambda name: None)
    with destination_lock(folder, "engine folder"):  # no export --force may swap the folder out meanwhile
        step(BUILD_STEPS[0])
        manifest = EngineManifest.read(folder)
        built = plan_engines(folder, manifest, config, step, force=force, checked=True)
        if built is not manifest:
            step(WRITE_MANIFEST)
            built.write(folder)  # atomic: the old manifest or the new one
        return TrtSection.from_manifest(built, folder)


def plan_engines(folder: Path, manifest: EngineManifest, config: TrtBuildConfig, step: Callable[[str], None],
                 *, force: bool = False, checked: bool = False) -> EngineManifest:
    """``manifest`` (the folder's, written or not) with the plans built into ``folder`` and recorded in its
    ``tensorrt`` section; ``manifest`` itself when its plans are up to date. Writes no manifest: the caller
    owns that (build_engines; the export driver writes its folder's once). ``checked``: the caller has
    reported the first of PLAN_STEPS."""
    if not checked:
        step(PLAN_STEPS[0])
    onnx_sha = _check_graphs(folder, manifest)
    static = not has_sliding_window(folder)
    plan = profiles(manifest.kv_layout, config, static_decode=static)
    step(GPU_STEP)
    require_gpu()
    trt = _import_tensorrt()
    gpu, capability = gpu_info()
    wanted = {"precision": config.precision, "workspace_gb": float(config.workspace_gb),
              "max_batch": config.max_batch,
              "profiles": {k: [p.to_dict() for p in v] for k, v in plan.items()}}
    current = _current(manifest, folder)
    if not force and current and _up_to_date(current, folder, onnx_sha, wanted, trt.__version__, capability):
        return manifest
    cache_path = _cache_path(folder, config)
    plans, seconds = _build_plans(trt, folder, manifest, plan, config, cache_path, step)
    section = TrtSection(
        tensorrt_version=trt.__version__, gpu=gpu, compute_capability=capability, precision=config.precision,
        workspace_gb=float(config.workspace_gb), max_batch=config.max_batch, sentinel_rows=SENTINEL_ROWS,
        decode_kv="static" if static else "gather", plans=plans, profiles=wanted["profiles"],
        onnx_sha256=onnx_sha, timing_cache=str(cache_path), build_seconds=seconds)
    return replace(manifest, tensorrt=asdict(section))


def _check_graphs(folder: Path, manifest: EngineManifest) -> dict[str, str]:
    """Both ONNX graphs present and accepted by the TensorRT compatibility check; their sha256."""
    from .tensorrt_compat import check_engine

    if manifest.quantization:
        raise EngineError(f"{folder} has {manifest.quantization.get('format')} weights "
                          "(onnxruntime's MatMulNBits), which TensorRT does not take: run it with "
                          "onnxruntime, or re-export with --weights float for TensorRT")
    if manifest.attention:
        raise EngineError(f"{folder} has attention fused into onnxruntime's contrib ops "
                          "(GroupQueryAttention), which TensorRT does not take: run it with onnxruntime, or "
                          "re-export with --target tensorrt (or --attention standard, i.e. "
                          "OnnxTarget(attention=standard)) for TensorRT")
    shas = {}
    for name, entry in manifest.graphs.items():
        path = folder / entry.file
        if not path.is_file():
            raise EngineError(f"{folder}: {entry.file} is missing: TensorRT engines are built from the ONNX "
                              f"graphs, re-export with `popcompile export MODEL --out {folder} --force`")
        shas[name] = sha256_file(path)
    report = check_engine(folder)
    if not report.ok:
        ops = ", ".join(sorted({f"{f.op} ({f.status})" for f in report.failures}))
        raise EngineError(f"{folder}: TensorRT's ONNX parser cannot take these graphs ({ops}): see "
                          f"`popcompile check {folder} --target tensorrt`")
    return shas


def _current(manifest: EngineManifest, folder: Path) -> TrtSection | None:
    if not manifest.tensorrt:
        return None
    try:
        return TrtSection.from_manifest(manifest, folder)
    except EngineError:
        return None  # malformed: rebuild


def _up_to_date(section: TrtSection, folder: Path, onnx_sha: dict, wanted: dict, version: str,
                capability: str) -> bool:
    if (section.onnx_sha256 != onnx_sha or section_config(section) != wanted
            or section.tensorrt_version != version or section.compute_capability != capability):
        return False
    return all((folder / p["file"]).is_file() and (folder / p["file"]).stat().st_size == p["bytes"]
               for p in section.plans.values())


def _cache_path(folder: Path, config: TrtBuildConfig) -> Path:
    path = Path(config.timing_cache)
    return path if path.is_absolute() else folder / path


def _build_plans(trt, folder: Path, manifest: EngineManifest, plan: dict, config: TrtBuildConfig,
                 cache_path: Path, step: Callable[[str], None]) -> tuple[dict, dict]:
    """Build prefill.plan then decode.plan with one shared timing cache; files replaced only when built."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    cache = _load_timing_cache(builder, cache_path)
    plans, seconds = {}, {}
    for name, build_step in BUILD_PLAN_STEPS.items():
        step(build_step)
        start = time.perf_counter()
        data = _build_one(trt, builder, logger, folder / manifest.graphs[name].file, plan[name], config,
                          cache)
        seconds[name] = round(time.perf_counter() - start, 1)
        atomic_write(folder / PLANS[name], data)
        plans[name] = {"file": PLANS[name], "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        # saved after each engine: a failed second build keeps the first one's timings
        atomic_write(cache_path, bytes(cache.serialize()))
    return plans, seconds


def _build_one(trt, builder, logger, onnx_path: Path, engine_profiles: tuple[Profile, ...],
               config: TrtBuildConfig, cache) -> bytes:
    """Parse one ONNX graph (external weights beside it) and build its serialized engine."""
    network = builder.create_network(_network_flags(trt, config.precision))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors}")
    settings = builder.create_builder_config()
    settings.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(config.workspace_gb * 2**30))
    settings.builder_optimization_level = config.optimization_level
    _set_precision(trt, settings, config.precision)
    if not settings.set_timing_cache(cache, ignore_mismatch=False):
        raise EngineError(f"TensorRT refused the timing cache: delete {config.timing_cache} and rebuild")
    for profile in engine_profiles:
        trt_profile = builder.create_optimization_profile()
        for name, r in profile.shapes.items():
            trt_profile.set_shape(name, r.min, r.opt, r.max)
        settings.add_optimization_profile(trt_profile)
    serialized = builder.build_serialized_network(network, settings)
    if serialized is None:
        raise EngineError(f"TensorRT could not build {onnx_path.stem}.plan (see the TensorRT errors above): "
                          "try a larger --workspace-gb or --precision fp32")
    return bytes(serialized)


def _network_flags(trt, precision: str) -> int:
    """fp32: a strongly typed network (types exactly as in the ONNX graph); fp16/bf16: weakly typed (0)."""
    strongly = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 1 << int(strongly) if precision == "fp32" and strongly is not None else 0


def _set_precision(trt, settings, precision: str) -> None:
    if precision == "fp32":
        tf32 = getattr(trt.BuilderFlag, "TF32", None)
        if tf32 is not None:
            settings.clear_flag(tf32)  # exact fp32 matmuls: the numbers the CPU engines give
        return
    flag = getattr(trt.BuilderFlag, precision.upper(), None)
    if flag is None:
        raise EngineError(f"TensorRT {trt.__version__} has no BuilderFlag.{precision.upper()} "
                          "(TensorRT 11 builds strongly typed networks only): use --precision fp32, or "
                          "TensorRT 10 "
                          "(pip install 'tensorrt-cu12>=10.14,<11')")
    settings.set_flag(flag)


def _load_timing_cache(builder, path: Path):
    """The timing cache from ``path`` (empty when absent or unreadable); shared by both builds."""
    settings = builder.create_builder_config()
    data = path.read_bytes() if path.is_file() else b""
    try:
        cache = settings.create_timing_cache(data)
        if cache is not None and settings.set_timing_cache(cache, ignore_mismatch=False):
            return cache
    except Exception:  # noqa: BLE001 - a corrupt file: TensorRT raises what its parser found
        pass
    # a corrupt file, or timings of another GPU/TensorRT version: start afresh (the file is then replaced)
    return settings.create_timing_cache(b"")


def _import_tensorrt():
    try:
        import tensorrt
    except ImportError as err:  # require_gpu found the package, but it does not load (CUDA libraries)
        raise TensorRTUnavailable(f"the tensorrt package does not load ({err}): reinstall it for this CUDA "
                                  "version (pip install 'tensorrt-cu12>=10.14,<11')") from None
    return tensorrt


def gpu_info(index: int = 0) -> tuple[str, str]:
    """(name, compute capability "9.0") of GPU ``index`` from nvidia-smi; "unknown" where it cannot tell."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "unknown", "unknown"
    try:
        out = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader", "-i", str(index)],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        name, capability = (part.strip() for part in out.splitlines()[0].rsplit(",", 1))
        return name, capability
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return "unknown", "unknown"
