"""POP++ trained for what users see (distill.py, targets="greedy"): the scored tokens are the full model's own
greedy output, the held-out scores are free-running greedy agreement, the KL runs on a kept vocabulary, the
boundary token is weighted; the calibration prompts (distill_windows.py)."""
from __future__ import annotations

import pytest
import torch
from test_distill import CUT, LAYERS, plain_pop, sharp_model, windows
from tiny import CharTokenizer

from popcompile import reference
from popcompile.config import DistillConfig
from popcompile.frontend.arch import DECODER_TYPES
from popcompile.kvfit import corpus, distill, distill_windows, student
from popcompile.kvfit.calibrate import ridge_fit
from popcompile.measure.eval.scoring import matched_prefix
from popcompile.reference import Variant

CONT = 6


def _data(model, ids, **options):
    config = DistillConfig(continuation=CONT, **options)
    return student.precompute(model, ids, CUT, config, lambda done: None)


@pytest.mark.parametrize("arch", sorted(DECODER_TYPES))
def test_greedy_targets_and_scores_are_free_running_generation(arch):
    model, ids = sharp_model(arch), windows(6, 20)
    fit = plain_pop(model, ridge_fit(model, [ids], CUT))  # the paper's POP: far from full on some windows
    data = _data(model, ids, vocab_top_k=0)
    full = [reference.generate(model, w[None], CONT, Variant(LAYERS)) for w in ids]
    assert data.targets.tolist() == full  # the scored rows are x_N, then the full model's greedy tokens
    pop = [reference.generate(model, w[None], CONT, Variant(CUT, kv_weights=fit.weights)) for w in ids]
    matched = [matched_prefix(p, f) for p, f in zip(pop, full)]
    score = distill._score(model, data, torch.arange(len(ids)), fit.weights)
    assert score.matched_prefix == pytest.approx(sum(matched) / len(ids))
    assert score.first_token == pytest.approx(sum(p[0] == f[0] for p, f in zip(pop, full)) / len(ids))
    # the score tells windows apart (tiny qwen2's and qwen3_moe's POP happen to equal full on all six)
    assert len(set(matched)) > 1 or arch in ("qwen2", "qwen3_moe")


def test_kept_vocabulary_is_the_union_of_top_k_and_its_kl():
    model, ids = sharp_model("llama"), windows(4, 20)
    fit = plain_pop(model, ridge_fit(model, [ids], CUT))  # KL ~1e-1: the comparison has digits to compare
    whole, kept = _data(model, ids, vocab_top_k=0), _data(model, ids, vocab_top_k=3)
    assert whole.vocab is None and whole.teacher.shape == (4, CONT, 97)
    top = whole.teacher.topk(3, dim=-1).indices.unique()
    assert torch.equal(kept.vocab, top) and len(top) < 97
    torch.testing.assert_close(kept.teacher, whole.teacher[..., top])
    rows = torch.arange(4)
    pop = student.student_logits(model, whole, rows, fit.weights)[..., top]
    t, s = (torch.log_softmax(x, -1) for x in (whole.teacher[..., top], pop))
    kl = float((t.exp() * (t - s)).sum(-1).mean())
    assert distill._score(model, kept, rows, fit.weights).kl == pytest.approx(kl, rel=1e-4)
    assert torch.equal(kept.targets, whole.targets)


def test_boundary_weight_weights_the_first_scored_row():
    model, ids = sharp_model("llama"), windows(2, 20)
    fit = ridge_fit(model, [ids], CUT)
    data, rows = _data(model, ids), torch.arange(2)
    kl = distill._row_kl(model, data, rows, fit.weights)[0].detach()  # [2, CONT]
    for weight in (1.0, 5.0):
        loss = distill._loss(model, data, rows, fit.weights, DistillConfig(continuation=CONT,
                                                                           boundary_weight=weight))
        expected = ((weight * kl[:, 0] + kl[:, 1:].sum(1)) / (weight + CONT - 1)).mean()
        assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def test_greedy_selection_prefers_the_longer_matched_prefix_then_the_lower_kl():
    a, b = distill.Score(0.1, 0.9, 5.0), distill.Score(0.05, 0.9, 4.0)
    assert a.better_than(b, "greedy") and not b.better_than(a, "greedy")
    assert b.better_than(a, "kl")
    assert distill.Score(0.04, 0.9, 5.0).better_than(a, "greedy")


def test_distilling_on_greedy_targets_keeps_the_best_held_out_score():
    model, ids = sharp_model("llama"), windows(16, 24)
    init = plain_pop(model, ridge_fit(model, [ids], CUT))  # the paper's POP: room to improve
    config = DistillConfig(steps=40, lr=1e-3, continuation=CONT, eval_every=5, held_out=0.25)
    result = distill.distill_kv(model, ids, init, config)
    assert result.best_step > 0 and result.best.matched_prefix >= result.initial.matched_prefix
    held = ids[list(result.held_out)]
    again = distill._score(model, _data(model, held), torch.arange(len(held)), result.fit.weights)
    assert again == result.best


class Templated(CharTokenizer):
    chat_template = "yes"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "<u>" + messages[0]["content"] + "</u><a>"


def test_calibration_prompts_cycle_kinds_under_the_template():
    tok = Templated()
    found = distill_windows.prompt_windows(tok, 200, 8)
    assert found.shape == (8, 200)
    head, tail = tok("<u>")["input_ids"], tok("</u><a>")["input_ids"]
    for i, window in enumerate(found.tolist()):
        kind = distill_windows.KINDS[i % 4]
        if kind.startswith("chat"):
            instruction = tok(distill_windows.INSTRUCTIONS[kind])["input_ids"]
            assert window[:len(head) + len(instruction)] == head + instruction and window[-len(tail):] == tail
        else:
            assert window[:3] != head
    plain = CharTokenizer()
    raw = distill_windows.prompt_windows(plain, 200, 12)
    instruction = plain(distill_windows.INSTRUCTIONS["chat code"])["input_ids"]
    assert raw[2].tolist()[:len(instruction)] == instruction  # no template: the instruction, raw
    stream = [t for doc in corpus.calibration_docs(plain) for t in doc][:1000]  # read on, never repeated
    body = raw[2].tolist()[len(instruction):]
    assert raw[0].tolist() == stream[:200] and body == stream[200:200 + len(body)]
    assert raw[4].tolist() == stream[200 + len(body):400 + len(body)]


def test_a_template_that_refuses_a_lone_user_turn_gives_raw_prompts():
    class Refusing(Templated):
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            raise ValueError("conversation roles must alternate system/user/assistant")

    class Rewriting(Templated):
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "<u>" + messages[0]["content"].lower() + "</u>"

    raw = distill_windows.prompt_windows(CharTokenizer(), 100, 4)
    for tok in (Refusing(), Rewriting()):
        assert distill_windows.template_parts(tok) is None
        assert torch.equal(distill_windows.prompt_windows(tok, 100, 4), raw)
