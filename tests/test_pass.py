"""The POP pass (boundary "separate") on tiny exported graphs: node counts by module path, numerics against
reference.py. The folded boundary (passes/boundary.py on exported graphs) is tests/test_fold_export.py."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import TINY, empty_past, greedy_with_graphs, run_graph, tiny_model

from popcompile import reference
from popcompile.config import resolve_cut
from popcompile.driver import build_graphs
from popcompile.frontend.arch import DECODER_TYPES, arch_spec
from popcompile.passes.layers import find_layers, layer_part, module_path
from popcompile.passes.pop import pop_pass

# one worker runs this file: each architecture's graph pair, built once per module (conftest.py)
pytestmark = pytest.mark.xdist_group("test_pass")

ARCHS = sorted(DECODER_TYPES)
# Exact equality is expected where the graph and eager HF run the same kernels on the same inputs;
# 1e-5 absorbs reassociation in fused kernels.
ATOL = 1e-5


def test_every_registered_architecture_has_a_tiny_model():
    """Coverage stays honest: an architecture added to the table needs a tiny test model (a vision-language
    model's text decoder: the VLM's, tiny.tiny_vlm, tested in tests/test_vlm_*.py)."""
    from popcompile.frontend.arch import ARCHITECTURES
    from popcompile.frontend.vision import VISION_LANGUAGE

    assert set(DECODER_TYPES) == set(TINY)
    inside = {spec.part_of for spec in ARCHITECTURES.values() if spec.part_of}
    assert inside == set(VISION_LANGUAGE) == {"qwen3_vl"}


@pytest.fixture(scope="module", params=ARCHS)
def arch_pair(request):
    model = tiny_model(request.param)
    return model, build_graphs(model, cut=2, boundary="separate")


def _parts_by_layer(program) -> Counter:
    """(layer, last path component) -> node count, for call nodes inside decoder layers."""
    counts = Counter()
    for node in program.graph.nodes:
        found = layer_part(node) if node.op == "call_function" else None
        if found:
            counts[found[0], found[1].split(".")[-1] or "<residual>"] += 1
    return counts


PRUNED_PARTS = {"q_proj", "o_proj", "mlp", "gate_proj", "up_proj", "down_proj", "post_attention_layernorm",
                "pre_feedforward_layernorm", "post_feedforward_layernorm", "q_norm", "<residual>"}


def test_deep_layers_keep_only_the_kv_path(arch_pair):
    model, pair = arch_pair
    before, after = _parts_by_layer(pair.decode), _parts_by_layer(pair.prefill)
    norm = arch_spec(model.config).input_norm  # None: post-norm layers (OLMo 2) project h_cut itself
    for layer in range(pair.num_layers):
        kept = {part for (l, part) in after if l == layer}
        if layer < pair.cut:
            assert {part for (l, part) in before if l == layer} == kept, f"shallow layer {layer} changed"
        else:
            assert not kept & PRUNED_PARTS, f"layer {layer} still has {sorted(kept & PRUNED_PARTS)}"
            assert {"k_proj", "v_proj"} | ({norm} if norm else set()) <= kept
    paths = {module_path(n) for n in pair.prefill.graph.nodes}
    assert not any(p.endswith("lm_head") or p.endswith("model.norm") for p in paths)


def test_decode_graph_matches_hf(arch_pair):
    model, pair = arch_pair
    prompt = torch.randint(0, 97, (2, 11))
    logits, *_ = run_graph(pair.decode.module(), prompt, empty_past(pair.layout, 2))
    torch.testing.assert_close(logits, model(prompt).logits[:, -1], atol=ATOL, rtol=0)


def test_prefill_kv_matches_reference(arch_pair):
    model, pair = arch_pair
    prompt = torch.randint(0, 97, (1, 13))  # longer than Gemma's/Mistral's tiny sliding windows
    kv = run_graph(pair.prefill.module(), prompt, empty_past(pair.layout))
    cache = reference.prefill_cache(model, prompt, pair.cut)
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(kv[2 * i], layer.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(kv[2 * i + 1], layer.values, atol=ATOL, rtol=0)


def test_prefill_on_top_of_a_filled_cache(arch_pair):
    """A later chat turn: POP prefill with past length > 0 equals the reference on the whole text."""
    model, pair = arch_pair
    text = torch.randint(0, 97, (1, 14))
    first = run_graph(pair.prefill.module(), text[:, :6], empty_past(pair.layout))
    second = run_graph(pair.prefill.module(), text[:, 6:], list(first), start=6)
    cache = reference.prefill_cache(model, text, pair.cut)
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(torch.cat([first[2 * i], second[2 * i]], 2), layer.keys, atol=ATOL, rtol=0)


def test_greedy_pop_equals_reference(arch_pair):
    model, pair = arch_pair
    prompt = torch.randint(0, 97, (1, 10))
    expected = reference.generate(model, prompt, 6, reference.Variant(cut=pair.cut))
    assert greedy_with_graphs(pair, prompt, 6) == expected


def test_decode_graph_is_never_mutated():
    model = tiny_model("llama")
    from popcompile.frontend.capture import capture
    from popcompile.passes.prefill import prefill_graph

    captured = capture(model)
    before = [(n.op, str(n.target)) for n in captured.program.graph.nodes]
    prefill_graph(captured, 2, boundary="separate")
    prefill_graph(captured, 2, boundary="folded")
    assert [(n.op, str(n.target)) for n in captured.program.graph.nodes] == before


def test_cut_equal_to_layers_keeps_every_layer():
    model = tiny_model("qwen3")
    pair = build_graphs(model, cut=4, boundary="separate")
    counts = _parts_by_layer(pair.prefill)
    assert counts[2, "o_proj"] == 1 and counts[2, "down_proj"] == 1
    # Without logits nothing reads the last layer's output: only its K/V path is left, even at cut = L.
    assert counts[3, "o_proj"] == 0 and counts[3, "k_proj"] == 1
    prompt = torch.randint(0, 97, (1, 9))
    full = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, 9:].tolist()
    assert greedy_with_graphs(pair, prompt, 6) == full


def test_find_layers_reads_the_norm_input_not_the_residual_cast():
    model = tiny_model("llama")
    gm = build_graphs(model, cut=4, boundary="separate").decode.module()
    layers = find_layers(gm.graph)
    assert len(layers) == 4
    # layer l+1 reads the residual add that closes layer l (tagged as layer l itself)
    for prev, layer in zip(layers, layers[1:]):
        assert layer_part(layer.input) == (prev.index, "")


@pytest.mark.parametrize("kwargs, message", [
    ({"cut": 0}, "integer >= 1"), ({"cut": 5}, "out of range"), ({"prune_ratio": 1.0}, "out of range"),
    ({"cut": 2, "prune_ratio": 0.5}, "either"),
])
def test_bad_cut_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_cut(4, **kwargs)


@pytest.mark.parametrize("layers, expected", [(30, 20), (18, 12), (32, 22), (4, 3), (1, 1)])
def test_default_cut_prunes_the_last_third(layers, expected):
    assert resolve_cut(layers) == expected


def test_pass_rejects_a_graph_without_decoder_layers():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="cut=1 is out of range for a model with 0 layers"):
        pop_pass(gm, 1)


def test_kv_weights_replace_only_the_deep_projections():
    """POP+: same nodes, new weights; the original weights give the same graph outputs."""
    from popcompile.passes.pop import Projection

    model = tiny_model("qwen2")  # qwen2's k/v projections have a bias
    layers = model.get_decoder().layers
    same = {3: {"k_proj": Projection(layers[3].self_attn.k_proj.weight, layers[3].self_attn.k_proj.bias)}}
    torch.manual_seed(1)
    new_k = Projection(torch.randn_like(layers[3].self_attn.k_proj.weight), torch.randn(32))
    new_v = Projection(torch.randn_like(layers[3].self_attn.v_proj.weight), None)
    plain = build_graphs(model, cut=2, boundary="separate")
    unchanged = build_graphs(model, cut=2, kv_weights=same, boundary="separate")
    refit = build_graphs(model, cut=2, kv_weights={3: {"k_proj": new_k, "v_proj": new_v}},
                         boundary="separate")
    assert _parts_by_layer(refit.prefill) == _parts_by_layer(plain.prefill)
    prompt = torch.randint(0, 97, (1, 8))
    base, same_out, new = (run_graph(p.prefill.module(), prompt, empty_past(p.layout))
                           for p in (plain, unchanged, refit))
    for a, b in zip(base, same_out):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for i in range(6):  # layers 0..2 untouched
        torch.testing.assert_close(new[i], base[i], atol=0, rtol=0)
    h = layers[3].input_layernorm(model(prompt, output_hidden_states=True).hidden_states[2])
    v = (h @ new_v.weight.T).view(1, 8, 2, 16).transpose(1, 2)
    torch.testing.assert_close(new[7], v, atol=ATOL, rtol=0)
    assert not torch.allclose(new[6], base[6])
    with pytest.raises(ValueError, match="only pruned layers"):
        build_graphs(model, cut=2, kv_weights={1: {"k_proj": new_k}}, boundary="separate")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arch=st.sampled_from(ARCHS), kv_heads=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2, 3]),
       head_dim=st.sampled_from([8, 16]), layers=st.integers(2, 5), data=st.data())
def test_prefill_kv_equivalence_over_shapes(arch, kv_heads, groups, head_dim, layers, data):
    """Property: for any geometry and cut, the prefill graph's K/V equal the reference's."""
    cut = data.draw(st.integers(1, layers), label="cut")
    model = tiny_model(arch, layers=layers, heads=kv_heads * groups, kv_heads=kv_heads, head_dim=head_dim)
    pair = build_graphs(model, cut=cut, max_seq=64, boundary="separate")
    prompt = torch.randint(0, 97, (1, 9))
    kv = run_graph(pair.prefill.module(), prompt, empty_past(pair.layout))
    cache = reference.prefill_cache(model, prompt, cut)
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(kv[2 * i], layer.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(kv[2 * i + 1], layer.values, atol=ATOL, rtol=0)


def test_a_clip_that_binds_clamps_pruned_kv_and_the_graph_as_the_model_does():
    """OLMoE clamps q, k and v to [-clip_qkv, clip_qkv] after their projections and norms (TINY's clip never
    binds): with one that does, arch.pruned_kv of h_cut (then RoPE) and the prefill graph's K/V both equal the
    cache the model itself writes in POP's reference."""
    from transformers.models.olmoe.modeling_olmoe import apply_rotary_pos_emb

    from popcompile.frontend.arch import pruned_kv

    clip, cut = 0.3, 2
    model = tiny_model("olmoe", clip_qkv=clip)
    prompt = torch.randint(0, 97, (1, 9))
    cache = reference.prefill_cache(model, prompt, cut)
    pair = build_graphs(model, cut=cut, boundary="separate")
    kv = run_graph(pair.prefill.module(), prompt, empty_past(pair.layout))
    h_cut = model(prompt, output_hidden_states=True).hidden_states[cut]  # [1, 9, 64]
    cos, sin = model.model.rotary_emb(h_cut, torch.arange(9)[None])
    for index in range(cut, 4):
        layer = model.model.layers[index]
        with torch.no_grad():
            k, v = pruned_kv(arch_spec(model.config), layer, h_cut,
                             lambda x, a=layer.self_attn: (a.k_proj(x), a.v_proj(x)), 16)
        assert k.abs().max() == clip and v.abs().max() == clip  # the clamp binds on both
        k, v = (t.view(1, 9, 2, 16).transpose(1, 2) for t in (k, v))
        k = apply_rotary_pos_emb(k, k, cos, sin)[1]
        for got in ((k, v), (kv[2 * index], kv[2 * index + 1])):
            torch.testing.assert_close(got[0], cache.layers[index].keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(got[1], cache.layers[index].values, atol=ATOL, rtol=0)
