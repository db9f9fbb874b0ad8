"""What an export checks before torch loads: option values and the destination (no torch or onnx import).

``force`` may replace only a popcompile engine folder: one whose manifest parses and names our format.
A folder holding anything else (a thesis, a dataset) is refused, whatever ``force`` says.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..engine.manifest import BOUNDARIES, FORMAT, MANIFEST
from ..errors import ConfigError, OutputError
from ..fsutil import check_destination

#: engine precisions: the graphs' weights, activations, KV inputs/outputs and logits all take this dtype
DTYPES = ("float32", "float16")
#: capture traces 3 new tokens over 4 cached ones (capture.example_inputs): a shorter buffer cannot be exported
MIN_MAX_SEQ = 8


def check_options(*, dtype: str, boundary: str, max_seq: int | None, cut: int | None,
                  prune_ratio: float | None, min_prompt_tokens: int | str = 0) -> None:
    """ConfigError for option values no model can take (the model's own limits are checked once it loads)."""
    if min_prompt_tokens != "auto" and (isinstance(min_prompt_tokens, bool) or not isinstance(min_prompt_tokens, int)
                                        or min_prompt_tokens < 0):
        raise ConfigError(f"--min-prompt-tokens {min_prompt_tokens!r} is not valid: give auto (measure at export) "
                          "or an integer >= 0 (0: POP for every prompt)")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported: choose one of {', '.join(DTYPES)}")
    if boundary not in BOUNDARIES:
        raise ConfigError(f"boundary={boundary!r} is not supported: choose one of {', '.join(BOUNDARIES)}")
    if max_seq is not None and (isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq < MIN_MAX_SEQ):
        raise ConfigError(f"--max-seq {max_seq!r} is too small: give an integer >= {MIN_MAX_SEQ}")
    if cut is not None and (isinstance(cut, bool) or not isinstance(cut, int) or cut < 1):
        raise ConfigError(f"--cut {cut!r} is not a layer index: give an integer >= 1")
    if prune_ratio is not None and not (math.isfinite(prune_ratio) and 0.0 <= prune_ratio < 1.0):
        raise ConfigError(f"--prune-ratio {prune_ratio} is out of range: use 0 <= ratio < 1")


def is_engine_folder(path: Path) -> bool:
    """``path`` holds a popcompile manifest that parses (what ``force`` may replace)."""
    try:
        data = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def check_output_folder(out_dir: Path, force: bool) -> None:
    """OutputError unless ``out_dir`` can be created, or replaced (``force``) as a popcompile engine folder."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise OutputError(f"--out {out_dir} exists and is not a folder: choose another --out")
    if not out_dir.exists():
        check_destination(out_dir)
        return
    if not force:
        raise OutputError(f"--out {out_dir} already exists: choose another --out or pass --force to replace it")
    if not is_engine_folder(out_dir):
        raise OutputError(f"--out {out_dir} is not a popcompile engine folder (no readable {MANIFEST}): --force "
                          "replaces only engine folders; move it away or choose another --out")
    check_destination(out_dir)
