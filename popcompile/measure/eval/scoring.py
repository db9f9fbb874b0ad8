"""Scoring for ``popcompile eval``: the variants registry, continuation and generation scores, shared by the
eager reference (run.py), the engine evaluation (engine.py) and the cut sweep (sweep.py).

Every variant runs through ``reference.py`` (the eager specification) on the same data:

    full             Variant(cut=L)                  nothing pruned
    pop              Variant(cut)                    POP as in the paper
    pop-kvfit        Variant(cut, kv_weights=...)    POP+ (K/V projections refitted, calibrate.py)
    pop-distill      Variant(cut, kv_weights=...)    POP++ (pop-kvfit's weights distilled on the output,
                                                     distill.py)
    pop-no-boundary  Variant(cut, boundary=False)    x_N pruned too
    pop-no-kv        Variant(cut, kv_projection=False)  deep layers leave no cache for the prompt
    shortgpt         Variant(cut, shortgpt=True)     deep layers removed in prefill and decode
    wanda            Variant(L, weights=...)         30% of each decoder linear's row zeroed (baselines.py)
    slicegpt         Variant(L, weights=...)         25% of the hidden dimension sliced off (baselines.py)
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from ... import reference
from ...errors import ConfigError
from ...progress import progress_bar
from ...reference import Variant
from . import data as eval_data


@dataclass(frozen=True)
class VariantContext:
    """What a variant factory may use: the cut, the depth, and (lazily) K/V weights for that cut, from
    ``resolve_fit`` (POP+, ridge) or ``distill_fit`` (POP++): cut -> {layer: {"k_proj"|"v_proj": Projection}};
    and from ``baseline_fit`` a baseline's weight transform: "wanda"|"slicegpt" ->
    {"module.param": tensor}."""

    cut: int
    num_layers: int
    kv_fit: Callable[[int], Any] | None = None
    distill_fit: Callable[[int], Any] | None = None
    baseline_fit: Callable[[str], Any] | None = None

    def fitted_kv(self) -> Any:
        return self._weights("pop-kvfit", self.kv_fit)

    def distilled_kv(self) -> Any:
        return self._weights("pop-distill", self.distill_fit)

    def _weights(self, variant: str, fit: Callable[[int], Any] | None) -> Any:
        # at cut >= L-1 nothing is refitted: layer L-1 reads h_{L-1} in the full model too
        if fit is None:
            raise ValueError(f"variant {variant} needs a model to calibrate on (give {REFITS[variant]})")
        return fit(self.cut) if self.cut < self.num_layers - 1 else None

    def baseline_weights(self, variant: str) -> Any:
        if self.baseline_fit is None:
            raise ValueError(f"variant {variant} needs a model to calibrate on (give baseline_fit)")
        return self.baseline_fit(variant)


#: name -> factory(VariantContext) -> Variant. Register new variants here.
VARIANTS: dict[str, Callable[[VariantContext], Variant]] = {
    "full": lambda c: Variant(cut=c.num_layers),
    "pop": lambda c: Variant(c.cut),
    "pop-kvfit": lambda c: Variant(c.cut, kv_weights=c.fitted_kv()),
    "pop-distill": lambda c: Variant(c.cut, kv_weights=c.distilled_kv()),
    "pop-no-boundary": lambda c: Variant(c.cut, boundary=False),
    "pop-no-kv": lambda c: Variant(c.cut, kv_projection=False),
    "shortgpt": lambda c: Variant(c.cut, shortgpt=True),
    "wanda": lambda c: Variant(c.num_layers, weights=c.baseline_weights("wanda")),
    "slicegpt": lambda c: Variant(c.num_layers, weights=c.baseline_weights("slicegpt")),
}
#: the variants with refitted K/V weights -> the VariantContext field (and make_variants/sweep argument)
#: they use
REFITS = {"pop-kvfit": "kv_fit", "pop-distill": "distill_fit"}
BASELINE = "full"


def register_variant(name: str, factory: Callable[[VariantContext], Variant]) -> None:
    """Add a variant: ``factory(VariantContext) -> Variant``."""
    if name in VARIANTS:
        raise ValueError(f"variant {name!r} is already registered")
    VARIANTS[name] = factory


def make_variants(names: Iterable[str], cut: int, num_layers: int, kv_fit: Callable[[int], Any] | None = None,
                  distill_fit: Callable[[int], Any] | None = None,
                  baseline_fit: Callable[[str], Any] | None = None) -> dict[str, Variant]:
    """``{name: Variant}`` for the named registry entries, the baseline ``full`` always first."""
    names = list(dict.fromkeys([BASELINE, *names]))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ConfigError(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    context = VariantContext(cut, num_layers, kv_fit, distill_fit, baseline_fit)
    return {name: VARIANTS[name](context) for name in names}


def describe(variant: Variant) -> dict:
    """A variant as JSON-able fields (the POP+ weights as a flag)."""
    return {"cut": variant.cut, "boundary": variant.boundary, "kv_projection": variant.kv_projection,
            "shortgpt": variant.shortgpt, "kv_refit": bool(variant.kv_weights),
            "weights_replaced": len(variant.weights or ())}


def default_kv_fit(loaded, cuts: Iterable[int] = ()) -> Callable[[int], Any]:
    """cut -> POP+ weights as ``export --kv-calibration auto`` fits them (KVFitConfig's defaults, on the
    built-in calibration corpus, held out from the evaluation data; a vision-language model's on image+text
    windows, ``kvfit.fit.builtin_batches``).

    Lazy: the first call fits its cut and every cut in ``cuts`` in one pass over the corpus
    (``calibrate.ridge_fits``); later calls for those cuts are free."""
    from ...config import KVFitConfig
    from ...kvfit.calibrate import ridge_fits
    from ...kvfit.fit import builtin_batches

    config, layers = KVFitConfig(), num_layers(loaded.model)
    fits: dict[int, Any] = {}

    def fit(cut: int):
        if cut not in fits:
            wanted = sorted({cut, *(c for c in cuts if 1 <= c < layers - 1)})
            folder = getattr(loaded.source, "path", None)  # a VLM's preprocessor_config.json
            batches = builtin_batches(loaded.model, loaded.tokenizer, config, folder)
            with torch.no_grad(), _bar(sum(b.numel() for b in batches),
                                       f"calibrate {len(wanted)} cut(s)") as bar:
                found = ridge_fits(loaded.model, batches, wanted, ridge=config.ridge, bias=config.fits_bias,
                                    progress=bar.update)
            fits.update({c: f.weights for c, f in found.items()})
        return fits[cut]
    return fit


#: the variants a vision-language model runs (the reference's image path): POP and its boundary ablation
#: against full, with POP+ (fitted as export fits it: on image+text windows)
VISION_VARIANTS = ("full", "pop", "pop-kvfit", "pop-no-boundary")


def variant_refusal(model, name: str) -> str | None:
    """Why variant ``name`` cannot run on ``model`` (one line), or None (slicegpt: where the norms forbid
    the rotation; a vision-language model: the variants of VISION_VARIANTS only)."""
    from ...frontend.vision import is_vision_language
    from .baselines import slicegpt_refusal

    if is_vision_language(model) and name not in VISION_VARIANTS:
        return (f"{name} is not run on a vision-language model ({model.config.model_type}): choose from "
                f"{', '.join(VISION_VARIANTS)}")
    return slicegpt_refusal(model.config) if name == "slicegpt" else None


def default_variant_names(model) -> list[str]:
    """Every registered variant that applies to ``model``."""
    return [n for n in VARIANTS if not variant_refusal(model, n)]


def check_variants_apply(model, names: Iterable[str]) -> None:
    """ConfigError for the first named variant that cannot run on ``model``, before any calibration."""
    for name in names:
        reason = variant_refusal(model, name)
        if reason:
            raise ConfigError(reason)


def default_baseline_fit(loaded, options: Any = None) -> Callable[[str], Any]:
    """"wanda"|"slicegpt" -> its weight transform (baselines.py, ``options`` a BaselineOptions, default
    sparsity 0.3 / slicing 0.25), calibrated on the built-in corpus (held out from the evaluation data).
    Lazy: one pass over the corpus per baseline, at its first call."""
    from ...kvfit.calibrate import default_batches
    from .baselines import TRANSFORMS, BaselineOptions

    options = BaselineOptions() if options is None else options
    fits: dict[str, Any] = {}

    def fit(name: str):
        if name not in fits:
            batches = default_batches(loaded.tokenizer)
            with torch.no_grad(), _bar(sum(b.numel() for b in batches), f"calibrate {name}") as bar:
                fits[name] = TRANSFORMS[name](loaded.model, batches, options, progress=bar.update)
        return fits[name]
    return fit


def default_distill_fit(loaded, config: Any = None) -> Callable[[int], Any]:
    """cut -> POP++ weights as ``export --kv-calibration distill`` makes them (``kvfit.fit.fit_on_tokens``,
    method distill: the ridge fit with a bias and its distillation from one full-model pass), with ``config``
    (a config.DistillConfig, default its defaults; tests give few steps), on the built-in corpus's windows
    (``kvfit.fit.builtin_tokens``: 512 prompt + 48 scored tokens, disjoint from the evaluation data).
    Lazy, one run per cut; the corpus is tokenized once."""
    from ...config import DistillConfig, KVFitConfig
    from ...kvfit.fit import builtin_tokens, fit_on_tokens

    # no time budget: the curve measures POP++ itself, which a fallback to POP+ would mislabel
    fit_config = KVFitConfig(method="distill", distill=DistillConfig() if config is None else config,
                             budget_s=None)
    fits: dict[int, Any] = {}
    windows: list = []  # the corpus, tokenized at the first cut asked for and reused for the others

    def fit(cut: int):
        if cut not in fits:
            windows[:] = windows or [builtin_tokens(loaded.tokenizer, fit_config)]
            with _bar(fit_config.distill.steps, f"distill cut {cut}") as bar:
                def report(event) -> None:  # the training steps; the teacher pass over the windows is short
                    if getattr(event, "phase", None) == "train":  # not the FitPlan (its estimate)
                        bar.update(event.done - bar.n)
                fitted, _ = fit_on_tokens(loaded.model, windows[0], cut, fit_config, progress=report)
                fits[cut] = fitted.weights
        return fits[cut]
    return fit


def _bar(total: int, desc: str):
    """A bar on a terminal, a line per 10% in a log (progress.py)."""
    return progress_bar(total, desc, leave=False)


def num_layers(model) -> int:
    return len(reference.decoder_layers(model))


# --- continuation ------------------------------------------------------------------------------

def default_batch_size(model, cont_len: int) -> int:
    """Logits exist for the continuation only (the prefill keeps its last row): keep them near 1 GiB."""
    return batch_size_for(model.get_output_embeddings().weight.shape[0], cont_len)


def batch_size_for(vocab: int, cont_len: int) -> int:
    """Documents per batch whose float32 logits [B, cont_len, vocab] stay near 1 GiB (at most 8)."""
    return max(1, min(8, 2**28 // (cont_len * vocab)))


@contextlib.contextmanager
def last_logits_only(model) -> Iterator[None]:
    """The model's forwards return logits [B, 1, V] of the last position only (``logits_to_keep=1``)."""
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: (args, {**kwargs, "logits_to_keep": 1}), with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def continuation_logits(model, prefix: torch.Tensor, continuation: torch.Tensor,
                        variant: Variant) -> torch.Tensor:
    """``reference.continuation_logits`` [B, C, V], with the prefill's logits made for its last row only
    (the only one it returns; on Gemma 3's 262k vocabulary the all-row head costs more than the layers)."""
    with reference.attention_for(model, variant):
        run = reference.PopRun(model, variant, prefix.shape[1])
        with last_logits_only(model):
            first = run.prefill(prefix)[:, None]
        if continuation.shape[1] == 1:
            return first
        rest = run.step(continuation[:, :-1], prefix.shape[1])
    return torch.cat([first, rest], dim=1)


