"""``popcompile export``: capture, POP pass, write an engine folder."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import ATTENTION_LOWERINGS, DTYPES, WEIGHT_FORMATS, PopConfig, QualityFloor
from ..engine.kv import DEFAULT_MAX_SEQ
from ..engine.manifest import BOUNDARIES
from ..exporters.targets import TARGETS
from ..fsutil import destination_lock
from ..threshold import DEFAULT_MIN_SPEEDUP, FIXED_MIN_PROMPT_TOKENS
from . import build_trt
from .common import (
    CliError,
    add_cut_options,
    add_fit_options,
    add_model_argument,
    add_precision_option,
    check_range,
    fit_options,
    precheck_model,
    quiet_libraries,
)
from .info import summary


def register(sub) -> None:
    p = sub.add_parser("export", help="capture a model, apply POP and write an engine folder",
                       description="Capture MODEL, derive the POP prefill graph and write both graphs, "
                                   "the manifest and the tokenizer into --out.")
    add_model_argument(p)
    p.add_argument("--out", required=True, type=Path, help="engine folder to create (must not exist)")
    add_cut_options(p, allow_auto=True)
    p.add_argument("--min-agreement", type=float,
                   help="with --cut auto (the default): the quality floor, the share of 64 built-in "
                        f"held-out prompts on which POP's first token must equal the full model's (default "
                        f"{QualityFloor.min_agreement}); the deepest cut that holds it is taken, measured "
                        "with POP+ weights at every cut (~2 min at 135M on 2 CPU cores, estimated and "
                        "printed first; skipped over --calibration-budget), and the "
                        "shipped fit is measured again at that cut (docs/results.md)")
    p.add_argument("--budget", type=float,
                   help="with --cut auto (the default): instead of the quality floor, the share of "
                        "prefill importance the pruned layers may hold (stage-aware importance, "
                        "`popcompile analyze`)")
    p.add_argument("--max-seq", type=int,
                   help="the engine's context limit: prompt and generated tokens together, the KV buffer's "
                        f"length (default: min({DEFAULT_MAX_SEQ}, model limit), the model's "
                        "max_position_embeddings; `popcompile info` shows it)")
    p.add_argument("--kv-calibration", default=str(PopConfig().kv_calibration),
                   metavar="{auto,ridge,distill,none,FILE}",
                   help="refit the pruned layers' K/V projections, at no inference cost: distill (POP++: "
                        "trained on the full model's first greedy tokens, 4-5 min at 135M on 2 CPU cores; "
                        "greedy output closest to the full model's, docs/results.md), ridge (POP+: closed "
                        "form, 2 min), "
                        "auto (default: distill for a text model, ridge for a vision-language model), "
                        "none (the paper's POP), or a file from `popcompile calibrate`. The fit's time is "
                        "estimated and printed first; --device and --calibration-budget say where it runs "
                        "and how long it may take")
    add_fit_options(p)
    p.add_argument("--target", choices=list(TARGETS), default="onnx",
                   help="engine format (default onnx; tensorrt needs an NVIDIA GPU; vllm writes a folder "
                        "that `vllm serve` runs with POP, docs/vllm.md)")
    p.add_argument("--force", action="store_true",
                   help="replace --out if it is an engine folder (only once the new one is complete; any "
                        "other folder is refused)")
    p.add_argument("--json", action="store_true",
                   help="print the manifest as JSON instead of a summary, with \"steps\": each step's wall "
                        "seconds and peak resident memory (each also printed to stderr as it ends)")
    add_precision_option(p, "--dtype", DTYPES, default=PopConfig.dtype,
                         help=f"ONNX graph precision (default {PopConfig.dtype}; a float16 engine runs with "
                              "`run --provider cuda`)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="float",
                   help="weight format of the onnx target: float (default: the --dtype), int8 or int4 "
                        "(onnxruntime's MatMulNBits, weight-only: every matmul weight and the LM head in "
                        "blocks with one scale each; decode reads 4-8x fewer bytes; quality in "
                        "docs/results.md)")
    p.add_argument("--block-size", type=int,
                   help="with --weights int8/int4: input channels per quantisation block, a power of two "
                        "16..256 (default 32; smaller: closer to float, slightly larger weights)")
    p.add_argument("--accuracy-level", type=int, choices=range(5), metavar="{0..4}",
                   help="with --weights int8/int4: MatMulNBits' compute type on CPU (default 4: int8 "
                        "activations, the fastest; 1: float32)")
    p.add_argument("--attention", choices=ATTENTION_LOWERINGS,
                   help="attention in the onnx target's graphs: auto (default: fused for float32, standard "
                        "for float16), fused (onnxruntime's GroupQueryAttention and fused RMSNorm: faster "
                        "prefill and decode on CPU, docs/benchmarks.md) or standard (plain ONNX ops, for "
                        "other runtimes and `build-trt`; --target tensorrt always uses them)")
    p.add_argument("--boundary", choices=BOUNDARIES, default=PopConfig.boundary,
                   help="how the last prompt token x_N gets the full model: folded (default: inside the "
                        "prefill graph, which takes x_1..x_N and returns its logits; one call to the first "
                        "token) or separate (a decode-graph call after a prefill of x_1..x_{N-1}, the "
                        "paper's layout)")
    p.add_argument("--min-prompt-tokens", type=_threshold_arg, default=PopConfig.min_prompt_tokens,
                   metavar="{auto,N}",
                   help="prompts shorter than this prefill with the full model, where POP gains little (run "
                        "--min-prompt-tokens overrides it): auto (default: measure POP against full on the "
                        "new engine, seconds; the shortest length from which it is >= "
                        f"{DEFAULT_MIN_SPEEDUP}x faster, docs/prompt_length.md; --target vllm: "
                        f"{FIXED_MIN_PROMPT_TOKENS}, nothing is measured there) or N (0: POP for every "
                        "prompt)")
    build_trt.add_build_options(p)
    p.set_defaults(handler=cmd_export)


def _threshold_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor an integer") from None


def cmd_export(args) -> None:
    from ..config import KVFitConfig, PopConfig
    from ..exporters.checks import check_output_folder

    defaulted = _default_cut(args)
    _check_cut_options(args)
    _check_auto_cut_calibration(args)  # before the floor's config, which refuses a file without the cut
    floor = None
    if args.cut == "auto" and args.budget is None and (defaulted or not _vision_language(args)):
        floor = QualityFloor(**({} if args.min_agreement is None else {"min_agreement": args.min_agreement}))
    config = PopConfig(cut=None if args.cut == "auto" else args.cut, prune_ratio=args.prune_ratio,
                       boundary=args.boundary, kv_calibration=args.kv_calibration, dtype=args.dtype,
                       max_seq=args.max_seq, min_prompt_tokens=args.min_prompt_tokens,
                       kv_fit=KVFitConfig(**fit_options(args)), quality_floor=floor)
    target = _target(args)
    check_output_folder(args.out, args.force)
    if config.kv_calibration.fits_now:  # --device cuda without a GPU: fail now, not after the model loads
        from ..kvfit.budget import resolve_device

        resolve_device(config.kv_fit.device)
    target.preflight(config)  # no GPU for TensorRT: fail now, not after the ONNX export
    precheck_model(args.model)
    with destination_lock(args.out):  # held through the cut choice too; a second export fails here, at once
        manifest, records = _compile(args, config, target)
    if args.json:
        data = json.loads(manifest.to_json())
        print(json.dumps({**data, "steps": [record.to_dict() for record in records]}, indent=2,
                         sort_keys=True))
    else:
        print(summary(args.out, manifest) if target.runtime else manifest.summary(args.out))


def _target(args):
    from ..config import WeightQuantization

    quantized = args.weights != "float" or args.block_size is not None or args.accuracy_level is not None
    if quantized and args.target != "onnx":
        raise CliError(f"--weights/--block-size/--accuracy-level quantise onnxruntime engines (MatMulNBits); "
                       f"--target {args.target} takes float weights: drop them, or use --target onnx")
    if quantized and args.weights == "float":
        raise CliError("--block-size and --accuracy-level go with --weights int8 or int4")
    if args.attention is not None and args.target != "onnx":
        takes = "always takes standard ONNX ops" if args.target == "tensorrt" else "has no graphs"
        raise CliError(f"--attention {args.attention} lowers the onnx target's graphs; "
                       f"--target {args.target} {takes}: drop --attention")
    if args.target == "tensorrt":
        return TARGETS["tensorrt"](build_trt.build_config(args))
    if args.target == "onnx":
        given = {"block_size": args.block_size, "accuracy_level": args.accuracy_level}
        weights = WeightQuantization(args.weights, **{k: v for k, v in given.items() if v is not None})
        return TARGETS["onnx"](weights, **({"attention": args.attention} if args.attention else {}))
    return TARGETS[args.target]()


def _vision_language(args) -> bool:
    """Whether MODEL is a vision-language model (its config, read without the weights; a hub id is
    downloaded here, where the export would download it): --cut auto then chooses with analyze, on image+text
    (the quality floor's prompts are text)."""
    from ..frontend.models import resolve_source
    from ..frontend.vision import VISION_LANGUAGE

    path = Path(resolve_source(args.model, revision=args.revision).path) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("model_type") in VISION_LANGUAGE
    except (OSError, ValueError, AttributeError):
        return False  # a GGUF file (no config.json) or a damaged one (load_model says so)


def _default_cut(args) -> bool:
    """Neither --cut nor --prune-ratio: a calibration file's own cut (it was fitted there), else auto, the
    quality floor (the driver skips it for a vision-language model: the paper's third). Whether auto came by
    default (an explicit --cut auto on a vision-language model asks analyze)."""
    from ..config import KVCalibration

    if args.cut is not None or args.prune_ratio is not None:
        return False
    kv = KVCalibration.of(args.kv_calibration)
    if kv.mode == "file":
        from ..kvfit.calibrate import load_fit

        args.cut = load_fit(kv.path).info.cut
        return False
    args.cut = "auto"
    return True


def _check_auto_cut_calibration(args) -> None:
    """--cut auto chooses a cut; a calibration file was fitted for one: both cannot hold unless they agree."""
    from ..config import KVCalibration

    kv = KVCalibration.of(args.kv_calibration)
    if args.cut == "auto" and kv.mode == "file":
        from ..kvfit.calibrate import load_fit

        cut = load_fit(kv.path).info.cut
        raise CliError(f"--cut auto chooses the cut, but --kv-calibration {kv} was fitted for cut {cut}: "
                       f"give --cut {cut}, or --kv-calibration auto to fit for the chosen cut")


def _check_cut_options(args) -> None:
    check_range("--min-agreement", args.min_agreement, 0.0, 1.0)
    check_range("--budget", args.budget, 0.0, 1.0, below_high=True)
    if args.cut != "auto" and (args.min_agreement is not None or args.budget is not None):
        raise CliError("--min-agreement and --budget choose the cut: drop --cut N / --prune-ratio "
                       "(--cut auto is the default)")
    if args.min_agreement is not None and args.budget is not None:
        raise CliError("--min-agreement (the quality floor) and --budget (analyze) are two ways to choose: "
                       "give one")


def _compile(args, config, target):
    from dataclasses import replace

    from tqdm import tqdm

    from ..driver import compile, steps
    from ..frontend.models import load_model
    from ..progress import progress_bar
    from .fitprogress import FitProgress

    quiet_libraries()
    records = []

    def measured(record) -> None:
        records.append(record)
        if args.json:
            tqdm.write("step " + json.dumps(record.to_dict()), file=sys.stderr)

    # the driver loads the model (and so may read it in the engine's dtype and cast it in place) unless the
    # cut is chosen first by analyze (--budget), which runs it; the quality floor is a step of the driver
    loaded, analyzed = args.model, args.cut == "auto" and config.quality_floor is None
    if analyzed:
        loaded = load_model(args.model, revision=args.revision)
        from ..measure.autocut import choose_cut, describe

        print(describe(budget=args.budget), file=sys.stderr)
        cut, choice = choose_cut(loaded, budget=args.budget)
        config = replace(config, cut=cut, cut_choice=choice)
    names = steps(config, target)
    with progress_bar(len(names), "export", "step") as bar:  # a bar on a terminal, a line per step in a log
        def progress(name: str) -> None:
            if bar.n or name != names[0]:
                bar.update(1)
            bar.set_description(name)

        with FitProgress(leave=False) as fit_progress:
            manifest = compile(loaded, config, out=args.out, target=target, force=args.force,
                               progress=progress, fit_progress=fit_progress,
                               revision=None if analyzed else args.revision, measured=measured)
        bar.update(bar.total - bar.n)
    return manifest, records
