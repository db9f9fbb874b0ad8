"""The ``chat`` task: do POP's approximated deep K/V compound when a chat carries its cache across turns?

Each conversation is three user messages. Turns 1 and 2 are answered by the full model (greedy), so every
variant sees the same history; then the third turn's greedy reply under:

    full           the full model on the whole history (the baseline)
    NAME           the variant's prefill of the whole history from an empty cache   reference.generate
    NAME-carried   the variant turn by turn with the cache carried, as session.chat  reference.PopRun.extend
                   runs it: each turn prefills only its new tokens (pruned), the
                   replies' rows are written by decode steps (the full model)

for each NAME of ``CHAT_VARIANTS`` (pop, pop-kvfit, pop-distill) the eval was given.

Scored as the generation task (scoring.compare_generations): exact match and matched prefix vs full.
Needs a chat template; runs through reference.py only (an engine folder's chat is tested against it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from ... import reference
from ...errors import ConfigError
from ...runtime.chat import common_prefix
from .config import CHAT_NEEDS, CHAT_VARIANTS
from .scoring import compare_generations, num_layers

CONVERSATIONS: tuple[tuple[str, str, str], ...] = (
    ("What is the capital of France?", "Roughly how many people live there?", "Name a famous museum there."),
    ("Write a Python function that returns the factorial of n.", "Now make it iterative.",
     "Add a docstring."),
    ("Explain what a hash table is in two sentences.", "What is a collision?", "How can one be resolved?"),
    ("Give me three tips for better sleep.", "Which one matters most?", "Why that one?"),
    ("What is photosynthesis?", "Where in the plant does it happen?", "What does it produce?"),
    ("Translate 'good morning' into Spanish.", "And into French?", "And into German?"),
    ("Suggest a name for a pet turtle.", "Give me two more.", "Which one would you pick?"),
    ("What is 12 times 13?", "Divide that by 4.", "Is the result a whole number?"),
)


@dataclass(frozen=True)
class Conversation:
    # each earlier turn: (its prompt ids, the full model's reply ids)
    turns: list[tuple[list[int], list[int]]]
    final: list[int]                          # the last turn's prompt ids (the whole history)


def chat_task(model, tok, variants: Mapping[str, reference.Variant], limit: int | None,
              gen_tokens: int) -> dict:
    """The task's results (module docstring) for the first ``limit`` conversations, for each of ``variants``
    named in ``CHAT_VARIANTS`` (the others are skipped: the ablations already collapse on one turn)."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError("the chat task needs a chat template, and this model's tokenizer has none: "
                          "leave chat out of --tasks")
    chosen = {name: v for name, v in variants.items() if name in CHAT_VARIANTS}
    if not chosen:
        raise ConfigError(CHAT_NEEDS)
    full, eos = reference.Variant(cut=num_layers(model)), tok.eos_token_id
    conversations = [_history(model, tok, turns, full, gen_tokens) for turns in CONVERSATIONS[:limit]]
    by_final = {tuple(c.final): c for c in conversations}
    runs = {"full": lambda c: reference.generate(model, torch.tensor([c.final]), gen_tokens, full, eos)}
    for name, variant in chosen.items():
        runs[name] = lambda c, v=variant: reference.generate(model, torch.tensor([c.final]), gen_tokens, v,
                                                             eos)
        runs[f"{name}-carried"] = lambda c, v=variant: carried(model, c, v, gen_tokens, eos)
    scores = compare_generations([c.final for c in conversations], list(runs),
                                 lambda name, ids: runs[name](by_final[tuple(ids)]),
                                 lambda ids: tok.decode(ids, skip_special_tokens=True))
    return {"conversations": len(conversations), "turns": 3, "max_new_tokens": gen_tokens,
            "final_prompt_tokens": [len(c.final) for c in conversations], "variants": scores}


def _history(model, tok, turns: tuple[str, ...], full, gen_tokens: int) -> Conversation:
    messages, earlier = [], []
    for text in turns[:-1]:
        messages.append({"role": "user", "content": text})
        ids = _template(tok, messages)
        reply = reference.generate(model, torch.tensor([ids]), gen_tokens, full, tok.eos_token_id)
        earlier.append((ids, reply))
        messages.append({"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)})
    messages.append({"role": "user", "content": turns[-1]})
    return Conversation(earlier, _template(tok, messages))


def _template(tok, messages: list[dict]) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=False))


def carried(model, conversation: Conversation, variant, gen_tokens: int, eos: int | None) -> list[int]:
    """The last turn's greedy reply with the cache carried across turns (session.chat's schedule)."""
    run, logits = carried_prefill(model, conversation, variant)
    return reference.greedy(run, logits, len(conversation.final), gen_tokens, eos)


@torch.no_grad()
def carried_prefill(model, conversation: Conversation, variant) -> tuple[reference.PopRun, torch.Tensor]:
    """The run after the last turn's prompt, the cache carried from the earlier turns, and its logits
    [1, V]."""
    run, cached = reference.PopRun(model, variant, 0), []
    for ids, reply in conversation.turns:
        kept = common_prefix(cached, ids)
        run.extend(torch.tensor([ids[kept:]]), kept)
        if len(reply) > 1:  # the reply's tokens ran as decode steps; its last one never ran
            run.step(torch.tensor([reply[:-1]]), len(ids))
        cached = ids + reply[:-1]
    kept = common_prefix(cached, conversation.final)
    return run, run.extend(torch.tensor([conversation.final[kept:]]), kept)
