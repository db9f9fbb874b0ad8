"""One owner per decision (popcompile/README.md "Who decides what"): a default is written once, a rule is
computed once.

Read from the source: every function parameter default, dataclass field default and
``add_argument(--flag, default=...)`` in the package whose name is one of ``OWNERS`` and whose value is a
literal (a number, a string, True/False: not None, not a name) must sit in one of that decision's owners.
Elsewhere the default is read from the owner by name (``KVFitConfig.ridge``, ``DEFAULT_FIT_BIAS["ridge"]``),
so changing it in one place changes it everywhere. A literal passed at a call (``min_prompt_tokens=0``:
force POP) is a choice, not a default, and is not counted.

The rules are read from the source the same way (``RULES``): each names the code shapes that compute the
decision and the modules allowed to hold them; every checker has a self-test, so that a check cannot pass
by seeing nothing.
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
    "budget_s": ("config.py",),           # KVFitConfig.budget_s (DEFAULT_CALIBRATION_BUDGET_S)
    "prune_ratio": ("config.py",),        # PopConfig, resolve_cut (DEFAULT_PRUNE_RATIO)
    # PopConfig ("auto": measured at export); the formats' reading of a record written before the field
    # existed (0: POP for every prompt) in the engine manifest and the vLLM folder's config entry
    "min_prompt_tokens": ("config.py", "engine/manifest.py", "vllm_plugin/settings.py"),
    "min_speedup": ("threshold.py",),     # the rule that turns a speedup curve into min_prompt_tokens
    "attention": ("exporters/targets.py",),  # OnnxTarget resolves the lowering once (OnnxTarget.lowering)
    # PopConfig; the manifest's reading of a version-1 file; reference.Variant.boundary is another flag (a
    # bool: whether the eager reference runs the boundary token through the full model)
    "boundary": ("config.py", "engine/manifest.py", "reference.py"),
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


# --- rules computed in one place ------------------------------------------------------------------------

def _sources() -> dict[str, ast.AST]:
    return {str(path.relative_to(PACKAGE)): ast.parse(path.read_text())
            for path in sorted(PACKAGE.rglob("*.py"))}


def _mentions(node: ast.AST, word: str) -> bool:
    return word in ast.unparse(node)


def prompt_rule(tree: ast.AST) -> list[int]:
    """Lines comparing a prompt length with ``min_prompt_tokens`` / a ``threshold`` (<, <=, >, >=); a check
    against the literal 0 (a value's validation) is not the rule."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in node.ops)
            and any(_mentions(side, "min_prompt_tokens") or _name(side) == "threshold"
                    for side in (node.left, *node.comparators))
            and not any(isinstance(side, ast.Constant) and side.value == 0 for side in node.comparators)]


def names_used(*names: str):
    """Lines reading any of ``names`` (a name, an attribute, an import): the owner's constants and helpers."""
    def find(tree: ast.AST) -> list[int]:
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in names or isinstance(node, ast.Attribute) and \
                    node.attr in names:
                found.append(node.lineno)
            elif isinstance(node, ast.ImportFrom) and any(a.name in names for a in node.names):
                found.append(node.lineno)
        return found
    return find


def lowering_choice(tree: ast.AST, owner: str = "lowering") -> list[int]:
    """Lines choosing an attention lowering (a conditional whose branch is the literal fused or standard)
    outside a function named ``owner`` (OnnxTarget.lowering)."""
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == owner
              for n in ast.walk(f)}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.IfExp) and id(node) not in inside
            and any(isinstance(b, ast.Constant) and b.value in ("fused", "standard")
                    for b in (node.body, node.orelse))]


def byte_sizes(tree: ast.AST) -> list[int]:
    """Lines writing a dtype's byte size: a dict {"float16": 2, ...} or ``4 if dtype == "float32" else 2``."""
    dtypes = ("float32", "float16", "bfloat16")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in dtypes and
                                              isinstance(v, ast.Constant) and isinstance(v.value, int)
                                              for k, v in zip(node.keys, node.values)):
            found.append(node.lineno)
        elif isinstance(node, ast.IfExp) and any(d in ast.unparse(node.test) for d in dtypes) and all(
                isinstance(b, ast.Constant) and isinstance(b.value, int) for b in (node.body, node.orelse)):
            found.append(node.lineno)
    return found


