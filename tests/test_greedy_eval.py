"""The greedy task: first-token and matched-prefix agreement from one teacher-forced pass equal what
free-running greedy generation gives; the held-out prompt set; the bootstrap intervals (the engine path:
test_eval_engine.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny import CharTokenizer, tiny_model

from popcompile import reference
from popcompile.frontend.models import LoadedModel, ModelSource
from popcompile.kvfit import corpus
from popcompile.measure.eval import greedy, prompts, report, scoring
from popcompile.measure.eval.config import EvalConfig
from popcompile.measure.eval.run import reference_eval

LAYERS, CUT, TOKENS = 4, 2, 10


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=LAYERS)


def _random_prompts(count: int, seed: int = 0) -> list[prompts.Prompt]:
    rng = np.random.default_rng(seed)
    return [prompts.Prompt(f"p{i}", prompts.KINDS[i % 3], tuple(int(t) for t in rng.integers(3, 97, n)))
            for i, n in enumerate(rng.integers(8, 30, count))]


def test_scores_equal_free_running_generation(model):
    variants = scoring.make_variants(["pop", "pop-no-boundary", "pop-no-kv"], CUT, LAYERS)
    found = _random_prompts(12)
    functions = greedy.reference_functions(model, variants, TOKENS, None)
    scores = greedy.greedy_scores(found, list(variants), *functions)
    full = [reference.generate(model, torch.tensor([p.ids]), TOKENS, variants["full"]) for p in found]
    assert scores["full_lengths"] == [len(f) for f in full]
    assert scores["variants"]["full"]["matched_prefix"]["mean"] == TOKENS
    assert scores["variants"]["full"]["first_token"]["mean"] == 1.0
    spread = set()
    for name in ("pop", "pop-no-boundary", "pop-no-kv"):
        own = [reference.generate(model, torch.tensor([p.ids]), TOKENS, variants[name]) for p in found]
        matched = [scoring.matched_prefix(o, f) for o, f in zip(own, full)]
        row = scores["variants"][name]["per_prompt"]
        assert row["matched_prefix"] == matched  # one teacher-forced pass = free-running generation
        assert row["first_token"] == [float(o[0] == f[0]) for o, f in zip(own, full)]
        spread.update(matched)
    assert len(spread) >= 3  # the variants differ from full at different depths: the check can fail
    vs = scores["variants"]["pop-no-kv"]["vs_pop"]["matched_prefix"]
    pop, no_kv = (scores["variants"][n]["per_prompt"]["matched_prefix"] for n in ("pop", "pop-no-kv"))
    assert vs["mean"] == pytest.approx(np.mean(np.subtract(no_kv, pop)))
    assert "vs_pop" not in scores["variants"]["pop"] and scores["compared_with"] == "pop"


def test_interval_brackets_the_mean_and_narrows_with_more_prompts():
    assert greedy.interval(np.full(20, 3.0)) == [3.0, 3.0]
    rng = np.random.default_rng(0)
    few, many = rng.integers(0, 2, 30).astype(float), rng.integers(0, 2, 600).astype(float)
    low, high = greedy.interval(few)
    assert low < few.mean() < high and 0.2 < high - low < 0.5  # ~2 * 1.96 * sqrt(.25 / 30) = 0.36
    low_many, high_many = greedy.interval(many)
    assert high_many - low_many < (high - low) / 3
    assert greedy.interval(few) == greedy.interval(few)  # seeded


def test_prompt_set_is_large_mixed_and_held_out_from_calibration():
    found, skipped = prompts.greedy_prompts(CharTokenizer())
    assert len(found) >= 100 and not skipped
    kinds = [p.kind for p in found]
    assert {k: kinds.count(k) for k in prompts.KINDS} == {k: prompts.PER_KIND for k in prompts.KINDS}
    assert kinds[:6] == ["code", "prose", "chat"] * 2  # interleaved: --limit keeps the mix
    names = [p.name for p in found]
    assert len(set(names)) == len(names)
    stdlib = {n.split("/")[1][:-3] for n in names if n.startswith("stdlib/")}
    assert stdlib and stdlib <= set(corpus.STDLIB_MODULES) and not stdlib & set(corpus.CALIBRATION_MODULES)
    held_out = {name for name, _ in corpus.documentation_topics("calibration")}
    topics = {n.split(":")[-1] for n in names if "pydoc/" in n}
    assert len(topics) >= 30 and not topics & held_out
    assert {name for name, _ in corpus.documentation_topics("evaluation")}.isdisjoint(held_out)
    code = {n for n in names if n.startswith("HumanEval/")}
    implement = {n.split(":")[1] for n in names if n.startswith("implement:")}
    assert len(code) >= 19 and len(implement) == 20 and not code & implement
    assert prompts.greedy_prompts(CharTokenizer(), limit=5)[0] == found[:5]


def test_chat_prompts_go_under_the_template():
    class Templated(CharTokenizer):
        chat_template = "yes"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, return_dict):
            return [1, *self(messages[0]["content"])["input_ids"], 2]

    found = {p.name: p for p in prompts.greedy_prompts(Templated())[0]}
    plain = {p.name: p for p in prompts.greedy_prompts(CharTokenizer())[0]}
    chat = [n for n, p in found.items() if p.kind == "chat"]
    assert all(found[n].ids == (1, *plain[n].ids, 2) for n in chat)
    assert all(found[n].ids == plain[n].ids for n in found if found[n].kind != "chat")


def test_eval_runs_the_task_and_reports_it(model, tmp_path):
    loaded = LoadedModel(model, CharTokenizer(), ModelSource("tiny", "folder", "tiny", None))
    config = EvalConfig(tasks=("greedy",), variants=("pop", "pop-no-kv"), limit=4, greedy_tokens=4)
    results = reference_eval(loaded, "tiny", config)
    g = results["tasks"]["greedy"]
    assert g["prompts"] == 4 and g["kinds"] == {"code": 2, "prose": 1, "chat": 1}
    assert g["variants"]["full"]["agreement"] == 1.0 and g["compared_with"] == "pop"
    text = report.report(results)
    assert "greedy: 4 prompts (2 code, 1 prose, 1 chat)" in text and "prefix vs pop" in text
    json.dumps(results)
