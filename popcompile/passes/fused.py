"""A fused [q; k; v] projection (Phi-3's ``self_attn.qkv_proj``) split into the K and V projections POP keeps.

A pruned layer keeps its K/V projections and drops its query. With one fused linear there is nothing to
drop: its K and V outputs are slices of the same node as its Q. Before either POP pass rewires the deep
layers, each deep layer's fused node is split by the slices that read it::

    before   x -> linear(W [q+2kv, d]) -> qkv -+- [..., :q]        -> query ...
                                               +- [..., q:q+kv]    -> key ...
                                               +- [..., q+kv:]     -> value ...
    after    x -> linear(W)              -> qkv -- [..., :q]        -> query ...     (module: qkv_proj)
             x -> linear(W[q:q+kv])      -> key ...                                  (module: k_proj)
             x -> linear(W[q+kv:])       -> value ...                                (module: v_proj)

The new nodes carry the module paths a model with separate projections has (``ArchSpec.k_proj`` and
``v_proj``: ``self_attn.k_proj``, ``self_attn.v_proj``), so everything after this (the boundary pass's
K/V parts, POP+ weight replacement, the shape checks) treats them as it treats Llama's. The Q slice keeps
reading the fused node: the separate boundary's pass then drops it with the query; the folded boundary runs
it on x_N alone (one row of the whole ``W``, the decode graph's weight). The weight rows are slices of the
parameter in the graph (no copy): the ONNX writer turns each into an initializer of its own
(exporters/onnx.fold_weight_slices), so the prefill graph carries no Q rows for its pruned layers.

Graph forms: torch.export's ``aten.slice.Tensor(qkv, dim, start, end)`` and dynamo's
``qkv[..., start:end]`` (``operator.getitem``), on the last dimension.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..frontend.arch import FUSED_QKV, KV_PARTS
from .layers import LINEAR, Layer, layer_part

_ATEN_SLICE = torch.ops.aten.slice.Tensor


class FusedProjectionError(ValueError):
    """A fused projection read other than as [q; k; v] slices of its last dimension."""


def fused_node(layer: Layer) -> fx.Node | None:
    """The layer's linear node inside a fused [q; k; v] projection (arch.FUSED_QKV), or None."""
    found = [n for n in layer.nodes if n.target in LINEAR and layer_part(n)[1] in FUSED_QKV]
    if len(found) > 1:
        raise FusedProjectionError(f"layer {layer.index}: {len(found)} fused qkv projection nodes, not one")
    return found[0] if found else None


def _value(node) -> torch.Tensor | None:
    return node.meta.get("val", node.meta.get("example_value")) if isinstance(node, fx.Node) else None


def _last_dim_slice(user: fx.Node, rows: int, ndim: int) -> tuple[int, int] | None:
    """(start, end) of ``user`` where it is a unit-step slice of its input's last dimension, else None."""
    if user.target is _ATEN_SLICE:
        dim, start, end, step = (list(user.args[1:]) + [0, None, None, 1][len(user.args) - 1:])[:4]
        if dim not in (-1, ndim - 1) or step != 1:
            return None
    elif user.target is operator.getitem and isinstance(user.args[1], tuple):
        *lead, last = user.args[1]
        full = all(i is Ellipsis or i == slice(None) for i in lead)
        if not (full and isinstance(last, slice) and last.step in (None, 1)
                and (Ellipsis in lead or len(lead) == ndim - 1)):
            return None
        start, end = last.start, last.stop
    else:
        return None
    start, end = 0 if start is None else start, rows if end is None else min(end, rows)
    if not (isinstance(start, int) and isinstance(end, int)):
        return None
    start, end = start + rows if start < 0 else start, end + rows if end < 0 else end  # Python's negatives
    return (start, end) if 0 <= start < end <= rows else None


