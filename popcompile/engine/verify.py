"""Every file a runtime reads from an engine folder: inside the folder, with the manifest's size and sha256.

Hashing is the only check that catches a changed byte, and it costs: SmolLM2-135M's weights.bin (540 MB)
takes about a second to hash (docs/reliability.md has the numbers). A verified hash is therefore
remembered per file identity in ``HashCache``: one small JSON file per verified file under
``~/.cache/popcompile/verified/`` (or the folder a caller names), holding the file's resolved path,
size, mtime_ns, ctime_ns, inode and device with the sha256 it had. A later load whose ``stat`` gives
the same identity reuses the hash (microseconds); any write to the file changes its ctime (which user
space cannot set back), so a changed file is hashed again. What the cache cannot see: a change below
the file system (bit rot on disk, a write to the raw device), and a writer who can also write the cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import EngineError
from .manifest import RE_EXPORT, EngineManifest, engine_file, sha256_file


class UnverifiedWeightsWarning(UserWarning):
    """An engine folder whose manifest predates weights hashing: its weights are checked by size only."""


@dataclass(frozen=True)
class HashCache:
    """Where verified hashes are remembered; ``folder=None`` keeps none (every load hashes every file)."""

    folder: Path | None

    @classmethod
    def default(cls) -> "HashCache":
        return cls(Path.home() / ".cache" / "popcompile" / "verified")

    def _entry(self, path: Path) -> Path:
        return self.folder / f"{hashlib.sha256(str(path).encode()).hexdigest()[:40]}.json"

    @staticmethod
    def identity(path: Path, info: os.stat_result) -> dict:
        return {"path": str(path), "size": info.st_size, "mtime_ns": info.st_mtime_ns,
                "ctime_ns": info.st_ctime_ns, "inode": info.st_ino, "device": info.st_dev}

    def lookup(self, path: Path, info: os.stat_result) -> str | None:
        """The sha256 this very file (same identity) had when it was verified, or None."""
        if self.folder is None:
            return None
        try:
            data = json.loads(self._entry(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # no entry, or one damaged: hash again
            return None
        if not isinstance(data, dict) or data.get("file") != self.identity(path, info):
            return None
        digest = data.get("sha256")
        return digest if isinstance(digest, str) else None

    def store(self, path: Path, info: os.stat_result, digest: str) -> None:
        """Remember a verified hash (atomically); a cache that cannot be written only costs the next load a
        hash."""
        if self.folder is None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".tmp", delete=False) as file:
                json.dump({"file": self.identity(path, info), "sha256": digest}, file)
            os.replace(file.name, self._entry(path))
        except OSError:
            return


def verify_file(folder: Path, name: str, key: str, size: int, sha256: str | None, cache: HashCache, *,
                fix: str = RE_EXPORT) -> Path:
    """The resolved path of manifest entry ``key`` (file ``name``), after checking its size and, unless
    ``sha256`` is None, its hash (through ``cache``); EngineError names the file and ``fix``."""
    path = engine_file(folder, name, key)
    try:
        info = path.stat()
    except OSError:
        raise EngineError(f"{folder}: {name} is missing: the engine folder is incomplete, {fix}") from None
    if not stat.S_ISREG(info.st_mode):
        raise EngineError(f"{folder}: {name} ({key}) is not a regular file: {fix}")
    if info.st_size != size:
        raise EngineError(f"{folder}: {name} has {info.st_size} bytes where the manifest says {size} "
                          f"(changed or truncated): {fix}")
    if sha256 is None or cache.lookup(path, info) == sha256:
        return path
    try:
        digest = sha256_file(path)
    except OSError as err:
        raise EngineError(f"{folder}: {name} cannot be read ({err.strerror}): "
                          f"check its permissions") from None
    if digest != sha256:
        raise EngineError(f"{folder}: {name} does not match the manifest's sha256 (changed or corrupt): "
                          f"{fix}")
    cache.store(path, info, digest)
    return path


def verify_folder(folder: Path, manifest: EngineManifest, cache: HashCache) -> dict[str, Path]:
    """Both graphs (a vision-language engine's vision graph too) and the weights file verified; returns the
    resolved paths ("prefill", "decode", "vision" where there is one, "weights")."""
    paths = {name: verify_file(folder, entry.file, f"graphs.{name}.file", entry.bytes, entry.sha256, cache)
             for name, entry in manifest.graphs.items()}
    section = manifest.vision_section(folder)
    if section is not None:
        graph = section.graph
        paths["vision"] = verify_file(folder, graph["file"], "vision.graph.file", graph["bytes"],
                                      graph["sha256"], cache)
    weights = manifest.weights
    if manifest.weights_sha256() is None:
        warnings.warn(f"{folder}: the manifest has no sha256 for {weights['file']} "
                      "(exported before weights were hashed): it is checked by size only; "
                      "re-export the engine to verify it",
                      UnverifiedWeightsWarning, stacklevel=3)
    paths["weights"] = verify_file(folder, weights["file"], "weights.file", weights["bytes"],
                                   manifest.weights_sha256(), cache)
    return paths
