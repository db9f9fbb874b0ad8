"""Every entry point's K/V weights, from one place.

    kv_fit(model, tokenizer, cut, kv_calibration)     export (driver), torch.compile (dynamo), the vLLM target
        none -> None (plain POP) | file -> the fit read and checked | auto, distill -> fit_builtin
    fit_builtin(model, tokenizer, cut, KVFitConfig)   the built-in corpus (builtin_tokens) -> fit_cut
    fit_cut(model, tokens, cut, KVFitConfig)          `popcompile calibrate` (its own text) and fit_builtin:
        ridge   -> calibrate.fit_kv_cuts on [4, seq_len] batches (POP+)
        distill -> distill.ridge_then_distill on [W, T] windows (POP++: the ridge fit, then trained)

Every default (ridge, bias, window length, steps, ...) is KVFitConfig's (config.py). Here, not in
calibrate.py or distill.py, because it picks between them: distill builds on calibrate.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from ..config import KVCalibration, KVFitConfig
from .calibrate import KVFit, check_fit, check_fit_shapes, default_batches, fit_kv_cuts, load_fit
from .distill import DistillResult, default_windows, ridge_then_distill

#: the step ``kv_fit`` reports before distilling (driver.steps lists it for kv_calibration distill)
DISTILL_STEP = "distill"


def kv_fit(model: torch.nn.Module, tokenizer, cut: int, kv: KVCalibration | str | Path | None,
           fit: KVFit | None = None, *, config: KVFitConfig | None = None,
           step: Callable[[str], None] | None = None) -> KVFit | None:
    """The K/V weights ``kv`` asks for at ``cut``, for every entry point (export, torch.compile, eval).

    none: plain POP (None). auto: the ridge fit on the built-in corpus, now (needs ``tokenizer``). distill:
    that fit distilled on windows of the same corpus (minutes; ``step("distill")`` is reported before it
    starts). file: the fit read from it (or ``fit``, read earlier by ``read_fit``), checked against ``cut``
    and the model's shapes. None as well when ``cut`` prunes nothing. ``config``: how auto and distill fit
    (default KVFitConfig(); its method is the mode's)."""
    kv = KVCalibration.of(kv)
    layers = model.config.get_text_config().num_hidden_layers  # a VLM: its text decoder
    if kv.mode == "none" or cut == layers:
        return None
    if kv.fits_now:
        method = "distill" if kv.mode == "distill" else "ridge"
        return fit_builtin(model, tokenizer, cut, replace(config or KVFitConfig(), method=method), step=step)
    fit = fit or load_fit(kv.path)
    check_fit(fit, cut, layers)
    check_fit_shapes(fit, model)
    return fit


def fit_builtin(model: torch.nn.Module, tokenizer, cut: int, config: KVFitConfig, *,
                step: Callable[[str], None] | None = None) -> KVFit:
    """``fit_cut`` on the built-in calibration corpus (``builtin_tokens``). Distill at cut L-1 leaves no layer
    to train (layer L-1 reads h_cut in the full model too): the fit is ridge's, empty."""
    if config.method == "distill" and cut >= model.config.get_text_config().num_hidden_layers - 1:
        config = replace(config, method="ridge")
    if config.method == "distill":
        (step or (lambda name: None))(DISTILL_STEP)
    return fit_cut(model, builtin_tokens(tokenizer, config), cut, config)[0]


def builtin_tokens(tokenizer, config: KVFitConfig) -> list[torch.Tensor] | torch.Tensor:
    """The built-in corpus (corpus.py, disjoint from the evaluation's text) as ``fit_cut`` takes it:
    [4, seq_len] batches for ridge, windows [W, seq_len + continuation] for distill (a prompt, then the
    scored tokens)."""
    if config.method == "distill":
        return default_windows(tokenizer, seq_len=config.seq_len + config.distill.continuation,
                               max_tokens=config.max_tokens)
    return default_batches(tokenizer, seq_len=config.seq_len, max_tokens=config.max_tokens)


def fit_cut(model: torch.nn.Module, tokens: list[torch.Tensor] | torch.Tensor, cut: int,
            config: KVFitConfig, *, progress: Callable | None = None) -> tuple[KVFit, DistillResult | None]:
    """(the fit at ``cut``, the distillation's record or None) from token ids: batches [B, T] for ridge (a
    list; ``progress(tokens done)``), windows [W, T] for distill (a tensor or a list of batches, stacked;
    ``progress(DistillProgress)``), each with ``config``'s ridge and bias."""
    if config.method == "distill":
        windows = tokens if isinstance(tokens, torch.Tensor) else torch.cat(list(tokens))
        result = ridge_then_distill(model, windows, cut, config.distill, ridge=config.ridge,
                                    bias=config.fits_bias, progress=progress)
        return result.fit, result
    with torch.no_grad():
        fits = fit_kv_cuts(model, tokens, [cut], ridge=config.ridge, bias=config.fits_bias, progress=progress)
    return fits[cut], None
