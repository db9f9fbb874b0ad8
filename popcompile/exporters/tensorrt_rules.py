"""Checks of the TensorRT ONNX parser's documented per-op restrictions (tensorrt_ops.json's
``restrictions`` text), one function per op: ``f(node, entry, consts, opset) -> [(status, detail)]``.

``consts`` knows constant values and static shapes of the graph; ``entry`` is the op's row of the
support table. Used by ``tensorrt_compat.check_model``.
"""
from __future__ import annotations

import onnx


def check_attention(node, entry, consts, opset):
    bad = ([n for i, n in enumerate(node.input) if i >= 4 and n]
           + [n for i, n in enumerate(node.output) if i >= 1 and n])
    if bad:
        return [("unsupported", f"past_key/past_value/nonpad_kv_seqlen inputs and present/qk outputs are "
                                f"unsupported (found {', '.join(bad)}); TensorRT: {entry['restrictions']}")]
    return []


def check_tensor_scatter(node, entry, consts, opset):
    axis = attr(node, "axis", -2)
    return [] if axis == -2 else [("unsupported", f"axis={axis}; TensorRT: {entry['restrictions']}")]


def check_scatter_nd(node, entry, consts, opset):
    reduction = attr(node, "reduction", b"none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    return ([] if reduction == "none"
            else [("unsupported", f"reduction={reduction}; TensorRT: {entry['restrictions']}")])


def check_top_k(node, entry, consts, opset):
    out = ([] if attr(node, "sorted", 1) == 1
           else [("unsupported", "sorted=0; TensorRT: " + entry["restrictions"])])
    k = consts.value(node.input[1]) if len(node.input) > 1 else None
    if k is not None and int(k.reshape(-1)[0]) >= 3840:
        out.append(("unsupported", f"K={int(k.reshape(-1)[0])}; TensorRT: {entry['restrictions']}"))
    return out


def check_layer_norm(node, entry, consts, opset):
    extra = [n for n in node.output[1:] if n]
    return [("unsupported", f"outputs {extra} used; TensorRT: {entry['restrictions']}")] if extra else []


def check_constant(node, entry, consts, opset):
    bad = [a.name for a in node.attribute if a.name in ("sparse_value", "value_string", "value_strings")]
    return [("unsupported", f"attribute {bad[0]}; TensorRT: {entry['restrictions']}")] if bad else []


def check_max_pool(node, entry, consts, opset):
    return ([("unsupported", "the Indices output is unsupported")]
            if len(node.output) > 1 and node.output[1] else [])


def check_squeeze(node, entry, consts, opset):
    has_axes = ((len(node.input) > 1 and node.input[1]) if opset >= 13
                else attr(node, "axes", None) is not None)
    dims = consts.shapes.get(node.input[0]) if node.input else None
    if has_axes or (dims is not None and all(d is not None for d in dims)):
        return []
    return [("restriction", "no `axes`: TensorRT must know at build time which dims are 1, and the input has "
                            "dynamic dims; give the axes as a constant")]


def check_if(node, entry, consts, opset):
    branches = {a.name: a.g for a in node.attribute if a.name in ("then_branch", "else_branch")}
    ranks = {name: [len(o.type.tensor_type.shape.dim) if o.type.tensor_type.HasField("shape") else None
                    for o in g.output] for name, g in branches.items()}
    then, other = ranks.get("then_branch", []), ranks.get("else_branch", [])
    if any(a is not None and b is not None and a != b for a, b in zip(then, other)):
        return [("unsupported", f"branch outputs differ in rank ({then} vs {other}); "
                                f"TensorRT: {entry['restrictions']} "
                                "(merged decoders break this way: optimum#2013)")]
    return [("restriction", f"If node (TensorRT: {entry['restrictions']}); popcompile graphs must not "
                            "contain If: export without control flow")]


def check_loop(node, entry, consts, opset):
    return [("restriction", f"{node.op_type} node: TensorRT: {entry.get('restrictions') or 'supported'}; "
                            "popcompile graphs must not contain control flow: unroll it at export")]


RESTRICTION_CHECKS = {
    "Attention": check_attention, "TensorScatter": check_tensor_scatter, "ScatterND": check_scatter_nd,
    "TopK": check_top_k, "LayerNormalization": check_layer_norm, "Squeeze": check_squeeze,
    "Constant": check_constant, "MaxPool": check_max_pool, "If": check_if, "Loop": check_loop,
    "Scan": check_loop,
}


def attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default