def qkv_rows(node: fx.Node, layer: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """The (start, end) rows of Q, K and V in a fused node's output, read from the three slices that take
    them (FusedProjectionError for any other reader)."""
    value, weight = _value(node), _value(node.args[1])
    if value is None or weight is None:
        raise FusedProjectionError(f"layer {layer}: the fused projection {node.name} has no recorded shape")
    rows, ndim = int(weight.shape[0]), value.dim()
    found = {}
    for user in node.users:
        span = _last_dim_slice(user, rows, ndim)
        if span is None:
            raise FusedProjectionError(f"layer {layer}: {user.name} ({user.target}) reads the fused "
                                       f"projection {node.name}, not as a slice of its last dimension")
        found.setdefault(span, []).append(user)
    spans = sorted(found)
    if len(spans) != 3 or spans[0][0] != 0 or spans[-1][1] != rows or any(
            a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise FusedProjectionError(f"layer {layer}: the fused projection {node.name} is read as rows "
                                   f"{spans}, not as [q; k; v] of its {rows} rows")
    return tuple(spans)


def kv_row_shapes(node: fx.Node, layer: int) -> dict[str, tuple]:
    """{"k_proj"|"v_proj": (weight shape, bias shape or None)} of a fused node's K and V rows (what a K/V fit
    must match, as passes.pop.kv_projection_shapes reads a separate projection's)."""
    _, k, v = qkv_rows(node, layer)
    width = int(_value(node.args[1]).shape[1])
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return {part: ((end - start, width), None if bias is None else (end - start,))
            for part, (start, end) in zip(KV_PARTS, (k, v))}


def split_fused_projections(graph: fx.Graph, layers: list[Layer]) -> int:
    """Split the fused projection of each of ``layers`` (module docstring); returns how many were split. The
    layers' node lists are stale afterwards: find the layers again."""
    count = 0
    for layer in layers:
        node = fused_node(layer)
        if node is None:
            continue
        _, k, v = qkv_rows(node, layer.index)
        for part, (start, end) in zip(KV_PARTS, (k, v)):
            _rows_linear(graph, node, part, start, end)
        count += 1
    return count


def _rows_linear(graph: fx.Graph, node: fx.Node, part: str, start: int, end: int) -> None:
    """``linear(x, W[start:end], b[start:end])`` before ``node``, tagged as the sibling module ``part``; the
    slices of ``node`` at exactly those rows read it instead."""
    x, weight, *rest = node.args
    bias = rest[0] if rest else node.kwargs.get("bias")
    stack = _sibling_stack(node, part)
    with graph.inserting_before(node):
        args = [_row_slice(graph, node, weight, start, end, stack)]
        if bias is not None:
            args.append(_row_slice(graph, node, bias, start, end, stack))
        rows = graph.call_function(node.target, (x, *args))
    readers = [u for u in node.users if _last_dim_slice(u, int(_value(weight).shape[0]),
                                                        _value(node).dim()) == (start, end)]
    rows.meta.update(nn_module_stack=stack, **_meta_of(readers[0]))
    for reader in readers:
        reader.replace_all_uses_with(rows)
        graph.erase_node(reader)


def _row_slice(graph: fx.Graph, node: fx.Node, tensor: fx.Node, start: int, end: int, stack: dict) -> fx.Node:
    """``tensor[start:end]`` (its first dimension) in the graph's own form: aten.slice in an ATen graph,
    getitem in dynamo's."""
    if node.target is torch.ops.aten.linear.default:
        out = graph.call_function(_ATEN_SLICE, (tensor, 0, start, end))
    else:
        out = graph.call_function(operator.getitem, (tensor, slice(start, end)))
    value = _value(tensor)
    key = "val" if "val" in tensor.meta or "example_value" not in tensor.meta else "example_value"
    if value is not None:
        out.meta[key] = value[start:end]
    out.meta["nn_module_stack"] = stack
    return out


def _meta_of(reader: fx.Node) -> dict:
    """The recorded value of the slice a new node replaces (same shape, dtype and device)."""
    return {key: reader.meta[key] for key in ("val", "example_value") if key in reader.meta}


def _sibling_stack(node: fx.Node, part: str) -> dict:
    """``node``'s module stack with its innermost module renamed to ``part``'s last name:
    ``...layers.3.self_attn.qkv_proj`` -> ``...layers.3.self_attn.k_proj``."""
    stack = dict(node.meta.get("nn_module_stack") or {})
    if not stack:
        return stack
    key, (path, kind) = list(stack.items())[-1]
    del stack[key]
    name = path.rsplit(".", 1)[-1]
    stack[f"{key}_pop_{part}"] = (f"{path[: len(path) - len(name)]}{part}", kind)
    return stack
