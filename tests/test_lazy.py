"""Models built without their weights (frontend/lazy.py) through the K/V fit: ridge streams one module's
weights at a time and fits exactly what the loaded model fits; distill reads them all, or falls back to
ridge when they do not fit in memory; the export of a lazily loaded model with a fit writes the loaded
model's engine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_engine import tiny_hf_folder

from popcompile.config import DistillConfig, KVFitConfig, PopConfig
from popcompile.driver import _loads_lazily, compile
from popcompile.exporters.targets import OnnxTarget
from popcompile.frontend.lazy import LazyWeights
from popcompile.frontend.models import load_model
from popcompile.kvfit.budget import plan_fit
from popcompile.kvfit.calibrate import load_fit, ridge_fits, token_batches
from popcompile.kvfit.fit import fit_on_tokens

LAYERS, CUT = 6, 4
SHORT = DistillConfig(steps=6, continuation=4, eval_every=3, patience=100, windows=4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Llama with an untied head (two large weights, each read on its own)."""
    return tiny_hf_folder(tmp_path_factory.mktemp("lazy-hf"), layers=LAYERS, tie_word_embeddings=False,
                          max_position_embeddings=256)


def batches(count: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 97, (2, 40), generator=generator) for _ in range(count)]


def placeholders_left(model: torch.nn.Module, lazy: LazyWeights) -> list[str]:
    return [name for name, p in model.named_parameters() if lazy.key(p) is None]


def real_bytes(model: torch.nn.Module, lazy: LazyWeights) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if lazy.key(p) is None)


def test_streamed_ridge_fit_equals_the_loaded_models_and_leaves_placeholders(folder):
    lazy_model = load_model(str(folder), lazy=True)
    whole = load_model(str(folder))
    lazy, model = lazy_model.lazy, lazy_model.model
    with torch.no_grad():
        want = ridge_fits(whole.model, batches(), [CUT])[CUT]
        with lazy.streamed(model):
            got = ridge_fits(model, batches(), [CUT])[CUT]
    for layer, parts in want.weights.items():
        for part, projection in parts.items():
            torch.testing.assert_close(got.weights[layer][part].weight, projection.weight, rtol=0, atol=0)
    assert got.info == want.info
    assert placeholders_left(model, lazy) == []
    assert not any("_lazy_held" in m.__dict__ for m in model.modules())


def test_a_streamed_forward_holds_one_modules_weights_at_a_time(folder):
    loaded = load_model(str(folder), lazy=True)
    lazy, model = loaded.lazy, loaded.model
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                  for m in model.modules())
    seen: list[int] = []
    record = lambda *_: seen.append(real_bytes(model, lazy))
    hooks = [m.register_forward_hook(record) for m in model.modules()]
    with torch.no_grad(), lazy.streamed(model):
        model(batches(1)[0])
    for hook in hooks:
        hook.remove()
    # the hook runs after the module's forward, before its weights are dropped: one module's at most
    assert seen and 0 < max(seen) <= largest
    assert real_bytes(model, lazy) == 0


def test_streamed_puts_the_placeholders_back_when_a_forward_raises(folder):
    loaded = load_model(str(folder), lazy=True)
    lazy, model = loaded.lazy, loaded.model
    with pytest.raises(IndexError), torch.no_grad(), lazy.streamed(model):
        model(torch.tensor([[500]]))  # past the vocabulary: the embedding raises after reading its weight
    assert placeholders_left(model, lazy) == [] and real_bytes(model, lazy) == 0


def test_materialise_reads_every_weight_once_and_forgets_the_keys(tmp_path):
    tied = tiny_hf_folder(tmp_path / "tied", layers=2)  # lm_head is embed_tokens
    loaded, whole = load_model(str(tied), lazy=True), load_model(str(tied))
    lazy, model = loaded.lazy, loaded.model
    assert lazy.placeholder_bytes(model) == sum(p.numel() * 4 for p in whole.model.parameters())
    lazy.materialise(model)
    assert lazy.keys == {} and model.lm_head.weight is model.model.embed_tokens.weight
    ids = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, whole.model(ids).logits, rtol=0, atol=0)


