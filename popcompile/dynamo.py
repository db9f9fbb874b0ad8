"""``torch.compile(model, backend="pop")``: POP inside plain PyTorch.

Registered through the ``torch_dynamo_backends`` entry point, so the name works after
``pip install popcompile`` without importing it. Dynamo hands the backend each graph it captures:

- a **decode graph** (sequence length 1) is passed to the inner backend untouched;
- a **prefill graph** (sequence length N > 1) is rewritten by ``fold_boundary_pass``: the deep
  layers keep their K/V projections over all N positions (POP's cache, x_N's from its true hidden
  state) and run attention and MLP for x_N alone, so the call returns x_N's logits at POP's cost. A
  graph traced at a static N (the first prompt without ``dynamic=True``) first gets N as a symbol
  (``passes/static_seq.py``); a second length makes dynamo recompile once with a symbolic N;
- per call, the prefill runs the full graph instead when the call asks for logits at every position
  or the prompt is shorter than ``min_prompt_tokens``;
- anything else (no decoder layers, a graph break inside the model, a static N that cannot be told
  from another size) runs unmodified through the inner backend, with one warning per reason.

Options: ``torch.compile(model, backend="pop", options={"prune_ratio": 1/3, "cut": None,
"inner": "inductor", "kv_calibration": None, "min_prompt_tokens": MIN_PROMPT_TOKENS})``
(``kv_calibration``: POP+ weights from ``popcompile calibrate`` for the same cut, used for
x_1..x_{N-1}). docs/torch_compile.md lists the call forms that work.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import sympy
import torch
import torch.fx as fx

from .config import KVCalibration, PopConfig, resolve_cut
from .errors import ConfigError
from .frontend.arch import TRANSFORMERS_FOLDERS, transformers_folder
from .passes.boundary import UnsupportedGraph, fold_boundary_pass
from .passes.layers import find_layers, is_logits, module_path
from .passes.pop import kv_projection_shapes
from .passes.static_seq import symbolize_sequence
from .threshold import FIXED_MIN_PROMPT_TOKENS, uses_pop

#: prompts shorter than this prefill with the full graph (options={"min_prompt_tokens": N} overrides it;
#: 0: POP for every prompt). docs/prompt_length.md: the threshold rule (popcompile/threshold.py, 1.2x) on
#: this backend (inner eager, 16-2048 tokens) gives 16 for SmolLM2 (1.22x at 16) and 64 for Gemma 3
#: (1.172x / 1.198x / 1.221x at 16 / 32 / 64); one default for every model: the larger.
MIN_PROMPT_TOKENS = FIXED_MIN_PROMPT_TOKENS
_OPTION_NAMES = ("prune_ratio", "cut", "inner", "kv_calibration", "min_prompt_tokens")


class PopFallbackWarning(UserWarning):
    """A graph ran unpruned; the message says why."""


@dataclass(frozen=True)
class PopOptions:
    """What ``options=`` of ``torch.compile(..., backend="pop")`` may hold."""

    prune_ratio: float | None = None
    cut: int | None = None
    inner: str | Callable = "inductor"
    # POP+: a file from `popcompile calibrate` (same cut)
    kv_calibration: KVCalibration | str | Path | None = None
    min_prompt_tokens: int = MIN_PROMPT_TOKENS  # shorter prompts run the full graph (chosen per call)

    def __post_init__(self) -> None:
        try:  # the same rules as an export's (config.PopConfig), with the backend's name in front
            config = PopConfig(cut=self.cut, prune_ratio=self.prune_ratio, kv_calibration=self.kv_calibration,
                               min_prompt_tokens=self.min_prompt_tokens)
        except ConfigError as err:
            raise ConfigError(f"pop backend: {err}") from None
        if config.min_prompt_tokens == "auto":
            raise ConfigError("pop backend: min_prompt_tokens='auto' is an export option: give an int >= 0 "
                              "(0: POP for every prompt)")
        if config.kv_calibration.fits_now:  # minutes of fitting inside a compile call
            # auto: what export fits for a text model
            method = "" if config.kv_calibration.mode == "ridge" else " --method distill"
            raise ConfigError(f"pop backend: kv_calibration={config.kv_calibration.mode!r} fits at export "
                              f"time only: make a file with `popcompile calibrate MODEL --out FILE{method}` "
                              "and give its path")
        object.__setattr__(self, "kv_calibration", config.kv_calibration)
        if not (callable(self.inner) or isinstance(self.inner, str)):
            raise TypeError(f"pop backend: inner={self.inner!r} must be a backend name ('inductor', 'eager') "
                            "or callable")

    @classmethod
    def from_dict(cls, options: Mapping | None) -> PopOptions:
        options = dict(options or {})
        unknown = sorted(set(options) - set(_OPTION_NAMES))
        if unknown:
            raise ConfigError(f"pop backend: unknown options {unknown}: use {', '.join(_OPTION_NAMES)}")
        return cls(**options)

    def resolve_cut(self, num_layers: int) -> int:
        return resolve_cut(num_layers, cut=self.cut, prune_ratio=self.prune_ratio)  # default: 1/3 pruned


@dataclass(frozen=True)
class GraphRecord:
    """What the backend did with one graph dynamo gave it."""

    kind: str  # "prefill-pop" | "prefill-full" (static N < min_prompt_tokens) | "decode" | "fallback"
    nodes_before: int
    nodes_after: int
    cut: int | None = None
    num_layers: int | None = None
    reason: str = ""
    # prefill traced at one static length N (dynamo's first call without dynamic=)
    static_len: int | None = None


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
        cut, num_layers, logits_rows, seq, static_len = plan
        # a static graph only ever sees N
        if static_len is not None and not uses_pop(static_len, opts.min_prompt_tokens):
            reason = f"prompt length {static_len} < min_prompt_tokens={opts.min_prompt_tokens}"
            self.records.append(GraphRecord("prefill-full", before, before, cut, num_layers, reason,
                                            static_len))
            return _inner(opts.inner)(gm, example_inputs)
        pruned = fx.GraphModule(gm, _copy_graph(gm.graph))  # the pass rewrites a copy: gm stays whole
        try:
            _fold(pruned, cut, _kv_weights(opts, cut, num_layers, gm.graph), static_len)
        except UnsupportedGraph as err:
            self._warn(str(err))
            self.records.append(GraphRecord("fallback", before, before, reason=str(err)))
            return _inner(opts.inner)(gm, example_inputs)
        self.records.append(GraphRecord(kind, before, len(pruned.graph.nodes), cut, num_layers,
                                        static_len=static_len))
        pop_fn = _inner(opts.inner)(pruned, example_inputs)
        return _Guarded(pop_fn, lambda: _inner(opts.inner)(gm, example_inputs),
                        self._chooser(gm, logits_rows, seq, opts))

    def _plan(self, gm: fx.GraphModule, opts: PopOptions):
        family = _family(gm.graph)  # before find_layers, whose own refusal would not name it
        if family is not None and family not in TRANSFORMERS_FOLDERS:
            return "fallback", (f"transformers' {family} is not a family popcompile prunes (supported: "
                                f"{', '.join(sorted(TRANSFORMERS_FOLDERS))}; docs/families.md)"), None
        layers = find_layers(gm.graph)
        if not layers:
            return "fallback", _NO_LAYERS, None
        hidden = layers[0].input.meta.get("example_value")
        if hidden is None or hidden.dim() != 3:
            return "fallback", "the first layer's input has no [batch, seq, hidden] shape", None
        seq = hidden.shape[1]
        if _is_one(seq):
            return "decode", "", None
        if _experts_without_the_op(gm.graph):
            return "fallback", _MOE, None
        logits = _logits_node(gm.graph)
        if logits is None:
            return "fallback", "no LM head output in the graph (a graph break inside the model?)", None
        cut = opts.resolve_cut(len(layers))
        static_len = None if isinstance(seq, torch.SymInt) else int(seq)
        return "prefill-pop", "", (cut, len(layers), logits.meta["example_value"].shape[1], seq, static_len)

    def _chooser(self, gm: fx.GraphModule, logits_rows, seq, opts: PopOptions) -> Callable[[tuple], bool]:
        """args -> run POP? Full graph for all-position logits (with a warning) and for short prompts."""
        sizes = _SizeReader(gm)

        def use_pop(args) -> bool:
            if sizes.value(logits_rows, args) != 1:
                self._warn(_ALL_ROWS)
                return False
            return uses_pop(sizes.value(seq, args), opts.min_prompt_tokens)
        return use_pop

    def _warn(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"popcompile: graph runs unpruned: {reason}", PopFallbackWarning, stacklevel=2)


_NO_LAYERS = ("no decoder layers ('layers.<i>' modules with an input_layernorm) in the graph (a graph break "
              "inside the model? a vision-language model's image placement breaks the graph unless "
              "torch._dynamo.config.capture_dynamic_output_shape_ops and capture_scalar_outputs are True: "
              "docs/torch_compile.md)")
_ALL_ROWS = ("the call asks for logits at more than the last position; POP computes only the last "
             "(pass logits_to_keep=1, as generate() does)")


class _Guarded:
    """Per call: the POP graph when ``use_pop(args)`` (one logits row, as ``generate`` asks, and a prompt of
    at least ``min_prompt_tokens``), else the full graph, compiled at its first use."""

    def __init__(self, pop_fn, make_full, use_pop: Callable[[tuple], bool]):
        self.pop_fn, self.make_full, self.full_fn, self.use_pop = pop_fn, make_full, None, use_pop

    def __call__(self, *args):
        if self.use_pop(args):
            return self.pop_fn(*args)
        if self.full_fn is None:
            self.full_fn = self.make_full()
        return self.full_fn(*args)


class _SizeReader:
    """Evaluates a graph's size expressions (e.g. the sequence length s0) from the call's inputs."""

    def __init__(self, gm: fx.GraphModule):
        # symbol -> how to read it: a SymInt input, or a tensor input's dim of exactly that size
        self.readers: dict = {}
        for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.SymInt):
                self.readers.setdefault(value.node.expr, lambda args, i=i: int(args[i]))
            elif isinstance(value, torch.Tensor):
                for d, size in enumerate(value.shape):
                    if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                        self.readers.setdefault(size.node.expr, lambda args, i=i, d=d: int(args[i].shape[d]))

    def value(self, size, args) -> int:
        if not isinstance(size, torch.SymInt):
            return int(size)
        expr = size.node.expr
        missing = expr.free_symbols - set(self.readers)
        assert not missing, f"size {expr} has symbols {missing} that no graph input carries"
        return int(expr.subs({sym: self.readers[sym](args) for sym in expr.free_symbols}))


def _fold(gm: fx.GraphModule, cut: int, kv_weights, static_len: int | None) -> None:
    """The POP rewrite; a static-length graph first gets its sequence length as a symbol (static_seq.py)."""
    if static_len is None:
        fold_boundary_pass(gm, cut, kv_weights)
        return
    symbolized = symbolize_sequence(gm, static_len)
    try:
        fold_boundary_pass(gm, cut, kv_weights)
    finally:
        symbolized.restore_meta()


def _kv_weights(opts: PopOptions, cut: int, num_layers: int, graph: fx.Graph):
    """A calibration file's weights, checked against the cut and the graph's k/v projections as export checks
    them against the model's (InputError naming what to re-run); None for kv_calibration none."""
    from .kvfit.calibrate import check_kv_shapes
    from .kvfit.fit import resolve_file_fit

    fit = resolve_file_fit(opts.kv_calibration, cut, num_layers)
    if fit is None:
        return None
    check_kv_shapes(fit, kv_projection_shapes(graph, cut + 1))
    return fit.weights


_MOE = ("a mixture of experts run by transformers' own experts implementation (tokens sorted by expert: no "
        "last position to take): call popcompile.use_pop_experts(model) before torch.compile")


def _family(graph: fx.Graph) -> str | None:
    """The transformers model folder of the graph's decoder layers (the ``...DecoderLayer`` class in its
    nodes' module stacks), None for a model of the user's own."""
    for node in graph.nodes:
        for _, cls in (node.meta.get("nn_module_stack") or {}).values():
            if isinstance(cls, type) and cls.__name__.endswith("DecoderLayer"):
                return transformers_folder(cls)
    return None


def _experts_without_the_op(graph: fx.Graph) -> bool:
    """Nodes inside an experts module (``...mlp.experts``) but no ``popcompile::experts`` call."""
    inside = any(module_path(n).endswith(".experts") for n in graph.nodes if n.op == "call_function")
    return inside and not any("popcompile.experts" in str(n.target) for n in graph.nodes)


def _is_one(size) -> bool:
    return not isinstance(size, torch.SymInt) and size == 1


def _logits_node(graph: fx.Graph) -> fx.Node | None:
    found = [n for n in graph.output_node().all_input_nodes if is_logits(n)]
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
