"""``popcompile calibrate``: K/V projections for the pruned layers, closed form (ridge, POP+) or distilled
on the output from the ridge fit (distill, POP++: popcompile/kvfit/distill.py). The default, auto, is
export's: ``kvfit.fit.fit_method`` decides (POP++ for a text model, POP+ for a vision-language model)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..config import FIT_METHODS, check_cut_choice
from ..errors import ConfigError, InputError, OutputError
from ..fsutil import check_destination
from .common import (
    add_corpus_options,
    add_cut_options,
    add_fit_options,
    add_model_argument,
    check_range,
    fit_options,
    precheck_model,
    quiet_libraries,
    user_sources,
)

#: --method: auto (kvfit.fit.fit_method decides, as for export's --kv-calibration auto) or a method
CALIBRATE_METHODS = ("auto", *FIT_METHODS)


def register(sub) -> None:
    from ..config import DistillConfig, KVFitConfig

    fit, steps = KVFitConfig(), DistillConfig()
    p = sub.add_parser("calibrate", help="fit the pruned layers' K/V projections on your own text (POP++ or "
                                         "POP+)",
                       description="Fit, for every pruned layer, k/v projections that map input_norm(h_cut) "
                                   "to the K/V the full model makes (ridge, POP+), then, for a text model "
                                   "by default, train them on the full model's greedy tokens (distill, "
                                   "POP++); write them as safetensors + JSON for `export --kv-calibration "
                                   "FILE`.")
    add_model_argument(p)
    p.add_argument("--out", required=True, type=Path,
                   help="output .safetensors file (the fit's details are in its metadata; nothing else is "
                        "written)")
    add_cut_options(p)
    add_corpus_options(p, "calibrate")
    p.add_argument("--seq-len", type=int, default=fit.seq_len,
                   help=f"tokens per calibration window (default {fit.seq_len})")
    p.add_argument("--max-tokens", type=int, default=fit.max_tokens,
                   help=f"calibration tokens at most (default {fit.max_tokens})")
    p.add_argument("--ridge", type=float, default=fit.ridge,
                   help=f"regulariser, relative to mean diag(X^T X) ({fit.ridge:g})")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                   help="fit a bias for every k/v projection (where the model has none: one Add per refitted "
                        "layer in the prefill graph); --no-bias: only where the model's projection has one. "
                        "Default: off for ridge (it lowered greedy chat agreement, docs/results.md), on for "
                        "distill")
    p.add_argument("--method", choices=CALIBRATE_METHODS, default="auto",
                   help="auto (default: export's --kv-calibration auto, the best fit the model has: distill "
                        "for a text model, ridge for a vision-language model); ridge (POP+): closed-form fit "
                        "to the full model's K/V; distill (POP++): start from it, "
                        f"then train on KL(full || POP) of the first {steps.continuation} tokens the full "
                        "model generates after each window (the first one weighted "
                        f"{steps.boundary_weight:g}x), keeping the weights with the longest greedy "
                        "agreement on held-out windows (minutes)")
    p.add_argument("--steps", type=int,
                   help=f"distill: Adam steps at most, one window each (default {steps.steps})")
    p.add_argument("--lr", type=float, help=f"distill: Adam learning rate (default {steps.lr:g})")
    p.add_argument("--seed", type=int,
                   help=f"distill: seed of the held-out split and the window order (default {steps.seed})")
    add_fit_options(p)
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--json", action="store_true",
                   help="print the fit as one JSON object (the file's metadata, the layers, how it ran; "
                        "distill's held-out scores) instead of a summary line")
    p.set_defaults(handler=cmd_calibrate)


def cmd_calibrate(args) -> None:
    check_range("--seq-len", args.seq_len, 1)  # before torch is imported: bad options fail in a second
    check_range("--max-tokens", args.max_tokens, 1)
    check_cut_choice(args.cut, args.prune_ratio)
    check_range("--ridge", args.ridge, 0.0)
    config = fit_config(args)  # auto's method is checked again once the model says which it is
    check_output_file(args.out, args.force)
    precheck_model(args.model)
    from ..kvfit.budget import resolve_device

    resolve_device(config.device)  # --device cuda without a GPU: fail now, not after the model loads
    from ..config import resolve_cut
    from ..frontend.models import load_model
    from ..frontend.vision import check_cut as check_vision_cut
    from ..kvfit.calibrate import save_fit
    from ..kvfit.distill import check_cut
    from ..kvfit.fit import check_method, fit_method

    sources = user_sources(args)  # before the model loads: a bad file fails in a second
    quiet_libraries()
    loaded = load_model(args.model, revision=args.revision, lazy=True)  # weights read as the fit needs them
    layers = loaded.model.config.get_text_config().num_hidden_layers  # a VLM: its text decoder's
    cut = resolve_cut(layers, cut=args.cut, prune_ratio=args.prune_ratio)
    check_cut(cut, layers)  # before minutes of fitting
    check_vision_cut(loaded.model.config, cut)
    config = fit_config(args, fit_method(loaded.model, args.method))  # auto: the one rule export follows
    check_method(loaded.model, config)
    batches = calibration_batches(args, loaded, sources, config)
    fit, result = fitted(loaded.model, batches, cut, config, lazy=loaded.lazy)
    check_output_file(args.out, args.force)  # again: the file may have appeared during the fit
    save_fit(fit, args.out)
    if args.json:
        print(json.dumps(fit_json(args.out, fit, result), indent=2))
        return
    from .info import FIT_NAMES

    name = FIT_NAMES.get(fit.info.method, fit.info.method).split()[0]  # what ran: auto's choice, a fallback
    print(f"{args.out}: {name} K/V projections of layers {cut}..{fit.info.num_layers - 1} fitted on "
          f"{fit.info.tokens} tokens (ridge {fit.info.ridge}{fit_note(fit, result)})")


def fit_json(out: Path, fit, result) -> dict:
    """`calibrate --json`: the file, its metadata (CalibrationInfo), the refitted layers, how the fit ran
    (its record: device, estimate, time, a fallback) and, for distill, its held-out scores."""
    from dataclasses import asdict

    distill = None if result is None else {
        "steps_run": result.steps_run, "best_step": result.best_step, "stopped": result.stopped,
        "initial": asdict(result.initial), "best": asdict(result.best)}
    return {"out": str(out), **asdict(fit.info), "layers": sorted(fit.weights), "fit": fit.record,
            "distill": distill}


def fit_config(args, method: str | None = None):
    """The KVFitConfig of the flags for ``method`` (default --method; auto, before the model says which
    method it is, checks what every method shares); ConfigError for bad or misplaced values."""
    from ..config import DistillConfig, KVFitConfig

    method = method or args.method
    given = {name: value for name, value in (("steps", args.steps), ("lr", args.lr), ("seed", args.seed))
             if value is not None}
    if method == "ridge" and given:
        why = "" if args.method == "ridge" else " (auto fits ridge for a vision-language model)"
        raise ConfigError(f"{', '.join(f'--{name}' for name in given)} apply to --method distill only{why}: "
                          "add --method distill or drop them")
    config = KVFitConfig(method="ridge" if method == "auto" else method, ridge=args.ridge, bias=args.bias,
                         seq_len=args.seq_len, max_tokens=args.max_tokens, distill=DistillConfig(**given),
                         **fit_options(args))
    if method == "distill" and args.seq_len < 2:
        raise ConfigError(f"--seq-len {args.seq_len} leaves no prompt token to prune for --method distill: "
                          "use --seq-len >= 2")
    return config


def calibration_batches(args, loaded, sources, config) -> list:
    """[4, --seq-len] token batches of the user's text, --max-tokens at most, or the built-in text as export
    fits on it (kvfit.fit.builtin_tokens: distill's are code, prose and chat prompts); a vision-language
    model's are image+text windows of that text (kvfit/images.py)."""
    from ..frontend.vision import is_vision_language
    from ..kvfit.calibrate import token_batches
    from ..kvfit.fit import builtin_tokens

    tokenizer = loaded.tokenizer
    if is_vision_language(loaded.model):
        return image_batches(args, loaded, sources)
    if sources:
        docs = [tokenizer(text).input_ids for texts in sources.values() for text in texts]
        batches = list(token_batches(docs, args.seq_len, 4))[: max(1, args.max_tokens // (4 * args.seq_len))]
    else:
        batches = builtin_tokens(tokenizer, config)
    if not len(batches):
        raise InputError(f"the calibration text has fewer than --seq-len={args.seq_len} tokens: "
                         "give more text")
    return batches


def image_batches(args, loaded, sources) -> list:
    """[4, --seq-len] image+text windows (a synthetic image in a chat turn, then the text), --max-tokens at
    most: the text is the user's, or the built-in corpus."""
    from ..kvfit.corpus import calibration_docs, encode
    from ..kvfit.images import image_windows

    tokenizer = loaded.tokenizer
    texts = [text for group in sources.values() for text in group] if sources else None
    docs = (calibration_docs(tokenizer) if texts is None else
            (encode(tokenizer, text, add_special_tokens=False) for text in texts))
    return image_windows(loaded.model, tokenizer, docs, seq_len=args.seq_len, max_tokens=args.max_tokens,
                         folder=getattr(loaded.source, "path", None))


def fitted(model, batches: list, cut: int, config, lazy=None):
    """(the fit, distill's DistillResult or None), through ``kvfit.fit.fit_on_tokens``, its estimate,
    fallback and progress drawn by ``FitProgress`` (one bar per phase: tokens for ridge; for distill the
    full model's pass, whose forward also gives the ridge fit's statistics, then the training steps).
    ``lazy``: the model was built without its weights (frontend.lazy; ridge streams them)."""
    from ..kvfit.fit import fit_on_tokens
    from .fitprogress import FitProgress

    with FitProgress() as progress:
        return fit_on_tokens(model, batches, cut, config, progress=progress, lazy=lazy)


def fit_note(fit, result) -> str:
    """The summary line's tail: a fallback, an early stop, the time against the estimate, distill's scores."""
    record = fit.record or {}
    tail = f"; {record['stopped']}" if record.get("stopped") else ""
    if record:
        tail += (f"; fitted in {record['elapsed_s']:.0f} s on {record['device']} (estimated "
                 f"{record['estimate_s']:.0f} s)")
    if record.get("fallback"):
        return f"; POP+ (ridge) instead of POP++: {record['fallback_cause']}{tail}"
    if result is None:
        return tail
    first, best = result.initial, result.best
    return (f"; distilled {result.steps_run} steps, held-out matched prefix "
            f"{first.matched_prefix:.2f} -> {best.matched_prefix:.2f} tokens, KL {first.kl:.4f} -> "
            f"{best.kl:.4f} at step {result.best_step}{tail}")


def check_output_file(out: Path, force: bool) -> None:
    """OutputError unless ``out`` is a new file in a writable folder, or an existing file and ``force``."""
    if out.is_dir():
        raise OutputError(f"--out {out} is a folder: give a file name such as {out / 'kv.safetensors'}")
    if out.exists() and not force:
        raise OutputError(f"--out {out} exists: choose another --out or pass --force")
    check_destination(out)
