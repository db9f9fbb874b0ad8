"""``EvalConfig``: what ``popcompile eval`` runs, validated once (before any model is loaded).

Plain data, no torch import: the CLI builds it from its flags, ``run.run_eval`` and
``engine.run_engine_eval`` read it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ...config import DistillConfig, check_cut_choice
from ...errors import ConfigError, OutputError
from ...fsutil import check_destination

TASKS = ("continuation", "generation", "greedy", "humaneval", "chat", "images")
DEFAULT_TASKS = ("continuation", "generation")
#: the default with the user's own text (--text / --jsonl): the task that scores it
TEXT_TASKS = ("continuation",)
#: a vision-language model's default: its answers about images (images.py)
VISION_TASKS = ("images",)
#: what `eval --out` writes (replaced only with --force)
OUTPUT_FILES = ("results.json", "quality.png", "sweep.png")
#: the variants the chat task runs, each from a fresh prefill and with the cache carried across turns
CHAT_VARIANTS = ("pop", "pop-kvfit", "pop-distill")
CHAT_NEEDS = (f"the chat task compares POP with the full model: name one of {', '.join(CHAT_VARIANTS)} in "
              "--variants (or leave --variants out)")
PROMPT_FORMATS = ("auto", "chat", "raw")  # HumanEval: humaneval.resolve_format
CODE_EXEC_REFUSAL = ("the humaneval task runs model-written code on this machine; pass --allow-code-exec "
                     "to allow it (ideally inside a sandbox or container)")


@dataclass(frozen=True)
class EvalConfig:
    tasks: tuple[str, ...] = DEFAULT_TASKS
    variants: tuple[str, ...] | None = None  # None: every registered variant (an engine folder: full, pop)
    cut: int | None = None                   # the first pruned layer; or prune_ratio; default 1/3 pruned
    prune_ratio: float | None = None
    limit: int | None = None                 # documents / prompts / problems per task
    prefix_len: int = 512                    # continuation: prefilled tokens
    cont_len: int = 48                       # continuation: scored tokens
    gen_tokens: int = 64                     # generation: greedy tokens per chat prompt
    greedy_tokens: int = 32                  # greedy: the full model's tokens each variant is scored on
    code_tokens: int = 256                   # humaneval: max tokens per completion
    batch_size: int | None = None            # documents per forward (default: by vocabulary size)
    sweep: bool = False                      # continuation at every cut L..ceil(L/2)
    min_agreement: float = 0.95              # the sweep's auto cut
    allow_code_exec: bool = False            # humaneval runs model-written code
    timeout: float = 10.0                    # seconds per HumanEval test program
    code_prompt: str = "auto"                # PROMPT_FORMATS
    provider: str | None = None              # engine folders only: onnxruntime provider
    threads: int | None = None               # engine folders only: onnxruntime intra-op threads
    force: bool = False                      # replace OUTPUT_FILES already in the output folder
    distill: DistillConfig = DistillConfig()  # pop-distill: how its weights are distilled (tests: few steps)
    revision: str | None = None              # a hub id's branch, tag or commit (default: its main branch)
    #: the user's own text (--text / --jsonl): (file, its texts) pairs; the continuation task and the sweep
    #: score windows of it (data.text_documents) instead of the built-in documents
    texts: tuple[tuple[str, tuple[str, ...]], ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(dict.fromkeys(self.tasks)))
        if self.variants is not None:
            object.__setattr__(self, "variants", tuple(dict.fromkeys(self.variants)))
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ConfigError(f"unknown task(s) {', '.join(unknown)}: use a comma list of {', '.join(TASKS)}")
        if "humaneval" in self.tasks and not self.allow_code_exec:
            raise ConfigError(CODE_EXEC_REFUSAL)
        if not (self.tasks or self.sweep):
            raise ConfigError("nothing to do: give --tasks or --sweep")
        if "chat" in self.tasks and self.variants is not None and not set(self.variants) & set(CHAT_VARIANTS):
            raise ConfigError(CHAT_NEEDS)
        sizes = {"--limit": self.limit, "--prefix-len": self.prefix_len, "--cont-len": self.cont_len,
                 "--gen-tokens": self.gen_tokens, "--greedy-tokens": self.greedy_tokens,
                 "--code-tokens": self.code_tokens,
                 "--batch-size": self.batch_size, "--threads": self.threads}
        for flag, value in sizes.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{flag} must be >= 1, got {value!r} (a whole number)")
        check_cut_choice(self.cut, self.prune_ratio)
        if not (math.isfinite(self.min_agreement) and 0.0 <= self.min_agreement <= 1.0):
            raise ConfigError(f"--min-agreement must be within 0..1, got {self.min_agreement}")
        if self.code_prompt not in PROMPT_FORMATS:
            raise ConfigError(f"unknown HumanEval prompt format {self.code_prompt!r}: "
                              f"use {', '.join(PROMPT_FORMATS)}")
        if not isinstance(self.distill, DistillConfig):
            raise ConfigError(f"distill={self.distill!r} is not a DistillConfig: "
                              "give DistillConfig(steps=...)")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ConfigError(f"--timeout must be > 0, got {self.timeout}")
        if self.texts is not None:
            object.__setattr__(self, "texts", tuple((str(f), tuple(t)) for f, t in self.texts))
            if "continuation" not in self.tasks and not self.sweep:
                raise ConfigError("--text / --jsonl are scored by the continuation task (and --sweep): add "
                                  "continuation to --tasks")


def parse_tasks(text: str | None, sweep_only: bool, own_text: bool = False) -> tuple[str, ...]:
    """``--tasks a,b`` -> a tuple; none given: the default tasks, or nothing with ``--sweep``, or with the
    user's own text (``own_text``: --text / --jsonl) the continuation task that scores it."""
    if text is None:
        return () if sweep_only else TEXT_TASKS if own_text else DEFAULT_TASKS
    tasks = tuple(t.strip() for t in text.split(",") if t.strip())
    if not tasks:
        raise ConfigError(f"unknown task(s) (none): use a comma list of {', '.join(TASKS)}")
    return tasks


def check_output_folder(out: str | Path, force: bool) -> None:
    """OutputError unless ``out`` is a folder (or can be made) where OUTPUT_FILES may be written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file: give a folder")
    taken = [out / name for name in OUTPUT_FILES if (out / name).exists()]
    if taken and not force:
        raise OutputError(f"{taken[0]} exists: choose another --out or pass --force to replace it")
    check_destination(out / OUTPUT_FILES[0])
