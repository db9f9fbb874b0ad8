"""HumanEval for ``popcompile eval``: prompt formats, code extraction, greedy completion, pass@1.

Two prompt formats, because a base model and an instruct model are asked differently:

- ``raw``: the problem's prompt (signature + docstring) as plain text; the model continues the
  function body, which ends where a line starts at column 0 (HumanEval's original protocol).
  For base models and models without a chat template (the Gemma 3 GGUF).
- ``chat``: the tokenizer's chat template around an instruction to complete the function and reply
  with one ```python block (an instruct model asked for raw continuation writes fences and prose).
  Generation stops at the end of turn or when the code block closes; ``extract_code`` turns the
  reply into what the harness appends to the prompt: the whole function (its imports and top-level
  defs; example calls and prints are dropped) or, when the reply is only a body, that body.

``auto`` picks ``chat`` when the tokenizer has a chat template, else ``raw``. Execution (in a
subprocess with a timeout, only with ``allow_code_exec``) is ``data.checker``'s.
"""
from __future__ import annotations

import ast
import re
from typing import Any, Callable

import torch

from ... import reference
from ...kvfit.corpus import encode
from ...progress import progress_bar
from ...reference import Variant
from . import data as eval_data
from .config import CODE_EXEC_REFUSAL, PROMPT_FORMATS  # noqa: F401 (re-exported)

CHAT_INSTRUCTION = ("Complete the following Python function. Reply with the complete function, "
                    "including its signature, in a single ```python code block.\n\n```python\n{prompt}```")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)
