"""A fused graph that reads its past from, and writes its new rows into, the session's KV buffer itself
(onnxruntime's ``past_present_share_buffer``): the decode graph's KV outputs become GroupQueryAttention's
presents, and the past length comes from the mask instead of the past's shape.

    before   past.i.key  [B,Hkv,P,D] ── GQA(.., past_k, past_v, seqlens_k=P+T-1, total=P+T)  (present unused)
             k_new       [B,Hkv,T,D] ─────────────────────────────────────────── present.i.key  (T new rows)
             Shape(past.i.key)[2] = P  ── cache positions, causal mask
    after    past.i.key  [B,Hkv,R,D] ── GQA ── present.i.key [B,Hkv,max(R,P+T),D]  (R: the rows bound)
             k_new stays GQA's input only
             Shape(attention_mask)[1] - Shape(input_ids)[1] = P

Bound to the same memory as its past (the buffer's ``[B, Hkv, max_seq, D]`` rows of a layer, R = max_seq),
``present.i.key`` is that memory: GroupQueryAttention writes the T new rows at P..P+T-1 in place and attends
over rows 0..P+T-1 (the graph's mask bias still covers padding and sliding windows); nothing is gathered or
concatenated per step. Given a past of exactly P rows (R = P) and separate output memory, it returns the P+T
rows, past then new: the same graph serves a first prompt (P = 0), where a buffer-wide binding would make
GroupQueryAttention's scores T x max_seq per head.

Applied only where every layer is GroupQueryAttention and the past is read nowhere else but as its batch
size or its length (the exporter's symbolic sizes); anything else keeps the rows-out contract.
"""
from __future__ import annotations

import onnx
from onnx import helper

from ..engine.kv import KVLayout
from .attention import GQA
from .graph import rename_tensor

_PREFIX = "pop_shared_kv"
#: the present rows' dimension in the declared outputs: max(rows bound as the past, past + new tokens)
PRESENT_DIM = "present"


def share_kv_buffer(proto: onnx.ModelProto, layout: KVLayout) -> bool:
    """Rewrite ``proto`` in place (module docstring) when it qualifies; whether it did."""
    graph = proto.graph
    gqa = {node.input[3]: node for node in graph.node if node.op_type == GQA}
    past = set(layout.past_names)
    if set(gqa) != set(layout.past_names[0::2]) or not _past_reads_only_sizes(graph, past):
        return False
    for layer in range(layout.num_layers):
        node = gqa[layout.past_name(layer, "key")]
        assert node.input[4] == layout.past_name(layer, "value"), node.name
        for index, kind in ((1, "key"), (2, "value")):
            name = layout.present_name(layer, kind)
            # the new rows: GQA's key/value input only
            rename_tensor(graph, name, f"{_PREFIX}/{layer}/{kind}_rows")
            node.output[index] = name
    _past_length_from_mask(graph, past)  # last: it rebuilds graph.node, whose messages ``gqa`` holds
    for output in graph.output:
        if output.name in layout.present_names:
            output.type.tensor_type.shape.dim[2].dim_param = PRESENT_DIM
    return True


def _past_reads_only_sizes(graph: onnx.GraphProto, past: set[str]) -> bool:
    """Every read of a past input is GroupQueryAttention's past_key/past_value, or a Shape of its batch (0:1)
    or rows (2:3) dimension."""
    for node in graph.node:
        for slot, name in enumerate(node.input):
            if name not in past:
                continue
            if node.op_type == GQA and slot in (3, 4):
                continue
            if node.op_type != "Shape" or _shape_range(node) not in ((0, 1), (2, 3)):
                return False
    return True


def _past_length_from_mask(graph: onnx.GraphProto, past: set[str]) -> None:
    """Each ``Shape(past)[2:3]`` (P) -> ``Shape(attention_mask)[1:2] - Shape(input_ids)[1:2]``: bound to the
    buffer, the past's rows are max_seq, not P."""
    nodes = []
    for node in graph.node:
        if node.op_type == "Shape" and node.input[0] in past and _shape_range(node) == (2, 3):
            out = node.output[0]
            nodes += [helper.make_node("Shape", ["attention_mask"], [f"{out}/total"], start=1, end=2),
                      helper.make_node("Shape", ["input_ids"], [f"{out}/new"], start=1, end=2),
                      helper.make_node("Sub", [f"{out}/total", f"{out}/new"], [out])]
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _shape_range(node: onnx.NodeProto) -> tuple[int | None, int | None]:
    attrs = {a.name: a.i for a in node.attribute}
    return attrs.get("start"), attrs.get("end")

