"""POP with the boundary token folded in: one prefill graph for x_1..x_N whose deep layers run x_N only.

The POP pass (``pop.py``) makes a graph for x_1..x_{N-1} and leaves x_N to the decode graph. Inside
``torch.compile`` there is no decode graph to hand when the prompt arrives: the model's forward is
called once on all N tokens. This pass rewrites that one N-token graph so it computes exactly what
POP computes, at POP's cost:

Before, layer l >= cut (every position through every layer)::

    x_l [B,N,d] -> norm -> q,k,v proj -> RoPE -> cache write (k,v) -> SDPA(causal) -> o_proj -> + -> MLP ...
        ... -> + -> x_{l+1}
    x_L -> final norm -> lm_head -> logits

After (``x̄`` = the last position only, [B,1,d]; ``h_cut`` = input of layer ``cut``)::

    kv_in_l = h_cut                               (l == cut)
            = cat(h_cut[:, :N-1], x̄_l)            (l >  cut: POP's projection of h_cut, x_N's true state)
    kv_in_l -> norm -> k,v proj -> RoPE -> cache write            (all N positions, as POP)
    x̄_l -> norm -> q proj -> RoPE(last position) -> SDPA(q̄; all N keys, not causal) -> o_proj -> + -> MLP ...
        ... -> + -> x̄_{l+1}
    x̄_L -> final norm -> lm_head -> logits [B,1,V]

Layers ``0..cut-1`` are untouched. Deep layers keep their K/V projections over all positions (the
cache the decode steps read) and run queries, attention output and MLP for x_N alone; the rest is
dead code and goes. The "last-position copy" is made node by node: a node that reads a last-position
value is copied with its other tensor inputs sliced to the last position along their sequence
dimension, and the sequence length replaced by 1 in its shape arguments. Requires a symbolic
sequence length (``torch.compile(..., dynamic=True)`` or dynamo's automatic dynamic shapes), so
that "the sequence dimension" is never confused with another dimension of the same size.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from .fused import FusedProjectionError, split_fused_projections
from .layers import find_layers, is_logits, layer_part, module_path
from .pop import LINEAR, KVWeights, Projection, eliminate_dead_code, rewire_deep_layers, weight_constant

_SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
#: parts of a layer that only make the cache: never copied to the last position
_KV_PARTS = ("self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm")


class UnsupportedGraph(ValueError):
    """The graph is outside what the pass understands; the reason names what was found."""


@dataclass(frozen=True)
class BoundaryResult:
    graph_module: fx.GraphModule
    cut: int
    num_layers: int
    seq_len: object  # the graph's symbolic sequence length (a torch.SymInt)


def fold_boundary_pass(gm: fx.GraphModule, cut: int, kv_weights: KVWeights | None = None) -> BoundaryResult:
    """Rewrite a dynamo prefill graph in place (see module docstring). Raises UnsupportedGraph."""
    layers = find_layers(gm.graph)
    if not layers:
        raise UnsupportedGraph("no decoder layers ('layers.<i>' modules) found")
    if not 1 <= cut <= len(layers):
        raise ValueError(f"cut={cut} is out of range for a graph with {len(layers)} layers: "
                         f"use 1..{len(layers)}")
    seq, seq_dim = _sequence(layers[0].input)
    if cut == len(layers):
        return BoundaryResult(gm, cut, len(layers), seq)
    try:
        if split_fused_projections(gm.graph, layers[cut:]):  # Phi-3's qkv_proj: K and V nodes of their own
            layers = find_layers(gm.graph)
    except FusedProjectionError as err:
        raise UnsupportedGraph(str(err)) from None
    copier = _LastPosition(gm.graph, seq)
    h_cut, nodes = layers[cut].input, list(gm.graph.nodes)  # the graph's own nodes, before the seed's
    # x̄ of h_cut, copied contiguous: a post-norm layer (OLMo 2) feeds it to q_proj's linear directly, and a
    # strided view into linear makes export guard B != 1 and N != 1 (as in _split_projection)
    last = _slice(gm.graph, h_cut, seq_dim, -1, None)
    with gm.graph.inserting_after(last):
        contiguous = gm.graph.call_function(torch.clone, (last,), {"memory_format": torch.contiguous_format})
    copier.seed(h_cut, contiguous)
    kv_inputs = {}
    deep = {n: layer.index for layer in layers[cut:] for n in layer.nodes}
    for node in nodes:
        index = deep.get(node)
        if index is not None and index > cut and layers[index].nodes[0] is node:
            kv_inputs[index] = _kv_input(gm.graph, node, h_cut, copier.last[layers[index].input], seq_dim)
        if index is not None and layer_part(node)[1].startswith(_KV_PARTS):
            copier.whole.add(node)
            continue
        copier.visit(node)
    _check_output(gm.graph, copier)
    rewire_deep_layers(layers, cut, lambda layer: kv_inputs.get(layer.index, h_cut))
    for index, projections in (kv_weights or {}).items():
        if not cut < index < len(layers):
            raise ValueError(f"kv_weights for layer {index}: "
                             f"only layers {cut + 1}..{len(layers) - 1} take them")
        for name, projection in projections.items():
            _split_projection(gm, layers[index], name, projection, seq_dim)
    eliminate_dead_code(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return BoundaryResult(gm, cut, len(layers), seq)


def _sequence(hidden: fx.Node) -> tuple[object, int]:
    """The symbolic sequence length of the first layer's input hidden state [B, N, d], and its dim."""
    value = _value(hidden)
    if value is None or value.dim() != 3:
        raise UnsupportedGraph(f"the first layer's input {hidden.name} has no [B, N, d] shape recorded")
    seq = value.shape[1]
    if not isinstance(seq, torch.SymInt):
        raise UnsupportedGraph(f"the sequence length is static ({seq}): compile with dynamic=True")
    return seq, 1


