"""One owner per decision (issue 34, popcompile/README.md "Who decides what"): a default is written once.

Read from the source: every function parameter default, dataclass field default and
``add_argument(--flag, default=...)`` in the package whose name is one of ``OWNERS`` and whose value is a
literal (a number, a string, True/False: not None, not a name) must sit in one of that decision's owners.
Elsewhere the default is read from the owner by name (``KVFitConfig.ridge``, ``DEFAULT_FIT_BIAS["ridge"]``),
so changing it in one place changes it everywhere. A literal passed at a call (``min_prompt_tokens=0``:
force POP) is a choice, not a default, and is not counted.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "popcompile"
#: decision -> the modules that own its default (relative to popcompile/)
OWNERS = {
    "ridge": ("config.py",),              # KVFitConfig: how POP+ / POP++ weights are fitted
    "bias": ("config.py",),               # KVFitConfig.bias (None: the method's, DEFAULT_FIT_BIAS)
    "max_tokens": ("config.py",),
    "lr": ("config.py",),                 # DistillConfig
    "held_out": ("config.py",),
    "patience": ("config.py",),
    "prune_ratio": ("config.py",),        # PopConfig, resolve_cut (DEFAULT_PRUNE_RATIO)
    # PopConfig ("auto": measured at export); the formats' reading of a record written before the field
    # existed (0: POP for every prompt) in the engine manifest and the vLLM folder's config entry
    "min_prompt_tokens": ("config.py", "engine/manifest.py", "vllm_plugin/settings.py"),
    "min_speedup": ("threshold.py",),     # the rule that turns a speedup curve into min_prompt_tokens
    "attention": ("exporters/targets.py",),  # OnnxTarget resolves the lowering once (OnnxTarget.lowering)
}


def _name(node: ast.AST) -> str | None:
    return node.arg if isinstance(node, ast.arg) else node.id if isinstance(node, ast.Name) else None


def _literal(node: ast.AST | None) -> bool:
    return (isinstance(node, ast.Constant) and node.value is not None) or (
        isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant))


def literal_defaults(source: str) -> list[tuple[str, int]]:
    """(decision, line) for each literal default of a decision in ``source`` (see the module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
                     *zip(args.kwonlyargs, args.kw_defaults)]
            found += [(a.arg, d.lineno) for a, d in pairs if a.arg in OWNERS and _literal(d)]
        elif isinstance(node, ast.AnnAssign) and _name(node.target) in OWNERS and _literal(node.value):
            found.append((_name(node.target), node.lineno))
        elif isinstance(node, ast.Call):
            flag = node.args[0] if node.args else None
            if (isinstance(flag, ast.Constant) and isinstance(flag.value, str) and flag.value.startswith("--")
                    and flag.value[2:].replace("-", "_") in OWNERS):
                found += [(flag.value[2:].replace("-", "_"), k.lineno) for k in node.keywords
                          if k.arg == "default" and _literal(k.value)]
    return found


def test_each_default_is_written_in_its_owner_only():
    misplaced = [f"{path.relative_to(PACKAGE)}:{line}: {name} (owners: {', '.join(OWNERS[name])})"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for name, line in literal_defaults(path.read_text())
                 if str(path.relative_to(PACKAGE)) not in OWNERS[name]]
    assert misplaced == []


@pytest.mark.parametrize("source, expected", [
    ("def f(x, *, ridge=1e-3): pass", [("ridge", 1)]),
    ("def f(ridge: float = KVFitConfig.ridge): pass", []),
    ("class C:\n    lr: float = 1e-4", [("lr", 2)]),
    ("fit(model, ridge=0.01)", []),  # a choice at a call, not a default
    ("p.add_argument('--max-tokens', type=int, default=65536)", [("max_tokens", 1)]),
    ("p.add_argument('--max-tokens', type=int, default=fit.max_tokens)", []),
    ("def f(prune_ratio=-0.5): pass", [("prune_ratio", 1)]),
])
def test_the_checker_sees_literal_defaults(source, expected):
    """The checker itself, so that the rule above cannot pass by seeing nothing."""
    assert literal_defaults(source) == expected


def test_every_owner_exists_and_names_its_decision():
    """A typo in OWNERS would exempt nothing and check nothing: each owner names the decision (a field, a
    parameter or a DEFAULT_... constant)."""
    for name, owners in OWNERS.items():
        for owner in owners:
            text = (PACKAGE / owner).read_text()
            assert f"{name}:" in text or f"{name} =" in text or f"DEFAULT_{name.upper()}" in text, \
                (name, owner)
