"""popcompile: Prefill-Only Pruning (POP) as a compiler pipeline.

    manifest = popcompile.compile("smollm2-135m", popcompile.PopConfig(), out="engines/smol")
    session = popcompile.open_session("engines/smol")          # runtime="onnxruntime" | "tensorrt"
    print(session.generate("Hello!")[0].text)

``compile`` (driver.py) runs load -> calibrate -> capture -> POP pass -> export -> manifest; the
steps are public too: load_model, capture, pop_graphs (the POP pass compile runs, on a captured model),
build_graphs (capture + pop_graphs).

Attributes are imported on first use, so ``import popcompile.runtime`` in a deployment pulls in
neither torch nor transformers.
"""
from __future__ import annotations

import importlib
import warnings

__version__ = "0.1.0"

_PUBLIC = {
    "compile": "popcompile.driver",
    "PopConfig": "popcompile.config",
    "KVCalibration": "popcompile.config",
    "KVFitConfig": "popcompile.config",
    "DistillConfig": "popcompile.config",
    "QualityFloor": "popcompile.config",
    "WeightQuantization": "popcompile.config",
    "OnnxTarget": "popcompile.exporters.targets",
    "TensorRTTarget": "popcompile.exporters.targets",
    "TrtBuildConfig": "popcompile.exporters.tensorrt",
    "open_session": "popcompile.runtime",
    "load_model": "popcompile.frontend.models",
    "use_pop_experts": "popcompile.frontend.experts",
    "capture": "popcompile.frontend.capture",
    "KVLayout": "popcompile.engine.kv",
    "pop_graphs": "popcompile.passes.prefill",
    "pop_pass": "popcompile.passes.pop",  # the separate-boundary pass alone; pop_graphs is compile's
    "resolve_cut": "popcompile.config",
    "build_graphs": "popcompile.driver",
    "export": "popcompile.driver",
    "OrtSession": "popcompile.runtime.ort",
    "PopSession": "popcompile.runtime.ort",  # OrtSession's earlier name
    "PopcompileError": "popcompile.errors",
    "ConfigError": "popcompile.errors",
    "InputError": "popcompile.errors",
    "ModelError": "popcompile.errors",
    "EngineError": "popcompile.errors",
    "OutputError": "popcompile.errors",
    "EnvironmentUnavailable": "popcompile.errors",
}

#: deprecated name -> its replacement: importable (with a DeprecationWarning), not exported by ``import *``
_DEPRECATED = {"PopSession": "OrtSession", "pop_pass": "pop_graphs"}
__all__ = sorted(set(_PUBLIC) - set(_DEPRECATED)) + ["__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'popcompile' has no attribute {name!r}")
    module = importlib.import_module(_PUBLIC[name])
    if name not in _DEPRECATED:
        return getattr(module, name)
    warnings.warn(f"popcompile.{name} is deprecated: use {_DEPRECATED[name]}", DeprecationWarning,
                  stacklevel=2)
    with warnings.catch_warnings():  # one warning: the module may warn of the same name itself
        warnings.simplefilter("ignore", DeprecationWarning)
        return getattr(module, name)
