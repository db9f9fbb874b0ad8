"""The held-out prompts of the ``greedy`` task: what a user types, none of it in any calibration text.

Three kinds, 40 prompts each, interleaved (code, prose, chat, code, ...) so that ``limit`` keeps the mix:

    code    20 HumanEval prompts (signature + docstring, raw: the model writes the body; problems 0, 8, 16,
            ...) and 20 slices of the evaluation's stdlib modules (corpus.STDLIB_MODULES, each cut at a line
            end from the middle of the file)
    prose   the opening of 40 Python documentation topics (corpus.documentation_topics("evaluation"))
    chat    under the chat template (raw text without one): 20 "implement this function" requests on other
            HumanEval problems (4, 12, 20, ...), 20 "summarize this passage" requests on those topics

POP++ calibrates on the other stdlib modules (corpus.CALIBRATION_MODULES) and the other half of the
documentation topics; HumanEval is never calibrated on. Prompts shorter than ``MIN_TOKENS`` are left out:
engines prefill those with the full model (``min_prompt_tokens``, 64 for both shipped models).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...kvfit.corpus import documentation_topics, encode, stdlib_texts
from .data import chat_prompt_ids, humaneval_problems

KINDS = ("code", "prose", "chat")
PER_KIND = 40
MIN_TOKENS = 64
#: characters kept of a stdlib slice / a documentation topic (about 300-500 tokens)
CODE_CHARS, PROSE_CHARS = 1500, 1200
IMPLEMENT = "Implement this Python function. Reply with the code only.\n\n```python\n{}```"
SUMMARIZE = "Summarize this passage from the Python documentation in two sentences.\n\n{}"


@dataclass(frozen=True)
class Prompt:
    name: str
    kind: str              # one of KINDS
    ids: tuple[int, ...]   # what the model is prefilled with (chat: under the template)


def _cut(text: str, chars: int) -> str:
    """``text`` up to ``chars`` characters, ended at the last line end inside them."""
    if len(text) <= chars:
        return text
    head = text[:chars]
    return head[:head.rfind("\n") + 1] or head


def _middle_slice(source: str, chars: int) -> str:
    """``chars`` characters of ``source`` from the first line start at or after its middle."""
    start = source.find("\n", len(source) // 2) + 1
    return _cut(source[start:], chars)


def _texts() -> dict[str, list[tuple[str, str, bool]]]:
    """kind -> [(name, text, under the chat template)], PER_KIND each."""
    problems = humaneval_problems()
    topics = documentation_topics("evaluation")[:PER_KIND]
    code = [(p["task_id"], p["prompt"], False) for p in problems[0::8][:PER_KIND // 2]]
    code += [(name, _middle_slice(text, CODE_CHARS), False) for name, text in stdlib_texts()[:PER_KIND // 2]]
    prose = [(name, _cut(text, PROSE_CHARS), False) for name, text in topics]
    chat = [(f"implement:{p['task_id']}", IMPLEMENT.format(p["prompt"]), True)
            for p in problems[4::8][:PER_KIND // 2]]
    chat += [(f"summarize:{name}", SUMMARIZE.format(_cut(text, PROSE_CHARS).strip()), True)
             for name, text in topics[0::2][:PER_KIND // 2]]
    return {"code": code, "prose": prose, "chat": chat}


def greedy_prompts(tokenizer: Any, limit: int | None = None,
                   max_tokens: int | None = None) -> tuple[list[Prompt], list[str]]:
    """(the prompts, names left out: shorter than MIN_TOKENS or longer than ``max_tokens``), kinds
    interleaved, the first ``limit``."""
    queues: dict[str, list[Prompt]] = {}
    skipped: list[str] = []
    for kind, texts in _texts().items():
        queues[kind] = []
        for name, text, chat in texts:
            ids = chat_prompt_ids(tokenizer, text) if chat else encode(tokenizer, text)
            if len(ids) < MIN_TOKENS or (max_tokens is not None and len(ids) > max_tokens):
                skipped.append(name)
            else:
                queues[kind].append(Prompt(name, kind, tuple(ids)))
    prompts = [queue[i] for i in range(max(map(len, queues.values()))) for queue in queues.values()
               if i < len(queue)]
    return prompts[:limit], skipped
