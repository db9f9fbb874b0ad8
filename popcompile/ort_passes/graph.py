"""What the ONNX-level rewrites (ort_passes/, in the order of ort_passes.ORT_PASSES) read and edit in a
graph: who produces and who reads a tensor, a Transpose's permutation, renaming a tensor or pointing its
readers elsewhere, the nodes in topological order, and the nodes no output needs removed; an initializer's
values (``tensor_array``), wherever they are kept.

Each works on the ``onnx.GraphProto`` itself, in place: the weights are never copied.
"""
from __future__ import annotations

import os
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """The size of an initializer's values in bytes, wherever they are kept."""
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def tensor_array(tensor: onnx.TensorProto) -> np.ndarray:
    """An initializer's values: in the proto, or (while the exporter keeps the weights out of memory,
    exporters/scratch.py) in the file its external data names by absolute path, read for this tensor only.
    Read-only where read from a file."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    info = {entry.key: entry.value for entry in tensor.external_data}
    if not os.path.isabs(info["location"]):
        raise ValueError(f"initializer {tensor.name!r}: external data {info['location']!r} is relative; "
                         "read the model with onnx.load (its folder resolves it)")
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    with open(info["location"], "rb") as handle:
        handle.seek(int(info.get("offset", 0)))
        data = handle.read(int(info["length"]))
    if info["location"].endswith(BFLOAT16_BITS):  # float32 values stored as their upper 16 bits (bf16 values)
        upper = np.frombuffer(data, np.uint16).astype(np.uint32)
        return (upper << 16).view(np.float32).reshape(tuple(tensor.dims))
    return np.frombuffer(data, dtype).reshape(tuple(tensor.dims))


#: how the name of the exporter's scratch file ends (exporters/scratch.py) where its float32 tensors are
#: stored as the upper halves of their values, whose lower halves are all zero (a bf16 checkpoint's weights)
BFLOAT16_BITS = ".bf16bits"


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """tensor name -> the node that writes it (graph inputs and initializers have none)."""
    return {out: node for node in graph.node for out in node.output}


def readers(graph: onnx.GraphProto) -> defaultdict[str, list[onnx.NodeProto]]:
    """tensor name -> the nodes that read it, once per input slot (a node that reads it twice: twice)."""
    found: defaultdict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            found[name].append(node)
    return found


def dims(value: onnx.ValueInfoProto) -> list[int | str] | None:
    """A declared shape: ints and dim names (0 where neither is known); None where no shape is declared."""
    if not value.type.tensor_type.HasField("shape"):
        return None
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def declared_shapes(graph: onnx.GraphProto) -> dict[str, list[int | str] | None]:
    """tensor name -> its declared shape (``dims``), over value_info, inputs and outputs."""
    return {v.name: dims(v) for v in (*graph.value_info, *graph.input, *graph.output)}


def transpose_perm(node: onnx.NodeProto) -> list[int] | None:
    """A Transpose's ``perm``; None where it has none (reversed axes: rank-dependent)."""
    for attr in node.attribute:
        if attr.name == "perm":
            return list(helper.get_attribute_value(attr))
    return None


def rename_tensor(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Tensor ``old`` is called ``new`` by every node (writer and readers) and value_info; a graph output
    named ``old`` keeps its name, so it needs a new producer."""
    for node in graph.node:
        for names in (node.input, node.output):
            for index, name in enumerate(names):
                if name == old:
                    names[index] = new
    for value in graph.value_info:
        if value.name == old:
            value.name = new


def redirect_readers(graph: onnx.GraphProto, sources: dict[str, str]) -> int:
    """Every reader of a key reads its value instead (followed to the end of chained keys); the writers stay
    (``drop_dead`` takes those no one reads any more). Graph outputs are never redirected. Returns how many
    tensors are."""
    outputs = {value.name for value in graph.output}
    sources = {old: new for old, new in sources.items() if old not in outputs}

    def final(name: str) -> str:
        while name in sources:
            name = sources[name]
        return name

    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in sources:
                node.input[index] = final(name)
    return len(sources)


def topological_sort(graph: onnx.GraphProto) -> None:
    """Order the nodes so each comes after the producers of its inputs, the original order kept wherever the
    data allows: onnx_ir's stable sort, run on stand-in nodes that carry the tensor names alone (no weight or
    attribute is converted). Raises ValueError on a cycle."""
    import onnx_ir as ir

    values = {name: ir.Value(name=name) for node in graph.node for name in node.output if name}
    stand_ins = {
        ir.Node(node.domain, node.op_type, [values.get(name) for name in node.input],
                outputs=[values[name] if name else ir.Value() for name in node.output]): node
        for node in graph.node}
    order = ir.Graph([], [], nodes=stand_ins)
    order.sort()
    nodes = [stand_ins[stand_in] for stand_in in order]
    del graph.node[:]
    graph.node.extend(nodes)


def drop_dead(graph: onnx.GraphProto) -> None:
    """Remove the nodes no graph output depends on, keeping the order of the others, then the initializers and
    value_info nothing refers to any more."""
    needed = {out.name for out in graph.output}
    live = []
    for node in reversed(graph.node):
        if any(out in needed for out in node.output):
            live.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(live))
    used = needed | {i.name for i in graph.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    produced = {out for node in graph.node for out in node.output}
    infos = [v for v in graph.value_info if v.name in produced]
    del graph.value_info[:]
    graph.value_info.extend(infos)
