"""Attention (and RMSNorm) lowered to onnxruntime's fused contrib ops: an ONNX-level rewrite after export,
for the onnx target only (TensorRT's parser takes standard ops: ``attention="standard"``).

Step 1, onnxscript's ORT fusions (``optimize_for_ort``): RMSNorm -> ``SimplifiedLayerNormalization``,
residual Add + RMSNorm -> ``SkipSimplifiedLayerNormalization``, and the exporter's decomposed
scaled-dot-product attention -> ``com.microsoft.MultiHeadAttention``, which still reads K/V repeated per
query head.

Step 2, here (``mha_to_gqa``): each MultiHeadAttention whose key and value are repeated from
``Concat(past, new)`` and whose query has as many tokens as ``new`` becomes ``GroupQueryAttention``, which
reads the past and the new rows per KV head (no repeat per query head, no transposed copy of K):

    before   past_k [B,Hkv,P,D] ─┐
             k_new  [B,Hkv,T,D] ─┴ Concat ─ Unsqueeze/Expand/Reshape (x H/Hkv)
                                 ─ Transpose/Reshape [B,P+T,H*D] ────────────────────────────┐
             q [B,T,H*D], mask bias [B,1,T,P+T] ─ Expand [B,H,T,P+T] ── MultiHeadAttention ◄─┘
    after    k_new ─ Transpose/Reshape [B,T,Hkv*D] ─┐
             q, past_k, past_v, mask bias [B,1,T,P+T] ── GroupQueryAttention(seqlens_k = P+T-1, total = P+T)

The mask stays the graph's own additive bias (padding, causality, Gemma 3's sliding windows), so GQA's
causal rule only repeats it. The KV contract is unchanged: ``present.i.key`` (the new rows) is still the
output and the past still an input. GQA also writes its own concatenated present, unused here (one copy of
the past per step): ``shared_kv`` then makes the decode graph's presents GQA's, bound to the buffer
itself. A layer whose query has fewer tokens than its new K/V (the prefill graph's pruned layers: only the
last token attends over all N) keeps MultiHeadAttention, which takes unequal lengths; a layer no fusion
matched keeps standard ops.
``lower_for_ort`` returns the graph and how many layers took each form, for the manifest.
"""
from __future__ import annotations

import contextlib
import io
from collections import Counter

import onnx
from onnx import TensorProto, helper

from .graph import declared_shapes, drop_dead, producers, tensor_bytes

#: weights this large are hidden from onnxscript's fusions (lower_for_ort): 256K float32 values, above what
#: its constant folding reads (8192 elements) and what any fusion matches by value
LARGE_BYTES = 1 << 20

GQA, MHA = "GroupQueryAttention", "MultiHeadAttention"
_MS = "com.microsoft"
#: MultiHeadAttention's key/value, from the fused graph back to the Concat of past and new rows
_REPEAT_CHAIN = ("Reshape", "Transpose", "Reshape", "Expand", "Unsqueeze", "Concat")
_PREFIX = "pop_gqa"


def lower_for_ort(proto: onnx.ModelProto, num_layers: int) -> tuple[onnx.ModelProto, dict[str, int]]:
    """``proto`` with fused norms and attention; the count of layers per attention form (GQA, MHA, standard).
    ``proto`` is consumed: its tensors move into the result (no copy of the weights), do not use it after.

    onnxscript's fusions see the weights of ``LARGE_BYTES`` or more by name, type and shape only (their values
    decide no fusion; a fusion that read one would fail, not guess) and get them back by name: they are never
    converted, and the exporter's scratch file (which may hold them in its own encoding) is never read."""
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    large = {}
    for tensor in proto.graph.initializer:
        if tensor_bytes(tensor) >= LARGE_BYTES:
            kept = large[tensor.name] = onnx.TensorProto()
            kept.CopyFrom(tensor)
            tensor.Clear()
            tensor.name, tensor.data_type = kept.name, kept.data_type
            tensor.dims.extend(kept.dims)
    with contextlib.redirect_stdout(io.StringIO()):
        model, _ = optimize_for_ort(ir.from_proto(proto))
    model.graph.sort()  # the fusions can leave a node before its producer (seen in Gemma 3's prefill graph)
    fused = ir.to_proto(model)
    for tensor in fused.graph.initializer:
        if tensor.name in large:
            if list(tensor.dims) != list(large[tensor.name].dims):
                raise AssertionError(f"onnxscript's fusions reshaped the weight {tensor.name}")
            tensor.CopyFrom(large.pop(tensor.name))
    count = mha_to_gqa(fused)
    ops = Counter(node.op_type for node in fused.graph.node if node.domain == _MS)
    forms = {GQA: count, MHA: ops[MHA]}
    forms["standard"] = num_layers - sum(forms.values())
    assert forms["standard"] >= 0, forms
    return fused, forms