def _value(node: fx.Node):
    """The example value recorded on a node: dynamo's ``example_value``, torch.export's ``val``."""
    return node.meta.get("example_value", node.meta.get("val"))


def _same(a, b) -> bool:
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr


def _scaled_by_sequence(size, seq) -> bool:
    """A size that grows by more than one per sequence position (B*N rows: tokens flattened), unlike the
    keys' P+N: its last position is no slice along one dim."""
    if not isinstance(size, torch.SymInt):
        return False
    expr = size.node.expr
    return any(sympy.diff(expr, symbol) not in (0, 1) for symbol in seq.node.expr.free_symbols)


def _slice(graph: fx.Graph, node: fx.Node, dim: int, start, stop) -> fx.Node:
    index = (slice(None),) * dim + (slice(start, stop),)
    with graph.inserting_after(node):
        return graph.call_function(operator.getitem, (node, index))


def _kv_input(graph: fx.Graph, before: fx.Node, h_cut: fx.Node, last: fx.Node, seq_dim: int) -> fx.Node:
    """cat(h_cut[:, :N-1], x̄_l): what layer l's K/V read, placed before the layer's first node."""
    with graph.inserting_before(before):
        index = (slice(None),) * seq_dim + (slice(None, -1),)
        head = graph.call_function(operator.getitem, (h_cut, index))
        return graph.call_function(torch.cat, ([head, last],), {"dim": seq_dim})


def _split_projection(gm: fx.GraphModule, layer, name: str, projection: Projection, seq_dim: int) -> None:
    """POP+: ``linear(x, W)`` -> ``slice_scatter(linear(x, W'), linear(x[:, N-1:], W), start=-1)``: the
    refit weights serve the pruned positions, x_N (its true hidden state) keeps the model's own. W'
    runs on all N rows (one row more than needed) and x_N's row is written over: slicing to N-1 rows
    and concatenating makes torch.export guard on sizes (N-1 != 1, B != 1) and refuse dynamic N."""
    found = [n for n in layer.nodes if n.target in LINEAR and module_path(n).endswith(f"self_attn.{name}")]
    if len(found) != 1:
        raise UnsupportedGraph(f"layer {layer.index}: expected one linear node in self_attn.{name}, "
                               f"found {len(found)}")
    node = found[0]
    graph, (x, *original) = gm.graph, node.args
    prefix = f"pop_kv_{layer.index}_{name}"
    with graph.inserting_before(node):
        view = graph.call_function(operator.getitem, (x, (slice(None),) * seq_dim + (slice(-1, None),)))
        # a strided view into linear makes export guard B != 1 and N != 1 (contiguity checks): copy it
        tail = graph.call_function(torch.clone, (view,), {"memory_format": torch.contiguous_format})
        dtype = _value(original[0]).dtype
        refit = [weight_constant(gm, node, f"{prefix}_weight", projection.weight.to(dtype))]
        if projection.bias is not None:
            refit.append(weight_constant(gm, node, f"{prefix}_bias", projection.bias.to(dtype)))
        every = graph.call_function(node.target, (x, *refit))
        own = graph.call_function(node.target, (tail, *original), dict(node.kwargs))
        joined = graph.call_function(torch.slice_scatter, (every, own), {"dim": seq_dim, "start": -1})
    joined.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    node.replace_all_uses_with(joined)
    graph.erase_node(node)


