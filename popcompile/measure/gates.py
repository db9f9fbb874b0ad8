"""The virtual-gates pass: a scalar gate on every residual branch, per layer, branch and stage.

Contract. Input: a GraphModule of a decoder (any outputs; ``analyze.capture_scorer`` gives one whose
input is ``input_ids [B, S]`` and whose output is ``(logits,)``), traced with static B and S. Output:
a new GraphModule over the same, rewritten graph and the same parameters (do not use the input
module afterwards), with two more positional inputs after the existing ones::

    gates   [B, L, 2, 2]  float   layer x branch {0: attention, 1: MLP} x stage {0: prefill, 1: decode}
    stage   [B, S]        float   0 at prefill (context) positions, 1 at decode (generated) positions

Gates are per sequence (dim 0), so one backward of ``sum_b loss_b`` gives every sequence's own
``d loss_b / d gates[b]``: a gate of row b reaches no other row's loss.

Before, layer l (pre-norm; Gemma 3's sandwich norms put post_*_layernorm inside the branch)::

    h_l -> input_layernorm -> self_attn (-> post_attention_layernorm) = a_l --+--> m_l = h_l + a_l
    m_l -> (pre_feedforward / post_attention)_layernorm -> mlp (-> post_feedforward_layernorm) = f_l
                                                                            +--> h_{l+1} = m_l + f_l

After (``scale`` is shared; at gates == 1 every scale is exactly 1.0 and the outputs are bitwise equal)::

    scale = gates[..., 0][:, None] + stage[:, :, None, None] * (gates[..., 1] - gates[..., 0])[:, None]
                                                                   # [B, S, L, 2]
    m_l     = h_l + a_l * scale[:, :, l, 0, None]                  # [B, S, H] * [B, S, 1]
    h_{l+1} = m_l + f_l * scale[:, :, l, 1, None]

So at a prefill position the attention branch of layer l is multiplied by ``gates[b, l, 0, 0]``, at a
decode position by ``gates[b, l, 0, 1]``; setting a gate to 0 removes that branch at those positions.

Finding the branches uses metadata and dataflow only: ``find_layers`` gives each layer's input h_l;
the attention add is the ``aten.add`` that reads h_l (through no-op casts such as RMSNorm's
``to(float32)``) outside the input norm, its other operand is a_l; the MLP add is the one that reads
m_l the same way. Checked: the MLP add is what the next layer reads as its input, directly or plus a
tensor no layer computes (Qwen3-VL's deepstack features after layers 0..k-1: left ungated).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..passes.layers import INPUT_NORM, Layer, find_layers, layer_part

BRANCHES = ("attn", "mlp")
STAGES = ("prefill", "decode")
GATES_INPUT = "gates"
STAGE_INPUT = "stage"

_ADD = torch.ops.aten.add.Tensor
# Ops that return their input's value unchanged when dtype (and shape) stay the same.
_NO_OP_CASTS = (
    torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default,
    torch.ops.aten.alias.default, torch.ops.aten.type_as.default,
)


@dataclass(frozen=True)
class Branch:
    """One residual branch: layer, kind ("attn" | "mlp"), and the nodes it was found at."""

    layer: int
    kind: str
    output: str  # name of the branch's output node (a_l or f_l)
    residual_add: str  # name of the add that the gate's mul now feeds
    module: str  # the branch output's part inside the layer, e.g. "self_attn.o_proj"

    def __post_init__(self) -> None:
        if self.kind not in BRANCHES:
            raise ValueError(f"Branch.kind must be one of {BRANCHES}, got {self.kind!r}")


@dataclass(frozen=True)
class GateResult:
    graph_module: fx.GraphModule
    num_layers: int
    batch: int
    seq_len: int
    branches: tuple[Branch, ...]
    modified: bool


def gate_pass(gm: fx.GraphModule) -> GateResult:
    """Add ``gates`` and ``stage`` inputs and gate every residual branch (module docstring)."""
    layers = find_layers(gm.graph)
    if not layers:
        raise ValueError("gate_pass: no decoder layers (modules named layers.<i>) in the graph")
    found = [pair for layer in layers for pair in _layer_branches(layer, layers)]
    batch, seq_len, _ = _val(found[0][0]).shape
    dtype = _val(found[0][0]).dtype
    gates, stage = _add_inputs(gm.graph, (batch, len(layers), 2, 2), (batch, seq_len), dtype)
    scale = _scale_table(gm.graph, gates, stage)
    branches = []
    for index, (output, add) in enumerate(found):
        layer, kind = divmod(index, 2)
        if tuple(_val(output).shape[:2]) != (batch, seq_len):
            raise ValueError(f"layer {layer} {BRANCHES[kind]}: branch shape {tuple(_val(output).shape)} "
                             f"is not [B={batch}, S={seq_len}, H]")
        _gate(gm.graph, output, add, scale, layer, kind)
        part = (layer_part(output) or (layer, ""))[1]
        branches.append(Branch(layer, BRANCHES[kind], output.name, add.name, part))
    # Flat positional inputs (input_ids, gates, stage): the pytree codegen and the input-spec check
    # of ``ExportedProgram.module()`` know the old inputs only, so the graph moves to a plain module.
    gm.graph._codegen = fx.graph.CodeGen()
    gm.graph.lint()
    gated = fx.GraphModule(gm, gm.graph, class_name="GatedDecoder")
    return GateResult(gated, len(layers), int(batch), int(seq_len), tuple(branches), modified=True)


def _layer_branches(layer: Layer, layers: list[Layer]) -> list[tuple[fx.Node, fx.Node]]:
    """[(a_l, attention add), (f_l, MLP add)] of one layer."""
    norm = set(layer.nodes_in(INPUT_NORM))
    attn_out, attn_add = _residual_add(layer.input, norm, layer.index, "attention")
    mlp_out, mlp_add = _residual_add(attn_add, norm, layer.index, "MLP")
    h_0 = _resolve(layers[0].input)
    if layer.index + 1 < len(layers) and not _reads(layers[layer.index + 1].input, mlp_add, h_0):
        raise ValueError(f"layer {layer.index}: the MLP residual add {mlp_add.name} is not the input of "
                         f"layer {layer.index + 1} ({layers[layer.index + 1].input.name})")
    return [(attn_out, attn_add), (mlp_out, mlp_add)]


def _reads(next_input: fx.Node, mlp_add: fx.Node, hidden: fx.Node) -> bool:
    """The next layer's input is h_{l+1}: the MLP add itself, or the MLP add plus a tensor that does not
    depend on the hidden state ``hidden`` (h_0): a vision-language model's deepstack features, added after
    layers 0..k-1; not a branch, so not gated."""
    node = _resolve(next_input)
    if node is mlp_add:
        return True
    if node.op != "call_function" or node.target is not _ADD:
        return False
    operands = [_resolve(a) if isinstance(a, fx.Node) else a for a in node.args[:2]]
    others = [a for a in operands if a is not mlp_add]
    return len(others) == 1 and isinstance(others[0], fx.Node) and not _depends_on(others[0], hidden)


def _depends_on(node: fx.Node, source: fx.Node) -> bool:
    """Whether ``source`` is ``node`` or one of its ancestors."""
    seen, todo = {node}, [node]
    while todo:
        current = todo.pop()
        if current is source:
            return True
        for arg in current.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return False


def _residual_add(residual: fx.Node, skip: set[fx.Node], layer: int, what: str) -> tuple[fx.Node, fx.Node]:
    """The one add reading ``residual`` (or a no-op cast of it): (its other operand, the add)."""
    aliases = _aliases(residual)
    adds = {user for alias in aliases for user in alias.users
            if user.op == "call_function" and user.target is _ADD and user not in skip
            and all(isinstance(a, fx.Node) for a in user.args[:2])}
    if len(adds) != 1:
        names = sorted(a.name for a in adds)
        raise ValueError(f"layer {layer}: expected one {what} residual add reading {residual.name}, "
                         f"found {names}")
    add = adds.pop()
    lhs, rhs = add.args[:2]
    branch = rhs if lhs in aliases else lhs
    if branch in aliases:
        raise ValueError(f"layer {layer}: {what} residual add {add.name} adds the residual to itself")
    return branch, add


def _aliases(node: fx.Node) -> set[fx.Node]:
    """``node`` and every chain of no-op casts starting at it (they carry the same value)."""
    found, todo = {node}, [node]
    while todo:
        for user in todo.pop().users:
            if _is_no_op_cast(user) and user not in found:
                found.add(user)
                todo.append(user)
    return found


def _resolve(node: fx.Node) -> fx.Node:
    """Follow no-op casts back to the node that computed the value."""
    while _is_no_op_cast(node):
        node = node.args[0]
    return node


def _is_no_op_cast(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _NO_OP_CASTS or not node.args:
        return False
    source = node.args[0]
    if not isinstance(source, fx.Node):
        return False
    out, src = node.meta.get("val"), source.meta.get("val")
    return (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor)
            and out.dtype == src.dtype and tuple(out.shape) == tuple(src.shape))


def _val(node: fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"node {node.name} has no tensor meta['val']: run the pass on a torch.export graph")
    return val


def _add_inputs(graph: fx.Graph, gates_shape, stage_shape, dtype) -> tuple[fx.Node, fx.Node]:
    """Placeholders ``gates`` and ``stage`` after the existing inputs, with fake-tensor metadata."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = {n.name for n in placeholders}
    if GATES_INPUT in names or STAGE_INPUT in names:
        raise ValueError("gate_pass: the graph already has 'gates'/'stage' inputs (the pass ran twice?)")
    mode = _fake_mode(graph)
    with graph.inserting_after(placeholders[-1]):
        stage = graph.placeholder(STAGE_INPUT)
    with graph.inserting_after(placeholders[-1]):
        gates = graph.placeholder(GATES_INPUT)
    with mode:
        gates.meta["val"] = torch.empty(gates_shape, dtype=dtype)
        stage.meta["val"] = torch.empty(stage_shape, dtype=dtype)
    return gates, stage


