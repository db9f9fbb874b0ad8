"""What ``popcompile analyze`` scores: real text cut into token windows, and ``Samples``, the sequences of one
analysis with how its gated graph reads them (a text decoder: the windows' ids; a vision-language model:
each window behind a synthetic image prompt, ``analyze_vision.py``).

The built-in corpus: HumanEval prompts and the docstrings of the running interpreter's stdlib, taken in
turn; ``--text`` / ``--jsonl`` replace it (commands/common.py reads them).
"""
from __future__ import annotations

import ast
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, InputError
from ..kvfit.corpus import encode
from .eval.data import humaneval_problems
from .gates import GateResult


@dataclass(frozen=True)
class ImagePrompts:
    """How a vision-language model's sequences were built (the report's ``images``): one synthetic image
    per sequence (eval/images.py's drawings), in a chat turn before the text; its tokens are prefill
    positions like every prompt token."""

    image_tokens: tuple[int, ...]  # per sequence: the image's placeholder tokens
    prompt_tokens: tuple[int, ...]  # per sequence: the image turn (chat tokens, image, question), then text
    image_sizes: tuple[tuple[int, int], ...]  # per sequence: (width, height) in pixels the image was drawn at
    max_image_tokens: int  # the cap: half of --context-len (images are resized down to fit it)
    deepstack: int  # k: image features enter after decoder layers 0..k-1, so the recommended cut is >= k


@dataclass(frozen=True)
class Samples:
    """The sequences one analysis scores and how its gated graph reads a batch of them."""

    windows: torch.Tensor  # [N, context + gen] ids (a VLM's with image placeholders); targets [:, context:]
    corpus: Mapping[str, int]  # text source -> sequences taken from it
    # (model, batch, seq_len, gen_len) -> the gated graph at static [batch, seq_len]
    capture: Callable[[torch.nn.Module, int, int, int], GateResult]
    # row indices [B] -> the graph's inputs before gates and stage (a text decoder: ids [B, S])
    inputs: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    images: ImagePrompts | None = None  # a vision-language model's image prompts

    def __len__(self) -> int:
        return len(self.windows)


def stdlib_docstrings() -> Iterator[str]:
    """Docstrings of the public top-level modules of the running interpreter's stdlib, one text per
    module (module, class and function docstrings in source order), modules sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs = [ast.get_docstring(node) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        text = "\n\n".join(d for d in docs if d)
        if text:
            yield text


def humaneval_prompts() -> list[str]:
    return [problem["prompt"] for problem in humaneval_problems()]


def default_sources() -> dict[str, Iterable[str]]:
    """The built-in corpus: HumanEval prompts and stdlib docstrings (lazy: read as far as needed)."""
    return {"humaneval": humaneval_prompts(), "stdlib-docstrings": stdlib_docstrings()}


def _token_stream(texts: Iterable[str], tokenizer: Any, chunk: int) -> Iterator[list[int]]:
    """The texts' tokens (joined by a blank line), cut into chunks of ``chunk`` tokens."""
    separator = encode(tokenizer, "\n\n", add_special_tokens=False)
    buffer: list[int] = []
    for text in texts:
        buffer += encode(tokenizer, text, add_special_tokens=False) + separator
        while len(buffer) >= chunk:
            yield buffer[:chunk]
            buffer = buffer[chunk:]


def special_prefix(tokenizer: Any) -> list[int]:
    """The tokenizer's own leading special tokens (Gemma's BOS; none for SmolLM2 or Qwen)."""
    return encode(tokenizer, "", add_special_tokens=True)


def token_windows(sources: Mapping[str, Iterable[str]], tokenizer: Any, length: int,
                  count: int) -> tuple[torch.Tensor, dict[str, int]]:
    """``count`` windows [N, length] of real text, sources taken in turn; each window starts with the
    tokenizer's own leading special tokens (Gemma's BOS; none for SmolLM2). Returns fewer windows when
    the text runs out, and how many each source gave."""
    prefix = special_prefix(tokenizer)
    if length <= len(prefix):
        raise ConfigError(f"window of {length} tokens leaves no room after {len(prefix)} special tokens")
    streams = {name: _token_stream(texts, tokenizer, length - len(prefix)) for name, texts in sources.items()}
    windows, taken = [], {name: 0 for name in sources}
    while streams and len(windows) < count:
        for name in list(streams):
            chunk = next(streams[name], None)
            if chunk is None:
                del streams[name]
            elif len(windows) < count:
                windows.append(prefix + chunk)
                taken[name] += 1
    if not windows:
        raise InputError(f"the text has fewer than {length} tokens (--context-len + --gen-len): "
                         "give more text")
    return torch.tensor(windows, dtype=torch.long), taken