def mode_none(tree: ast.AST) -> list[int]:
    """Lines deciding that a kv_calibration gives no weights (``kv.mode == "none"``)."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and _mentions(node.left, "mode") and any(isinstance(c, ast.Constant) and c.value == "none"
                                                    for c in node.comparators)]


def compares(*names: str):
    """Lines comparing anything with one of ``names`` (==, !=, in): a version check against a constant."""
    def find(tree: ast.AST) -> list[int]:
        return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
                and any(_name(side) in names or isinstance(side, ast.Attribute) and side.attr in names
                        for side in (node.left, *node.comparators))]
    return find


def calls(*functions: str):
    """Lines calling any of ``functions`` (by name or attribute)."""
    def find(tree: ast.AST) -> list[int]:
        return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and
                (_name(node.func) in functions or isinstance(node.func, ast.Attribute)
                 and node.func.attr in functions)]
    return find


#: decision -> (what computes it, the modules allowed to)
RULES = {
    # POP for a prompt of at least min_prompt_tokens: threshold.uses_pop (runtime, torch.compile, vLLM)
    "prompt >= min_prompt_tokens -> POP": (prompt_rule, ("threshold.py",)),
    # the share to prune and the cut it gives: config.check_cut_choice, config.resolve_cut
    "cut / prune_ratio rules": (names_used("is_prune_ratio", "DEFAULT_PRUNE_RATIO"), ("config.py",)),
    # the ridge solve: one solver (calibrate.ridge_solve), fed by one accumulator (calibrate.CutMoments)
    "the ridge fit": (calls("solve", "lstsq", "ridge_solve", "_AllCutMoments"), ("kvfit/calibrate.py",)),
    # auto -> fused | standard per dtype: OnnxTarget.lowering, and nowhere else (its own module included)
    "attention lowering": (lowering_choice, ()),
    # none / a file / fitted: kvfit.fit (resolve_fit, resolve_file_fit); KVCalibration says what a mode is
    "kv_calibration -> K/V weights": (mode_none, ("config.py", "kvfit/fit.py")),
    "a calibration file checked against the cut": (calls("check_fit"), ("kvfit/fit.py",)),
    "dtype byte sizes": (byte_sizes, ("engine/kv.py",)),
    # POP's K/V rows of a pruned layer: frontend.arch.pruned_kv (the pass rewires graphs to the same recipe)
    "the POP K/V formula": (names_used("k_norm"), ("frontend/arch.py",)),
    # the versions a manifest is written with and read at: engine.manifest (format_version,
    # is_readable_version)
    "manifest versions": (names_used("FORMAT_VERSION", "VISION_FORMAT_VERSION", "READABLE_VERSIONS"),
                          ("engine/manifest.py",)),
    # what marks a folder as ours: engine.manifest.is_engine_manifest (an engine), engine.vllm_folder.
    # is_readable_entry (a vLLM folder's config.json entry, read by the plugin too)
    "engine / vLLM folder format": (compares("FORMAT"), ("engine/manifest.py", "engine/vllm_folder.py")),
    # a K/V fit's k/v shapes against a model's or a graph's: kvfit.calibrate.check_kv_shapes
    "a K/V fit's shapes checked": (compares("got_shapes"), ("kvfit/calibrate.py",)),
    # where a K/V fit runs (auto -> cuda | cpu, an absent device refused) and what it is estimated to cost:
    # kvfit.budget (resolve_device, device_speed, plan_fit)
    "the K/V fit's device and estimate": (calls("is_available", "device_speed", "fit_work"),
                                          ("kvfit/budget.py",)),
}


@pytest.mark.parametrize("decision", RULES)
def test_each_rule_is_computed_by_its_owner_only(decision):
    find, owners = RULES[decision]
    misplaced = [f"{name}:{line}" for name, tree in _sources().items() if name not in owners
                 for line in find(tree)]
    assert misplaced == [], f"{decision}: computed outside {', '.join(owners)}"


def test_each_rule_is_found_in_its_owner():
    """A checker that matched nothing anywhere would pass everywhere: each finds its owner's own code."""
    sources = _sources()
    for decision, (find, owners) in RULES.items():
        assert not owners or any(find(sources[owner]) for owner in owners), decision
    assert lowering_choice(sources["exporters/targets.py"], owner="") != []  # OnnxTarget.lowering's own

