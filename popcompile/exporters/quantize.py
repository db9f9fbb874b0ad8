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
norms, RoPE and the K/V rows. The same function runs on both graphs with one ``Quantised`` cache: a
weight both graphs read (the decode graph's and the prefill's survivors share theirs) is quantised once,
and the second graph reads the same packed tensors (``write_shared`` stores each once).

One weight at a time: each MatMul's weight is read alone (from the graph, or from the scratch file the writer
keeps the weights in, ``ort_passes.graph.tensor_array``) and quantised by onnxruntime's own block kernel
(``DefaultWeightOnlyQuantizer.qbits_block_quant``, what its ``MatMulNBitsQuantizer`` calls), and the node is
written as that quantiser writes it; the whole float model is never in memory.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from functools import partial

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..config import WeightQuantization
from ..ort_passes.graph import tensor_array


class Quantised:
    """The quantised tensors made so far in one export, by the float weight they came from (its bytes'
    place in the scratch file, or a digest of a weight held in memory): each weight is quantised once,
    however many nodes and graphs read it. ``store``: called on each new tensor as it is made (the
    writer's scratch file: out of memory)."""

    def __init__(self, store: Callable[[onnx.TensorProto], None] | None = None) -> None:
        self.store = store
        self._by_source: dict[tuple, list[onnx.TensorProto]] = {}
        self.made = 0  # weights quantised (not reused)

    def into(self, graph: onnx.GraphProto) -> Callable[..., None]:
        """``add(weight, names, make)`` for ``graph``: ``graph`` then holds ``names`` (one per array ``make``
        returns), reused where ``weight`` was quantised before, made from it otherwise; once per name."""
        held: set[str] = set()

        def add(weight: onnx.TensorProto, names: list[str], make: Callable[[], tuple[np.ndarray, ...]]):
            if names[0] in held:
                return
            held.add(names[0])
            key = _source(weight)
            if key not in self._by_source:
                tensors = [numpy_helper.from_array(array, name) for array, name in zip(make(), names)]
                for tensor in tensors:
                    if self.store is not None:
                        self.store(tensor)
                self._by_source[key] = tensors
                self.made += 1
            for tensor, name in zip(self._by_source[key], names):
                copy = onnx.TensorProto()
                copy.CopyFrom(tensor)  # an external reference where stored: no bytes copied
                copy.name = name
                graph.initializer.append(copy)
        return add


def _source(weight: onnx.TensorProto) -> tuple:
    """What identifies a float weight's values: where they lie (an external tensor) or their digest."""
    shape = (weight.data_type, tuple(weight.dims))
    if weight.data_location == onnx.TensorProto.EXTERNAL:
        return shape + tuple((e.key, e.value) for e in weight.external_data)
    return shape + (hashlib.sha256(tensor_array(weight).tobytes()).digest(),)


