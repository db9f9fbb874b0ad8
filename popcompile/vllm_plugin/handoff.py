"""The hand-off store between a POP prefill instance and a full-model decode instance (connector.py).

One entry per prompt, keyed by the prompt's token ids (and its images' hashes, if any), written once,
atomically, by the prefill instance; read by the decode instance:

    ROOT/layout.json                  the pair's KV layout (``Layout``): the first instance writes it,
                                      every later one compares and refuses another
    ROOT/<key>/rows.safetensors       per attention layer: the K/V rows of prompt tokens 0..N-2,
                                      [N - 1, H_kv, C] in the cache's per-layer view (C: K and V, or
                                      whatever the attention backend keeps per head)
    ROOT/<key>/entry.json             {"rows": N - 1, "layout": <Layout fingerprint>}

Rows, not blocks: the decode instance may use another block size and the last, partial block is sent
too. The last prompt token is never sent: the decode instance runs it through the full model, which is
POP's boundary rule (x_N sees every layer), and samples the first token there.

Nothing here imports vLLM (the connector does); the main test suite checks this module on its own.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors.torch import load_file, save_file

from ..errors import ConfigError
from ..fsutil import atomic_write

ROWS_FILE = "rows.safetensors"
ENTRY_FILE = "entry.json"
LAYOUT_FILE = "layout.json"
#: bytes read from each end of every weight file for the fingerprint (hashing whole checkpoints would
#: cost seconds per GB at every start)
_SAMPLE = 1 << 20


@dataclass(frozen=True)
class Layout:
    """What must agree between the two instances for the rows to mean the same thing.

    ``weights``: a fingerprint of the checkpoint (``weights_fingerprint``); the cut is not part of it: POP's
    cache has the full model's layout at every cut, so any cut pairs with the full model."""

    architecture: str  # the stock architecture (PopLlamaForCausalLM serves LlamaForCausalLM)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    weights: str

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def differences(self, other: Layout) -> list[str]:
        return [f"{name} {getattr(self, name)!r} vs {getattr(other, name)!r}"
                for name in asdict(self) if getattr(self, name) != getattr(other, name)]


def weights_fingerprint(folder: str | Path) -> str:
    """sha256 over each stock weight file's name, size, first and last MiB (POP+ files excluded: the
    decode instance never reads them)."""
    digest = hashlib.sha256()
    files = sorted(p for p in Path(folder).glob("*.safetensors") if not p.name.startswith("pop_kv"))
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(_SAMPLE))
            handle.seek(max(0, size - _SAMPLE))
            digest.update(handle.read(_SAMPLE))
    return digest.hexdigest()[:16]


def entry_key(token_ids: Iterable[int], extra: Iterable[str] = ()) -> str:
    """The entry's name: sha256 of the prompt's token ids (int64 bytes) and its multimodal hashes."""
    digest = hashlib.sha256(torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes())
    for item in extra:
        digest.update(b"\0" + item.encode())
    return digest.hexdigest()[:32]


class HandoffStore:
    """The folder ``root`` shared by the two instances (a local or network file system)."""

    def __init__(self, root: str | Path, layout: Layout):
        self.root = Path(root)
        self.layout = layout
        self.root.mkdir(parents=True, exist_ok=True)

    def claim_layout(self) -> None:
        """Write the layout if none is there; ConfigError naming the differences if another one is."""
        path = self.root / LAYOUT_FILE
        mine = asdict(self.layout)
        if not path.exists():
            atomic_write(path, json.dumps(mine, indent=2, sort_keys=True) + "\n")
        theirs = Layout(**json.loads(path.read_text(encoding="utf-8")))
        if theirs != self.layout:
            raise ConfigError(f"KV hand-off folder {self.root} belongs to another model layout "
                              f"({'; '.join(theirs.differences(self.layout))}): serve the same model "
                              "and dtype on both instances, or give this pair its own shared_storage_path")

    def has(self, key: str) -> int:
        """Rows stored under ``key`` with this layout (0: none, or another layout's)."""
        try:
            entry = json.loads((self.root / key / ENTRY_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return 0
        return int(entry.get("rows", 0)) if entry.get("layout") == self.layout.fingerprint() else 0

    def write(self, key: str, rows: Mapping[str, torch.Tensor]) -> None:
        """Store ``rows`` {layer name: [T, ...]} under ``key``; readers see the whole entry or none."""
        final = self.root / key
        if final.exists():
            return
        staging = self.root / f".{key}.{os.getpid()}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        count = {tensor.shape[0] for tensor in rows.values()}
        if len(count) != 1:
            raise ValueError(f"layers hold different row counts {sorted(count)}")
        save_file({name: tensor.contiguous().cpu() for name, tensor in rows.items()},
                  str(staging / ROWS_FILE))
        (staging / ENTRY_FILE).write_text(json.dumps({"rows": count.pop(),
                                                      "layout": self.layout.fingerprint()}))
        try:
            staging.rename(final)
        except OSError:  # another writer got there first: its entry holds the same rows
            shutil.rmtree(staging, ignore_errors=True)

    def read(self, key: str) -> dict[str, torch.Tensor]:
        return load_file(str(self.root / key / ROWS_FILE))