def mha_to_gqa(proto: onnx.ModelProto) -> int:
    """Rewrite, in place, each MultiHeadAttention over repeated ``Concat(past, new)`` K/V with equal query and
    new-row lengths into GroupQueryAttention (module docstring); returns how many."""
    graph = proto.graph
    producer, shapes = producers(graph), declared_shapes(graph)
    nodes, count = [], 0
    for node in graph.node:
        match = _match(node, producer, shapes)
        if match is None:
            nodes.append(node)
            continue
        nodes.extend(_gqa_nodes(node, *match, index=count))
        count += 1
    if count:
        _add_lengths(graph)
        del graph.node[:]
        graph.node.extend([*_length_nodes(), *nodes])
        drop_dead(graph)
    return count


def _match(node, producer, shapes) -> tuple[tuple[str, str], tuple[str, str], int, str] | None:
    """(past_k, new_k), (past_v, new_v), kv heads and the un-expanded bias of a MultiHeadAttention GQA can
    replace; None for any other node."""
    if node.op_type != MHA or node.domain != _MS:
        return None
    attrs = {a.name for a in node.attribute}
    extra = list(node.input[3:5]) + list(node.input[6:])
    if not attrs <= {"num_heads", "scale"} or any(extra):
        return None
    kv = [_concat_source(name, producer) for name in node.input[1:3]]
    if None in kv:
        return None
    (past_k, new_k), (past_v, new_v) = kv
    q, past, new = shapes.get(node.input[0]), shapes.get(past_k), shapes.get(new_k)
    if not (q and past and new and len(q) == 3 and len(new) == 4 and q[1] == new[2]):
        return None  # the query's tokens are not the new rows' (or unknown): GQA needs equal lengths
    heads = helper.get_attribute_value(next(a for a in node.attribute if a.name == "num_heads"))
    if not isinstance(past[1], int) or heads % past[1]:
        return None
    return (past_k, new_k), (past_v, new_v), past[1], _bias(node, producer, shapes)


def _concat_source(name: str, producer) -> tuple[str, str] | None:
    """(past, new) of the ``Concat(past, new)`` that ``name`` repeats per query head, through
    _REPEAT_CHAIN."""
    node = producer.get(name)
    for op in _REPEAT_CHAIN:
        if node is None or node.op_type != op or node.domain not in ("", "ai.onnx"):
            return None
        if op == "Concat":
            return (node.input[0], node.input[1]) if len(node.input) == 2 else None
        node = producer.get(node.input[0])
    return None


def _bias(node, producer, shapes) -> str:
    """The attention bias before the fusion expanded it to every head: [B,1,T,P+T] broadcasts in GQA."""
    bias = node.input[5] if len(node.input) > 5 else ""
    source = producer.get(bias)
    if source is not None and source.op_type == "Expand" and len(shapes.get(source.input[0]) or ()) == 4:
        return source.input[0]
    return bias


def _gqa_nodes(node, k: tuple[str, str], v: tuple[str, str], kv_heads: int, bias: str, *, index: int) -> list:
    """The new rows to [B,T,Hkv*D] and one GroupQueryAttention writing ``node``'s output."""
    name = f"{_PREFIX}/{index}"
    nodes, rows = [], []
    for part, (_, new) in (("k", k), ("v", v)):
        nodes.append(helper.make_node("Transpose", [new], [f"{name}/{part}_bsnd"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Reshape", [f"{name}/{part}_bsnd", f"{_PREFIX}/bsd"],
                                      [f"{name}/{part}"]))
        rows.append(f"{name}/{part}")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    nodes.append(helper.make_node(
        GQA, [node.input[0], *rows, k[0], v[0], f"{_PREFIX}/seqlens_k", f"{_PREFIX}/total", "", "", "", bias],
        [node.output[0], f"{name}/present_k", f"{name}/present_v"], name=name, domain=_MS,
        kv_num_heads=kv_heads, **attrs))
    return nodes


def _add_lengths(graph: onnx.GraphProto) -> None:
    graph.initializer.extend([helper.make_tensor(f"{_PREFIX}/one", TensorProto.INT32, [1], [1]),
                              helper.make_tensor(f"{_PREFIX}/bsd", TensorProto.INT64, [3], [0, 0, -1])])


def _length_nodes() -> list:
    """seqlens_k [B] int32 = P+T-1 in every row (padding is in the bias) and total_sequence_length = P+T,
    from attention_mask [B, P+T]."""
    p = _PREFIX
    return [helper.make_node("Shape", ["attention_mask"], [f"{p}/total64"], start=1, end=2),
            helper.make_node("Cast", [f"{p}/total64"], [f"{p}/total1"], to=TensorProto.INT32),
            helper.make_node("Squeeze", [f"{p}/total1"], [f"{p}/total"]),
            helper.make_node("Sub", [f"{p}/total1", f"{p}/one"], [f"{p}/last"]),
            helper.make_node("Shape", ["attention_mask"], [f"{p}/batch"], start=0, end=1),
            helper.make_node("Expand", [f"{p}/last", f"{p}/batch"], [f"{p}/seqlens_k"])]
