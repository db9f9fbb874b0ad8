"""The ONNX-level rewrites that make an exported engine fast on onnxruntime, as one ordered list:
``ORT_PASSES``.

``onnx.fuse_for_ort`` runs them in this order on the two graphs ``to_onnx`` wrote (``{"decode": ..,
"prefill": ..}``, before the weights are quantised: quantize.py streams each packed weight as one
MatMulNBits) and builds the manifest's ``attention`` entry from what they record. Each pass has one
signature, ``run(graphs, context) -> dict``: it rewrites ``graphs`` in place (or replaces an entry: the
attention lowering consumes its input) and returns the entries it records for the manifest. The full graph
pictures are in each pass's module; the helpers they share in ort_passes/graph.py.

    pass        graphs        records      module
    attention   each          layers       attention.lower_for_ort
    shared_kv   decode        shared_kv    shared_kv.share_kv_buffer
    rotary      each          rotary       rotary.fuse_rotary
    pack        both at once  packed       pack.pack_projections
    views       each          -            views.drop_round_trip_views
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import onnx

from ..engine.kv import KVLayout
from .attention import lower_for_ort
from .pack import pack_projections
from .rotary import fuse_rotary
from .shared_kv import share_kv_buffer
from .views import drop_round_trip_views

#: graph name ("decode", "prefill") -> its ONNX model, rewritten in place
Graphs = dict[str, onnx.ModelProto]


@dataclass(frozen=True)
class OrtContext:
    """What the passes know of the model besides its graphs."""

    num_layers: int
    layout: KVLayout
    #: moves the values of a large initializer a pass makes out of memory as it is made (the ONNX writer's
    #: scratch file, exporters/scratch.py); None: they stay in the graph
    store: Callable[[onnx.TensorProto], None] | None = None


@dataclass(frozen=True)
class OrtPass:
    """One rewrite: ``run(graphs, context)`` edits ``graphs`` and returns its manifest entries; ``doc``: the
    graph before and after, and why the pass sits where it does in ``ORT_PASSES``."""

    name: str
    run: Callable[[Graphs, OrtContext], dict]
    doc: str


def _attention(graphs: Graphs, context: OrtContext) -> dict:
    layers = {}
    for name, proto in graphs.items():
        graphs[name], layers[name] = lower_for_ort(proto, context.num_layers)
    return {"layers": layers}


def _shared_kv(graphs: Graphs, context: OrtContext) -> dict:
    # decode only (the folded prefill's pruned layers are MultiHeadAttention: share_kv_buffer would refuse it)
    return {"shared_kv": [name for name in ("decode",) if share_kv_buffer(graphs[name], context.layout)]}


def _rotary(graphs: Graphs, context: OrtContext) -> dict:
    return {"rotary": {name: fuse_rotary(proto) for name, proto in graphs.items()}}


def _pack(graphs: Graphs, context: OrtContext) -> dict:
    return {"packed": pack_projections(graphs, context.store)}


def _views(graphs: Graphs, context: OrtContext) -> dict:
    for proto in graphs.values():
        drop_round_trip_views(proto)
    return {}


ORT_PASSES: tuple[OrtPass, ...] = (
    OrtPass("attention", _attention, """\
Norms and attention to onnxruntime's contrib ops (onnxscript's ORT fusions, then mha_to_gqa).
before: RMSNorm in standard ops; attention over K/V repeated per query head from Concat(past, new).
after:  (Skip)SimplifiedLayerNormalization; GroupQueryAttention(q, k_new, v_new, past_k, past_v, mask bias)
        where the query has as many tokens as the new rows, MultiHeadAttention where it has fewer (the folded
        prefill's pruned layers).
First: shared_kv, rotary and views act on the fused ops it leaves."""),
    OrtPass("shared_kv", _shared_kv, """\
The decode graph on the KV buffer itself (onnxruntime's past_present_share_buffer).
before: present.i.key = the new rows k_new [B,Hkv,T,D]; P = Shape(past.i.key)[2].
after:  present.i.key = GroupQueryAttention's present [B,Hkv,max(R,P+T),D], written in place where bound to
        the past; P = Shape(attention_mask)[1] - Shape(input_ids)[1].
After attention: it needs GroupQueryAttention in every layer. Before rotary: it decides whether k's
[B,H,S,D] form still has a reader (the present output), which the RoPE rewrite then rebuilds or not."""),
    OrtPass("rotary", _rotary, """\
Rotate-half RoPE to com.microsoft.RotaryEmbedding on the tokens' rows.
before: x [B,H,S,D] -> x*cos + Concat(Neg(x[..., D/2:]), x[..., :D/2])*sin (7 ops) -> Transpose, Reshape
        [B,S,H*D] -> GroupQueryAttention.
after:  v [B,S,H,D] -> Reshape [B,S,H*D] -> RotaryEmbedding -> Identity -> GroupQueryAttention.
After shared_kv: GroupQueryAttention's flattening of q and k is its anchor, and shared_kv decides which
[B,H,S,D] readers remain."""),
    OrtPass("pack", _pack, """\
Projections of one activation packed into one MatMul, across both graphs at once.
before: h -> MatMul(Wq), MatMul(Wk), MatMul(Wv) (each + Add(b) where biased).
after:  h -> MatMul([Wq|Wk|Wv]) (+ Add([bq|bk|bv])) -> Split -> q, k, v under their old names.
Both graphs at once: a packed weight is one new tensor, stored once only where every graph reading its parts
packs them alike. Before quantisation (after fuse_for_ort): int4/int8 stream one MatMulNBits per group."""),
    OrtPass("views", _views, """\
Views that end where they began, removed.
before: x [B,S,H*D] -> Reshape [B,S,H,D] -> Reshape [B,S,H*D] -> y
        x -> Transpose(p) -> Transpose(p^-1) -> y
after:  y's readers read x.
Last: the earlier rewrites close most of these round trips (GroupQueryAttention's Transpose of the new rows
back to [B,S,H,D], RoPE's Reshape of v to its [B,S,H*D] rows and the Identity that replaces GQA's
flattening), so it runs after all of them."""),
)
