"""The POP pass: captured decoder graph -> prefill graph.

Contract. Input: a GraphModule of the capture contract (``capture.py``): outputs
``(logits, present.0.key, present.0.value, ...)``. Output: the same module, rewritten, whose outputs
are the present K/V only. The decode graph is never touched: run the pass on a copy
(``ExportedProgram.module()`` makes one).

Before, layer l >= cut (every layer reads the previous layer's output)::

    h_l -> input_layernorm -> q/k/v_proj -> RoPE -> attention -> o_proj -> +h_l -> post-norms, MLP -> + ...
                                 k, v -> present.l
        ... -> h_{l+1}
    ... h_L -> norm -> lm_head -> logits

After (every deep layer reads h_cut, the output of layer cut-1; dead code is gone)::

    h_cut -> input_layernorm_l -> k_proj -> (k_norm) -> RoPE -> present.l.key
                               -> v_proj ----------------------> present.l.value

No q_proj, attention, o_proj, MLP or post-norm for the deep layers; no final norm and no LM head.
Layers ``0..cut-1`` are unchanged.

POP+ (``kv_weights``): the deep layers' k/v projections may read replacement weights (and a bias)
fitted so that ``input_norm_l(h_cut)`` predicts the K/V layer l would really have made. Same nodes:
only the ``linear`` nodes' weight and bias inputs change; a fitted bias on a projection that had none
(kvfit/calibrate.py's default) becomes the node's third input, one add [T, kv_width] more per projection.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..config import resolve_cut
from .fused import fused_node, kv_row_shapes, split_fused_projections
from .layers import LINEAR, Layer, find_layers, is_logits, module_path


@dataclass(frozen=True)
class Projection:
    """Replacement weights of one linear projection: weight [out, in], bias [out]."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None


#: layer index -> {"k_proj": Projection, "v_proj": Projection}
KVWeights = Mapping[int, Mapping[str, Projection]]


@dataclass(frozen=True)
class PopResult:
    graph_module: fx.GraphModule
    cut: int
    num_layers: int
    modified: bool


def pop_pass(gm: fx.GraphModule, cut: int, kv_weights: KVWeights | None = None) -> PopResult:
    """Rewrite ``gm`` in place into the prefill graph (see module docstring)."""
    layers = find_layers(gm.graph)
    cut = resolve_cut(len(layers), cut=cut)
    _drop_logits(gm.graph)
    if cut < len(layers):
        if split_fused_projections(gm.graph, layers[cut:]):  # Phi-3's qkv_proj: K and V nodes of their own
            layers = find_layers(gm.graph)
        h_cut = layers[cut].input
        rewire_deep_layers(layers, cut, lambda layer: h_cut)
    for index, projections in (kv_weights or {}).items():
        if not cut <= index < len(layers):
            raise ValueError(f"kv_weights for layer {index}: "
                             f"only pruned layers {cut}..{len(layers) - 1} take them")
        for name, projection in projections.items():
            _replace_projection(gm, layers[index], name, projection)
    erase_metadata_asserts(gm.graph)
    eliminate_dead_code(gm.graph)
    # Flat positional inputs and a flat tuple of outputs: the prefill graph's own interface.
    gm.graph._codegen = fx.graph.CodeGen()
    gm.graph.lint()
    gm.recompile()
    return PopResult(gm, cut, len(layers), modified=True)


def rewire_deep_layers(layers: list, cut: int, source: Callable[[Layer], fx.Node]) -> None:
    """The core of POP: the input norm of every layer ``l > cut`` (a post-norm layer's k/v projections)
    reads ``source(layer)`` (``h_cut``) instead of the previous layer's output, so its K/V are projections
    of that state."""
    for layer in layers[cut + 1:]:
        for node in layer.kv_readers():
            node.replace_input_with(layer.input, source(layer))


def _projection_node(layer, name: str) -> fx.Node:
    """The layer's one linear node of ``self_attn.<name>`` (``name``: k_proj | v_proj)."""
    linears = [n for n in layer.nodes if n.target in LINEAR and module_path(n).endswith(f"self_attn.{name}")]
    if len(linears) != 1:
        raise ValueError(f"layer {layer.index}: expected one linear node in self_attn.{name}, "
                         f"found {len(linears)}")
    return linears[0]


def _shape(node) -> tuple[int, ...] | None:
    """A weight's static shape from its node's metadata (torch.export: val, dynamo: example_value)."""
    value = node.meta.get("val", node.meta.get("example_value")) if isinstance(node, fx.Node) else None
    return None if value is None else tuple(int(d) for d in value.shape)