@pytest.mark.parametrize("find, source, expected", [
    (prompt_rule, "use = n >= min_prompt_tokens", [1]),
    (prompt_rule, "short = prompt < threshold", [1]),
    (prompt_rule, "if self.min_prompt_tokens < 0: pass", []),  # validation
    (prompt_rule, "use = uses_pop(n, min_prompt_tokens)", []),
    (names_used("is_prune_ratio"), "from ..config import is_prune_ratio", [1]),
    (names_used("is_prune_ratio"), "ok = config.is_prune_ratio(x)", [1]),
    (calls("solve"), "w = torch.linalg.solve(a, b)", [1]),
    (lowering_choice, 'a = "standard" if x == "standard" else "fused"', [1]),
    (lowering_choice, 'a = self.lowering(dtype)', []),
    (lowering_choice, 'def lowering(self, d):\n    return "fused" if d == "float32" else "standard"', []),
    (byte_sizes, 'size = 4 if self.dtype == "float32" else 2', [1]),
    (byte_sizes, 'SIZE = {"float16": 2}', [1]),
    (byte_sizes, 'size = ITEMSIZE[self.dtype]', []),
    (mode_none, 'if opts.kv_calibration.mode == "none": pass', [1]),
    (calls("check_fit"), "check_fit(fit, cut, layers)", [1]),
    (calls("is_available"), "gpu = torch.cuda.is_available()", [1]),
    (names_used("k_norm"), "norm = layer.get_submodule(spec.k_norm)", [1]),
    (names_used("FORMAT_VERSION"), "v = {'format_version': FORMAT_VERSION}", [1]),
    (compares("FORMAT"), "ok = entry.get('format') != FORMAT", [1]),
    (compares("FORMAT"), "ok = is_readable_entry(entry)", []),
])
def test_the_rule_checkers_see_a_second_site(find, source, expected):
    assert find(ast.parse(source)) == expected


def step_names() -> list[str]:
    """Every progress name an export or build-trt reports (the driver's, the writers', TensorRT's)."""
    from popcompile.config import PopConfig
    from popcompile.driver import steps
    from popcompile.exporters.steps import ONNX_WRITE_STEPS
    from popcompile.exporters.tensorrt import BUILD_STEPS

    names = {*BUILD_STEPS, *(step.name for step in ONNX_WRITE_STEPS)}
    for target in ("onnx", "tensorrt", "vllm"):
        names.update(steps(PopConfig(), target))
    return sorted(names)


def literal_counts(names: list[str], trees) -> dict[str, int]:
    """How many string literals in ``trees`` equal each of ``names``."""
    counts = dict.fromkeys(names, 0)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in counts:
                counts[node.value] += 1
    return counts


def test_each_step_name_is_written_once():
    """A step's name is a literal in one place; the writers, the driver and the CLI read it from there. Names
    of one word (load, calibrate, distill) are ordinary words elsewhere too and are not counted."""
    names = [name for name in step_names() if " " in name]
    assert len(names) >= 10
    counts = literal_counts(names, _sources().values())
    assert {name: n for name, n in counts.items() if n > 1} == {}  # 0: built from data (PLANS)


def test_the_step_counter_sees_a_second_definition():
    trees = [ast.parse('A = "write manifest"'), ast.parse('step("write manifest")')]
    assert literal_counts(["write manifest"], trees) == {"write manifest": 2}
