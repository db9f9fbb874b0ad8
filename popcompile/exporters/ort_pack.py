"""Projections that read the same activations packed into one MatMul (q/k/v, gate/up): an ONNX-level rewrite of
the fused graphs, before the weights are quantised, so that a decode step dispatches one weight-streaming
kernel where it dispatched three (onnxruntime-genai's packed QKV).

    before   h [B,S,K] ─┬─ MatMul(Wq [K,Nq]) ─ q          after   h ─ MatMul([Wq|Wk|Wv] [K,Nq+Nk+Nv]) ─ Split(-1) ─ q
                         ├─ MatMul(Wk [K,Nk]) ─ k                                                                   ├─ k
                         └─ MatMul(Wv [K,Nv]) ─ v                                                                   └─ v

Each output column is the same dot product as before (numbers equal up to the GEMM's blocking, and
MatMulNBits quantises the packed weight per column block, as it did each part). Only float weights stored as
initializers of shape [K, N] are packed; a weight another node also reads stays where it is.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .ort_attention import drop_dead

_PREFIX = "pop_pack"


def pack_projections(proto: onnx.ModelProto) -> int:
    """Pack, in place, every group of MatMuls reading one activation with [K, N] float weights; how many groups."""
    graph = proto.graph
    weights = {t.name: t for t in graph.initializer if len(t.dims) == 2 and t.data_type in _FLOATS}
    uses = defaultdict(int)
    for node in graph.node:
        for name in node.input:
            uses[name] += 1
    groups = defaultdict(list)
    for node in graph.node:
        if _is_projection(node, weights, uses):
            groups[node.input[0]].append(node)
    groups = {source: nodes for source, nodes in groups.items()  # two or more, over one K
              if len(nodes) > 1 and len({weights[node.input[1]].dims[0] for node in nodes}) == 1}
    if not groups:
        return 0
    packed = {id(node): index for index, nodes in enumerate(groups.values()) for node in nodes}
    nodes, done = [], set()
    for node in graph.node:
        index = packed.get(id(node))
        if index is None:
            nodes.append(node)
        elif index not in done:  # the group's packed MatMul and Split stand where its first member stood
            done.add(index)
            nodes += _packed(list(groups.values())[index], weights, graph, index)
    del graph.node[:]
    graph.node.extend(nodes)
    drop_dead(graph)
    return len(groups)


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def _is_projection(node, weights: dict, uses: dict) -> bool:
    return (node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and len(node.input) == 2
            and node.input[1] in weights and uses[node.input[1]] == 1)


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
