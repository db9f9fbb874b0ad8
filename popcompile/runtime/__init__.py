"""Runtimes for engine folders, registered by name; ``open_session`` picks one.

    open_session("engines/smol")                                   # onnxruntime, CPU
    open_session("engines/smol", provider="cuda", threads=4)       # onnxruntime options
    open_session("engines/smol-trt", runtime="tensorrt", cuda_graph=True)

Each name maps to ``module:class``, imported only when opened: importing this package loads neither
onnxruntime nor tensorrt (nor torch, ever).
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from ..errors import ConfigError

#: runtime name -> "module:SessionClass"
RUNTIMES = {
    "onnxruntime": "popcompile.runtime.ort:OrtSession",
    "tensorrt": "popcompile.runtime.trt:TrtSession",
}


def session_class(runtime: str) -> type:
    """The session class registered as ``runtime`` (ConfigError naming the registered ones)."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"runtime={runtime!r} is not a runtime: choose one of {', '.join(RUNTIMES)}")
    module, name = RUNTIMES[runtime].split(":")
    return getattr(importlib.import_module(module), name)


def open_session(folder: str | Path, runtime: str = "onnxruntime", **options):
    """A session over the engine folder ``folder`` with the runtime registered as ``runtime``.

    ``options`` are the session's keyword arguments (onnxruntime: provider, threads, io_binding,
    min_prompt_tokens, hash_cache, manifest; tensorrt: device, kv_binding, cuda_graph, min_prompt_tokens,
    hash_cache, manifest); one it does not take is a ConfigError naming those it does."""
    cls = session_class(runtime)
    accepted = [p.name for p in inspect.signature(cls).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(f"runtime {runtime!r} takes no option {', '.join(unknown)}: its options are "
                          f"{', '.join(accepted)}")
    return cls(folder, **options)
