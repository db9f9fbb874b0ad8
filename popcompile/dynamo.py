"""``torch.compile(model, backend="pop")``: POP inside plain PyTorch.

Registered through the ``torch_dynamo_backends`` entry point, so the name works after
``pip install popcompile`` without importing it. Dynamo hands the backend each graph it captures:

- a **decode graph** (sequence length 1) is passed to the inner backend untouched;
- a **prefill graph** (symbolic sequence length N) is rewritten by ``fold_boundary_pass``: the deep
  layers keep their K/V projections over all N positions (POP's cache, x_N's from its true hidden
  state) and run attention and MLP for x_N alone, so the call returns x_N's logits at POP's cost;
- anything else (no decoder layers, a graph break inside the model, a static sequence length, a
  call that asks for logits at every position) runs unmodified through the inner backend, with one
  warning per reason.

Options: ``torch.compile(model, backend="pop", dynamic=True, options={"prune_ratio": 1/3, "cut": None,
"inner": "inductor", "kv_calibration": None})`` (``kv_calibration``: POP+ weights from ``popcompile
calibrate`` for the same cut, used for x_1..x_{N-1}). ``dynamic=True`` gives dynamo's graphs a symbolic sequence length from the
first prompt on (without it the first prompt length is compiled static and runs unpruned).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import sympy
import torch
import torch.fx as fx

from .passes.boundary import UnsupportedGraph, fold_boundary_pass
from .passes.layers import find_layers, module_path
from .passes.pop import resolve_cut


class PopFallbackWarning(UserWarning):
    """A graph ran unpruned; the message says why."""


@dataclass(frozen=True)
class PopOptions:
    """What ``options=`` of ``torch.compile(..., backend="pop")`` may hold."""

    prune_ratio: float | None = None
    cut: int | None = None
    inner: str | Callable = "inductor"
    kv_calibration: str | Path | None = None  # POP+: a file from `popcompile calibrate` (same cut)

    def __post_init__(self) -> None:
        if self.cut is not None and self.prune_ratio is not None:
            raise ValueError("pop backend: give options 'cut' or 'prune_ratio', not both")
        if self.prune_ratio is not None and not 0.0 <= self.prune_ratio < 1.0:
            raise ValueError(f"pop backend: prune_ratio={self.prune_ratio} is out of range: use 0 <= prune_ratio < 1")
        if self.cut is not None and (isinstance(self.cut, bool) or not isinstance(self.cut, int) or self.cut < 1):
            raise ValueError(f"pop backend: cut={self.cut!r} must be a layer index >= 1")
        if self.kv_calibration is not None and not Path(self.kv_calibration).is_file():
            raise ValueError(f"pop backend: kv_calibration={self.kv_calibration!s} is not a file: "
                             f"make one with `popcompile calibrate MODEL --out FILE`")
        if not (callable(self.inner) or isinstance(self.inner, str)):
            raise TypeError(f"pop backend: inner={self.inner!r} must be a backend name ('inductor', 'eager') or callable")

    @classmethod
    def from_dict(cls, options: Mapping | None) -> PopOptions:
        options = dict(options or {})
        unknown = sorted(set(options) - {"prune_ratio", "cut", "inner", "kv_calibration"})
        if unknown:
            raise ValueError(f"pop backend: unknown options {unknown}: use prune_ratio, cut, inner, kv_calibration")
        return cls(**options)

    def resolve_cut(self, num_layers: int) -> int:
        return resolve_cut(num_layers, cut=self.cut, prune_ratio=self.prune_ratio)  # default: 1/3 pruned


@dataclass(frozen=True)
class GraphRecord:
    """What the backend did with one graph dynamo gave it."""

    kind: str  # "prefill-pop" | "decode" | "fallback"
    nodes_before: int
    nodes_after: int
    cut: int | None = None
    num_layers: int | None = None
    reason: str = ""


@dataclass(eq=False)  # hashed by identity: dynamo keys its caches by backend
class PopBackend:
    """The backend. ``records`` lists every graph compiled, for inspection and tests."""

    options: PopOptions = field(default_factory=PopOptions)
    records: list[GraphRecord] = field(default_factory=list)
    _warned: set = field(default_factory=set, repr=False)

    def __call__(self, gm: fx.GraphModule, example_inputs: list, options: Mapping | None = None):
        opts = PopOptions.from_dict(options) if options is not None else self.options
        before = len(gm.graph.nodes)
        try:
            kind, reason, plan = self._plan(gm, opts)
        except (UnsupportedGraph, ValueError) as err:
            kind, reason, plan = "fallback", str(err), None
        if kind == "fallback":
            self._warn(reason)
        if plan is None:
            self.records.append(GraphRecord(kind, before, before, reason=reason))
            return _inner(opts.inner)(gm, example_inputs)
        cut, num_layers, logits_rows = plan
        pruned = fx.GraphModule(gm, _copy_graph(gm.graph))  # the pass rewrites a copy: gm stays whole
        try:
            fold_boundary_pass(pruned, cut, _kv_weights(opts, cut, num_layers))
        except UnsupportedGraph as err:
            self._warn(str(err))
            self.records.append(GraphRecord("fallback", before, before, reason=str(err)))
            return _inner(opts.inner)(gm, example_inputs)
        self.records.append(GraphRecord(kind, before, len(pruned.graph.nodes), cut, num_layers))
        pop_fn = _inner(opts.inner)(pruned, example_inputs)
        return _Guarded(pop_fn, lambda: _inner(opts.inner)(gm, example_inputs), logits_rows, gm,
                        on_full=lambda: self._warn(_ALL_ROWS))

    def _plan(self, gm: fx.GraphModule, opts: PopOptions):
        layers = find_layers(gm.graph)
        if not layers:
            return "fallback", "no decoder layers ('layers.<i>' modules with an input_layernorm) in the graph", None
        hidden = layers[0].input.meta.get("example_value")
        if hidden is None or hidden.dim() != 3:
            return "fallback", "the first layer's input has no [batch, seq, hidden] shape", None
        if _is_one(hidden.shape[1]):
            return "decode", "", None
        if not isinstance(hidden.shape[1], torch.SymInt):
            return "fallback", ("the sequence length is static: compile with torch.compile(..., dynamic=True) "
                                "for POP from the first prompt"), None
        logits = _logits_node(gm.graph)
        if logits is None:
            return "fallback", "no LM head output in the graph (a graph break inside the model?)", None
        cut = opts.resolve_cut(len(layers))
        return "prefill-pop", "", (cut, len(layers), logits.meta["example_value"].shape[1])

    def _warn(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"popcompile: graph runs unpruned: {reason}", PopFallbackWarning, stacklevel=2)


_ALL_ROWS = ("the call asks for logits at more than the last position; POP computes only the last "
             "(pass logits_to_keep=1, as generate() does)")


class _Guarded:
    """Runs the POP graph when the call keeps one logits row (as ``generate`` asks), else the full graph."""

    def __init__(self, pop_fn, make_full, logits_rows, gm: fx.GraphModule, on_full: Callable[[], None]):
        self.pop_fn, self.make_full, self.full_fn, self.on_full = pop_fn, make_full, None, on_full
        self.rows = logits_rows
        # symbol of each SymInt placeholder -> its position among the inputs
        self.symbols = {node.meta["example_value"].node.expr: i
                        for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
                        if isinstance(node.meta.get("example_value"), torch.SymInt)}

    def __call__(self, *args):
        if self._one_row(args):
            return self.pop_fn(*args)
        if self.full_fn is None:
            self.on_full()
            self.full_fn = self.make_full()
        return self.full_fn(*args)

    def _one_row(self, args) -> bool:
        if not isinstance(self.rows, torch.SymInt):
            return self.rows == 1
        expr = self.rows.node.expr
        values = {sym: int(args[i]) for sym, i in self.symbols.items() if sym in expr.free_symbols}
        return bool(sympy.Eq(expr.subs(values), 1))


def _kv_weights(opts: PopOptions, cut: int, num_layers: int):
    if opts.kv_calibration is None or cut == num_layers:
        return None
    from .calibrate import check_fit, load_fit

    fit = load_fit(opts.kv_calibration)
    check_fit(fit, cut, num_layers)  # ValueError naming the cut to calibrate for
    return fit.weights


def _is_one(size) -> bool:
    return not isinstance(size, torch.SymInt) and size == 1


def _logits_node(graph: fx.Graph) -> fx.Node | None:
    found = [n for n in graph.output_node().all_input_nodes if module_path(n).endswith("lm_head")]
    return found[0] if len(found) == 1 else None


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    copy = fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


def _inner(inner: str | Callable) -> Callable:
    if callable(inner):
        return inner
    if inner == "eager":
        return lambda gm, example_inputs: gm.forward
    from torch._dynamo import lookup_backend

    return lookup_backend(inner)


#: the instance behind ``backend="pop"``
pop = PopBackend()
