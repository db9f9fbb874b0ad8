"""The package's layering, read from the source (popcompile/README.md, "Layering").

    parts      each top-level part imports only the parts ``MAY_IMPORT`` names for it (the drawing in
               popcompile/README.md, as a table)
    engine/    the engine-folder contract: no torch, transformers, onnx, onnxruntime, tensorrt or cuda;
               from popcompile only engine/ itself, errors and fsutil
    runtime/   never the exporters, the CLI commands or the measurement tools (analyze, autocut, eval)
    measure/   imported by commands/ and measure/ only: the compiler never depends on evaluation
    all        no import cycles among popcompile's modules

Every import counts: module level, inside functions, ``from .. import x`` and
``importlib.import_module("...")`` with a literal name.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "popcompile"
HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "tensorrt", "cuda")
ENGINE_MAY_USE = ("popcompile.engine", "popcompile.errors", "popcompile.fsutil")
RUNTIME_MUST_NOT_USE = ("popcompile.exporters", "popcompile.commands", "popcompile.measure")
MAY_USE_TOOLS = ("popcompile.commands", "popcompile.measure")
COMPILER = ("driver.py", "config.py", "frontend", "kvfit", "passes", "quality")
#: top-level part -> the parts it may import (besides itself). Read downward: a part names only parts listed
#: before it, so the table is the layer order. ``vllm_plugin`` runs inside vLLM and needs only the contract.
MAY_IMPORT = {
    "errors": set(),
    "fsutil": {"errors"},
    "threshold": {"errors"},
    "cost": {"errors"},
    "stepmeter": set(),
    "progress": set(),
    "engine": {"errors", "fsutil"},
    "ort_passes": {"engine"},
    "config": {"engine", "errors", "threshold"},
    "frontend": {"engine", "errors"},
    "passes": {"config", "engine", "errors", "frontend"},
    "kvfit": {"config", "cost", "errors", "frontend", "fsutil", "passes"},
    "quality": {"config", "errors", "frontend", "kvfit"},
    "reference": {"config", "errors", "frontend", "passes"},
    "runtime": {"cost", "engine", "errors", "fsutil", "threshold"},
    "vllm_plugin": {"config", "engine", "errors", "frontend", "fsutil", "threshold"},
    "exporters": {"config", "engine", "errors", "frontend", "fsutil", "kvfit", "ort_passes", "passes",
                  "vllm_plugin"},
    "dynamo": {"config", "errors", "frontend", "kvfit", "passes", "threshold"},
    "driver": {"config", "engine", "errors", "exporters", "frontend", "fsutil", "kvfit", "passes", "quality",
               "runtime", "stepmeter", "threshold"},
    "measure": {"config", "cost", "driver", "engine", "errors", "frontend", "fsutil", "kvfit", "passes",
                "progress", "quality", "reference", "runtime", "threshold"},
    "commands": {"config", "cost", "driver", "engine", "errors", "exporters", "frontend", "fsutil", "kvfit",
                 "measure", "progress", "runtime", "threshold"},
    "cli": {"commands", "errors"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(module: str | None, level: int, importer: str, package: bool) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in module ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".") if package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _is_module(name: str) -> bool:
    """Whether ``name`` is a popcompile module or package (so ``from pkg import name`` imports it)."""
    if not name.startswith("popcompile"):
        return False
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(source: str, importer: str, package: bool = False) -> set[str]:
    """Every module the source imports, absolute: ``from popcompile import errors`` gives
    ``popcompile.errors``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, importer, package)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base)
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def _matches(name: str, pattern: str) -> bool:
    """``name`` is ``pattern`` or inside it; a trailing ``*`` matches any name that starts with the rest."""
    if pattern.endswith("*"):
        return name.startswith(pattern[:-1])
    return name == pattern or name.startswith(pattern + ".")