_KEPT_NODES = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def resolve_format(tokenizer: Any, prompt_format: str) -> str:
    """``chat`` or ``raw`` (``auto``: chat when the tokenizer has a chat template)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"unknown HumanEval prompt format {prompt_format!r}: "
                         f"use {', '.join(PROMPT_FORMATS)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "chat" and not has_template:
        raise ValueError("prompt format 'chat' needs a tokenizer with a chat template: "
                         "use 'raw' for this model")
    if prompt_format == "auto":
        return "chat" if has_template else "raw"
    return prompt_format


def prompt_ids(tokenizer: Any, problem: dict, prompt_format: str) -> list[int]:
    """Token ids of the problem under ``raw`` or ``chat`` (the instruction in the user's turn)."""
    if prompt_format == "raw":
        return encode(tokenizer, problem["prompt"])
    return eval_data.chat_prompt_ids(tokenizer, CHAT_INSTRUCTION.format(prompt=problem["prompt"]))


def chat_reply_finished(text: str) -> bool:
    """True once the reply's first code block is closed (an opening fence, then a closing one)."""
    start = text.find("```")
    return start >= 0 and text.find("```", start + 3) >= 0


def code_block(text: str, entry_point: str) -> str:
    """The first fenced block that defines ``entry_point``, else the first block, else the whole text
    (an unclosed block runs to the end of the text: a reply cut by the token limit)."""
    blocks = [m.group(2) for m in _FENCE.finditer(text)]
    for block in blocks:
        if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", block, re.M):
            return block
    return blocks[0] if blocks else text


def _parsable_prefix(code: str) -> ast.Module | None:
    """The AST of the longest prefix of whole lines that parses (a reply may be cut mid-statement)."""
    lines = code.splitlines()
    for end in range(len(lines), 0, -1):
        try:
            return ast.parse("\n".join(lines[:end]))
        except SyntaxError:
            continue
    return None


def definitions(code: str) -> str | None:
    """The imports, functions and classes of ``code`` (top level, source order), or None if nothing parses."""
    tree = _parsable_prefix(code)
    if tree is None:
        return None
    kept = [ast.get_source_segment("\n".join(code.splitlines()), node) for node in tree.body
            if isinstance(node, _KEPT_NODES)]
    if not kept:
        return None
    # decorators are not part of a def's source segment; HumanEval solutions need none
    return "\n\n".join(seg for seg in kept if seg)


def as_body(code: str) -> str:
    """A function body: indented lines up to the first line at column 0; unindented code gets 4 spaces."""
    lines = [line for line in code.splitlines()]
    while lines and not lines[0].strip():
        lines.pop(0)
    if lines and not lines[0][:1].isspace():
        lines = ["    " + line if line.strip() else line for line in lines]
    return eval_data.truncate_completion("\n".join(lines) + "\n")


def extract_code(reply: str, problem: dict) -> str:
    """What the harness appends to the prompt for a chat reply: ``\\n`` + the reply's definitions when it
    redefines ``entry_point`` (the later def wins; the prompt's imports stay above it), else its body."""
    code = code_block(reply, problem["entry_point"])
    if re.search(rf"^def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.M):
        found = definitions(code)
        if found is not None:
            return "\n" + found + "\n"
    return as_body(code)


def completion_text(tokenizer: Any, prompt: list[int], new_ids: list[int]) -> str:
    """The text the new tokens add to the prompt (decoded together, so no leading space is lost)."""
    head = tokenizer.decode(prompt, skip_special_tokens=True)
    full = tokenizer.decode(prompt + new_ids, skip_special_tokens=True)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new_ids, skip_special_tokens=True)


@torch.no_grad()
def generate_until(model, prompt: torch.Tensor, variant: Variant, max_new_tokens: int,
                   eos_token_id: int | None = None,
                   stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """``reference.generate`` with an early stop: ends after the token for which ``stop(tokens)`` holds.
    With ``stop=None`` it returns exactly what ``reference.generate`` returns."""
    with reference.attention_for(model, variant):
        run = reference.PopRun(model, variant, prompt.shape[1])
        logits, tokens, pos = run.prefill(prompt), [], prompt.shape[1]
        for _ in range(max_new_tokens):
            token = int(logits[0].argmax())
            tokens.append(token)
            if token == eos_token_id or (stop is not None and stop(tokens)):
                break
            logits = run.step(torch.tensor([[token]]), pos)[:, -1]
            pos += 1
    return tokens


#: (variant name, prompt ids, stop(new ids) -> bool) -> new ids, greedy, ending after the first token
#: for which ``stop`` holds (or at eos, or at the token limit)
GenerateUntil = Callable[[str, list[int], Callable[[list[int]], bool]], list[int]]


def complete(model, tokenizer: Any, problem: dict, variant: Variant, prompt_format: str,
             max_new_tokens: int) -> tuple[str, str]:
    """Greedy (text generated, completion for the harness) of one problem under one variant."""
    generate = lambda name, ids, stop: generate_until(model, torch.tensor([ids]), variant, max_new_tokens,
                                                      getattr(tokenizer, "eos_token_id", None), stop)
    return complete_with(generate, "", tokenizer, problem, prompt_format)


def complete_with(generate: GenerateUntil, name: str, tokenizer: Any, problem: dict,
                  prompt_format: str) -> tuple[str, str]:
    """(text generated, completion for the harness) of one problem, generated by ``generate`` for ``name``."""
    ids = prompt_ids(tokenizer, problem, prompt_format)
    finished = chat_reply_finished if prompt_format == "chat" else eval_data.completion_finished
    stop = lambda new: finished(completion_text(tokenizer, ids, new))
    text = completion_text(tokenizer, ids, generate(name, ids, stop))
    if prompt_format == "chat":
        return text, extract_code(text, problem)
    return text, eval_data.truncate_completion(text)


def _bar(total: int, desc: str):
    """A bar on a terminal, a line per 10% in a log (progress.py)."""
    return progress_bar(total, desc, leave=False)


def humaneval_eval(model, tokenizer, problems: list[dict], variants: dict[str, Variant], *,
                   allow_code_exec: bool, max_new_tokens: int = 256, timeout: float = 10.0,
                   runner: str = "auto", prompt_format: str = "auto", baseline: str = "full") -> dict:
    """pass@1 (greedy) per variant and the fraction of completions identical to the baseline's."""
    eos = getattr(tokenizer, "eos_token_id", None)
    generate = lambda name, ids, stop: generate_until(model, torch.tensor([ids]), variants[name],
                                                      max_new_tokens, eos, stop)
    return humaneval_scores(generate, tokenizer, problems, list(variants), allow_code_exec=allow_code_exec,
                            timeout=timeout, runner=runner, prompt_format=prompt_format, baseline=baseline)


def humaneval_scores(generate: GenerateUntil, tokenizer, problems: list[dict], names: list[str], *,
                     allow_code_exec: bool, timeout: float = 10.0, runner: str = "auto",
                     prompt_format: str = "auto", baseline: str = "full") -> dict:
    """``humaneval_eval`` with the completions from ``generate`` (the eager reference's or an engine's)."""
    if not allow_code_exec:
        raise ValueError(CODE_EXEC_REFUSAL)
    runner_name, check = eval_data.checker(runner)
    prompt_format = resolve_format(tokenizer, prompt_format)
    out: dict[str, list[dict]] = {name: [] for name in names}
    with _bar(len(problems) * len(names), "humaneval") as bar:
        for problem in problems:
            for name in names:
                text, completion = complete_with(generate, name, tokenizer, problem, prompt_format)
                out[name].append({"task_id": problem["task_id"], "completion": completion, "generated": text,
                                  **check(problem, completion, timeout)})
                bar.update(1)
    results = {"runner": runner_name, "prompt_format": prompt_format, "variants": {}}
    for name, rows in out.items():
        results["variants"][name] = {
            "pass@1": sum(r["passed"] for r in rows) / len(rows),
            "identical_to_full": sum(r["completion"] == f["completion"] for r, f in zip(rows, out[baseline]))
            / len(rows),
            "problems": rows,
        }
    return results
