"""The quality floor's prompts: held out of every calibration text and of the evaluation's prompts.

Four kinds, ``PER_KIND`` each, interleaved (code, prose, chat code, chat prose, code, ...) so that a
``limit`` keeps the mix; all from the running interpreter's standard library, no download, no extra:

    code         a slice of a ``FLOOR_MODULES`` source from the middle of the file, raw (a continuation)
    prose        the module's docstring (prose with a little code), raw; Python's LICENSE.txt where the
                 interpreter ships it (licence text), in slices
    chat code    under the chat template: an instruction, then a slice from three quarters into the file
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

from ..errors import EnvironmentUnavailable
from ..kvfit.corpus import encode
from .eval.data import chat_prompt_ids

FLOOR_MODULES: tuple[str, ...] = (
    "cmd", "codeop", "doctest", "ftplib", "mimetypes", "pdb", "plistlib", "pyclbr", "pydoc", "rlcompleter",
    "sched", "shelve", "site", "smtplib", "socket", "socketserver", "ssl", "subprocess", "timeit", "tokenize",
)
KINDS = ("code", "prose", "chat code", "chat prose")
PER_KIND = 16
#: characters of a slice / a docstring (about 250-400 tokens)
CHARS = 1200
MIN_DOCSTRING = 400
INSTRUCTIONS = {"chat code": "Review the following code and describe what it is for.\n\n{}",
                "chat prose": "Read this text and explain its main point to a new programmer.\n\n{}"}


@dataclass(frozen=True)
class FloorPrompt:
    name: str
    kind: str              # one of KINDS
    ids: tuple[int, ...]   # what the model is prefilled with (chat: under the template)


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
    return [(f"LICENSE.txt@{i}", _at_line(text, i / 4)) for i in range(4)]


def texts() -> dict[str, list[tuple[str, str]]]:
    """kind -> [(name, text)], ``PER_KIND`` at most each (before tokenising)."""
    sources = _sources()
    docs = [(m, doc[:CHARS]) for m, source in sources
            if len(doc := ast.get_docstring(ast.parse(source)) or "") >= MIN_DOCSTRING]
    prose = [(f"{m}:doc", doc) for m, doc in docs] + _licence()
    return {"code": [(f"{m}.py@1/2", _at_line(s, 0.5)) for m, s in sources][:PER_KIND],
            "prose": prose[:PER_KIND],
            "chat code": [(f"review:{m}.py@3/4", INSTRUCTIONS["chat code"].format(_at_line(s, 0.75)))
                          for m, s in sources][:PER_KIND],
            "chat prose": [(f"explain:{m}:doc", INSTRUCTIONS["chat prose"].format(doc))
                           for m, doc in reversed(docs)][:PER_KIND]}


def floor_prompts(tokenizer: Any, limit: int | None = None) -> list[FloorPrompt]:
    """The prompts as token ids (raw kinds with the tokenizer's special prefix, chat kinds under its
    template; raw without one), kinds interleaved, the first ``limit``."""
    queues = {kind: [FloorPrompt(name, kind, tuple(chat_prompt_ids(tokenizer, text) if kind.startswith("chat")
                                                   else encode(tokenizer, text)))
                     for name, text in group]
              for kind, group in texts().items()}
    prompts = [queue[i] for i in range(max(map(len, queues.values()))) for queue in queues.values()
               if i < len(queue)]
    return prompts[:limit]
