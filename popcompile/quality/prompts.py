"""The quality floor's prompts: held out of every calibration text and of the evaluation's prompts.

Four kinds, ``PER_KIND`` each, interleaved (code, prose, chat code, chat prose, code, ...) so that a
``limit`` keeps the mix; all from the running interpreter's standard library, no download, no extra. Every
prompt has exactly ``length`` tokens (the text cut to fit, the chat template's turn around it), so that the
full model's passes run the prompts in batches (floor.py):

    code         a slice of a ``FLOOR_MODULES`` source from the middle of the file, raw (a continuation)
    prose        the module's docstring (prose with a little code), raw; Python's LICENSE.txt where the
                 interpreter ships it (licence text), in slices
    chat code    under the chat template: an instruction, then a slice from a quarter into the file
    chat prose   under the chat template: an instruction, then the docstring

``FLOOR_MODULES`` is disjoint from ``corpus.STDLIB_MODULES`` (the evaluation) and
``corpus.CALIBRATION_MODULES`` (POP+ and POP++), and present in CPython 3.10-3.13; the instructions are
neither the evaluation's nor the calibration's wording.
"""
from __future__ import annotations

import ast
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EnvironmentUnavailable, InputError
from ..kvfit.corpus import encode
from ..kvfit.distill_windows import template_parts

FLOOR_MODULES: tuple[str, ...] = (
    "cmd", "codeop", "doctest", "ftplib", "io", "mimetypes", "os", "pdb", "plistlib", "pyclbr", "pydoc",
    "rlcompleter", "sched", "shelve", "site", "smtplib", "socket", "socketserver", "ssl", "subprocess",
    "timeit", "tokenize", "turtle", "wave",
)
KINDS = ("code", "prose", "chat code", "chat prose")
PER_KIND = 16
#: tokens of every prompt; characters of a slice / a docstring read to make them (enough for most tokenizers)
LENGTH = 256
CHARS = 2400
MIN_DOCSTRING = 400
INSTRUCTIONS = {"chat code": "Review the following code and describe what it is for.\n\n{}",
                "chat prose": "Read this text and explain its main point to a new programmer.\n\n{}"}


@dataclass(frozen=True)
class FloorPrompt:
    name: str
    kind: str              # one of KINDS
    ids: tuple[int, ...]   # what the model is prefilled with (chat: under the template), ``length`` tokens


def _at_line(source: str, where: float, chars: int = CHARS) -> str:
    """``chars`` characters of ``source`` from the first line start at or after ``where`` of its length,
    ended at a line end."""
    start = source.find("\n", int(len(source) * where)) + 1
    head = source[start:start + chars]
    return head[:head.rfind("\n") + 1] or head


def _sources() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = [(m, (root / f"{m}.py").read_text(encoding="utf-8")) for m in FLOOR_MODULES
             if (root / f"{m}.py").is_file()]
    if not found:
        raise EnvironmentUnavailable(f"no standard-library sources found under {root}")
    return found


def _licence() -> list[tuple[str, str]]:
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    return [(f"LICENSE.txt@{i}/12", _at_line(text, i / 12)) for i in range(12)]


def texts() -> dict[str, list[tuple[str, str]]]:
    """kind -> [(name, text)]: every candidate (``floor_prompts`` keeps the first ``PER_KIND`` that are long
    enough)."""
    sources = _sources()
    docs = [(m, doc[:CHARS]) for m, source in sources
            if len(doc := ast.get_docstring(ast.parse(source)) or "") >= MIN_DOCSTRING]
    prose = [(f"{m}:doc", doc) for m, doc in docs] + _licence()
    return {"code": [(f"{m}.py@1/2", _at_line(s, 0.5)) for m, s in sources],
            "prose": prose,
            "chat code": [(f"review:{m}.py@1/4", INSTRUCTIONS["chat code"].format(_at_line(s, 0.25)))
                          for m, s in sources],
            "chat prose": [(f"explain:{name}", INSTRUCTIONS["chat prose"].format(text))
                           for name, text in reversed(prose)]}


def floor_prompts(tokenizer: Any, limit: int | None = None, length: int = LENGTH) -> list[FloorPrompt]:
    """The prompts as ``length`` token ids each, kinds interleaved, the first ``limit``: raw kinds are the
    tokenizer's special prefix and the text; chat kinds the template's turn (raw without a template) around
    the instruction and the text, cut to fit. A text too short for ``length`` is left out."""
    special = encode(tokenizer, "", add_special_tokens=True)
    head, tail = template_parts(tokenizer) or (special, [])
    queues: dict[str, list[FloorPrompt]] = {}
    for kind, group in texts().items():
        before, after = (head, tail) if kind.startswith("chat") else (special, [])
        room = length - len(before) - len(after)
        queues[kind] = [FloorPrompt(name, kind, tuple(before + body[:room] + after)) for name, text in group
                        if len(body := encode(tokenizer, text, add_special_tokens=False)) >= room > 0
                        ][:PER_KIND]
    prompts = [queue[i] for i in range(max(map(len, queues.values()))) for queue in queues.values()
               if i < len(queue)]
    if not prompts:
        raise InputError(f"no built-in floor prompt has {length} tokens for this tokenizer: choose the cut "
                         "with --cut N or --prune-ratio R")
    return prompts[:limit]