@torch.no_grad()
def continuation_eval(model, docs: list[eval_data.Document], variants: dict[str, Variant],
                      batch_size: int | None = None, desc: str = "continuation") -> dict[str, dict]:
    """Teacher-forced scores of each variant (``score_continuations``) through the eager reference.
    ``variants`` must hold the baseline ``full``."""
    check_documents(docs, variants)
    batch_size = batch_size or default_batch_size(model, len(docs[0].continuation))
    logits = lambda name, prefix, target: continuation_logits(model, prefix, target, variants[name])
    return score_continuations(docs, list(variants), logits, batch_size, desc)


def check_documents(docs: list[eval_data.Document], names: Iterable[str]) -> None:
    """ValueError unless the baseline is among ``names`` and the documents share one shape."""
    if BASELINE not in names:
        raise ConfigError(f"continuation_eval needs the {BASELINE!r} variant as its baseline: "
                          "add it to --variants")
    if not docs:
        raise ValueError("continuation_eval needs at least one document")
    lengths = {(len(d.prefix), len(d.continuation)) for d in docs}
    if len(lengths) != 1:
        raise ValueError(f"documents must share one prefix and continuation length, got {sorted(lengths)}")


#: (variant name, prefix [B, N], continuation [B, C]) -> teacher-forced logits [B, C, V]
ContinuationLogits = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def score_continuations(docs: list[eval_data.Document], names: list[str], logits: ContinuationLogits,
                        batch_size: int, desc: str = "continuation") -> dict[str, dict]:
    """Teacher-forced scores of each named variant from ``logits`` (the eager reference's or an engine's),
    in batches of ``batch_size`` documents; the baseline ``full`` comes first.

    Per variant: ``nll`` (mean over all continuation tokens), ``perplexity`` = exp(nll), ``agreement``
    (argmax == the full model's argmax), ``accuracy`` (argmax == the true token), ``kl_to_full``
    (mean KL(full || variant), nats), and per-document ``doc_nll`` / ``doc_agreement``.
    """
    check_documents(docs, names)
    names = list(dict.fromkeys([BASELINE, *names]))
    stats = {name: {"nll": [], "agree": [], "correct": [], "kl": []} for name in names}
    batches = [docs[i:i + batch_size] for i in range(0, len(docs), batch_size)]
    with _bar(len(batches) * len(names), desc) as bar:
        for batch in batches:
            prefix = torch.tensor([d.prefix for d in batch])
            target = torch.tensor([d.continuation for d in batch])
            base = None
            for name in names:  # the baseline comes first
                logp = torch.log_softmax(logits(name, prefix, target).float(), dim=-1)
                if base is None:
                    base = logp
                s = stats[name]
                s["nll"].append(-logp.gather(-1, target[..., None])[..., 0])
                s["agree"].append(logp.argmax(-1) == base.argmax(-1))
                s["correct"].append(logp.argmax(-1) == target)
                s["kl"].append((base.exp() * (base - logp)).sum(-1))
                bar.update(1)
    return {name: _continuation_summary(s) for name, s in stats.items()}


