"""The built-in text: Python standard-library sources of the running interpreter, read deterministically.

Two disjoint module lists: ``STDLIB_MODULES`` are evaluation documents (measure/eval/data.py),
``CALIBRATION_MODULES`` the POP+ calibration corpus (calibrate.default_batches), so evaluation stays
held out from calibration. No download, no torch.
"""
from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import EnvironmentUnavailable

#: Standard-library modules used as continuation documents (single files in every CPython >= 3.10).
STDLIB_MODULES: tuple[str, ...] = (
    "argparse", "ast", "base64", "bisect", "calendar", "configparser", "contextlib", "copy",
    "csv", "dataclasses", "difflib", "enum", "fractions", "functools", "heapq", "inspect",
    "ipaddress", "pprint", "queue", "random", "shlex", "statistics", "string", "textwrap",
)

#: Calibration text for POP+ (calibrate.py): other stdlib modules, so evaluation stays held out.
CALIBRATION_MODULES: tuple[str, ...] = (
    "abc", "codecs", "datetime", "decimal", "fileinput", "fnmatch", "getopt", "glob", "gzip", "hashlib",
    "locale", "numbers", "operator", "optparse", "pathlib", "pickle", "platform", "selectors", "shutil",
    "tarfile", "tempfile", "threading", "typing", "uuid", "weakref", "zipfile",
)


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text`` (a HF tokenizer, or anything called like one)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def calibration_docs(tokenizer: Any) -> Iterator[list[int]]:
    """The calibration corpus's modules as token ids without special tokens, encoded as they are read (a
    vision-language model's image+text windows take what follows each image turn from it: images.py)."""
    texts = stdlib_texts(CALIBRATION_MODULES)
    return (encode(tokenizer, text, add_special_tokens=False) for _, text in texts)


def stdlib_texts(modules: tuple[str, ...] = STDLIB_MODULES) -> list[tuple[str, str]]:
    """``(name, source)`` of each module file of the running interpreter's stdlib (missing ones are left
    out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for module in sorted(modules):
        path = root / f"{module}.py"
        if path.is_file():
            texts.append((f"stdlib/{module}.py", path.read_text(encoding="utf-8")))
    if not texts:
        raise EnvironmentUnavailable(f"no standard-library sources found under {root}")
    return texts


def documentation_topics(half: str) -> list[tuple[str, str]]:
    """``(name, text)`` of half of Python's documentation topics (``pydoc_data.topics``, prose with a little
    code), sorted by name: ``"evaluation"`` the even-numbered ones (eval's prompts, measure/eval/prompts.py),
    ``"calibration"`` the odd-numbered ones (POP++'s chat windows, distill_windows.py), so the two stay
    disjoint."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise EnvironmentUnavailable("Python's pydoc_data package is missing from this interpreter") from None
    if half not in ("evaluation", "calibration"):
        raise ValueError(f"half must be 'evaluation' or 'calibration', got {half!r}")
    names = sorted(topics)[half == "calibration"::2]
    return [(f"pydoc/{name}", topics[name]) for name in names]
