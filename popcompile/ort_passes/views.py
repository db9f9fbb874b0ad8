"""Views that come back to the shape they started from, removed: the last rewrite of the fused graphs.

After the fused ops take over, every projection's output `[B, S, H*D]` is viewed as `[B, S, H, D]` by the
exporter (a dynamic Reshape), then flattened back to `[B, S, H*D]` for RotaryEmbedding or GroupQueryAttention;
attention's output `[B, S, H*D]` is viewed as heads and flattened again before o_proj; v goes to
`[B, H, S, D]` and back through two Transposes. onnxruntime runs each as a kernel (8 a layer, 243 Reshapes
per SmolLM2 decode step) that moves nothing::

    before   x [B,S,576] ─ Reshape(shape) ─ [B,S,9,64] ─ Reshape([0,0,-1]) ─ y [B,S,576] ─ RotaryEmbedding
    after    x [B,S,576] ──────────────────────────────────────────────────────────────── RotaryEmbedding

    before   x ─ Transpose(0,2,1,3) ─ Transpose(0,2,1,3) ─ y          after   x ─ y

A chain of Reshapes (and Identities) keeps the elements in order, so where its end has the symbolic shape of
its start (onnxruntime's symbolic shape inference: ``batch``, ``seq`` and constants, compared as written) the
end is its start. Transposes whose permutations compose to the identity cancel first. Graph outputs keep their
producers.
"""
from __future__ import annotations

import onnx

from .graph import drop_dead, producers, redirect_readers, transpose_perm

_VIEWS = ("Reshape", "Identity")
_LIGHT_BYTES = 1 << 12  # initializers kept with their values for shape inference (shape constants)


def drop_round_trip_views(proto: onnx.ModelProto) -> int:
    """Remove, in place, the Transpose pairs that cancel and the Reshape chains that end where they began;
    how many tensors now read their chain's start."""
    graph = proto.graph
    moved = redirect_readers(graph, _cancelling_transposes(graph))
    moved += redirect_readers(graph, _round_trips(graph, _symbolic_shapes(proto)))
    if moved:
        drop_dead(graph)
    return moved


def _cancelling_transposes(graph: onnx.GraphProto) -> dict[str, str]:
    """y -> x for every ``y = Transpose(Transpose(x, p), q)`` with q∘p the identity."""
    producer = producers(graph)
    renames = {}
    for node in graph.node:
        inner = producer.get(node.input[0]) if node.op_type == "Transpose" and node.input else None
        if inner is None or inner.op_type != "Transpose":
            continue
        p, q = transpose_perm(inner), transpose_perm(node)
        if p is not None and q is not None and len(p) == len(q) and [p[i] for i in q] == sorted(p):
            renames[node.output[0]] = inner.input[0]
    return renames


def _round_trips(graph: onnx.GraphProto, shapes: dict[str, tuple]) -> dict[str, str]:
    """y -> x for the end y of every Reshape/Identity chain from x whose symbolic shape is x's."""
    producer = producers(graph)
    renames = {}
    for node in graph.node:
        if node.op_type not in _VIEWS:
            continue
        start = node.input[0]
        while start in producer and producer[start].op_type in _VIEWS:
            start = producer[start].input[0]
        end = node.output[0]
        if start != end and _known(shapes.get(end)) and shapes.get(end) == shapes.get(start):
            renames[end] = start
    return renames


def _known(shape: tuple | None) -> bool:
    return shape is not None and all(isinstance(d, int) or (d and not d.startswith("unk__")) for d in shape)


def _symbolic_shapes(proto: onnx.ModelProto) -> dict[str, tuple]:
    """name -> shape (ints and dim names) of every tensor, by onnxruntime's symbolic shape inference on a copy
    whose large initializers keep their dims only (their values decide no shape)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    graph = onnx.GraphProto(name=proto.graph.name, node=proto.graph.node, input=proto.graph.input,
                            output=proto.graph.output, value_info=proto.graph.value_info,
                            initializer=[_light(t) for t in proto.graph.initializer])
    light = onnx.ModelProto(ir_version=proto.ir_version, opset_import=proto.opset_import, graph=graph)
    try:
        inferred = SymbolicShapeInference.infer_shapes(light, auto_merge=False, guess_output_rank=False,
                                                       verbose=0)
    except Exception:  # noqa: BLE001 - its own asserts on a graph it cannot follow: no shape proves a round trip
        return {}
    values = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
    return {v.name: tuple(_dim(d) for d in v.type.tensor_type.shape.dim)
            for v in values if v.type.tensor_type.HasField("shape")}


def _light(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """``tensor`` itself if small; else its name, type and dims with no values."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL and tensor.ByteSize() <= _LIGHT_BYTES:
        return tensor
    return onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)


def _dim(dim) -> int | str | None:
    if dim.HasField("dim_param"):
        return dim.dim_param
    return dim.dim_value if dim.HasField("dim_value") else None
