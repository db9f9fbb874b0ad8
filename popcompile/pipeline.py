"""The straight pipeline: load -> capture -> POP pass -> (export -> run, elsewhere).

``build_graphs`` gives the two graphs that every exporter consumes: the decode graph (the captured
model, untouched) and the prefill graph (the captured model rewritten by the POP pass).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from .capture import CapturedModel, capture, export_flat
from .kv import KVLayout
from .passes.pop import KVWeights, pop_pass, resolve_cut


@dataclass(frozen=True)
class GraphPair:
    decode: ExportedProgram
    prefill: ExportedProgram
    layout: KVLayout
    cut: int
    num_layers: int


def prefill_graph(captured: CapturedModel, cut: int, kv_weights: KVWeights | None = None) -> ExportedProgram:
    """Run the POP pass on a copy of the decode graph and export the result."""
    gm = captured.program.module()  # a fresh GraphModule: the decode program stays untouched
    result = pop_pass(gm, cut, kv_weights)
    return export_flat(result.graph_module, captured.layout, captured.vocab_size)


def build_graphs(
    model: torch.nn.Module, *, cut: int | None = None, prune_ratio: float | None = None,
    max_seq: int | None = None, kv_weights: KVWeights | None = None,
) -> GraphPair:
    """Capture ``model`` and derive its prefill graph; the cut is validated before any tracing."""
    cut = resolve_cut(model.config.num_hidden_layers, cut=cut, prune_ratio=prune_ratio)
    captured = capture(model, max_seq=max_seq)
    prefill = prefill_graph(captured, cut, kv_weights)
    return GraphPair(captured.program, prefill, captured.layout, cut, captured.num_layers)
