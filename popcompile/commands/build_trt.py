"""``popcompile build-trt``: TensorRT plans for an ONNX engine folder (needs an NVIDIA GPU and tensorrt).

Also the pieces the export and run commands use for TensorRT: ``add_build_options`` and
``build_config`` (``export --target tensorrt``), ``add_runtime_options`` (``run --runtime tensorrt``).
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..exporters.tensorrt import BUILD_STEPS, TrtBuildConfig
from ..runtime import RUNTIMES
from .common import add_precision_option


def register(sub) -> None:
    p = sub.add_parser("build-trt", help="build TensorRT engines for an engine folder (NVIDIA GPU)",
                       description="Build prefill.plan and decode.plan from the folder's two ONNX graphs "
                                   "with TensorRT and record them, the TensorRT version, the GPU and the "
                                   "optimization profiles in its manifest. Kernel timings are kept in "
                                   "timing.cache there, so a rebuild is fast.")
    p.add_argument("engine", type=Path, help="engine folder written by `popcompile export`")
    add_build_options(p)
    p.add_argument("--force", action="store_true", help="rebuild even when the plans are up to date")
    p.add_argument("--json", action="store_true", help="print the manifest's tensorrt section as JSON")
    p.set_defaults(handler=cmd_build_trt)


#: the CLI's precision names (commands.common's one vocabulary) -> TrtBuildConfig's (exporters.tensorrt)
TRT_PRECISION = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def add_build_options(parser) -> None:
    """TensorRT build options, shared by `build-trt` and `export --target tensorrt`."""
    add_precision_option(parser, "--precision", list(TRT_PRECISION),
                         default=_cli_precision(TrtBuildConfig.precision),
                         help="float32 (strongly typed, TF32 off: the CPU's numbers), float16 or bfloat16 "
                              "(TensorRT may run layers at that precision; default "
                              f"{_cli_precision(TrtBuildConfig.precision)}: float16 can overflow in RMSNorm)")
    parser.add_argument("--workspace-gb", type=float, default=4.0,
                        help="GPU memory TensorRT may use for layer workspace while building and running "
                             "(default 4)")
    parser.add_argument("--opt-seq", type=int, default=1024,
                        help="prompt length the kernels are tuned for (default 1024; any length below the "
                             "folder's --max-seq runs)")
    parser.add_argument("--max-batch", type=int, default=1, help="most prompts per generate call (default 1)")


def build_config(args) -> TrtBuildConfig:
    return TrtBuildConfig(precision=TRT_PRECISION[args.precision], workspace_gb=args.workspace_gb,
                          opt_seq=args.opt_seq, max_batch=args.max_batch)


def _cli_precision(trt: str) -> str:
    """TrtBuildConfig's precision in the CLI's vocabulary (bf16 -> bfloat16)."""
    return {short: name for name, short in TRT_PRECISION.items()}.get(trt, trt)


def build(folder: Path, config: TrtBuildConfig, *, force: bool):
    """build_engines with its progress on stderr (a bar on a terminal, a line per step in a log); returns the
    manifest's new tensorrt section."""
    from ..exporters.tensorrt import build_engines
    from ..progress import progress_bar

    with progress_bar(len(BUILD_STEPS), "build-trt", "step") as bar:
        def progress(name: str) -> None:
            if bar.n or name != BUILD_STEPS[0]:
                bar.update(1)
            bar.set_description(name)

        section = build_engines(folder, config, progress=progress, force=force)
        bar.update(bar.total - bar.n)
    return section


def cmd_build_trt(args) -> None:
    section = build(args.engine, build_config(args), force=args.force)
    print(json.dumps(asdict(section), indent=2) if args.json else summary(args.engine, section))


def summary(folder: Path, section) -> str:
    plans = ", ".join(f"{p['file']} {p['bytes'] / 2**20:.1f} MiB ({section.build_seconds.get(name, 0):.0f} s)"
                      for name, p in section.plans.items())
    names = {engine: [p["name"] for p in profiles] for engine, profiles in section.profiles.items()}
    return (f"{folder}: TensorRT {section.tensorrt_version} on {section.gpu} (compute capability "
            f"{section.compute_capability}), {_cli_precision(section.precision)}, "
            f"max batch {section.max_batch}\n"
            f"  plans: {plans}\n  profiles: prefill {names['prefill']}, decode {names['decode']}; "
            f"decode KV binding {section.decode_kv}\n"
            f"  run: popcompile run {folder} --runtime tensorrt --prompt \"...\"")


def add_runtime_options(parser) -> None:
    """`run --runtime {onnxruntime,tensorrt}` and the TensorRT runtime's options (None unless given: the
    session's defaults apply, and run refuses another runtime's flags)."""
    parser.add_argument("--runtime", choices=list(RUNTIMES), default="onnxruntime",
                        help="onnxruntime (default; --provider picks its device, cpu or cuda) or tensorrt "
                             "(the folder's TensorRT plans from `popcompile build-trt`; NVIDIA GPU): the one "
                             "way to run with TensorRT")
    parser.add_argument("--kv-binding", choices=["auto", "static", "gather"],
                        help="--runtime tensorrt: how decode steps see the KV buffer (default auto: static "
                             "unless the model has sliding-window layers; see docs/tensorrt.md)")
    parser.add_argument("--cuda-graph", action="store_true", default=None,
                        help="--runtime tensorrt: replay decode steps as a CUDA graph (static KV binding)")
