"""Projections that read the same activation packed into one MatMul (q/k/v, gate/up), in both fused graphs at once
and so that every packed weight is one tensor the graphs share: an ONNX-level rewrite before the weights are
quantised, so that a decode step dispatches one weight-streaming kernel where it dispatched three
(onnxruntime-genai's packed QKV).

    before   h [B,S,K] ─┬─ MatMul(Wq [K,Nq]) ─ q          after   h ─ MatMul([Wq|Wk|Wv] [K,Nq+Nk+Nv]) ─ Split(-1) ─ q
                         ├─ MatMul(Wk [K,Nk]) ─ k                                                                   ├─ k
                         └─ MatMul(Wv [K,Nv]) ─ v                                                                   └─ v

Sharing decides the groups. ``write_shared`` stores each distinct tensor once; a packed weight is a new tensor,
so packing pays only where every graph that reads a part reads it inside the same group. The folded prefill
graph's pruned layers read k/v over the prompt (from h_cut, or h_l on x_N's row) and q over x_N's row alone:
packing decode's q/k/v there would store Wq twice and [Wk|Wv] beside [Wq|Wk|Wv] (+5.6% for SmolLM2). So the
parts of a group are split by where their weights occur, in every graph: weights that occur in exactly the same
groups everywhere are packed together (those pruned layers: [Wk|Wv] in both graphs, Wq alone), in the same column
order (by content), and stored once.

Each output column is the same dot product as before (numbers equal up to the GEMM's blocking; MatMulNBits
quantises the packed weight per column, as it did each part).
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .ort_attention import drop_dead

_PREFIX = "pop_pack"
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


@dataclass(frozen=True)
class _Member:
    node: onnx.NodeProto
    digest: str  # content of its weight [K, N]: the identity write_shared stores it under


def pack_projections(graphs: Mapping[str, onnx.ModelProto]) -> dict[str, int]:
    """Pack, in place, the MatMuls of each graph that read one activation and whose weights occur together in
    the same groups of every graph; returns the packed groups per graph."""
    groups = {name: _groups(proto.graph) for name, proto in graphs.items()}
    where = _occurrences(graphs, groups)
    packed = {}
    for name, proto in graphs.items():
        plan = [part for members in groups[name] for part in _split_by_occurrence(members, where)]
        packed[name] = _rewrite(proto.graph, plan)
    return packed


def _weights(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in graph.initializer if len(t.dims) == 2 and t.data_type in _FLOATS}


def _groups(graph: onnx.GraphProto) -> list[list[_Member]]:
    """The projections of each activation: MatMuls whose weight is a [K, N] float initializer read by it alone."""
    weights, uses = _weights(graph), defaultdict(int)
    for node in graph.node:
        for name in node.input:
            uses[name] += 1
    by_source: dict[str, list[_Member]] = defaultdict(list)
    for node in graph.node:
        if (node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and len(node.input) == 2
                and node.input[1] in weights and uses[node.input[1]] == 1):
            by_source[node.input[0]].append(_Member(node, _digest(weights[node.input[1]])))
    return list(by_source.values())


def _digest(tensor: onnx.TensorProto) -> str:
    array = numpy_helper.to_array(tensor)
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


def _rewrite(graph: onnx.GraphProto, plan: list[list[_Member]]) -> int:
    """Each planned part's packed MatMul and Split stand where its first member stood; the parts' weights go."""
    if not plan:
        return 0
    weights = _weights(graph)
    part_of = {id(member.node): index for index, part in enumerate(plan) for member in part}
    nodes, done = [], set()
    for node in graph.node:
        index = part_of.get(id(node))
        if index is None:
            nodes.append(node)
        elif index not in done:
            done.add(index)
            nodes += _packed([m.node for m in plan[index]], weights, graph, index)
    del graph.node[:]
    graph.node.extend(nodes)
    drop_dead(graph)
    return len(plan)


def _packed(members: list, weights: dict, graph: onnx.GraphProto, index: int) -> list:
    """One MatMul over the members' weights side by side, and the Split that gives each member its output."""
    arrays = [numpy_helper.to_array(weights[node.input[1]]) for node in members]
    name = f"{_PREFIX}/{index}"
    graph.initializer.extend([numpy_helper.from_array(np.concatenate(arrays, axis=1), f"{name}/weight"),
                              numpy_helper.from_array(np.array([a.shape[1] for a in arrays], np.int64),
                                                      f"{name}/split")])
    return [helper.make_node("MatMul", [members[0].input[0], f"{name}/weight"], [f"{name}/out"], name=f"{name}/matmul"),
            helper.make_node("Split", [f"{name}/out", f"{name}/split"], [node.output[0] for node in members],
                             name=f"{name}/split", axis=-1)]
