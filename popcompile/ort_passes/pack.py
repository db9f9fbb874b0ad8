"""Projections that read the same activation packed into one MatMul (q/k/v, gate/up), in both fused graphs
at once and so that every packed weight is one tensor the graphs share: an ONNX-level rewrite before the
weights are quantised, so that a decode step dispatches one weight-streaming kernel where it dispatched three
(onnxruntime-genai's packed QKV).

    before   h [B,S,K] ─┬─ MatMul(Wq [K,Nq]) ─ q
                        ├─ MatMul(Wk [K,Nk]) ─ k
                        └─ MatMul(Wv [K,Nv]) ─ v
    after    h [B,S,K] ─ MatMul([Wq|Wk|Wv] [K,Nq+Nk+Nv]) ─ Split(-1) ─┬─ q
                                                                      ├─ k
                                                                      └─ v

A bias (Qwen2's q/k/v; a POP+ fit's k/v bias, calibrate.py) follows each MatMul as ``Add(y, b [N])``. Where
every member of a part has one, the biases are packed too: ``MatMul([W1|W2]) ─ Add([b1|b2]) ─ Split``, one
Add per part instead of one per member; a part where some member has none keeps its Adds after the Split.

Sharing decides the groups. ``write_shared`` stores each distinct tensor once; a packed weight is a new
tensor, so packing pays only where every graph that reads a part reads it inside the same group. The folded
prefill graph's pruned layers read k/v over the prompt (from h_cut, or h_l on x_N's row) and q over x_N's
row alone: packing decode's q/k/v there would store Wq twice and [Wk|Wv] beside [Wq|Wk|Wv] (+5.6% for
SmolLM2). So the parts of a group are split by where their weights occur, in every graph: weights that occur
in exactly the same groups everywhere are packed together (those pruned layers: [Wk|Wv] in both graphs, Wq
alone), in the same column order (by content), and stored once.

Each output column is the same dot product as before (numbers equal up to the GEMM's blocking; MatMulNBits
quantises the packed weight per column, as it did each part).
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graph import drop_dead, readers, tensor_array

_PREFIX = "pop_pack"
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


@dataclass(frozen=True)
class _Member:
    node: onnx.NodeProto
    digest: str  # content of its weight [K, N]: the identity write_shared stores it under


def pack_projections(graphs: Mapping[str, onnx.ModelProto],
                     store: Callable[[onnx.TensorProto], None] | None = None) -> dict[str, int]:
    """Pack, in place, the MatMuls of each graph that read one activation and whose weights occur together in
    the same groups of every graph; returns the packed groups per graph. ``store``: called on each packed
    weight as it is made (OrtContext.store: its values moved out of memory at once)."""
    groups = {name: _groups(proto.graph) for name, proto in graphs.items()}
    where = _occurrences(graphs, groups)
    packed = {}
    for name, proto in graphs.items():
        plan = [part for members in groups[name] for part in _split_by_occurrence(members, where)]
        packed[name] = _rewrite(proto.graph, plan, store)
    return packed


def _weights(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in graph.initializer if len(t.dims) == 2 and t.data_type in _FLOATS}


def _groups(graph: onnx.GraphProto) -> list[list[_Member]]:
    """The projections of each activation: MatMuls whose weight is a [K, N] float initializer read by it
    alone."""
    weights, reading = _weights(graph), readers(graph)
    by_source: dict[str, list[_Member]] = defaultdict(list)
    for node in graph.node:
        if (node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and len(node.input) == 2
                and node.input[1] in weights and len(reading[node.input[1]]) == 1):
            by_source[node.input[0]].append(_Member(node, _digest(weights[node.input[1]])))
    return list(by_source.values())


def _digest(tensor: onnx.TensorProto) -> str:
    array = tensor_array(tensor)
    return hashlib.sha256(f"{array.dtype}{array.shape}".encode() + array.tobytes()).hexdigest()


def _occurrences(graphs: Mapping[str, onnx.ModelProto], groups: dict[str, list[list[_Member]]]) -> dict:
    """weight digest -> the places it occurs in: (graph, group) for a projection, (graph, node) for any other
    reader, so a weight read elsewhere too is never packed with another."""
    where: dict[str, set] = defaultdict(set)
    grouped: set[int] = set()  # id() of the projection nodes
    for name, members_list in groups.items():
        for index, members in enumerate(members_list):
            for member in members:
                where[member.digest].add((name, "group", index))
                grouped.add(id(member.node))
    for name, proto in graphs.items():
        weights = _weights(proto.graph)
        for index, node in enumerate(proto.graph.node):
            if id(node) in grouped:
                continue
            for value in node.input:
                if value in weights:
                    where[_digest(weights[value])].add((name, "node", index))
    return {digest: frozenset(places) for digest, places in where.items()}


def _split_by_occurrence(members: list[_Member], where: dict) -> list[list[_Member]]:
    """The parts of one group whose weights occur in the same places, two or more each, ordered by content."""
    parts: dict[frozenset, list[_Member]] = defaultdict(list)
    for member in members:
        parts[where[member.digest]].append(member)
    return [sorted(part, key=lambda m: m.digest) for part in parts.values() if len(part) > 1]


def _rewrite(graph: onnx.GraphProto, plan: list[list[_Member]],
             store: Callable[[onnx.TensorProto], None] | None = None) -> int:
    """Each planned part's packed MatMul (Add) and Split stand where its first member stood; the parts'
    weights (and bias Adds) go. The Split's outputs are produced earlier than the Adds' were: still before
    every reader."""
    if not plan:
        return 0
    weights = _weights(graph)
    context = _Context.of(graph)
    adds = [_bias_adds([m.node for m in part], context) for part in plan]
    part_of = {id(member.node): index for index, part in enumerate(plan) for member in part}
    dropped = {id(add) for found in adds if found for add, _ in found}
    nodes, done = [], set()
    for node in graph.node:
        index = part_of.get(id(node))
        if id(node) in dropped:
            continue
        if index is None:
            nodes.append(node)
        elif index not in done:
            done.add(index)
            nodes += _packed([m.node for m in plan[index]], weights, graph, index, adds[index], store)
    del graph.node[:]
    graph.node.extend(nodes)
    drop_dead(graph)
    return len(plan)


def _packed(members: list, weights: dict, graph: onnx.GraphProto, index: int, adds: list | None,
            store: Callable[[onnx.TensorProto], None] | None = None) -> list:
    """One MatMul over the members' weights side by side ([K, N1+N2+..]), with ``adds`` one Add of their
    biases side by side ([N1+N2+..]), and the Split that gives each member (or its Add) its output."""
    arrays = [tensor_array(weights[node.input[1]]) for node in members]
    name = f"{_PREFIX}/{index}"
    weight = numpy_helper.from_array(np.concatenate(arrays, axis=1), f"{name}/weight")
    del arrays[:]  # keep only the widths below
    if store is not None:
        store(weight)
    widths = [weights[node.input[1]].dims[1] for node in members]
    graph.initializer.extend([weight, numpy_helper.from_array(np.array(widths, np.int64), f"{name}/split")])
    nodes = [helper.make_node("MatMul", [members[0].input[0], f"{name}/weight"], [f"{name}/out"],
                              name=f"{name}/matmul")]
    source, outputs = f"{name}/out", [node.output[0] for node in members]
    if adds is not None:
        initializers = {t.name: t for t in graph.initializer if len(t.dims) == 1}
        biases = [tensor_array(initializers[bias]) for _, bias in adds]
        graph.initializer.append(numpy_helper.from_array(np.concatenate(biases), f"{name}/bias"))
        nodes.append(helper.make_node("Add", [source, f"{name}/bias"], [f"{name}/biased"],
                                      name=f"{name}/add"))
        source, outputs = f"{name}/biased", [add.output[0] for add, _ in adds]
    split = helper.make_node("Split", [source, f"{name}/split"], outputs, name=f"{name}/split", axis=-1)
    return [*nodes, split]


@dataclass(frozen=True)
class _Context:
    """What ``_bias_adds`` looks up, made once per graph before the rewrite."""

    readers: dict  # value name -> the nodes that read it
    outputs: frozenset  # graph output names
    biases: dict  # name -> 1-D float initializer
    weights: dict  # name -> 2-D float initializer

    @classmethod
    def of(cls, graph: onnx.GraphProto) -> "_Context":
        biases = {t.name: t for t in graph.initializer if len(t.dims) == 1 and t.data_type in _FLOATS}
        return cls(readers(graph), frozenset(o.name for o in graph.output), biases, _weights(graph))


def _bias_adds(members: list, context: _Context) -> list | None:
    """(the ``Add(y, b)`` each member's output y goes to alone, b's name), b a 1-D float initializer [N] of
    the member's N columns and dtype, in member order; None unless every member has one (then its Adds
    stay)."""
    adds = []
    for node in members:
        y, found = node.output[0], context.readers.get(node.output[0], [])
        if y in context.outputs or len(found) != 1:
            return None
        if found[0].op_type != "Add" or found[0].domain not in ("", "ai.onnx"):
            return None
        add, weight = found[0], context.weights[node.input[1]]
        other = [name for name in add.input if name != y]
        if len(add.input) != 2 or len(other) != 1 or other[0] not in context.biases:
            return None
        bias = context.biases[other[0]]
        if list(bias.dims) != [weight.dims[1]] or bias.data_type != weight.data_type:
            return None
        adds.append((add, other[0]))
    return adds
