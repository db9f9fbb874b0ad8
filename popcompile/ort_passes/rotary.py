"""Rotary position embedding as onnxruntime's ``com.microsoft.RotaryEmbedding``, on the tokens'
``[B, S, H*D]`` rows: an ONNX-level rewrite of the fused graphs (after ``attention`` and
``shared_kv``; onnxscript's own RoPE fusion needs a cos/sin cache pattern the exporter's graphs do not
have, so RoPE stays in 7 standard ops per query and key, each a node onnxruntime dispatches every decode
step).

    before   v [B,S,H,D] ─ Transpose ─ x [B,H,S,D] ─┬─ Mul(cos) ─────────────────────────────────┐
                                                    └─ Slice, Slice ─ Neg ─ Concat ─ Mul(sin) ─── Add ─ y
             y [B,H,S,D] ─ Transpose ─ Reshape [B,S,H*D] ─ GroupQueryAttention
                                                      (and y ─ present / MHA's repeat)
    after    v ─ Reshape [B,S,H*D] ─ RotaryEmbedding(positions, cos_cache, sin_cache) ─ y3 ─ Identity ─ GQA
             y3 ─ Reshape [B,S,H,D] ─ Transpose ─ y     (kept only where y has other readers)

``cos_cache``/``sin_cache`` are this step's own cos/sin (``[Bc, 1, S, D]``), their first halves as
``[Bc*S, D/2]`` rows, and ``positions [Bc, S]`` index them (row ``b*S + s``). That the halves are equal
(HF's ``cat(freqs, freqs)``) is checked on the graph: cos/sin must come from ``Cos``/``Sin`` of a
``Concat(f, f)``, through Unsqueeze, Cast or a scalar Mul, and that their rows run along x's dim 2 (the
[B,H,S,D] layout: a [B,S,H,D] x with S = 1 has a static dim 1 too). A partial rotation (Phi-3: the first r
of D channels rotated, ``Concat(rope(x[..., :r]), x[..., r:])``) is one RotaryEmbedding with
``rotary_embedding_dim = r`` on the whole rows. Anything else (another rotation) keeps its ops.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graph import (
    declared_shapes,
    drop_dead,
    producers,
    readers,
    tensor_array,
    topological_sort,
    transpose_perm,
)

_PREFIX = "pop_rope"
_BSNH = [0, 2, 1, 3]
_PASS_THROUGH = ("Unsqueeze", "Cast", "Mul")
_CONST_ELEMENTS = 1 << 16


def fuse_rotary(proto: onnx.ModelProto) -> int:
    """Rewrite, in place, every rotate-half RoPE (module docstring) into RotaryEmbedding; returns how many."""
    graph = proto.graph
    producer = producers(graph)
    # shape and scalar constants only: the weights (hundreds of MB) decide no match
    consts = {t.name: tensor_array(t) for t in graph.initializer
              if math.prod(t.dims) <= _CONST_ELEMENTS}
    consts.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                   if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
    shapes, reading = declared_shapes(graph), readers(graph)
    added, caches, count, head_dims, gone = [], {}, 0, set(), set()
    for node in list(graph.node):
        match = _match(node, producer, consts, shapes) if node.op_type == "Add" else None
        if match is None:
            continue
        x, cos, sin = match
        y, rotary_dim = node.output[0], None
        partial = _partial(node, x, producer, reading, consts, shapes)
        if partial is not None:  # Concat(rotated x[..., :r], x[..., r:]): one RotaryEmbedding of all of x
            concat, x, rotary_dim = partial
            y = concat.output[0]
            gone.add(id(concat))
        gone.add(id(node))
        head_dims.add(shapes[x][3])
        inputs = [_positions(cos, caches, added), _cache(cos, caches, added), _cache(sin, caches, added)]
        added += _rotary_nodes(y, x, inputs, shapes[x], producer, reading, shapes, consts, count, rotary_dim)
        count += 1
    if count:
        kept = [node for node in graph.node if id(node) not in gone]
        _constants(graph, head_dims)
        del graph.node[:]
        graph.node.extend([*kept, *added])
        topological_sort(graph)  # the added nodes stand last, after their readers
        drop_dead(graph)
    return count


def _match(add, producer, consts, shapes) -> tuple[str, str, str] | None:
    """(x, cos, sin) of ``add = x*cos + rotate_half(x)*sin``, x [B,H,S,D] with static H and D; else None."""
    for first, second in (add.input, add.input[::-1]):
        straight, rotated = producer.get(first), producer.get(second)
        if not (_is(straight, "Mul") and _is(rotated, "Mul")):
            continue
        for rot, sin in (rotated.input, rotated.input[::-1]):
            x = _rotate_half_source(producer.get(rot), producer, consts, shapes)
            if x is None or x not in straight.input:
                continue
            cos = straight.input[1] if straight.input[0] == x else straight.input[0]
            if (_halves_equal(cos, producer, consts, "Cos") and _halves_equal(sin, producer, consts, "Sin")
                    and _rows_agree(x, cos, shapes) and _rows_agree(x, sin, shapes)):
                return x, cos, sin
    return None


def _rows_agree(x: str, trig: str, shapes) -> bool:
    """Whether cos/sin ``trig`` [Bc,1,S,D] (as declared) rotate x along x's dim 2, the [B,H,S,D] layout the
    rewrite assumes. A static dim 1 alone does not tell the layouts apart: a [B,S,H,D] x with S = 1 (the
    folded prefill's last position) has one too, and its cos/sin [B,1,1,D] then have 1 where x has H.
    Undeclared shapes are not compared."""
    xs, ts = shapes.get(x), shapes.get(trig)
    if not (xs and ts and len(xs) == len(ts) == 4):
        return True
    return ts[1] in (1, None) and (xs[2] is None or ts[2] is None or xs[2] == ts[2])


def _partial(add, x: str, producer, reading, consts, shapes) -> tuple | None:
    """(the Concat, the whole x, r) where ``add`` rotates only the first r of x's D channels and a Concat
    appends the rest: ``Concat(add(x[..., :r]), x[..., r:])`` on the last axis (Phi-3's partial rotary), x
    [B,H,S,D] with static H and D; else None."""
    low = producer.get(x)
    whole = low.input[0] if _is(low, "Slice") else None
    shape = shapes.get(whole)
    if not (shape and len(shape) == 4 and all(isinstance(d, int) for d in (shape[1], shape[3]))):
        return None
    rotary, users = _slice(low, consts), reading.get(add.output[0], ())
    if not rotary or rotary[0] != 0 or not 0 < rotary[1] < shape[3] or len(users) != 1:
        return None
    concat = reading[add.output[0]][0]
    if not (_is(concat, "Concat") and list(concat.input[:1]) == [add.output[0]] and len(concat.input) == 2
            and {a.name: a.i for a in concat.attribute}.get("axis") in (-1, 3)):
        return None
    rest = producer.get(concat.input[1])
    if not (_is(rest, "Slice") and rest.input[0] == whole and _slice(rest, consts)[:1] == (rotary[1],)
            and _slice(rest, consts)[1] >= shape[3]):
        return None
    return concat, whole, rotary[1]


def _rotate_half_source(concat, producer, consts, shapes) -> str | None:
    """x of ``Concat(Neg(x[..., D/2:]), x[..., :D/2])`` on the last axis of a static [B,H,S,D] x."""
    if not _is(concat, "Concat") or len(concat.input) != 2:
        return None
    neg, low = producer.get(concat.input[0]), producer.get(concat.input[1])
    high = producer.get(neg.input[0]) if _is(neg, "Neg") else None
    if not (_is(high, "Slice") and _is(low, "Slice") and high.input[0] == low.input[0]):
        return None
    x = low.input[0]
    shape = shapes.get(x)
    if not (shape and len(shape) == 4 and all(isinstance(d, int) for d in (shape[1], shape[3]))):
        return None
    if shape[3] % 2:
        return None
    axis = {a.name: a.i for a in concat.attribute}.get("axis")
    half = shape[3] // 2
    if axis not in (-1, 3) or _slice(low, consts) != (0, half) or _slice(high, consts)[:1] != (half,):
        return None
    return x if _slice(high, consts)[1] >= shape[3] else None


def _slice(node, consts) -> tuple[int, int] | tuple[()]:
    """(start, end) of a one-axis, unit-step Slice on the last axis (3 or -1); () for any other."""
    values = [consts.get(name) for name in node.input[1:5]] + [None] * (5 - len(node.input))
    starts, ends, axes, steps = values[:4]
    if any(v is None or v.size != 1 for v in (starts, ends, axes)) or int(axes.item()) not in (-1, 3):
        return ()
    if steps is not None and (steps.size != 1 or int(steps.item()) != 1):
        return ()
    return int(starts.item()), int(ends.item())


def _halves_equal(name: str, producer, consts, op: str) -> bool:
    """``name`` is ``op(Concat(f, f))`` on the last axis, through Unsqueeze, Cast, Muls by a scalar and Slices
    of other axes (a folded prefill's pruned layers rotate x_N's query by the last position's cos/sin)."""
    node = producer.get(name)
    while _is(node, *_PASS_THROUGH, "Slice"):
        if node.op_type == "Slice":
            axes = consts.get(node.input[3]) if len(node.input) > 3 else None
            if axes is None or {-1, 3} & {int(a) for a in axes.ravel()}:
                return False
            node = producer.get(node.input[0])
        elif node.op_type == "Mul":
            scalars = [i for i in node.input if i in consts and consts[i].size == 1]
            if len(scalars) != 1:
                return False
            node = producer.get(next(i for i in node.input if i not in scalars))
        else:
            node = producer.get(node.input[0])
    concat = producer.get(node.input[0]) if _is(node, op) else None
    return (_is(concat, "Concat") and len(concat.input) == 2 and concat.input[0] == concat.input[1]
            and {a.name: a.i for a in concat.attribute}.get("axis") in (-1, 3))


def _is(node, *ops: str) -> bool:
    return node is not None and node.op_type in ops and node.domain in ("", "ai.onnx")


def _cache(trig: str, caches: dict, added: list) -> str:
    """``trig [Bc,1,S,D]`` -> its first half as ``[Bc*S, D/2]`` rows (once per tensor)."""
    if trig not in caches:
        name, p = f"{_PREFIX}/cache/{len(caches)}", _PREFIX
        added += [helper.make_node("Shape", [trig], [f"{name}/dim"], start=3, end=4),
                  helper.make_node("Div", [f"{name}/dim", f"{p}/two"], [f"{name}/half"]),
                  helper.make_node("Slice", [trig, f"{p}/zero", f"{name}/half", f"{p}/last"],
                                   [f"{name}/low"]),
                  helper.make_node("Concat", [f"{p}/minus_one", f"{name}/half"], [f"{name}/rows"], axis=0),
                  helper.make_node("Reshape", [f"{name}/low", f"{name}/rows"], [name])]
        caches[trig] = name
    return caches[trig]


def _positions(cos: str, caches: dict, added: list) -> str:
    """``[Bc, S]`` row indices ``b*S + s`` of ``cos [Bc,1,S,D]``'s cache."""
    key = ("positions", cos)
    if key not in caches:
        name = f"{_PREFIX}/positions/{len(caches)}"
        added += [helper.make_node("Shape", [cos], [f"{name}/b"], start=0, end=1),
                  helper.make_node("Shape", [cos], [f"{name}/s"], start=2, end=3),
                  helper.make_node("Mul", [f"{name}/b", f"{name}/s"], [f"{name}/n1"]),
                  helper.make_node("Squeeze", [f"{name}/n1"], [f"{name}/n"]),
                  helper.make_node("Range", [f"{_PREFIX}/zero_scalar", f"{name}/n", f"{_PREFIX}/one_scalar"],
                                   [f"{name}/flat"]),
                  helper.make_node("Concat", [f"{name}/b", f"{name}/s"], [f"{name}/shape"], axis=0),
                  helper.make_node("Reshape", [f"{name}/flat", f"{name}/shape"], [name])]
        caches[key] = name
    return caches[key]


def _rotary_nodes(y: str, x: str, inputs: list[str], shape: list, producer, reading, shapes, consts,
                  index: int, rotary_dim: int | None = None) -> list:
    """RotaryEmbedding on ``x``'s token rows, and ``y`` [B,H,S,D] again for readers other than GQA's
    flattening. ``rotary_dim``: only the first ``rotary_dim`` channels of each head rotate (partial rotary:
    onnxruntime's ``rotary_embedding_dim``), the rest pass through."""
    name, heads, head_dim = f"{_PREFIX}/{index}", shape[1], shape[3]
    partial = {} if rotary_dim is None else {"rotary_embedding_dim": rotary_dim, "num_heads": heads}
    tokens, nodes = _token_rows(x, producer, consts, name)
    if tokens is None:  # x is not a transpose of token rows: rotate x [B,H,S,D] as it is
        return [helper.make_node("RotaryEmbedding", [x, *inputs], [y], domain="com.microsoft", interleaved=0,
                                 **partial)]
    partial.pop("num_heads", None)
    for reader in reading[y]:  # y ─ Transpose ─ Reshape [B,S,H*D]: that Reshape becomes Identity(y3)
        if _is(reader, "Transpose") and transpose_perm(reader) == _BSNH:
            for flat in reading[reader.output[0]]:
                if _is(flat, "Reshape") and _flattens(flat, heads * head_dim, shapes, consts):
                    _identity(flat, f"{name}/y3")
    return [*nodes, helper.make_node("Reshape", [tokens, f"{_PREFIX}/bsd"], [f"{name}/rows"]),
            helper.make_node("RotaryEmbedding", [f"{name}/rows", *inputs], [f"{name}/y3"],
                             domain="com.microsoft", interleaved=0, num_heads=heads, **partial),
            helper.make_node("Reshape", [f"{name}/y3", f"{_PREFIX}/bshd/{head_dim}"], [f"{name}/bshd"]),
            helper.make_node("Transpose", [f"{name}/bshd"], [y], perm=_BSNH)]


def _token_rows(x: str, producer, consts, name: str) -> tuple[str | None, list]:
    """v [B,S,H,D] with ``x = Transpose(v)``, or with ``x = f(Transpose(u))`` for an ``f`` over the last axis
    alone (Gemma's q/k RMSNorm, a Mul by a per-channel constant), then ``v = f(u)``, a new node; (None, [])
    for any other x."""
    node, last_axis = producer.get(x), None
    if _on_last_axis(node, consts):
        last_axis, node = node, producer.get(node.input[0])
    if not (_is(node, "Transpose") and transpose_perm(node) == _BSNH):
        return None, []
    if last_axis is None:
        return node.input[0], []
    moved = helper.make_node(last_axis.op_type, [node.input[0], *last_axis.input[1:]], [f"{name}/rows4"],
                             domain=last_axis.domain)
    moved.attribute.extend(last_axis.attribute)
    return f"{name}/rows4", [moved]


def _on_last_axis(node, consts) -> bool:
    """A node whose first input is the data and that acts on its last axis alone (so it commutes with swapping
    axes 1 and 2): SimplifiedLayerNormalization over axis -1, or a Mul by a constant along the last axis."""
    if node is None or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "SimplifiedLayerNormalization":
        return {a.name: a.i for a in node.attribute}.get("axis", -1) == -1 and len(node.output) == 1
    value = consts.get(node.input[1]) if node.op_type == "Mul" and len(node.input) == 2 else None
    return value is not None and (value.ndim <= 1 or all(d == 1 for d in value.shape[:-1]))


def _flattens(node, width: int, shapes, consts) -> bool:
    """Whether Reshape ``node`` takes [B,S,H,D] to [B,S,H*D]: shape [0, 0, -1 or H*D], or declared so."""
    target = consts.get(node.input[1])
    if target is not None:
        return target.size == 3 and list(target[:2]) == [0, 0] and int(target[2]) in (-1, width)
    out, source = shapes.get(node.output[0]), shapes.get(node.input[0])
    return bool(out and source and len(out) == 3 and out[2] == width and out[:2] == source[:2]
                and all(isinstance(d, str) for d in out[:2]))


def _identity(node, source: str) -> None:
    node.op_type = "Identity"
    del node.input[:]
    node.input.append(source)
    del node.attribute[:]


def _constants(graph: onnx.GraphProto, head_dims: set[int]) -> None:
    values = {"zero": [0], "two": [2], "last": [-1], "minus_one": [-1], "bsd": [0, 0, -1],
              **{f"bshd/{d}": [0, 0, -1, d] for d in head_dims}}
    graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), f"{_PREFIX}/{k}")
                             for k, v in values.items())
    graph.initializer.extend([numpy_helper.from_array(np.array(0, np.int64), f"{_PREFIX}/zero_scalar"),
                              numpy_helper.from_array(np.array(1, np.int64), f"{_PREFIX}/one_scalar")])

