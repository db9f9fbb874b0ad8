"""The folded boundary on exported graphs (passes/boundary.py via driver.build_graphs, the default):
one prefill graph on x_1..x_N that runs x_N alone through the deep layers. Checked against the
separate pair (POP pass prefill on x_1..x_{N-1} + decode graph on x_N, tests/test_pass.py) and
reference.py."""
from __future__ import annotations

import pytest
import torch
from tiny import empty_past, greedy_with_graphs, run_graph, tiny_model

from popcompile import reference
from popcompile.driver import build_graphs
from popcompile.frontend.arch import DECODER_TYPES, arch_spec, kv_projections
from popcompile.passes.layers import layer_part
from popcompile.passes.pop import Projection

# one worker runs this file: each architecture's two graph pairs, built once per module (conftest.py)
pytestmark = pytest.mark.xdist_group("test_fold_export")

ARCHS = sorted(DECODER_TYPES)
ATOL = 1e-5  # same kernels on the same rows; reassociation in the one-row matmuls only
CUT = 2


@pytest.fixture(scope="module", params=ARCHS)
def pairs(request):
    model = tiny_model(request.param)
    return model, build_graphs(model, cut=CUT), build_graphs(model, cut=CUT, boundary="separate")


def _whole_prompt_linears(program) -> dict[tuple[int, str], bool]:
    """(layer, projection) -> whether its output has a row per prompt token (its rows depend on the sequence
    dim): [B, T, out], or [B*T, out] where a mixture of experts' router flattens the tokens; False for a
    last-position copy ([B, 1, out] or [B, out])."""
    seq = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name.endswith("input_ids"))
    symbol = seq.meta["val"].shape[1].node.expr
    found = {}
    for node in program.graph.nodes:
        part = layer_part(node) if node.op == "call_function" and "linear" in str(node.target) else None
        if part:
            rows = node.meta["val"].shape[:-1]
            found[part[0], part[1].split(".")[-1]] = any(
                isinstance(dim, torch.SymInt) and symbol in dim.node.expr.free_symbols for dim in rows)
    return found


def test_deep_layers_run_the_last_position_only_except_kv(pairs):
    """Phi-3: the fused qkv_proj runs on x_N alone (its Q); its K and V rows over the prompt are nodes of
    their own, named as a separate projection's (passes/fused.py)."""
    model, folded, _ = pairs
    assert folded.boundary == "folded"
    rows = _whole_prompt_linears(folded.prefill)
    for (layer, name), whole in rows.items():
        assert whole == (layer < CUT or name in ("k_proj", "v_proj")), f"layer {layer} {name}"
    query = (arch_spec(model.config).fused_qkv or "self_attn.q_proj").rsplit(".", 1)[-1]
    assert {name for (layer, name) in rows if layer == CUT} >= {query, "k_proj", "v_proj", "o_proj"}


def test_folded_prefill_equals_prefill_then_boundary_step(pairs):
    _, folded, separate = pairs
    prompt = torch.randint(0, 97, (2, 13))  # longer than the tiny sliding windows (4, 5)
    logits, *kv = run_graph(folded.prefill.module(), prompt, empty_past(folded.layout, 2))
    head = run_graph(separate.prefill.module(), prompt[:, :-1], empty_past(separate.layout, 2))
    step_logits, *step_kv = run_graph(separate.decode.module(), prompt[:, -1:], list(head), start=12)
    torch.testing.assert_close(logits, step_logits, atol=ATOL, rtol=0)
    for whole, rows, last in zip(kv, head, step_kv):
        torch.testing.assert_close(whole, torch.cat([rows, last], dim=2), atol=ATOL, rtol=0)


def test_greedy_with_folded_graphs_equals_reference(pairs):
    model, folded, _ = pairs
    prompt = torch.randint(0, 97, (1, 10))
    assert greedy_with_graphs(folded, prompt, 6) == reference.generate(model, prompt, 6,
                                                                       reference.Variant(cut=CUT))


def test_cut_equal_to_layers_is_the_full_model():
    model = tiny_model("llama")
    pair = build_graphs(model, cut=4)
    prompt = torch.randint(0, 97, (1, 9))
    full = model.generate(prompt, max_new_tokens=5, do_sample=False)[0, 9:].tolist()
    assert greedy_with_graphs(pair, prompt, 5) == full


@pytest.mark.parametrize("arch", ["qwen2", "llama", "phi3"])
def test_kv_weights_serve_the_pruned_rows_and_x_n_keeps_the_models_own(arch):
    """POP+ folded: rows 1..N-1 of layer 3 from the refit weights, row N from the model's (its true input).
    llama: a fitted k bias on a projection the model has without one; x_N's row keeps no bias. phi3: the
    refit replaces the K/V rows of its fused qkv_proj; x_N's row is the fused projection's own."""
    model = tiny_model(arch)
    torch.manual_seed(1)
    own = kv_projections(arch_spec(model.config), model.get_decoder().layers[3])
    weights = {3: {"k_proj": Projection(torch.randn_like(own["k_proj"].weight), torch.randn(32)),
                   "v_proj": Projection(torch.randn_like(own["v_proj"].weight), None)}}
    folded = build_graphs(model, cut=CUT, kv_weights=weights)
    separate = build_graphs(model, cut=CUT, kv_weights=weights, boundary="separate")
    prompt = torch.randint(0, 97, (1, 9))
    logits, *kv = run_graph(folded.prefill.module(), prompt, empty_past(folded.layout))
    head = run_graph(separate.prefill.module(), prompt[:, :-1], empty_past(separate.layout))
    step_logits, *step_kv = run_graph(separate.decode.module(), prompt[:, -1:], list(head), start=8)
    torch.testing.assert_close(logits, step_logits, atol=ATOL, rtol=0)
    for whole, rows, last in zip(kv, head, step_kv):
        torch.testing.assert_close(whole, torch.cat([rows, last], dim=2), atol=ATOL, rtol=0)
    # the separate prefill's rows
    cache = reference.prefill_cache(model, prompt[:, :-1], CUT, kv_weights=weights)
    torch.testing.assert_close(head[2 * 3], cache.layers[3].keys, atol=ATOL, rtol=0)


def test_unknown_boundary_is_a_clear_error():
    with pytest.raises(ValueError, match="boundary='late' is not one of"):
        build_graphs(tiny_model("llama"), cut=CUT, boundary="late")