def _continuation_summary(s: dict[str, list[torch.Tensor]]) -> dict:
    """One variant's per-batch [B, C] tensors -> its JSON scores."""
    nll, agree = torch.cat(s["nll"]), torch.cat(s["agree"]).float()
    mean_nll = float(nll.mean())
    return {
        "nll": mean_nll, "perplexity": math.exp(mean_nll), "agreement": float(agree.mean()),
        "accuracy": float(torch.cat(s["correct"]).float().mean()),
        "kl_to_full": float(torch.cat(s["kl"]).mean().clamp_min(0)),
        "doc_nll": [float(x) for x in nll.mean(1)], "doc_agreement": [float(x) for x in agree.mean(1)],
    }


# --- generation --------------------------------------------------------------------------------

def matched_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@torch.no_grad()
def generation_eval(model, prompts: list[list[int]], variants: dict[str, Variant], max_new_tokens: int = 64,
                    eos_token_id: int | None = None,
                    decode: Callable[[list[int]], str] | None = None) -> dict:
    """Greedy generations with ``reference.generate``, scored by ``compare_generations``."""
    generate = lambda name, ids: reference.generate(model, torch.tensor([ids]), max_new_tokens,
                                                    variants[name], eos_token_id)
    return compare_generations(prompts, list(variants), generate, decode)