def violations(folder: str, allowed, forbidden) -> list[str]:
    """``file: module`` for each import of a .py file under popcompile/folder that breaks the rule."""
    bad = []
    for path in sorted((PACKAGE / folder).rglob("*.py") if folder else PACKAGE.rglob("*.py")):
        for name in sorted(imports(path.read_text(), module_name(path), is_package(path))):
            if forbidden(name) or not allowed(name):
                bad.append(f"{path.relative_to(PACKAGE.parent)}: {name}")
    return bad


def _heavy(name: str) -> bool:
    return any(_matches(name, h) for h in HEAVY)


def test_engine_imports_nothing_heavy_and_only_errors_fsutil_from_popcompile():
    def allowed(name: str) -> bool:
        return not name.startswith("popcompile") or any(_matches(name, ok) for ok in ENGINE_MAY_USE)

    assert (PACKAGE / "engine" / "manifest.py").is_file()
    assert violations("engine", allowed, _heavy) == []


def test_runtime_imports_no_exporters_commands_or_quality_tools():
    def forbidden(name: str) -> bool:
        return any(_matches(name, bad) for bad in RUNTIME_MUST_NOT_USE)

    assert violations("runtime", lambda name: True, forbidden) == []


def test_only_commands_and_measure_import_measure():
    bad = [line
           for line in violations("", lambda name: True, lambda name: _matches(name, "popcompile.measure"))
           if not any(line.startswith(prefix.replace(".", "/") + "/") for prefix in MAY_USE_TOOLS)]
    assert bad == []


def part(module: str) -> str:
    """The top-level part of a popcompile module: ``popcompile.kvfit.distill`` -> ``kvfit``."""
    return module.split(".")[1]


def test_each_part_imports_only_the_parts_it_may():
    tops = {path.stem if path.suffix == ".py" else path.name for path in PACKAGE.iterdir()
            if (path.suffix == ".py" and path.name != "__init__.py") or (path / "__init__.py").is_file()}
    assert tops == set(MAY_IMPORT), tops ^ set(MAY_IMPORT)  # a new part is placed in the table on purpose
    order = list(MAY_IMPORT)
    assert all(order.index(dep) < order.index(name) for name, deps in MAY_IMPORT.items() for dep in deps)
    bad = sorted(f"{module}: {dep}" for module, deps in module_graph().items() if module.count(".")
                 for dep in deps if part(dep) != part(module) and part(dep) not in MAY_IMPORT[part(module)])
    assert bad == []


def test_compiler_imports_nothing_from_measure():
    """The compiler (driver, config, frontend/, kvfit/, passes/) needs no eval data or measurement tools."""
    def forbidden(name: str) -> bool:
        return _matches(name, "popcompile.measure")

    bad = []
    for part in COMPILER:
        if part.endswith(".py"):
            path = PACKAGE / part
            assert path.is_file(), part
            bad += [f"{part}: {name}" for name in sorted(imports(path.read_text(), module_name(path)))
                    if forbidden(name)]
        else:
            assert (PACKAGE / part).is_dir(), part
            bad += violations(part, lambda name: True, forbidden)
    assert bad == []


def test_only_vllm_loads_the_plugin_and_its_settings_need_no_vllm():
    """Outside vllm_plugin/ only its settings are imported (by the exporter); settings, the entry point's
    module and the hand-off store (tested in the main suite) import no vLLM at module level (the plugin's
    register() imports it when vLLM calls it)."""
    outside = [line for line in violations("", lambda name: True,
                                           lambda name: _matches(name, "popcompile.vllm_plugin")
                                           and not _matches(name, "popcompile.vllm_plugin.settings"))
               if not line.startswith("popcompile/vllm_plugin/")]
    assert outside == []
    for name in ("settings.py", "__init__.py", "handoff.py"):
        tree = ast.parse((PACKAGE / "vllm_plugin" / name).read_text())
        top = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
        top |= {node.module or "" for node in tree.body
                if isinstance(node, ast.ImportFrom) and node.level == 0}
        assert not any(_matches(module, "vllm") for module in top), (name, top)