def quantize_weights(proto: onnx.ModelProto, quantization: WeightQuantization,
                     store: Callable[[onnx.TensorProto], None] | None = None,
                     quantised: Quantised | None = None) -> onnx.ModelProto:
    """``proto`` with every constant-weight MatMul (and the Gemm LM head) as MatMulNBits and every fused
    mixture of experts (onnxruntime's MoE) as QMoE; float: unchanged.
    ``store``: called on each new initializer as it is made (the writer's scratch file: out of memory);
    ``quantised``: the cache shared by the graphs of one export (one per call where None)."""
    if quantization.bits is None:
        return proto
    quantised = quantised or Quantised(store)
    quantizer_module = _import_quantizer()
    untie_gemm_heads(proto, store)
    config = quantizer_module.DefaultWeightOnlyQuantConfig(block_size=quantization.block_size,
                                                           is_symmetric=True,
                                                           accuracy_level=quantization.accuracy_level,
                                                           bits=quantization.bits)
    blocks = quantizer_module.DefaultWeightOnlyQuantizer(config)
    weights = {t.name: t for t in proto.graph.initializer}
    add, nodes = quantised.into(proto.graph), []
    for node in proto.graph.node:
        rewrite = _REWRITES.get((node.domain, node.op_type))
        made = rewrite and rewrite(node, weights, add, blocks, quantization)
        nodes.append(made or node)
    graph = proto.graph
    del graph.node[:]
    graph.node.extend(nodes)
    _drop_unread_initializers(graph)
    if not any(entry.domain == "com.microsoft" for entry in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return proto


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def _matmul_nbits(node, weights, add, blocks, quantization: WeightQuantization):
    """``MatMul(x, W [K, N])`` -> ``MatMulNBits(x, W_q, scales)``; None where W is not a 2-D float weight."""
    weight = weights.get(node.input[1]) if len(node.input) == 2 else None
    if weight is None or len(weight.dims) != 2 or weight.data_type not in _FLOATS:
        return None
    rows, cols = weight.dims
    bits = quantization.bits
    names = [f"{weight.name}_Q{bits}", f"{weight.name}_scales"]
    add(weight, names, lambda: blocks.qbits_block_quant(tensor_array(weight))[:2])
    return helper.make_node("MatMulNBits", [node.input[0], *names], [node.output[0]],
                            name=f"{node.name}_Q{bits}" if node.name else "", domain="com.microsoft",
                            K=rows, N=cols, bits=bits, block_size=quantization.block_size,
                            **_accuracy(quantization))


def _qmoe(node, weights, add, blocks, quantization: WeightQuantization):
    """``MoE(x, router, fc1 [E, 2I, d], -, fc2 [E, d, I])`` (exporters/moe.py's fused lowering) ->
    ``QMoE(x, router, fc1_q [E, 2I, d*bits/8] uint8, fc1_scales, -, fc2_q, fc2_scales)``, symmetric
    (value = (q - 2^(bits-1)) * scale), the layout onnxruntime's CPU QMoE reads. int4: blocks of
    ``block_size`` input channels (scales [E, 2I, d/bs]) by MatMulNBits' own block kernel. int8: one scale per
    row (scales [E, 2I]): onnxruntime 1.32's 8-bit block-wise QMoE differs from its float MoE on the
    dequantised weights by 0.5% of the output, its row-wise path by float rounding (tests/test_moe.py).
    None where the node has biases, a third projection or weights that are not 3-D float initializers."""
    inputs = list(node.input) + [""] * (8 - len(node.input))
    fc1, fc2 = weights.get(inputs[2]), weights.get(inputs[4])
    if any(inputs[i] for i in (3, 5, 6, 7)) or fc1 is None or fc2 is None:
        return None
    block = _expert_block_size(quantization).get("block_size", 1)
    if any(len(w.dims) != 3 or w.data_type not in _FLOATS or w.dims[2] % block for w in (fc1, fc2)):
        return None
    names = []
    for weight in (fc1, fc2):
        names += [f"{weight.name}_Q{quantization.bits}", f"{weight.name}_scales"]
        add(weight, names[-2:], partial(_expert_blocks, tensor_array(weight), blocks, quantization))
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    attributes = {k: v.decode() if isinstance(v, bytes) else v for k, v in attributes.items()}
    return helper.make_node("QMoE", [inputs[0], inputs[1], names[0], names[1], "", names[2], names[3]],
                            [node.output[0]], name=f"{node.name}_Q{quantization.bits}" if node.name else "",
                            domain="com.microsoft", expert_weight_bits=quantization.bits,
                            **_expert_block_size(quantization), **attributes, **_accuracy(quantization))


def _expert_blocks(weight: np.ndarray, blocks, quantization: WeightQuantization):
    """weight [E, rows, cols] (out, in) -> packed [E, rows, cols*bits/8] uint8 and scales (_qmoe), one expert
    at a time (MatMulNBits' kernel quantises W [in, out] into [out, in/bs, bs*bits/8])."""
    experts, rows, cols = weight.shape
    block = _expert_block_size(quantization).get("block_size")
    packed = np.empty((experts, rows, cols * quantization.bits // 8), np.uint8)
    scales = np.empty((experts, rows) + ((cols // block,) if block else ()), weight.dtype)
    for e in range(experts):
        if block:
            q, s, _ = blocks.qbits_block_quant(np.ascontiguousarray(weight[e].T))
            packed[e], scales[e] = q.reshape(rows, -1), s.reshape(rows, -1)
        else:  # int8 per row: [-127, 127] around 128
            scales[e] = np.abs(weight[e]).max(axis=-1) / 127
            step = np.where(scales[e] == 0, 1, scales[e])[:, None]
            packed[e] = np.clip(np.rint(weight[e] / step), -127, 127) + 128
    return packed, scales


def _expert_block_size(quantization: WeightQuantization) -> dict:
    """QMoE's block_size attribute: block-wise int4; int8 row-wise (no attribute)."""
    return {"block_size": quantization.block_size} if quantization.bits == 4 else {}


def _accuracy(quantization: WeightQuantization) -> dict:
    return {"accuracy_level": quantization.accuracy_level} if quantization.accuracy_level else {}


#: (domain, op type) -> its weight-only quantised form (None: left as it is)
_REWRITES = {("", "MatMul"): _matmul_nbits, ("com.microsoft", "MoE"): _qmoe}


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
