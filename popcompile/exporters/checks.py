"""What an export checks of its destination before torch loads (no torch or onnx import; PopConfig checks
the options).

``force`` may replace only a popcompile engine folder: one whose manifest parses and names our format, or
a vLLM folder from ``--target vllm`` (its config.json's ``popcompile`` entry names our format).
A folder holding anything else (a thesis, a dataset) is refused, whatever ``force`` says.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..engine.manifest import MANIFEST, is_engine_manifest
from ..engine.vllm_folder import is_vllm_folder
from ..errors import OutputError
from ..fsutil import check_destination


def is_engine_folder(path: Path) -> bool:
    """``path`` holds a popcompile manifest that parses, or is a vLLM folder we wrote (what ``force`` may
    replace)."""
    try:
        data = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return is_vllm_folder(path)
    return is_engine_manifest(data)


def check_output_folder(out_dir: Path, force: bool) -> None:
    """OutputError unless ``out_dir`` can be created, or replaced (``force``) as a popcompile engine
    folder."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise OutputError(f"--out {out_dir} exists and is not a folder: choose another --out")
    if not out_dir.exists():
        check_destination(out_dir)
        return
    if not force:
        raise OutputError(f"--out {out_dir} already exists: choose another --out or pass --force to "
                          "replace it")
    if not is_engine_folder(out_dir):
        raise OutputError(f"--out {out_dir} is not a popcompile engine folder (no readable {MANIFEST}): "
                          "--force replaces only engine folders; move it away or choose another --out")
    check_destination(out_dir)
