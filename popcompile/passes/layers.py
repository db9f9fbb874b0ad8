"""Find decoder layers and their parts in an exported graph, from node metadata alone.

Every call node made by torch.export or by dynamo carries ``meta["nn_module_stack"]``: the chain of
modules it ran inside, innermost last, each as ``(path, type)``. A path such as
``model.model.layers.7.self_attn.k_proj`` (torch.export) or ``L['self'].model.layers.7.self_attn.k_proj``
(dynamo) gives the layer index (7) and the part inside the layer (``self_attn.k_proj``). No model class
or architecture name is consulted. Dynamo graphs also hold ``call_method`` nodes and take parameters
as placeholders; both are handled.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

#: a linear projection in an ATen graph (torch.export) or a torch-level graph (dynamo)
LINEAR = (torch.ops.aten.linear.default, torch._C._nn.linear, torch.nn.functional.linear)

_LAYER_PATH = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.(.+))?$")
INPUT_NORM = "input_layernorm"
#: what reads a post-norm layer's input (OLMo 2: no input norm; the attention's projections read the residual
#: stream itself), and of those the ones that make the cache
ATTENTION_INPUTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
KV_INPUTS = ("self_attn.k_proj", "self_attn.v_proj")
_CALLS = ("call_function", "call_method")


def module_path(node: fx.Node) -> str:
    """Innermost module path of a node ("" for nodes outside any submodule)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


#: ops the causal LM may apply to its LM head's output (frontend/arch.finish_logits: Granite's logits_scaling,
#: Gemma's final soft-cap is div, tanh, mul), walked back through to find the head
_MAX_LOGITS_OPS = 8


def is_logits(node: fx.Node) -> bool:
    """Whether ``node`` is the LM head's output, or an elementwise chain after it outside any decoder layer
    (``logits / scaling``, ``tanh(logits / cap) * cap``): each step reads exactly one tensor (dynamo may pass
    the scale as a SymFloat input)."""
    for _ in range(_MAX_LOGITS_OPS + 1):
        if module_path(node).endswith("lm_head"):
            return True
        tensors = [n for n in node.all_input_nodes if not _is_scalar(n)]
        if node.op not in _CALLS or layer_part(node) is not None or len(tensors) != 1:
            return False
        node = tensors[0]
    return False


def _is_scalar(node: fx.Node) -> bool:
    value = node.meta.get("example_value", node.meta.get("val"))
    return isinstance(value, (int, float, torch.SymInt, torch.SymFloat))


def layer_part(node: fx.Node) -> tuple[int, str] | None:
    """(layer index, part inside the layer) or None when the node is not inside a decoder layer.

    The part is "" for nodes that belong to the layer itself (residual adds are tagged so).
    """
    match = _LAYER_PATH.search(module_path(node))
    if match is None:
        return None
    return int(match.group(1)), match.group(2) or ""


@dataclass
class Layer:
    """The nodes of one decoder layer and the hidden state it reads."""

    index: int
    nodes: list[fx.Node] = field(default_factory=list)
    input: fx.Node | None = None  # the outside input of its input_layernorm (or of its q/k/v projections)
    post_norm: bool = False  # no input_layernorm: the projections read ``input`` themselves

    def parts(self) -> Counter:
        """Node count by part ("self_attn.k_proj", "mlp", ...)."""
        return Counter(layer_part(n)[1] for n in self.nodes)

    def nodes_in(self, part: str) -> list[fx.Node]:
        return [n for n in self.nodes if layer_part(n)[1] == part]

    def kv_readers(self) -> list[fx.Node]:
        """The nodes through which the layer's cache side reads ``input``: its input norm's, or a post-norm
        layer's k/v projections (the ones POP points at h_cut)."""
        parts = KV_INPUTS if self.post_norm else (INPUT_NORM,)
        return [n for n in self.nodes if layer_part(n)[1] in parts and self.input in n.all_input_nodes]


def find_layers(graph: fx.Graph) -> list[Layer]:
    """All decoder layers of a graph, in index order, each with its input hidden state.

    The layer input is found as the node outside ``input_layernorm`` that the norm's nodes read:
    not as "the previous layer's last node", since the residual add may read a no-op cast that is
    tagged as part of the norm. A post-norm layer (no ``input_layernorm`` nodes: OLMo 2) reads its input
    in the attention's q/k/v projections: the one outside node they read.
    """
    layers: dict[int, Layer] = {}
    for node in graph.nodes:
        found = layer_part(node) if node.op in _CALLS else None
        if found is not None:
            layers.setdefault(found[0], Layer(found[0])).nodes.append(node)
    ordered = [layers[i] for i in sorted(layers)]
    if [layer.index for layer in ordered] != list(range(len(ordered))):
        raise ValueError(f"decoder layers are not numbered 0..L-1: found {sorted(layers)}")
    for layer in ordered:
        layer.post_norm = not layer.nodes_in(INPUT_NORM)
        layer.input = _layer_input(layer)
    return ordered


def _layer_input(layer: Layer) -> fx.Node:
    """The one node outside the input norm (a post-norm layer: outside its q/k/v projections) that its nodes
    read, weights and epsilons aside."""
    parts = ATTENTION_INPUTS if layer.post_norm else (INPUT_NORM,)
    readers = {n for n in layer.nodes if layer_part(n)[1] in parts}
    if not readers:
        raise ValueError(f"layer {layer.index} has no '{INPUT_NORM}' nodes and no attention projections "
                         f"({', '.join(ATTENTION_INPUTS)}): not a decoder layer popcompile reads")
    outside = {
        arg
        for node in readers
        for arg in node.all_input_nodes
        if arg not in readers and arg.op not in ("get_attr", "placeholder")  # weights, eps
    }
    if len(outside) != 1:
        names = sorted(a.name for a in outside)
        raise ValueError(f"layer {layer.index}: expected one hidden-state input to '{' / '.join(parts)}', "
                         f"found {names}")
    return outside.pop()
