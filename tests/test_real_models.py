"""Capture and POP pass on the real shipped models (float32, a real prompt of a few hundred tokens)."""
from __future__ import annotations

import inspect
import json.decoder

import pytest
import torch
from tiny import empty_past, greedy_with_graphs, run_graph

from popcompile import reference
from popcompile.driver import build_graphs
from popcompile.frontend.arch import arch_spec, kv_projections

# one worker runs this file: the graphs of each real model, built once per module (conftest.py)
pytestmark = pytest.mark.xdist_group("test_real_models")

# The graph and eager HF run the same ops; 1e-4 is the bound for fp32 logits (vocab-wide max).
LOGITS_ATOL = 1e-4
KV_ATOL = 1e-4
REAL_TEXT = inspect.getsource(json.decoder)  # real code nobody here wrote


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def real(request, real_model):
    loaded = real_model(request.param)
    ids = loaded.tokenizer(REAL_TEXT, return_tensors="pt").input_ids[:, :300]
    pair = build_graphs(loaded.model, max_seq=1024)  # default cut: last third pruned
    return loaded.model, pair, ids


def test_default_cut(real):
    model, pair, _ = real
    assert (pair.num_layers, pair.cut) in {(30, 20), (18, 12)}


def test_decode_graph_logits_equal_hf(real):
    model, pair, ids = real
    with torch.no_grad():
        logits, *_ = run_graph(pair.decode.module(), ids, empty_past(pair.layout))
        expected = model(ids).logits[:, -1]
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL


def test_prefill_kv(real):
    """Layers < cut: HF's own KV, every row. Layers >= cut, rows 1..N-1: the formula applied to h_cut (V
    explicitly; K with k_norm and RoPE through the reference, whose deep layers all receive h_cut). Row N
    of a deep layer comes from x_N's own pass (folded boundary; tests/test_fold_export.py checks it)."""
    model, pair, ids = real
    spec = arch_spec(model.config)
    assert pair.boundary == "folded"
    with torch.no_grad():
        logits, *kv = run_graph(pair.prefill.module(), ids, empty_past(pair.layout))
        out = model(ids, output_hidden_states=True, use_cache=True)
        pop_cache = reference.prefill_cache(model, ids, pair.cut)
    h_cut = out.hidden_states[pair.cut]  # [1, N, hidden]: output of layer cut-1
    layers = model.get_decoder().layers
    for i in range(pair.num_layers):
        key, value = kv[2 * i], kv[2 * i + 1]
        if i < pair.cut:
            assert (key - out.past_key_values.layers[i].keys).abs().max() <= KV_ATOL, f"K layer {i}"
            assert (value - out.past_key_values.layers[i].values).abs().max() <= KV_ATOL, f"V layer {i}"
            continue
        layer = layers[i]
        v = kv_projections(spec, layer)["v_proj"](layer.get_submodule(spec.input_norm)(h_cut))
        v = v.view(1, ids.shape[1], pair.layout.num_kv_heads, pair.layout.head_dim).transpose(1, 2)
        assert (value - v)[:, :, :-1].abs().max() <= KV_ATOL, f"V layer {i}"
        assert (key - pop_cache.layers[i].keys)[:, :, :-1].abs().max() <= KV_ATOL, f"K layer {i}"
    assert logits.shape == (1, model.config.vocab_size)


def test_no_pruning_generation_equals_hf_generate(real):
    model, pair, ids = real
    prompt = ids[:, :120]
    full_pair = build_graphs(model, cut=pair.num_layers, max_seq=256)
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert greedy_with_graphs(full_pair, prompt, 12) == expected


def test_pop_generation_equals_reference(real):
    model, pair, ids = real
    expected = reference.generate(model, ids, 12, reference.Variant(cut=pair.cut))
    assert greedy_with_graphs(pair, ids, 12) == expected