def compare_generations(prompts: list[list[int]], names: list[str],
                        generate: Callable[[str, list[int]], list[int]],
                        decode: Callable[[list[int]], str] | None = None) -> dict:
    """``generate(name, prompt ids) -> new ids`` for every prompt and variant; per variant ``exact_match``
    (identical token sequence to full's), ``matched_prefix`` (mean leading tokens equal to full's),
    ``mean_length``, the ``tokens`` (and ``texts`` with ``decode``)."""
    names = list(dict.fromkeys([BASELINE, *names]))
    out: dict[str, list[list[int]]] = {name: [] for name in names}
    with _bar(len(prompts) * len(names), "generation") as bar:
        for ids in prompts:
            for name in names:
                out[name].append(generate(name, ids))
                bar.update(1)
    results = {}
    for name, gens in out.items():
        prefixes = [matched_prefix(g, f) for g, f in zip(gens, out[BASELINE])]
        results[name] = {
            "exact_match": sum(g == f for g, f in zip(gens, out[BASELINE])) / len(gens),
            "matched_prefix": sum(prefixes) / len(prefixes),
            "mean_length": sum(map(len, gens)) / len(gens),
            "tokens": gens,
            **({"texts": [decode(g) for g in gens]} if decode else {}),
        }
    return results


# --- tasks -------------------------------------------------------------------------------------

def timed(run: Callable[[], dict]) -> dict:
    """``run()``'s results with the seconds it took."""
    start = time.perf_counter()
    found = run()
    return {**found, "seconds": time.perf_counter() - start}


def reference_generation_task(model, tok, variants, limit, gen_tokens) -> dict:
    generate = lambda name, ids: reference.generate(model, torch.tensor([ids]), gen_tokens, variants[name],
                                                    tok.eos_token_id)
    return generation_task(tok, list(variants), generate, limit, gen_tokens)


def generation_task(tok, names: list[str], generate: Callable[[str, list[int]], list[int]], limit: int | None,
                    gen_tokens: int) -> dict:
    """The generation task's results: the chat prompts through ``generate(name, ids)``
    (``compare_generations``)."""
    texts = eval_data.CHAT_PROMPTS[:limit]
    prompts = [eval_data.chat_prompt_ids(tok, p) for p in texts]
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    return {"prompts": len(prompts), "prompt_texts": list(texts), "chat_template": bool(tok.chat_template),
            "max_new_tokens": gen_tokens, "variants": compare_generations(prompts, names, generate, decode)}
