"""``popcompile eval``: POP's quality against the full model and the paper's ablations, on real data.

Every variant runs through ``reference.py`` (the eager specification) on the same data:

    full             Variant(cut=L)                  nothing pruned
    pop              Variant(cut)                    POP as in the paper
    pop-kvfit        Variant(cut, kv_weights=...)    POP+ (ridge refit of the deep K/V projections)
    pop-distill      Variant(cut, kv_weights=...)    POP++ (that refit distilled on the output; minutes
                                                     per cut)
    pop-no-boundary  Variant(cut, boundary=False)    x_N pruned too
    pop-no-kv        Variant(cut, kv_projection=False)  deep layers leave no cache for the prompt
    shortgpt         Variant(cut, shortgpt=True)     deep layers removed in prefill and decode
    wanda            Variant(L, weights=...)         Wanda: 30% of each decoder linear's row zeroed
                                                     (baselines.py)
    slicegpt         Variant(L, weights=...)         SliceGPT: 25% of the hidden dimension sliced off
                                                     (not Gemma 3)

Tasks (data: ``data.py``): ``continuation`` (teacher-forced NLL / perplexity of a continuation
after a prefilled prefix, and top-1 agreement with the full model), ``generation`` (greedy chat
generations: exact match and matched prefix vs full), ``greedy`` (first generated token and matched
prefix vs full on 118 held-out code, prose and chat prompts, with bootstrap intervals; ``greedy.py``),
``humaneval`` (greedy code completion, pass@1;
runs model-written code, so only with ``allow_code_exec``; prompt formats and code extraction in
``humaneval.py``), ``chat`` (three-turn conversations: POP with the cache carried across turns, as
``session.chat`` runs it, vs a fresh POP prefill of the history, vs full; ``chat.py``). ``images`` (a
vision-language model: greedy answers about synthetic images, every variant against full; ``images.py``;
its default task). ``--sweep`` runs
the continuation task for ``pop`` and ``pop-kvfit`` (and ``pop-distill`` when named) at every cut
from L down to ceil(L/2) next to the FLOP bound of that cut (``sweep.py``, which also holds the cut
choice ``choose_cut``).

``--text`` / ``--jsonl`` (``EvalConfig.texts``): the continuation task and the sweep score windows of the
user's own text instead of the built-in documents (``data.text_documents``; results.json's
``continuation_text`` names the files); alone, they make continuation the only default task.

Given an exported engine folder (it holds ``popcompile.json``) instead of a model, eval scores the engine
itself with onnxruntime (``engine.py``): ``full`` (the decode graph on the whole prompt) and ``pop``
(the engine's prefill graph at its exported cut, with its K/V calibration if any) on the same tasks, data,
metrics and results schema (plus ``engine``, ``provider`` and ``kv_calibration``). The ablations, other
cuts and ``--sweep`` need the model and are refused for an engine folder.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from . import data as eval_data
from .chat import chat_task
from .config import DEFAULT_TASKS, VISION_TASKS, EvalConfig, check_output_folder
from .engine import is_engine_folder, run_engine_eval
from .greedy import reference_greedy_task
from .humaneval import humaneval_eval
from .images import images_task
from .report import write_results
from .scoring import (
    check_variants_apply,
    continuation_eval,
    default_baseline_fit,
    default_distill_fit,
    default_kv_fit,
    default_variant_names,
    describe,
    make_variants,
    num_layers,
    reference_generation_task,
    timed,
)
from .sweep import auto_cuts, sweep, sweep_cuts, sweep_variant_names


def run_eval(model_name: str, out: Path, config: EvalConfig | None = None, **options: Any) -> dict:
    """Run the tasks (and the sweep) of ``config`` (or ``EvalConfig(**options)``), write
    ``out/results.json`` and the plots; return the results. An engine folder as ``model_name`` runs
    ``engine.run_engine_eval`` (onnxruntime, ``config.provider`` / ``config.threads``)."""
    config = config if config is not None else EvalConfig(**options)
    check_output_folder(out, config.force)  # before any work: results.json is never replaced without force
    if is_engine_folder(model_name):
        if config.revision is not None:
            raise ConfigError(f"--revision {config.revision} picks a commit of a Hugging Face hub id; "
                              f"{model_name} is an engine folder: drop --revision")
        return run_engine_eval(model_name, out, config)
    if config.provider is not None or config.threads is not None:
        raise ConfigError("--provider and --threads are for an engine folder (onnxruntime); "
                         f"{model_name} runs through the eager reference")
    from ...frontend.models import load_model

    results = reference_eval(load_model(model_name, revision=config.revision), model_name, config)
    write_results(results, out, config.force)
    return results


def reference_eval(loaded: Any, model_name: str, c: EvalConfig) -> dict:
    """Every task of ``c`` through reference.py on a loaded model."""
    from ...config import resolve_cut
    from ...cost import speedup_bound
    from ...frontend.vision import is_vision_language

    model, tok = loaded.model, loaded.tokenizer
    layers = num_layers(model)
    vision = is_vision_language(model)
    if vision and c.tasks == DEFAULT_TASKS:
        c = dataclasses.replace(c, tasks=VISION_TASKS)
    cut = resolve_cut(layers, c.cut, c.prune_ratio)
    curves = sweep_variant_names(c.variants)
    kv_fit = default_kv_fit(loaded, sweep_cuts(layers) if c.sweep and "pop-kvfit" in curves else ())
    distill_fit = default_distill_fit(loaded, c.distill)
    names = default_variant_names(model) if c.variants is None else c.variants
    check_variants_apply(model, names)
    variants = make_variants(names, cut, layers, kv_fit=kv_fit, distill_fit=distill_fit,
                             baseline_fit=default_baseline_fit(loaded))
    results: dict[str, Any] = {
        "model": model_name, "model_type": model.config.model_type, "num_layers": layers, "cut": cut,
        "prefix_len": c.prefix_len, "cont_len": c.cont_len,
        "speedup_bound": speedup_bound(model.config.get_text_config(), c.prefix_len, cut),
        "variants": {n: describe(v) for n, v in variants.items()}, "limit": c.limit, "tasks": {},
    }
    results["continuation_text"] = [name for name, _ in c.texts] if c.texts else None  # None: built-in
    docs, skipped = (eval_data.continuation_documents(tok, c.prefix_len, c.cont_len, c.limit, c.texts)
                     if "continuation" in c.tasks or c.sweep else (None, None))
    t = results["tasks"]
    if "continuation" in c.tasks:
        t["continuation"] = timed(lambda: {
            "documents": len(docs), "names": [d.name for d in docs], "skipped_too_short": len(skipped),
            "variants": continuation_eval(model, docs, variants, c.batch_size)})
    if "generation" in c.tasks:
        t["generation"] = timed(lambda: reference_generation_task(model, tok, variants, c.limit,
                                                                  c.gen_tokens))
    if "greedy" in c.tasks:
        t["greedy"] = timed(lambda: reference_greedy_task(model, tok, variants, c.limit, c.greedy_tokens))
    if "chat" in c.tasks:
        t["chat"] = timed(lambda: chat_task(model, tok, variants, c.limit, c.gen_tokens))
    if "images" in c.tasks:
        if not vision:
            raise ConfigError(f"the images task asks a vision-language model about images; {model_name} is a "
                              f"text model ({model.config.model_type}): drop images from --tasks")
        t["images"] = timed(lambda: images_task(model, tok, variants, c.limit, c.gen_tokens,
                                                getattr(loaded.source, "path", None)))
    if "humaneval" in c.tasks:
        problems = eval_data.humaneval_problems()[:c.limit]
        t["humaneval"] = timed(lambda: {
            "problems": len(problems), "max_new_tokens": c.code_tokens, **humaneval_eval(
                model, tok, problems, variants, allow_code_exec=c.allow_code_exec,
                max_new_tokens=c.code_tokens, timeout=c.timeout, prompt_format=c.code_prompt)})
    if c.sweep:
        def run_sweep() -> dict:
            rows = sweep(model, docs, batch_size=c.batch_size, variants=curves, kv_fit=kv_fit,
                         distill_fit=distill_fit)
            thresholds = {c.min_agreement, 0.9, 0.95, 0.99}
            return {"documents": len(docs), "rows": rows, "auto_cut": auto_cuts(rows, thresholds)}
        results["sweep"] = timed(run_sweep)
    return results