def _fake_mode(graph: fx.Graph):
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch._subclasses.FakeTensor):
            return val.fake_mode
    raise ValueError("gate_pass: the graph carries no fake-tensor metadata: run it on a torch.export graph")


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    """A new call node whose meta['val'] is computed on the inputs' fake tensors."""
    node = graph.call_function(target, args)
    fake = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    with _fake_mode(graph):
        node.meta["val"] = target(*fake)
    return node


def _scale_table(graph: fx.Graph, gates: fx.Node, stage: fx.Node) -> fx.Node:
    """scale [B, S, L, 2] = g_prefill + stage * (g_decode - g_prefill): exactly 1.0 where gates are 1."""
    aten = torch.ops.aten
    with graph.inserting_before(stage.next):  # new nodes go in order before stage's successor
        prefill = _call(graph, aten.select.int, gates, -1, 0)                # [B, L, 2]
        decode = _call(graph, aten.select.int, gates, -1, 1)                 # [B, L, 2]
        delta = _call(graph, aten.sub.Tensor, decode, prefill)               # [B, L, 2]
        delta4 = _call(graph, aten.unsqueeze.default, delta, 1)              # [B, 1, L, 2]
        prefill4 = _call(graph, aten.unsqueeze.default, prefill, 1)          # [B, 1, L, 2]
        stage4 = _call(graph, aten.view.default, stage, [*stage.meta["val"].shape, 1, 1])  # [B, S, 1, 1]
        weighted = _call(graph, aten.mul.Tensor, stage4, delta4)             # [B, S, L, 2]
        return _call(graph, aten.add.Tensor, prefill4, weighted)             # [B, S, L, 2]


def _gate(graph: fx.Graph, branch: fx.Node, add: fx.Node, scale: fx.Node, layer: int, kind: int) -> None:
    """add(residual, branch) -> add(residual, branch * scale[:, :, layer, kind, None])."""
    aten = torch.ops.aten
    with graph.inserting_before(add):
        per_layer = _call(graph, aten.select.int, scale, 2, layer)           # [B, S, 2]
        column = _call(graph, aten.select.int, per_layer, 2, kind)           # [B, S]
        factor = _call(graph, aten.unsqueeze.default, column, -1)            # [B, S, 1]
        gated = _call(graph, aten.mul.Tensor, branch, factor)                # [B, S, H]
    add.replace_input_with(branch, gated)
