"""The POP pass of either boundary over a captured decode graph: the graph pair every exporter consumes.

    decode   the captured model (frontend/capture.py), untouched
    prefill  a copy of it rewritten by one POP pass, then re-exported (capture.export_flat):

    boundary="folded"    boundary.py: x_1..x_N in, deep layers run x_N alone, logits of x_N out
                         (one call to the first token; the default)
    boundary="separate"  pop.py: x_1..x_{N-1} in, K/V out; the decode graph runs x_N after it

The driver captures the model and calls ``pop_graphs`` with a cut it has already resolved.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.export import ExportedProgram

from ..config import PopConfig
from ..engine.kv import KVLayout
from ..frontend.capture import CapturedModel, export_flat
from .boundary import fold_boundary_pass
from .pop import KVWeights, erase_metadata_asserts, pop_pass


@dataclass(frozen=True)
class GraphPair:
    decode: ExportedProgram
    prefill: ExportedProgram
    layout: KVLayout
    cut: int
    num_layers: int
    boundary: str = PopConfig.boundary
    #: both graphs' inputs before the KV rows (frontend/capture.Interface.names)
    inputs: tuple[str, ...] = ("input_ids", "position_ids", "attention_mask")


def prefill_graph(captured: CapturedModel, cut: int, kv_weights: KVWeights | None = None,
                  boundary: str = PopConfig.boundary) -> ExportedProgram:
    """Run a POP pass on a copy of the decode graph and export the result (same inputs)."""
    gm = captured.program.module()  # a fresh GraphModule: the decode program stays untouched
    if boundary == "folded":
        erase_metadata_asserts(gm.graph)  # impure: left in, they keep the replaced full-length nodes alive
        result = fold_boundary_pass(gm, cut, kv_weights)
    else:
        result = pop_pass(gm, cut, kv_weights)
    return export_flat(result.graph_module, captured.layout, captured.interface)


def pop_graphs(captured: CapturedModel, cut: int, kv_weights: KVWeights | None = None,
               boundary: str = PopConfig.boundary) -> GraphPair:
    """The decode graph (``captured``, untouched) and its prefill graph at ``cut`` (already resolved)."""
    prefill = prefill_graph(captured, cut, kv_weights, boundary)
    return GraphPair(captured.program, prefill, captured.layout, cut, captured.num_layers, boundary,
                     captured.interface.names)
