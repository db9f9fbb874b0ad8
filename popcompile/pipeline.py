"""Capture -> POP pass: the two graphs every exporter consumes (driver.py runs the whole compile).

``build_graphs`` gives the two graphs that every exporter consumes: the decode graph (the captured
model, untouched) and the prefill graph (the captured model rewritten by a POP pass):

    boundary="folded"    passes/boundary.py: x_1..x_N in, deep layers run x_N alone, logits of x_N out
                         (one call to the first token; the default)
    boundary="separate"  passes/pop.py: x_1..x_{N-1} in, K/V out; the decode graph runs x_N after it
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from .capture import CapturedModel, capture, export_flat
from .engine.kv import KVLayout
from .engine.manifest import BOUNDARIES
from .passes.boundary import fold_boundary_pass
from .config import resolve_cut
from .errors import ConfigError
from .passes.pop import KVWeights, erase_metadata_asserts, pop_pass


@dataclass(frozen=True)
class GraphPair:
    decode: ExportedProgram
    prefill: ExportedProgram
    layout: KVLayout
    cut: int
    num_layers: int
    boundary: str = "folded"


def prefill_graph(captured: CapturedModel, cut: int, kv_weights: KVWeights | None = None,
                  boundary: str = "folded") -> ExportedProgram:
    """Run a POP pass on a copy of the decode graph and export the result."""
    gm = captured.program.module()  # a fresh GraphModule: the decode program stays untouched
    if boundary == "folded":
        erase_metadata_asserts(gm.graph)  # impure: left in, they keep the replaced full-length nodes alive
        result = fold_boundary_pass(gm, cut, kv_weights)
    else:
        result = pop_pass(gm, cut, kv_weights)
    return export_flat(result.graph_module, captured.layout, captured.vocab_size)


def pop_graphs(captured: CapturedModel, cut: int, kv_weights: KVWeights | None = None,
               boundary: str = "folded") -> GraphPair:
    """The decode graph (``captured``, untouched) and its prefill graph at ``cut`` (already resolved)."""
    prefill = prefill_graph(captured, cut, kv_weights, boundary)
    return GraphPair(captured.program, prefill, captured.layout, cut, captured.num_layers, boundary)


def build_graphs(
    model: torch.nn.Module, *, cut: int | None = None, prune_ratio: float | None = None,
    max_seq: int | None = None, kv_weights: KVWeights | None = None, boundary: str = "folded",
) -> GraphPair:
    """Capture ``model`` and derive its prefill graph; cut and boundary are validated before any tracing."""
    if boundary not in BOUNDARIES:
        raise ConfigError(f"boundary={boundary!r} is not one of {', '.join(BOUNDARIES)}")
    cut = resolve_cut(model.config.num_hidden_layers, cut=cut, prune_ratio=prune_ratio)
    return pop_graphs(capture(model, max_seq=max_seq), cut, kv_weights, boundary)