def module_graph() -> dict[str, set[str]]:
    """popcompile module -> the popcompile modules it imports (every import, function-local ones too)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        graph[name] = {m for m in imports(path.read_text(), name, is_package(path))
                       if m.startswith("popcompile.") and m != name and not m.startswith(name + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    """A package importing its own submodules (``popcompile.x`` -> ``popcompile.x.y``) is not a cycle."""
    assert cycles(module_graph()) == []


def test_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_old_paths_are_gone():
    """The contract moved to engine/, the eval cluster to measure/ (once tools/), loading and capture to
    frontend/, the K/V fits to kvfit/, pipeline.py into driver.py and passes/prefill.py: no shims left
    behind."""
    assert not (PACKAGE / "exporters" / "manifest.py").exists()
    assert not (PACKAGE / "kv.py").exists()
    assert not (PACKAGE / "tools").exists() and not (PACKAGE / "passes" / "gates.py").exists()
    for old in ("models", "arch", "gguf_tokenizer", "capture", "calibrate", "distill", "corpus", "pipeline"):
        assert not (PACKAGE / f"{old}.py").exists(), old
    for old in ("analyze", "evaluate", "eval_engine", "eval_config", "eval_data", "eval_report", "sweep",
                "humaneval"):
        assert not (PACKAGE / f"{old}.py").exists(), old


@pytest.mark.parametrize("source, importer, package, expected", [
    ("from ..exporters.manifest import MANIFEST", "popcompile.runtime.x", False,
     {"popcompile.exporters.manifest"}),
    ("def f():\n    from ..measure.eval import run", "popcompile.runtime.x", False,
     {"popcompile.measure.eval.run"}),
    ("from .. import driver as d", "popcompile.runtime.x", False, {"popcompile.driver"}),
    ("from . import manifest", "popcompile.engine", True, {"popcompile.engine.manifest"}),
    ("from .kv import KVLayout", "popcompile.engine.manifest", False, {"popcompile.engine.kv"}),
    ("from ..errors import EngineError", "popcompile.engine.kv", False, {"popcompile.errors"}),
    ("import onnx.helper\nfrom torch import nn", "popcompile.engine.kv", False, {"onnx.helper", "torch"}),
    ("importlib.import_module('tensorrt')", "popcompile.engine.kv", False, {"tensorrt"}),
])
def test_imports_are_read_as_absolute_names(source, importer, package, expected):
    """The checker itself: relative, function-local and importlib imports all resolve (else the rules above
    would pass vacuously)."""
    assert imports(source, importer, package) == expected


def test_checker_flags_what_it_should():
    assert (_heavy("onnxruntime.capi") and _heavy("torch") and not _heavy("torchvision")
            and not _heavy("numpy"))
    assert (_matches("popcompile.measure.eval.data", "popcompile.measure")
            and not _matches("popcompile.measurex", "popcompile.measure"))
    assert _matches("popcompile.eval_data", "popcompile.eval_*")


def test_importing_engine_loads_no_torch_or_onnx():
    """In a fresh interpreter: the package and all of its modules, then sys.modules."""
    code = textwrap.dedent(
        """
        import importlib, json, pkgutil, sys
        import popcompile.engine as engine
        for info in pkgutil.iter_modules(engine.__path__):
            importlib.import_module(f"popcompile.engine.{info.name}")
        print(json.dumps(sorted(sys.modules)))
        """
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    assert [m for m in loaded if _heavy(m)] == []
    assert [m for m in loaded
            if m.startswith("popcompile.") and not any(_matches(m, ok) for ok in ENGINE_MAY_USE)] == []
    assert {"popcompile.engine.kv", "popcompile.engine.manifest", "popcompile.engine.tensorrt"} <= set(loaded)
