"""``popcompile::experts`` (frontend/experts.py) in ONNX: torch.onnx's translation of the op, by lowering.

Shapes: hidden [N, d]; index [N, k] int64; weights [N, k]; gate_up [E, 2I, d] (gate rows, then up rows);
down [E, d, I]; out [N, d].

fused     onnxruntime's ``com.microsoft.MoE``: the active experts only. Its CPU kernel routes itself (softmax
          of a router input [N, E], top-k, renormalised) and takes SwiGLU's gate and up rows interleaved:

              router = ScatterElements(full(-1e9), index, log(weights))   softmax -> weights / sum(weights)
              out    = MoE(hidden, router, Gather(gate_up, [0, I, 1, I+1, ...], axis=1), down)
                       * sum(weights)                                      (the experts are linear in it)

          so every family's own routing (softmax before or after top-k, renormalised or not) is kept
          exactly; the Gather of the weight is folded into the stored initializer (fold_weight_gathers).
standard  plain ONNX ops, every expert on every token, weighted by the dense routing [N, E] (zero where
          unrouted): E/k times the active FLOPs of the experts (for TensorRT and float16 graphs).
"""
from __future__ import annotations

import functools

import numpy as np

#: router input of the experts a token is not routed to: its softmax underflows to exactly 0
UNROUTED = -1e9


@functools.cache
def _ops():
    """onnxscript's opset 18, and com.microsoft with onnxruntime's MoE schema registered in onnx (which
    knows no com.microsoft ops: onnxscript builds a node from its schema)."""
    import onnx
    import onnxscript

    if not onnx.defs.has("MoE", domain="com.microsoft"):
        onnx.defs.register_schema(_moe_schema())
    return onnxscript.opset18, onnxscript.values.Opset("com.microsoft", 1)


def _moe_schema():
    """The inputs and attributes of onnxruntime's com.microsoft.MoE (version 1) this module sets."""
    from onnx.defs import OpSchema

    optional, single = OpSchema.FormalParameterOption.Optional, OpSchema.FormalParameterOption.Single
    inputs = [OpSchema.FormalParameter(name, "T", param_option=single if name in ("input", "router_probs",
                                       "fc1_experts_weights", "fc2_experts_weights") else optional)
              for name in ("input", "router_probs", "fc1_experts_weights", "fc1_experts_bias",
                           "fc2_experts_weights", "fc2_experts_bias", "fc3_experts_weights",
                           "fc3_experts_bias")]
    attribute = OpSchema.Attribute
    attributes = [
        attribute("activation_type", OpSchema.AttrType.STRING, "relu, gelu, silu, swiglu or identity"),
        attribute("k", OpSchema.AttrType.INT, "experts per token"),
        attribute("normalize_routing_weights", OpSchema.AttrType.INT, "renormalise the top-k weights"),
        attribute("swiglu_fusion", OpSchema.AttrType.INT, "1: gate and up rows interleaved in fc1"),
        attribute("activation_alpha", OpSchema.AttrType.FLOAT, "SwiGLU: x * sigmoid(alpha * x)"),
        attribute("activation_beta", OpSchema.AttrType.FLOAT, "SwiGLU: (up + beta)"),
    ]
    return OpSchema("MoE", "com.microsoft", 1, inputs=inputs,
                    outputs=[OpSchema.FormalParameter("output", "T")],
                    type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "float tensors")],
                    attributes=attributes)


def _scattered(op, index, values, num_experts: int, fill: float):
    """[N, E]: ``values`` [N, k] at each token's experts ``index`` [N, k], ``fill`` elsewhere."""
    rows = op.Shape(index, start=0, end=1)
    filled = op.Expand(op.CastLike(op.Constant(value_float=fill), values),
                       op.Concat(rows, op.Constant(value_ints=[num_experts]), axis=0))
    return op.ScatterElements(filled, index, values, axis=1)


