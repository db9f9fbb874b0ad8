"""Every entry point's K/V weights, from one place.

    resolve_fit(model, tokenizer, cut, kv_calibration)   export (driver), eval, the vLLM target
        none -> None (plain POP) | file -> resolve_file_fit, then checked against the model's shapes
        ridge, distill -> fit_builtin | auto -> fit_method's: distill for a text model, ridge for a VLM
    resolve_file_fit(kv_calibration, cut, num_layers)   resolve_fit without a model: torch.compile (dynamo)
    fit_builtin(model, tokenizer, cut, KVFitConfig)     the built-in corpus (builtin_batches) -> fit_on_tokens
    fit_on_tokens(model, tokens, cut, KVFitConfig)      `popcompile calibrate` (its own text) and fit_builtin:
        ridge   -> calibrate.ridge_fits on [4, seq_len] batches (POP+); a vision-language model's are
                   image+text windows (images.py: a synthetic image, then the text)
        distill -> distill.ridge_then_distill on [W, T] windows (POP++: the ridge fit, then trained; text
                   models only: a VLM is refused, ``check_method``)
        both on KVFitConfig.device within KVFitConfig.budget_s (budget.py: the estimate, printed before
        the fit; distill over the budget falls back to ridge; a fit that runs out stops with the best so far)
        a model built without its weights (``lazy``, frontend.lazy): ridge on the CPU reads one module's
        weights at a time (LazyWeights.streamed); distill, or another device, reads them all first, and
        distill whose float32 weights exceed the memory available falls back to ridge

Every default (ridge, bias, window length, steps, ...) is KVFitConfig's (config.py). Here, not in
calibrate.py or distill.py, because it picks between them: distill builds on calibrate.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from ..config import FIT_METHODS, KVCalibration, KVFitConfig
from ..errors import ConfigError
from ..frontend.lazy import LazyWeights
from ..frontend.vision import is_vision_language
from ..passes.pop import Projection
from .budget import Deadline, FitPlan, on_device, plan_fit, resolve_device
from .calibrate import KVFit, batch_kind, check_fit, check_fit_shapes, default_batches, load_fit, ridge_fits
from .corpus import calibration_docs
from .distill import DistillProgress, DistillResult, check_inputs, default_windows, ridge_then_distill
from .images import ImageWindow, image_windows

#: the step ``resolve_fit`` reports before distilling (driver.steps lists it for kv_calibration distill)
DISTILL_STEP = "distill"


def resolve_fit(model: torch.nn.Module, tokenizer, cut: int, kv: KVCalibration | str | Path | None,
           fit: KVFit | None = None, *, config: KVFitConfig | None = None,
           step: Callable[[str], None] | None = None, folder: str | Path | None = None,
           progress: Callable | None = None, lazy: LazyWeights | None = None) -> KVFit | None:
    """The K/V weights ``kv`` asks for at ``cut``, for every entry point (export, torch.compile, eval).

    none: plain POP (None). ridge: the ridge fit on the built-in corpus, now (needs ``tokenizer``; a
    vision-language model's windows are image+text, ``folder`` its model folder with the
    preprocessor_config.json). distill: a ridge fit distilled on the built-in prompts (minutes;
    ``step("distill")`` is reported before it starts; text models only). auto: ``fit_method``'s. file: the
    fit read from it (or ``fit``, read earlier by ``load_file_fit``), checked against ``cut`` and the model's
    shapes. None as well when ``cut`` prunes nothing. ``config``: how the built-in fits are made (default
    KVFitConfig(); its method is the mode's). ``progress``: the fit's events (``fit_on_tokens``).
    ``lazy``: the model was built without its weights (``fit_on_tokens``)."""
    kv = KVCalibration.of(kv)
    layers = model.config.get_text_config().num_hidden_layers  # a VLM: its text decoder
    if kv.fits_now and cut < layers:
        method = fit_method(model, kv)
        return fit_builtin(model, tokenizer, cut, replace(config or KVFitConfig(), method=method), step=step,
                           folder=folder, progress=progress, lazy=lazy)
    fit = resolve_file_fit(kv, cut, layers, fit)
    if fit is not None:
        check_fit_shapes(fit, model)
    return fit


def resolve_file_fit(kv: KVCalibration, cut: int, num_layers: int, fit: KVFit | None = None) -> KVFit | None:
    """``resolve_fit`` where no model is at hand (the torch.compile backend sees graphs only): None for none
    and for a cut that prunes nothing; a file's fit (``fit`` when read already) checked against ``cut``. The
    modes fitted at compile time need the model: ConfigError."""
    if kv.mode == "none" or cut == num_layers:
        return None
    if kv.fits_now:
        raise ConfigError(f"kv_calibration={kv.mode!r} fits on the model: call resolve_fit with it")
    fit = fit or load_fit(kv.path)
    check_fit(fit, cut, num_layers)
    return fit


def fit_method(model: torch.nn.Module, kv: KVCalibration | str) -> str | None:
    """The fitting method ``kv`` runs on ``model`` ("ridge" | "distill"), None for none and a file. auto, the
    export default, is the best measured (docs/results.md, "Greedy agreement"): distill, whose greedy
    generations match the full model's longest, except on a vision-language model, where distill is not
    implemented (check_method) and ridge is."""
    kv = KVCalibration.of(kv)
    if kv.mode == "auto":
        return "ridge" if is_vision_language(model) else "distill"
    return kv.mode if kv.mode in FIT_METHODS else None


def fit_builtin(model: torch.nn.Module, tokenizer, cut: int, config: KVFitConfig, *,
                step: Callable[[str], None] | None = None, folder: str | Path | None = None,
                progress: Callable | None = None, lazy: LazyWeights | None = None) -> KVFit:
    """``fit_on_tokens`` on the built-in calibration corpus (``builtin_batches``). Distill at cut L-1 leaves
    no layer to train (layer L-1 reads h_cut in the full model too): the fit is ridge's, empty."""
    check_method(model, config)
    if config.method == "distill" and cut >= model.config.get_text_config().num_hidden_layers - 1:
        config = replace(config, method="ridge")
    if config.method == "distill":
        (step or (lambda name: None))(DISTILL_STEP)
    return fit_on_tokens(model, builtin_batches(model, tokenizer, config, folder), cut, config,
                         progress=progress, lazy=lazy)[0]


def builtin_batches(model: torch.nn.Module, tokenizer, config: KVFitConfig,
                    folder: str | Path | None = None) -> list[torch.Tensor | ImageWindow] | torch.Tensor:
    """What ``fit_on_tokens`` fits ``model`` on by default: ``builtin_tokens``, or for a vision-language model
    [4, seq_len] image+text windows of the same corpus (images.image_windows; ``folder``: the model folder,
    whose preprocessor_config.json sizes the images)."""
    if not is_vision_language(model):
        return builtin_tokens(tokenizer, config)
    return image_windows(model, tokenizer, calibration_docs(tokenizer), seq_len=config.seq_len,
                         max_tokens=config.max_tokens, folder=folder)


def builtin_tokens(tokenizer, config: KVFitConfig) -> list[torch.Tensor] | torch.Tensor:
    """The built-in corpus (corpus.py, disjoint from the evaluation's text) as ``fit_on_tokens`` takes it:
    [4, seq_len] batches for ridge, windows for distill (distill.default_windows: ``config.distill.windows``
    prompts of seq_len tokens for greedy targets)."""
    if config.method == "distill":
        budget = min(config.max_tokens, config.distill.windows * config.seq_len)
        return default_windows(tokenizer, config.distill, seq_len=config.seq_len, max_tokens=budget)
    return default_batches(tokenizer, seq_len=config.seq_len, max_tokens=config.max_tokens)


def fit_on_tokens(model: torch.nn.Module, tokens: list[torch.Tensor] | torch.Tensor, cut: int,
            config: KVFitConfig, *, progress: Callable | None = None,
            lazy: LazyWeights | None = None) -> tuple[KVFit, DistillResult | None]:
    """(the fit at ``cut``, the distillation's record or None) from token ids: batches [B, T] for ridge (a
    list), windows [W, T] for distill (a tensor or a list of batches, stacked), each with ``config``'s ridge
    and bias. Ridge also takes a vision-language model's image+text windows (images.ImageWindow batches).

    On ``config.device``, within ``config.budget_s`` (budget.py): ``progress`` gets the ``FitPlan`` first
    (its ``line()``: the estimate; its ``fallback``: why distill became ridge, then fitted on the same
    windows), then ``DistillProgress`` reports (phase "ridge": tokens, "teacher": windows, "train": steps).
    Without ``progress`` a fallback is a warning. The fit's ``record`` says what ran (the manifest's
    ``extra.kv_fit``); its weights are on the CPU. ``lazy``: ``model`` was built without its weights
    (placeholders, frontend.lazy): ``held`` reads them as the plan needs."""
    check_method(model, config)
    device = resolve_device(config.device)
    report = progress or _warn_fallback
    windows = None
    if config.method == "distill":
        windows = tokens if isinstance(tokens, torch.Tensor) else torch.cat(list(tokens))
        check_inputs(model, windows, cut, config.distill)  # a bad input fails before the estimate is shown
        shapes = [tuple(windows.shape)]
    else:
        tokens = list(tokens)
        shapes = [tuple(batch_kind(b).ids(b).shape) for b in tokens]
    plan = plan_fit(model, shapes, cut, config, device,
                    unread_bytes=0 if lazy is None else lazy.placeholder_bytes(model))
    report(plan)
    deadline, result, stopped = Deadline(config.budget_s), None, None
    with held(model, lazy, plan.method, device), on_device(model, device):
        if plan.method == "distill":
            result = ridge_then_distill(model, windows, cut, config.distill, ridge=config.ridge,
                                        bias=config.fits_bias, progress=report, stop=deadline.passed)
            fit = result.fit
            if result.stopped == "budget":
                stopped = f"stopped at step {result.steps_run} of {config.distill.steps}: budget"
        else:
            ridge = replace(config, method="ridge")
            batches = list(tokens) if windows is None else list(windows.split(4))
            total, done = sum(b.numel() for b in batches), [0]

            def counted(count: int) -> None:
                done[0] += count
                report(DistillProgress("ridge", done[0], total))
            with torch.no_grad():
                fit = ridge_fits(model, batches, [cut], ridge=ridge.ridge, bias=ridge.fits_bias,
                                 progress=counted, stop=deadline.passed)[cut]
            if fit.info.tokens < total:
                stopped = f"stopped after {fit.info.tokens} of {total} tokens: budget"
    return replace(on_cpu(fit), record=plan.record(deadline.elapsed(), stopped)), result


def held(model: torch.nn.Module, lazy: LazyWeights | None, method: str,
         device: torch.device) -> contextlib.AbstractContextManager:
    """How the fit holds the weights of a model built without them: ridge on the CPU streams them (one
    module's at a time, per forward); distill, and a fit on another device, read them all now, for good."""
    if lazy is None:
        return contextlib.nullcontext(model)
    if method == "ridge" and device.type == "cpu":
        return lazy.streamed(model)
    lazy.materialise(model)
    return contextlib.nullcontext(model)


def on_cpu(fit: KVFit) -> KVFit:
    """``fit`` with its weights on the CPU (a fit made on a GPU)."""
    cpu = lambda t: None if t is None else t.detach().cpu()
    weights = {i: {part: Projection(cpu(p.weight), cpu(p.bias)) for part, p in parts.items()}
               for i, parts in fit.weights.items()}
    return replace(fit, weights=weights)


def _warn_fallback(event) -> None:
    """Where nobody draws the fit's progress: its fallback, if any, as a warning (one line)."""
    if isinstance(event, FitPlan) and event.fallback:
        warnings.warn(event.fallback, stacklevel=3)


def check_method(model: torch.nn.Module, config: KVFitConfig) -> None:
    """ConfigError for distill on a vision-language model: POP++ trains on text windows through the whole
    model, and image prompts are not implemented there (the ridge fit takes them)."""
    if config.method == "distill" and is_vision_language(model):
        raise ConfigError(f"distill (POP++) is not implemented for vision-language models "
                          f"({model.config.model_type}): use --kv-calibration auto (export) or --method "
                          "ridge (calibrate), both fitted on image+text windows")
