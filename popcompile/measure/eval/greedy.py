"""The ``greedy`` task: how often a variant's greedy generation is the full model's, on held-out prompts.

What a user sees is the engine's free-running greedy output. For each prompt (prompts.py: code, prose, chat
turns) the full model generates ``G`` greedy tokens ``y_1..y_G`` (ending at EOS); then each variant scores
``y`` teacher-forced after its own prefill of the prompt (logits [1, G, V])::

    first token     argmax_1 == y_1                      the first generated token
    matched prefix  leading positions with argmax_t == y_t
    agreement       the share of the G positions         (teacher-forced on the full model's own output)

The first two ARE the free-running measures, computed in one forward: while the variant's argmaxes equal
``y`` its context equals the full model's, so its free-running generation follows ``y`` exactly as long as the
matched prefix (tests/test_greedy_eval.py checks it against reference.generate).

Intervals: 95% percentile bootstrap over prompts (``RESAMPLES``, seeded), and for each variant the paired
bootstrap of its difference from ``compared_with`` (pop-kvfit, the export default, when it runs; else pop):
a difference whose interval excludes 0 is resolved by these prompts.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ... import reference
from ...errors import ConfigError
from .prompts import Prompt, greedy_prompts
from .scoring import BASELINE, _bar, continuation_logits

RESAMPLES = 2000
LEVEL = 0.95
#: the variant every other one is compared with, the first of these that runs
COMPARE_WITH = ("pop-kvfit", "pop")

#: (variant name, prompt [1, N], the full model's tokens [1, G]) -> teacher-forced logits [1, G, V]
Logits = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


def leading_matches(agree: torch.Tensor) -> int:
    """Leading True values of ``agree`` [G]."""
    return int(agree.long().cumprod(0).sum())


def interval(values: np.ndarray, seed: int = 0) -> list[float]:
    """The 95% percentile bootstrap interval [low, high] of the mean of ``values`` [n] (rows resampled)."""
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(RESAMPLES, len(values)))].mean(axis=1)
    tail = (1 - LEVEL) / 2 * 100
    return [float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))]


def _stat(values: list[float]) -> dict:
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), "ci95": interval(array)}


def greedy_scores(prompts: list[Prompt], names: list[str], generate_full: Callable[[list[int]], list[int]],
                  logits: Logits) -> dict:
    """Per variant: ``first_token``, ``matched_prefix`` (mean and ci95), ``agreement`` (mean over every
    scored position), the same by prompt kind, per-prompt lists, and ``vs_<compared_with>`` (paired mean
    difference of first_token and matched_prefix with ci95). ``generate_full(ids)`` gives the full model's
    greedy tokens; ``names`` must hold ``full`` (its scores check the method: 1.0 and the whole length)."""
    names = list(dict.fromkeys([BASELINE, *names]))
    rows: dict[str, dict[str, list]] = {n: {"first": [], "matched": [], "agree": []} for n in names}
    lengths = []
    with _bar(len(prompts) * (len(names) + 1), "greedy") as bar:
        for prompt in prompts:
            target = generate_full(list(prompt.ids))
            lengths.append(len(target))
            bar.update(1)
            ids, y = torch.tensor([prompt.ids]), torch.tensor([target])
            for name in names:
                agree = logits(name, ids, y)[0].argmax(-1) == y[0]  # [G]
                rows[name]["first"].append(float(agree[0]))
                rows[name]["matched"].append(leading_matches(agree))
                rows[name]["agree"].append(agree.tolist())
                bar.update(1)
    kinds = [p.kind for p in prompts]
    compared = next((n for n in COMPARE_WITH if n in names), None)
    return {"prompts": len(prompts), "kinds": {k: kinds.count(k) for k in dict.fromkeys(kinds)},
            "names": [p.name for p in prompts], "full_lengths": lengths, "compared_with": compared,
            "variants": {n: _summary(rows[n], rows.get(compared), kinds, compared) for n in names}}


def _summary(r: dict[str, list], base: dict[str, list] | None, kinds: list[str],
             compared: str | None) -> dict:
    scored = [a for per_prompt in r["agree"] for a in per_prompt]
    out = {"first_token": _stat(r["first"]), "matched_prefix": _stat(r["matched"]),
           "agreement": sum(scored) / len(scored),
           "by_kind": {k: {"first_token": _mean(r["first"], kinds, k),
                           "matched_prefix": _mean(r["matched"], kinds, k)} for k in dict.fromkeys(kinds)},
           "per_prompt": {"first_token": r["first"], "matched_prefix": r["matched"]}}
    if base is not None and base is not r:
        out[f"vs_{compared}"] = {label: _stat([a - b for a, b in zip(r[key], base[key])])
                                 for key, label in (("first", "first_token"), ("matched", "matched_prefix"))}
    return out


def _mean(values: list[float], kinds: list[str], kind: str) -> float:
    picked = [v for v, k in zip(values, kinds) if k == kind]
    return sum(picked) / len(picked)


def greedy_task(tok, names: list[str], generate_full: Callable[[list[int]], list[int]], logits: Logits,
                limit: int | None, greedy_tokens: int, max_seq: int | None = None) -> dict:
    """The task's results on the first ``limit`` prompts of prompts.greedy_prompts (``greedy_scores``);
    ``max_seq``: an engine's length, prompts that leave no room for ``greedy_tokens`` are left out."""
    room = None if max_seq is None else max_seq - greedy_tokens
    prompts, skipped = greedy_prompts(tok, limit, room)
    if not prompts:
        raise ConfigError(f"no prompt of the greedy task fits the engine's max length {max_seq} with "
                          f"{greedy_tokens} greedy tokens: re-export with a larger --max-seq (1024 fits all)")
    return {"max_new_tokens": greedy_tokens, "skipped": skipped, "chat_template":
            bool(getattr(tok, "chat_template", None)), **greedy_scores(prompts, names, generate_full, logits)}


def reference_greedy_task(model, tok, variants: dict[str, reference.Variant], limit: int | None,
                          greedy_tokens: int) -> dict:
    """``greedy_task`` through reference.py (``reference_functions``)."""
    generate_full, logits = reference_functions(model, variants, greedy_tokens, tok.eos_token_id)
    return greedy_task(tok, list(variants), generate_full, logits, limit, greedy_tokens)


def reference_functions(model, variants: dict[str, reference.Variant], greedy_tokens: int,
                        eos_token_id: int | None) -> tuple[Callable[[list[int]], list[int]], Logits]:
    """(the full model's greedy tokens by reference.generate, each variant's scoring.continuation_logits)."""
    full = variants[BASELINE]
    generate_full = lambda ids: reference.generate(model, torch.tensor([ids]), greedy_tokens, full,
                                                   eos_token_id)
    logits = lambda name, prompt, target: continuation_logits(model, prompt, target, variants[name])
    return generate_full, logits
