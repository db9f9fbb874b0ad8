"""The vLLM folder's mark (``export --target vllm``): config.json's ``popcompile`` entry, read without vLLM.

    "popcompile": {"format": 1, "cut": 20, "kv_weights": "pop_kv.safetensors" | null,
                   "popcompile_version": ...}

popcompile.vllm_plugin.settings validates the entry where vLLM loads the folder; here only whether a
folder is one (``export --force`` may replace it; ``run`` names ``vllm serve`` instead of a missing manifest).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

CONFIG_KEY = "popcompile"
FORMAT = 1


def is_vllm_folder(folder: str | Path) -> bool:
    """``folder`` was written by ``export --target vllm``: its config.json has our entry."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return is_readable_entry(config.get(CONFIG_KEY) if isinstance(config, dict) else None)


def is_readable_entry(entry: object) -> bool:
    """The one rule for the entry's version: a mapping whose ``format`` is FORMAT (the plugin reads no
    other)."""
    return isinstance(entry, Mapping) and entry.get("format") == FORMAT