class _LastPosition:
    """Copies nodes that read a last-position value, mapping their inputs to the last position."""

    def __init__(self, graph: fx.Graph, seq):
        self.graph, self.seq = graph, seq
        self.last: dict[fx.Node, fx.Node] = {}
        self.sliced: dict[fx.Node, fx.Node] = {}  # full value -> its last position (made once)
        # the cache side of the deep layers: their K/V parts and the tensors made from them alone (RoPE'd
        # keys, the cache's concatenation, keys repeated per head), read whole by a copy: an eager
        # attention's matmul(q̄, k^T) sees every key even where the keys' length is the sequence length
        self.whole: set[fx.Node] = set()

    def seed(self, node: fx.Node, last: fx.Node) -> None:
        self.last[node] = last

    def visit(self, node: fx.Node) -> None:
        if node.op not in ("call_function", "call_method"):
            return
        if not any(arg in self.last for arg in node.all_input_nodes):
            if isinstance(_value(node), torch.Tensor) and not self.whole.isdisjoint(node.all_input_nodes):
                self.whole.add(node)
            return
        if node.target in _SDPA:
            args, kwargs = self._attention(node)
        else:
            args = fx.node.map_arg(node.args, self._input)
            kwargs = fx.node.map_arg(node.kwargs, self._input)
        with self.graph.inserting_after(node):
            copy = self.graph.create_node(node.op, node.target, args, kwargs, name=f"{node.name}_last")
        copy.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        self.last[node] = copy

    def _input(self, arg: fx.Node) -> fx.Node | int:
        if arg in self.last:
            return self.last[arg]
        if arg in self.whole:
            return arg
        value = _value(arg)
        if isinstance(value, torch.SymInt):
            if _same(value, self.seq):
                return 1  # a shape argument: the copy has one position
            if self.seq.node.expr.free_symbols & value.node.expr.free_symbols:
                raise UnsupportedGraph(f"{arg.name}: a size derived from the sequence length "
                                       f"reaches the query side")
            return arg  # independent of the sequence length (e.g. logits_to_keep)
        if isinstance(value, torch.Tensor):
            dims = [d for d, size in enumerate(value.shape) if _same(size, self.seq)]
            if len(dims) == 2 and dims[1] == value.dim() - 1 == dims[0] + 1:
                dims = dims[:1]  # an attention mask [.., N, N] (no past): its query rows, as for SDPA's mask
            if len(dims) > 1:
                raise UnsupportedGraph(f"{arg.name} has the sequence length in {len(dims)} dims: ambiguous")
            if not dims and any(_scaled_by_sequence(size, self.seq) for size in value.shape):
                # e.g. a mixture of experts' tokens flattened and sorted by expert: no last position to take
                raise UnsupportedGraph(f"{arg.name} {tuple(value.shape)}: a size derived from the sequence "
                                       "length (tokens flattened?) reaches the query side")
            if dims:
                if arg not in self.sliced:
                    self.sliced[arg] = _slice(self.graph, arg, dims[0], -1, None)
                return self.sliced[arg]
        return arg

    def _attention(self, node: fx.Node) -> tuple[tuple, dict]:
        """SDPA with a last-position query: keys/values stay whole; the mask keeps its last query row."""
        query, key, value, *rest = node.args
        kwargs = dict(node.kwargs)
        mask = rest[0] if rest else kwargs.pop("attn_mask", None)
        if isinstance(mask, fx.Node):
            mask = _slice(self.graph, mask, _value(mask).dim() - 2, -1, None)
        kwargs.update(attn_mask=mask, is_causal=False)  # one query at position N sees every key
        if len(rest) > 1:
            raise UnsupportedGraph(f"{node.name}: SDPA with positional dropout/causal arguments")
        return (self.last[query], key, value), kwargs


def _check_output(graph: fx.Graph, copier: _LastPosition) -> None:
    """Logits must be the last copy of a value; the other outputs (cache tensors) stay as they are."""
    output = graph.output_node()
    replaced = fx.node.map_arg(output.args, lambda n: copier.last.get(n, n))
    if replaced == output.args:
        raise UnsupportedGraph("no graph output depends on the last layer (graph break before the LM head?)")
    for node in output.all_input_nodes:
        if node in copier.last and not is_logits(node):
            raise UnsupportedGraph(f"output {node.name} depends on the deep layers "
                                   f"but is not the LM head's logits")
    output.args = replaced