def kv_projection_shapes(graph: fx.Graph, first: int, parts: tuple[str, ...] = ("k_proj", "v_proj")) -> dict:
    """layer -> part -> (weight shape, bias shape or None) of the k/v projections of layers ``first``..L-1,
    read from the graph (what a K/V fit must match where no model is at hand: torch.compile)."""
    shapes = {}
    for layer in find_layers(graph)[first:]:
        fused = fused_node(layer)
        if fused is not None:  # K and V are rows of one fused projection (fused.py)
            shapes[layer.index] = {part: shape for part, shape in kv_row_shapes(fused, layer.index).items()
                                   if part in parts}
            continue
        for part in parts:
            node = _projection_node(layer, part)
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            shapes.setdefault(layer.index, {})[part] = (_shape(node.args[1]), _shape(bias))
    return shapes


def _replace_projection(gm: fx.GraphModule, layer, name: str, projection: Projection) -> None:
    """Point the layer's ``<name>`` linear node at new weight (and bias) attributes of ``gm``."""
    node = _projection_node(layer, name)
    old_weight = node.args[1].meta.get("val")
    if old_weight is not None and tuple(old_weight.shape) != tuple(projection.weight.shape):
        raise ValueError(f"layer {layer.index} {name}: weight shape {tuple(projection.weight.shape)} != "
                         f"{tuple(old_weight.shape)}")
    args = [node.args[0], weight_constant(gm, node, f"pop_kv_{layer.index}_{name}_weight", projection.weight)]
    if projection.bias is not None:
        args.append(weight_constant(gm, node, f"pop_kv_{layer.index}_{name}_bias", projection.bias))
    node.args = tuple(args)


def weight_constant(gm: fx.GraphModule, before: fx.Node, name: str, value: torch.Tensor) -> fx.Node:
    gm.register_buffer(name, value.detach().clone())
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(name)


def _drop_logits(graph: fx.Graph) -> None:
    """Remove output 0 (logits): prefill only fills the cache. Keeps the present K/V outputs."""
    output = graph.output_node()
    outputs = list(output.args[0])
    assert is_logits(outputs[0]), "capture contract: output 0 is the LM head's logits"
    output.args = (tuple(outputs[1:]),)


def eliminate_dead_code(graph: fx.Graph) -> None:
    """fx's DCE with :func:`has_side_effect` as the purity test."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    graph.eliminate_dead_code(is_impure_node=lambda node: has_side_effect(node, order))


def has_side_effect(node: fx.Node, order: dict[fx.Node, int] | None = None) -> bool:
    """DCE's test. fx calls any nondeterministic op impure, so an unused SDPA (which could do dropout)
    would survive; an ATen op is kept here only if it is an assert or its schema mutates an input that
    something can observe (``mutation_is_observable``: a router's in-place ``weights /= weights.sum()`` in
    a pruned layer goes with the layer). fx calls every ``call_method`` pure, which would drop dynamo's
    in-place cache writes (``keys.index_copy_(...)``): an in-place method (trailing underscore) is kept."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        if node.target in _ASSERTS:
            return True
        return node.target._schema.is_mutable and (order is None or mutation_is_observable(node, order))
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__") or node.target == "__setitem__"
    return node.is_impure()


def mutation_is_observable(node: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether an in-place op's write can be seen: it mutates a graph input, a view (its base may be read),
    or a tensor that a node after it reads. Writes to a fresh intermediate that only earlier nodes read
    are dead once the op's own output is."""
    schema = node.target._schema
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        if not isinstance(value, fx.Node) or not _fresh(value):
            return True
        if any(user is not node and order.get(user, -1) > order[node] for user in value.users):
            return True
    return False


def _fresh(value: fx.Node) -> bool:
    """An op's own new tensor (not an input, a weight or a view of another tensor)."""
    if value.op != "call_function":
        return False
    if value.target is operator.getitem:
        return _fresh(value.args[0]) if isinstance(value.args[0], fx.Node) else False
    target = value.target
    return isinstance(target, torch._ops.OpOverload) and all(
        ret.alias_info is None for ret in target._schema.returns)


_ASSERTS = (torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default)


def erase_metadata_asserts(graph: fx.Graph) -> None:
    """``_assert_tensor_metadata`` nodes are impure: left in, they keep dead layers alive past DCE."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)
