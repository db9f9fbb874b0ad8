"""The FLOP cost model: published bounds, exact identities and properties over random geometries."""
from __future__ import annotations

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from popcompile.cost import Geometry, prefill_flops, speedup_bound

LLAMA_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=14336, vocab_size=128256, num_hidden_layers=32)
SMOLLM2_135M = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, num_hidden_layers=30)


def test_llama_8b_bound_matches_design():
    # docs/benchmarks.md: "Llama-3.1-8B at cut 22/32 is 1.430x at 2048 tokens".
    assert speedup_bound(LLAMA_8B, 2048, 22) == pytest.approx(1.43, abs=0.005)


@pytest.mark.parametrize("n_tokens", [1024, 2048])
def test_smollm2_bound_matches_design(n_tokens):
    # docs/benchmarks.md: the bound at cut 20/30 is 1.460x (1024 tokens) and 1.465x (2048);
    # ORT measured 1.41-1.44x.
    assert speedup_bound(SMOLLM2_135M, n_tokens, 20) == pytest.approx(1.46, abs=0.01)


def test_full_prefill_by_hand():
    # One layer, one token: Q,K,V,O = 2*h*(2HD + 2*Hkv*D), MLP = 6hF, attention = 4HD*1, head = 2hV.
    g = Geometry(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                 intermediate_size=16, vocab_size=10, num_hidden_layers=1)
    expected = 2 * 8 * (2 * 8 + 2 * 4) + 6 * 8 * 16 + 4 * 8 * 1 + 2 * 8 * 10
    assert prefill_flops(g, 1) == expected
    # Two tokens: projections and MLP double, attention covers 1 + 2 = 3 (query, key) pairs.
    expected2 = 2 * (2 * 8 * (2 * 8 + 2 * 4) + 6 * 8 * 16) + 4 * 8 * 3 + 2 * 8 * 10
    assert prefill_flops(g, 2) == expected2


@pytest.mark.parametrize("n_tokens", [1, 2, 17, 2048])
def test_no_pruning_is_exactly_the_full_prefill(n_tokens):
    # Integer sums: x_1..x_{N-1} then x_N costs exactly what x_1..x_N costs, so the bound is 1.0 exactly.
    assert prefill_flops(LLAMA_8B, n_tokens, cut=32) == prefill_flops(LLAMA_8B, n_tokens)
    assert speedup_bound(LLAMA_8B, n_tokens, 32) == 1.0


def test_bound_decreases_with_cut():
    bounds = [speedup_bound(SMOLLM2_135M, 1024, cut) for cut in range(1, 31)]
    assert all(a > b for a, b in zip(bounds, bounds[1:]))


def test_from_hf_config_defaults_head_dim():
    config = transformers.LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                      intermediate_size=1536, vocab_size=49152, num_hidden_layers=30)
    assert Geometry.from_config(config) == Geometry(**SMOLLM2_135M)
    assert speedup_bound(config, 2048, 20) == speedup_bound(SMOLLM2_135M, 2048, 20)


@pytest.mark.parametrize("bad", [dict(hidden_size=0), dict(num_key_value_heads=2), dict(head_dim=None)])
def test_invalid_geometry(bad):
    with pytest.raises(ValueError):
        Geometry(**{**SMOLLM2_135M, **bad})


@pytest.mark.parametrize("cut, n_tokens", [(0, 10), (31, 10), (None, 10), (20, 0), (True, 10)])
def test_invalid_arguments(cut, n_tokens):
    with pytest.raises(ValueError):
        speedup_bound(SMOLLM2_135M, n_tokens, cut)


@st.composite
def geometries(draw):
    kv_heads = draw(st.integers(1, 16))
    return Geometry(
        hidden_size=draw(st.integers(1, 16384)),
        num_attention_heads=kv_heads * draw(st.integers(1, 8)),
        num_key_value_heads=kv_heads,
        head_dim=draw(st.integers(1, 256)),
        intermediate_size=draw(st.integers(1, 65536)),
        vocab_size=draw(st.integers(1, 300000)),
        num_hidden_layers=draw(st.integers(1, 128)),
    )


@settings(max_examples=200, deadline=None)
@given(geometries(), st.integers(1, 32768), st.data())
def test_bound_properties(g, n_tokens, data):
    layers = g.num_hidden_layers
    cut = data.draw(st.integers(1, layers))
    bound = speedup_bound(g, n_tokens, cut)
    assert bound >= 1.0
    if cut == layers:
        assert bound == 1.0
    if cut > 1:
        lower = speedup_bound(g, n_tokens, cut - 1)
        if n_tokens >= 2:  # x_1..x_{N-1} is not empty: pruning one more layer saves FLOPs
            assert lower > bound
        else:  # N = 1: the prefill graph has no tokens, nothing to save
            assert lower == bound == 1.0


def test_a_mixture_of_experts_counts_its_active_experts_and_its_router():
    """Mixtral's shapes: 2 of 8 experts of width 14336 per token, so F = 28672, and 8 router logits per token;
    Qwen3-MoE's expert width is moe_intermediate_size (its intermediate_size is a dense layer's)."""
    mixtral = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
               "intermediate_size": 14336, "vocab_size": 32000, "num_hidden_layers": 32,
               "num_local_experts": 8, "num_experts_per_tok": 2}
    g = Geometry.from_config(mixtral)
    assert (g.intermediate_size, g.num_experts, g.head_dim) == (28672, 8, 128)
    dense = Geometry.from_config({**mixtral, "num_local_experts": None, "intermediate_size": 28672})
    assert g.layer(0, 5) - dense.layer(0, 5) == 2 * 5 * 4096 * 8  # the router, nothing else
    qwen = {**mixtral, "num_local_experts": None, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768}
    assert Geometry.from_config(qwen).intermediate_size == 8 * 768
    with pytest.raises(ValueError, match="num_experts"):
        Geometry(64, 4, 2, 16, 128, 97, 4, num_experts=-1)