def test_distill_whose_weights_exceed_the_memory_falls_back_to_ridge(folder):
    model = load_model(str(folder), lazy=True).model
    config = KVFitConfig(method="distill", distill=SHORT, budget_s=None)
    cpu = torch.device("cpu")
    fits = plan_fit(model, [(4, 40)], CUT, config, cpu, unread_bytes=2 * 2**30, memory=2**30)
    assert fits.method == "ridge" and fits.requested == "distill"
    assert fits.fallback_cause == "its float32 weights exceed the memory available"
    assert fits.fallback.startswith("POP++ (distill) trains through the whole model: its float32 "
                                    "weights (2.0 GiB) exceed the memory available for the fit (1.0 GiB); "
                                    "fitting POP+")
    assert plan_fit(model, [(4, 40)], CUT, config, cpu, unread_bytes=2**20, memory=2**30).method == "distill"
    assert plan_fit(model, [(4, 40)], CUT, config, cpu).method == "distill"  # a loaded model: no check


def test_distill_on_a_lazy_model_reads_it_whole_and_fits_what_the_loaded_model_fits(folder):
    config = KVFitConfig(method="distill", distill=SHORT, budget_s=None, seq_len=40)
    windows = torch.cat(batches(2))
    loaded = load_model(str(folder), lazy=True)
    got, _ = fit_on_tokens(loaded.model, windows, CUT, config, progress=lambda event: None, lazy=loaded.lazy)
    want, _ = fit_on_tokens(load_model(str(folder)).model, windows, CUT, config, progress=lambda event: None)
    assert loaded.lazy.keys == {} and got.record["method"] == "distill"
    for layer, parts in want.weights.items():
        for part, projection in parts.items():
            torch.testing.assert_close(got.weights[layer][part].weight, projection.weight,
                                       rtol=0, atol=0)


def test_export_with_a_ridge_fit_loads_lazily_and_writes_the_loaded_models_engine(folder, tmp_path):
    """The driver builds the model without its weights for a float32 engine with a fit (driver._loads_lazily);
    the engine is byte for byte the one exported from the loaded model."""
    config = PopConfig(cut=CUT, kv_calibration="ridge", max_seq=64, min_prompt_tokens=0,
                       kv_fit=KVFitConfig(max_tokens=1024, seq_len=64))
    assert _loads_lazily(config, OnnxTarget())
    events = []
    compile(str(folder), config, out=tmp_path / "lazy", target=OnnxTarget(), fit_progress=events.append)
    compile(load_model(str(folder)), config, out=tmp_path / "loaded", target=OnnxTarget(),
            fit_progress=lambda event: None)
    lazy, loaded = ((tmp_path / name / "weights.bin").read_bytes() for name in ("lazy", "loaded"))
    assert lazy == loaded and events[0].method == "ridge"


def test_calibrate_streams_a_folders_weights_and_fits_what_the_loaded_model_fits(folder, tmp_path, cli):
    text = tmp_path / "domain.txt"
    text.write_text(" ".join(f"t{(i * 7) % 90}" for i in range(600)))
    cli("calibrate", folder, "--out", tmp_path / "kv.safetensors", "--cut", CUT, "--text", text,
        "--seq-len", 32, "--device", "cpu", "--method", "ridge")
    got = load_fit(tmp_path / "kv.safetensors")
    whole = load_model(str(folder))
    docs = [whole.tokenizer(text.read_text()).input_ids]
    with torch.no_grad():
        want = ridge_fits(whole.model, list(token_batches(docs, 32, 4)), [CUT])[CUT]
    assert got.info.tokens == want.info.tokens > 0
    for layer, parts in want.weights.items():
        for part, projection in parts.items():
            torch.testing.assert_close(got.weights[layer][part].weight, projection.weight, rtol=0, atol=0)
