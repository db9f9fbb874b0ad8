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
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..config import WeightQuantization

#: the loggers of onnxruntime's quantiser, which logs a line per node at INFO
_LOGGERS = ("onnxruntime.quantization.matmul_nbits_quantizer", "onnxruntime.quantization")


def quantize_weights(proto: onnx.ModelProto, quantization: WeightQuantization) -> onnx.ModelProto:
    """``proto`` with every constant-weight MatMul (and the Gemm LM head) as MatMulNBits; float: unchanged."""
    if quantization.bits is None:
        return proto
    quantizer_module = _import_quantizer()
    untie_gemm_heads(proto)
    config = quantizer_module.DefaultWeightOnlyQuantConfig(block_size=quantization.block_size,
                                                           is_symmetric=True,
                                                           accuracy_level=quantization.accuracy_level,
                                                           bits=quantization.bits)
    with _quiet():
        quantizer = quantizer_module.MatMulNBitsQuantizer(proto, algo_config=config)
        quantizer.process()
    return quantizer.model.model


def untie_gemm_heads(proto: onnx.ModelProto) -> int:
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
            transposed = np.ascontiguousarray(numpy_helper.to_array(weights[node.input[1]]).T)
            weights[name] = numpy_helper.from_array(transposed, name)
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


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
