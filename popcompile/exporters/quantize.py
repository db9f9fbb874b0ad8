"""Weight-only int8/int4 quantisation of an exported graph with onnxruntime's own quantiser.

Every MatMul whose second input is a constant weight becomes a ``com.microsoft.MatMulNBits``: the weight
stored in blocks of ``block_size`` input channels, one float scale per block (symmetric), dequantised
inside the kernel::

    before:  x [B, T, K] ─ MatMul(W [K, N] float32) ─────────────────────────────► y [B, T, N]
    after:   x [B, T, K] ─ MatMulNBits(W_q [N, K/bs, bs*bits/8] uint8, scales [N*K/bs]) ─► y

The LM head is a ``Gemm(h, E, transB=1)`` over the embedding matrix ``E [V, K]`` (tied in SmolLM2 and
Gemma 3), which the quantiser does not take; it is first rewritten into a MatMul over its own transposed
copy ``E.T [K, V]``, so the head is quantised while the embedding lookup (Gather) keeps float rows::

    Gemm(h, E, transB=1)  ->  MatMul(h, E.T)  ->  MatMulNBits(h, E.T_q, scales)

Attention's activation-by-activation MatMuls (Q·Kᵀ, P·V) have no constant input and stay float, as do
norms, RoPE and the K/V rows. The same function runs on both graphs; the quantised weights are a
deterministic function of the float ones, so ``write_shared`` still stores each of them once.

One weight at a time: each MatMul's weight is read alone (from the graph, or from the scratch file the writer
keeps the weights in, ``ort_passes.graph.tensor_array``) and quantised by onnxruntime's own block kernel
(``DefaultWeightOnlyQuantizer.qbits_block_quant``, what its ``MatMulNBitsQuantizer`` calls), and the node is
written as that quantiser writes it; the whole float model is never in memory.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..config import WeightQuantization
from ..ort_passes.graph import tensor_array


def quantize_weights(proto: onnx.ModelProto, quantization: WeightQuantization,
                     store: Callable[[onnx.TensorProto], None] | None = None) -> onnx.ModelProto:
    """``proto`` with every constant-weight MatMul (and the Gemm LM head) as MatMulNBits; float: unchanged.
    ``store``: called on each new initializer as it is made (the writer's scratch file: out of memory)."""
    if quantization.bits is None:
        return proto
    quantizer_module = _import_quantizer()
    untie_gemm_heads(proto, store)
    config = quantizer_module.DefaultWeightOnlyQuantConfig(block_size=quantization.block_size,
                                                           is_symmetric=True,
                                                           accuracy_level=quantization.accuracy_level,
                                                           bits=quantization.bits)
    blocks = quantizer_module.DefaultWeightOnlyQuantizer(config)
    graph, bits = proto.graph, quantization.bits
    weights = {t.name: t for t in graph.initializer}
    nodes, quantized = [], set()
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or len(weight.dims) != 2 or weight.data_type not in _FLOATS:
            nodes.append(node)
            continue
        rows, cols = weight.dims
        packed, scales, _ = blocks.qbits_block_quant(tensor_array(weight))
        names = (f"{weight.name}_Q{bits}", f"{weight.name}_scales")
        if names[0] not in quantized:  # a weight two MatMuls read is quantised once
            made = [numpy_helper.from_array(packed, names[0]), numpy_helper.from_array(scales, names[1])]
            for tensor in made if store else ():
                store(tensor)
            graph.initializer.extend(made)
            quantized.add(names[0])
        extra = {"accuracy_level": quantization.accuracy_level} if quantization.accuracy_level else {}
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], *names], [node.output[0]],
                                      name=f"{node.name}_Q{bits}" if node.name else "",
                                      domain="com.microsoft", K=rows, N=cols, bits=bits,
                                      block_size=quantization.block_size, **extra))
    del graph.node[:]
    graph.node.extend(nodes)
    _drop_unread_initializers(graph)
    if not any(entry.domain == "com.microsoft" for entry in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return proto


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def _drop_unread_initializers(graph: onnx.GraphProto) -> None:
    """Initializers no node reads (the float weights now quantised) removed, as the quantiser's
    clean_initializers does."""
    read = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def untie_gemm_heads(proto: onnx.ModelProto, store: Callable[[onnx.TensorProto], None] | None = None) -> int:
    """Rewrite each ``Gemm(A, W, transB=1)`` over a 2-D float initializer W (alpha = beta = 1) into
    ``MatMul(A, W.T)`` (+ ``Add(C)`` when it has a bias), W.T a new initializer; returns how many."""
    weights = {t.name: t for t in proto.graph.initializer}
    nodes, count = [], 0
    for node in proto.graph.node:
        if not _plain_gemm(node, weights):
            nodes.append(node)
            continue
        name = f"{node.input[1]}.T"
        if name not in weights:
            transposed = np.ascontiguousarray(tensor_array(weights[node.input[1]]).T)
            weights[name] = numpy_helper.from_array(transposed, name)
            del transposed
            if store is not None:
                store(weights[name])
            proto.graph.initializer.append(weights[name])
        product = f"{node.output[0]}.matmul" if len(node.input) > 2 else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [product], name=f"{node.name}.matmul"))
        if len(node.input) > 2:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]],
                                          name=f"{node.name}.bias"))
        count += 1
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return count


def _plain_gemm(node: onnx.NodeProto, weights: dict[str, onnx.TensorProto]) -> bool:
    if node.op_type != "Gemm" or node.input[1] not in weights or len(weights[node.input[1]].dims) != 2:
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return (attrs.get("transB", 0) == 1 and attrs.get("transA", 0) == 0
            and attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0
            and weights[node.input[1]].data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16))


def _import_quantizer():
    """onnxruntime's quantiser module; its import calls ``logging.basicConfig(level=INFO)``, which would make
    every library's INFO lines print from then on: the root logger is restored as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization import matmul_nbits_quantizer
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return matmul_nbits_quantizer
