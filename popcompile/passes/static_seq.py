"""Give a dynamo graph traced at a static sequence length N a symbolic one, so the POP pass applies.

Without ``dynamic=True`` dynamo traces the first prompt with static shapes: N is a literal in the
graph (``view(linear, (1, N, -1, 64))``, ``arange(N)``, ``add_(length, N)``), and ``fold_boundary_pass``
cannot tell the sequence dimension from another of the same size. This pass re-derives the shapes
with N as a symbol ``s``:

- the token inputs (integer-dtype placeholders: ``input_ids``, ``position_ids``, masks, cache
  positions) get ``s`` in every dimension of size N; parameters, buffers and float inputs stay static;
- every call runs on fake tensors with the literal ints equal to N replaced by ``s``;
- if that forces ``s`` to a constant (N was also another size, e.g. the head dim, and the two met),
  the graph is refused: ``UnsupportedGraph``.

On success the graph is rewritten so the literals read ``input_ids.size(dim)`` instead (the same value
in every call this graph serves: dynamo's guards fix N), and every node's ``example_value`` is the
symbolic one. ``restore_meta`` puts the static values back once the POP pass has read them, so the
inner backend sees the metadata of dynamo's own fake mode only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from .boundary import UnsupportedGraph


@dataclass(frozen=True)
class Symbolized:
    """What ``symbolize_sequence`` changed: the size node it added, and each node's static example_value."""

    size_node: fx.Node
    seq_len: int
    static_meta: dict

    def restore_meta(self) -> None:
        for node in self.size_node.graph.nodes:
            if node in self.static_meta:
                node.meta["example_value"] = self.static_meta[node]
        self.size_node.meta["example_value"] = self.seq_len


def symbolize_sequence(gm: fx.GraphModule, seq_len: int) -> Symbolized:
    """In place (module docstring). Raises UnsupportedGraph when N cannot be told apart from other sizes."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise UnsupportedGraph(f"sequence length {seq_len!r}: a static prefill graph needs N >= 2")
    env = ShapeEnv()
    symbol = env.create_symbol(seq_len, ConstantSource("pop_sequence_length"), dynamic_dim=DimDynamic.DYNAMIC)
    seq = env.create_symintnode(symbol, hint=seq_len)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)  # get_attr constants: real tensors
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with mode:
        inputs = [_fake_input(node.meta.get("example_value"), seq_len, seq) for node in placeholders]
    token = _token_input(placeholders, seq_len)
    runner = _SymbolicRun(gm, seq_len, seq)
    try:
        with mode:
            runner.run(*inputs)
    except Exception as err:  # noqa: BLE001 - any op that refuses a symbolic N: this graph stays unpruned
        raise UnsupportedGraph(f"the static graph does not run with a symbolic sequence length "
                               f"({type(err).__name__}: {str(err)[:200]}): "
                               f"compile with dynamic=True") from err
    _check_unambiguous(runner.values, seq_len, symbol, env)
    with gm.graph.inserting_after(placeholders[-1]):
        size = gm.graph.call_method("size", (token[0], token[1]))
    static = {node: node.meta.get("example_value") for node in gm.graph.nodes if node is not size}
    for node in runner.literal_nodes:
        node.args = _replace(node.args, seq_len, size)
        node.kwargs = _replace(node.kwargs, seq_len, size)
    for node, value in runner.values.items():
        node.meta["example_value"] = value
    size.meta["example_value"] = seq
    gm.recompile()
    return Symbolized(size, seq_len, static)


def _check_unambiguous(values: dict, seq_len: int, symbol, env: ShapeEnv) -> None:
    """Refuse when N may have meant something else: another value has a dim of size N (a head dim of N,
    a rotary half of N...), a dim mixes s with other sizes, or the run pinned s to a constant."""
    for node, value in values.items():
        for size in (value.shape if isinstance(value, torch.Tensor) else ()):
            expr = size.node.expr if isinstance(size, torch.SymInt) else size
            mixed = getattr(expr, "free_symbols", set()) and expr != symbol
            if expr == seq_len or mixed:
                raise UnsupportedGraph(
                    f"the static sequence length {seq_len} cannot be told apart from another size "
                    f"({node.name} has shape {tuple(value.shape)}): compile with dynamic=True, "
                    "or the next prompt length recompiles with a symbolic one")
    if symbol in env.replacements:
        raise UnsupportedGraph(f"the static sequence length {seq_len} is pinned by the graph: "
                               f"compile with dynamic=True")


def _fake_input(value, seq_len: int, seq: torch.SymInt):
    """A fake tensor like ``value``; token inputs (integer dtype) get ``seq`` for dims of size N."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype.is_floating_point or seq_len not in value.shape:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    if value.dim() >= 2 and value.shape[0] == seq_len:  # batch == N: which dims are the sequence?
        raise UnsupportedGraph(f"a token input of shape {tuple(value.shape)} has the static sequence length "
                               f"{seq_len} as its batch size too: compile with dynamic=True")
    # no SymInt == int test: it would guard
    shape = [seq if size == seq_len else size for size in value.shape]
    return torch.empty(shape, dtype=value.dtype, device=value.device)


def _token_input(placeholders: list[fx.Node], seq_len: int) -> tuple[fx.Node, int]:
    """The first integer-dtype input with a dim of size N (``input_ids`` [B, N]), and that dim."""
    for node in placeholders:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and not value.dtype.is_floating_point and seq_len in value.shape:
            return node, list(value.shape).index(seq_len)
    raise UnsupportedGraph(f"no integer input (input_ids) has the sequence length {seq_len}: "
                           "inputs_embeds prompts need dynamic=True")


def _replace(args, seq_len: int, by):
    return fx.node.map_aggregate(args, lambda a: by if type(a) is int and a == seq_len else a)


def _has_literal(args, seq_len: int) -> bool:
    found = []
    fx.node.map_aggregate(args, lambda a: found.append(a) if type(a) is int and a == seq_len else None)
    return bool(found)


class _SymbolicRun(fx.Interpreter):
    """Runs the graph on fake inputs with literal N read as ``seq``; keeps each node's value."""

    def __init__(self, gm: fx.GraphModule, seq_len: int, seq: torch.SymInt):
        super().__init__(gm, garbage_collect_values=False)
        self.seq_len, self.seq = seq_len, seq
        self.values: dict[fx.Node, object] = {}
        self.literal_nodes: list[fx.Node] = []

    def run_node(self, node: fx.Node):
        if (node.op in ("call_function", "call_method")
                and _has_literal((node.args, node.kwargs), self.seq_len)):
            self.literal_nodes.append(node)
        value = super().run_node(node)
        self.values[node] = value
        return value

    def call_function(self, target, args, kwargs):
        return super().call_function(target, _replace(args, self.seq_len, self.seq),
                                     _replace(kwargs, self.seq_len, self.seq))

    def call_method(self, target, args, kwargs):
        return super().call_method(target, _replace(args, self.seq_len, self.seq),
                                   _replace(kwargs, self.seq_len, self.seq))