def experts_fused(hidden, index, weights, gate_up, down):
    """onnxruntime's MoE (module docstring)."""
    op, msft = _ops()
    num_experts, rows, _ = gate_up.shape
    k, inter = index.shape[-1], rows // 2
    interleave = np.stack([np.arange(inter), np.arange(inter) + inter], axis=1).reshape(-1)
    fc1 = op.Gather(gate_up, op.Constant(value_ints=interleave.tolist()), axis=1)
    router = _scattered(op, index, op.Log(weights), num_experts, UNROUTED)
    out = msft.MoE(hidden, router, fc1, None, down, activation_type="swiglu", swiglu_fusion=1, k=k,
                   normalize_routing_weights=1, activation_alpha=1.0, activation_beta=0.0)
    return op.Mul(out, op.ReduceSum(weights, op.Constant(value_ints=[1]), keepdims=1))


def experts_standard(hidden, index, weights, gate_up, down):
    """Every expert on every token (module docstring), as Einsums over the stored weights (no transposes):
    [N, d] x [E, 2I, d] -> [E, N, 2I]; SwiGLU -> [E, N, I]; x [E, d, I] -> [E, N, d]; x routing [N, E]."""
    op, _ = _ops()
    up_rows = op.Einsum(hidden, gate_up, equation="nd,ejd->enj")
    gate, up = op.Split(up_rows, num_outputs=2, axis=-1)
    act = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)
    each = op.Einsum(act, down, equation="eni,edi->end")
    routing = op.CastLike(_scattered(op, index, weights, gate_up.shape[0], 0.0), each)  # [N, E]
    return op.Einsum(routing, each, equation="ne,end->nd")


LOWERINGS = {"fused": experts_fused, "standard": experts_standard}


def translation_table(lowering: str) -> dict:
    """torch.onnx's ``custom_translation_table`` for ``lowering`` ("fused" or "standard")."""
    from ..frontend.experts import experts_op

    return {experts_op()._opoverload: LOWERINGS[lowering]}


def fold_weight_gathers(programs: list, *, read=None) -> int:
    """Fold each ``Gather(W, constant indices, axis)`` of a weight it alone reads (experts_fused's interleave
    of gate_up) into the initializer ``W.index_select(axis, indices)``, named as its output, in every graph of
    ``programs`` (unoptimised ONNXPrograms): the engine stores the layout onnxruntime's MoE reads, and
    nothing gathers at load. ``read``: a placeholder's values (a model built without its weights), read and
    permuted when saved. Returns how many were folded."""
    import onnx_ir as ir
    import torch

    folded = 0
    for program in programs:
        graph = program.model.graph
        for node in list(graph):
            if node.op_type != "Gather" or node.domain != "":
                continue
            weight, indices = node.inputs
            raw = getattr(weight.const_value, "raw", None) if weight.is_initializer() else None
            order = _constant_ints(indices)
            if not isinstance(raw, torch.Tensor) or order is None or len(weight.uses()) != 1:
                continue
            axis, out = node.attributes.get_int("axis", 0), node.outputs[0]
            index = torch.tensor(order)
            shape = list(raw.shape)
            shape[axis] = len(order)

            def permuted(raw=raw, axis=axis, index=index) -> ir.Tensor:
                values = read(raw) if read is not None else raw
                return ir.Tensor(values.detach().index_select(axis, index).contiguous().numpy())

            dims = ir.Shape(shape)
            const = ir.LazyTensor(permuted, dtype=weight.const_value.dtype, shape=dims, name=out.name)
            value = ir.Value(name=out.name, shape=dims, type=out.type or ir.TensorType(const.dtype),
                             const_value=const)
            ir.convenience.replace_all_uses_with(out, value)
            graph.remove(node, safe=True)
            graph.initializers.pop(weight.name)
            graph.register_initializer(value)
            folded += 1
    return folded


def _constant_ints(value) -> list[int] | None:
    """A 1-D int constant's values (an initializer or a Constant node's output), else None."""
    const = value.const_value
    if const is None and value.producer() is not None and value.producer().op_type == "Constant":
        attribute = value.producer().attributes.get("value_ints")
        return list(attribute.as_ints()) if attribute is not None else None
    if const is None:
        return None
    array = const.numpy()
    return array.astype(int).tolist() if array.ndim == 1 and array.dtype.kind in "iu" else None
