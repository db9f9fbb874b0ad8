"""The hand-off store of the vLLM prefill/decode split (popcompile.vllm_plugin.handoff), without vLLM: entries
are keyed by the exact prompt, written whole or not at all, and a folder belongs to one model layout.
tests_vllm/test_vllm_disagg.py runs the two instances over it."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from popcompile.errors import ConfigError
from popcompile.vllm_plugin.handoff import HandoffStore, Layout, entry_key, weights_fingerprint

LAYOUT = Layout(architecture="LlamaForCausalLM", num_layers=4, num_kv_heads=2, head_dim=32, dtype="float32",
                weights="abc")


def rows(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(count, 2, 2, 32, generator=generator)
            for i in range(4)}


def test_an_entry_round_trips_under_its_exact_prompt(tmp_path):
    store = HandoffStore(tmp_path, LAYOUT)
    key = entry_key([5, 6, 7, 8])
    assert store.has(key) == 0
    written = rows(3)
    store.write(key, written)
    assert store.has(key) == 3
    assert all(torch.equal(store.read(key)[name], tensor) for name, tensor in written.items())
    # another prompt, a prefix of it, or the same ids with an image are other entries
    assert {entry_key([5, 6, 7]), entry_key([5, 6, 7, 9]), entry_key([5, 6, 7, 8], ["img"])}.isdisjoint({key})
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def test_a_second_write_of_a_prompt_keeps_the_first(tmp_path):
    store = HandoffStore(tmp_path, LAYOUT)
    key = entry_key([1, 2, 3])
    store.write(key, rows(2, seed=0))
    store.write(key, rows(2, seed=1))
    name = "model.layers.0.self_attn.attn"
    assert torch.equal(store.read(key)[name], rows(2, seed=0)[name])


def test_layers_with_different_row_counts_are_not_written(tmp_path):
    store = HandoffStore(tmp_path, LAYOUT)
    bad = {**rows(3), "model.layers.9.self_attn.attn": torch.zeros(2, 2, 2, 32)}
    with pytest.raises(ValueError, match=r"different row counts \[2, 3\]"):
        store.write(entry_key([1]), bad)
    assert store.has(entry_key([1])) == 0


def test_the_folder_belongs_to_the_first_layout_and_refuses_another(tmp_path):
    HandoffStore(tmp_path, LAYOUT).claim_layout()
    HandoffStore(tmp_path, LAYOUT).claim_layout()  # the same model again: fine
    other = replace(LAYOUT, num_layers=30, dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"another model layout \(num_layers 4 vs 30; dtype 'float32' vs "
                                          r"'bfloat16'\)"):
        HandoffStore(tmp_path, other).claim_layout()


def test_an_entry_of_another_layout_is_not_a_hit(tmp_path):
    key = entry_key([1, 2, 3])
    HandoffStore(tmp_path, LAYOUT).write(key, rows(2))
    assert HandoffStore(tmp_path, replace(LAYOUT, weights="def")).has(key) == 0


def test_the_weights_fingerprint_tells_checkpoints_apart_and_ignores_pop_plus_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, value in ((a, 1.0), (b, 2.0)):
        folder.mkdir()
        save_file({"w": torch.full((4, 4), value)}, str(folder / "model.safetensors"))
    assert weights_fingerprint(a) != weights_fingerprint(b)
    before = weights_fingerprint(a)
    save_file({"pop_kv.layers.2.k_proj.weight": torch.ones(2, 2)}, str(a / "pop_kv.safetensors"))
    assert weights_fingerprint(a) == before
