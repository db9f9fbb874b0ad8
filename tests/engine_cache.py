"""One build of each engine folder per test run, shared by every test and both xdist workers.

    def test_x(engines):
        folder = engines.tiny("llama", cut=3, max_seq=64)          # built once per run, then reused
        folder = engines.tiny("llama", model={"kv_heads": 1}, cut=3)  # tiny_model() overrides
    def test_y(real_engines):                                    # marks the test real_model
        folder = real_engines.real("smollm2-135m", max_seq=512)  # a shipped model, loaded once per worker

A folder is keyed by its builder and every argument; the first caller builds it under a file lock while the
other worker waits, later callers get the finished folder. The cache lives in the run's base temp folder, so
nothing survives the run: no engine of an older commit can pass a test. Folders are shared: a test that
damages one works on a copy (``shutil.copytree``); the session checks at its end that every folder it handed
out is unchanged (names, sizes, modification times) and fails the run if one was not.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock


def _slug(value: Any) -> str:
    """A stable text for a key: Paths by their string, mappings sorted, objects by repr."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={_slug(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_slug(v) for v in value) + "]"
    return str(value) if isinstance(value, Path) else repr(value)


def export_key(export_kwargs: dict) -> tuple[str, str]:
    """The export as the driver sees it: the PopConfig and the target the keywords make, so that spelling a
    default out (``dtype="float32"``) or leaving it out keys the same folder."""
    from popcompile.config import PopConfig
    from popcompile.exporters.targets import target_for

    kwargs = dict(export_kwargs)
    target = target_for(kwargs.pop("target", "onnx"))
    return repr(PopConfig(**kwargs)), repr(target)


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime_ns) of every file under ``folder``."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


class EngineCache:
    """Engine folders under ``root`` (shared by the run's workers), built once each."""

    def __init__(self, root: Path, loaded: Callable[[str], Any] | None = None,
                 handed_out: dict[Path, dict] | None = None):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._loaded = loaded  # name -> LoadedModel, this worker's real-model cache (real_engines only)
        self.handed_out = {} if handed_out is None else handed_out

    def using(self, loaded: Callable[[str], Any]) -> "EngineCache":
        """The same cache, able to build shipped models' engines from ``loaded(name)``."""
        return EngineCache(self.root, loaded, self.handed_out)

    def get(self, name: str, build: Callable[[Path], Any], *key: Any) -> Path:
        """The folder ``build(folder)`` makes, keyed by ``name`` and ``key``; built once per run."""
        digest = hashlib.sha256(_slug(key).encode()).hexdigest()[:12]
        folder = self.root / f"{name}-{digest}"
        with FileLock(str(folder) + ".lock"):
            if not folder.exists():
                staged = folder.with_name(folder.name + ".staged")
                shutil.rmtree(staged, ignore_errors=True)
                build(staged)
                staged.rename(folder)
        self.handed_out.setdefault(folder, snapshot(folder))
        return folder

    def tiny(self, model_type: str, *, model: dict | None = None, **export_kwargs) -> Path:
        """tiny_engine(model_type, ..., **export_kwargs) over tiny_model(model_type, **model)."""
        from tiny_engine import tiny_engine

        export_kwargs = {"kv_calibration": "none", "min_prompt_tokens": 0, **export_kwargs}  # its defaults
        build = lambda out: tiny_engine(model_type, out, model_kwargs=model or {}, **export_kwargs)
        return self.get(f"tiny-{model_type}", build, model_type, model or {}, export_key(export_kwargs))

    def tiny_vl(self, *, model: dict | None = None, **export_kwargs) -> Path:
        """tiny_vl_engine over tiny_vlm(**model)."""
        from tiny import tiny_vlm
        from tiny_engine import tiny_vl_engine

        export_kwargs = {"kv_calibration": "none", "min_prompt_tokens": 0, **export_kwargs}  # its defaults
        build = lambda out: tiny_vl_engine(out, tiny_vlm(**(model or {})), **export_kwargs)
        return self.get("tiny-vl", build, model or {}, export_key(export_kwargs))

    def real(self, name: str, **export_kwargs) -> Path:
        """A shipped model's engine: ``driver.export(load_model(name), ...)``, the model loaded once per
        worker. POP for every prompt and no K/V refit unless ``export_kwargs`` say otherwise."""
        from popcompile.driver import export

        assert self._loaded is not None, "shipped models' engines come from the real_engines fixture"
        export_kwargs = {"kv_calibration": "none", "min_prompt_tokens": 0, **export_kwargs}
        build = lambda out: export(self._loaded(name), out, **export_kwargs)
        return self.get(name, build, name, export_key(export_kwargs))

    def changed(self) -> list[str]:
        """The handed-out folders whose files differ from when they were first handed out."""
        return [str(folder) for folder, before in self.handed_out.items() if snapshot(folder) != before]
