"""The seed paper's other baselines (measure/eval/baselines.py): Wanda and SliceGPT as weight transforms
swapped into reference.Variant, on tiny random models."""
from __future__ import annotations

import math

import pytest
import torch
from tiny import CharTokenizer, tiny_model

from popcompile import reference
from popcompile.errors import ConfigError
from popcompile.frontend.models import LoadedModel, ModelSource
from popcompile.kvfit import corpus
from popcompile.measure.eval import baselines, scoring
from popcompile.measure.eval import data as eval_data
from popcompile.measure.eval import run as eval_run
from popcompile.measure.eval.config import EvalConfig
from popcompile.reference import Variant

LAYERS = 4
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=LAYERS)


@pytest.fixture(scope="module")
def batches():
    torch.manual_seed(1)
    return [torch.randint(0, 97, (2, 24)) for _ in range(3)]


def _logits(model, ids, variant):
    return reference.continuation_logits(model, ids[:, :10], ids[:, 10:], variant)


def test_wanda_zeroes_the_lowest_scores_of_each_row(model, batches):
    found = baselines.wanda_weights(model, batches)
    assert set(found) == {f"model.layers.{i}.{n}.weight" for i in range(LAYERS) for n in LINEARS}
    for key, pruned in found.items():
        count = int(pruned.shape[1] * 0.3)
        assert ((pruned == 0).sum(1) == count).all(), key  # the random weights have no zeros of their own
    # by hand on one linear: its inputs [tokens, in] captured from the dense model
    down = model.model.layers[1].mlp.down_proj
    inputs = []
    handle = down.register_forward_pre_hook(lambda m, args: inputs.append(args[0].flatten(0, 1)))
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids)
    handle.remove()
    channel_norm = torch.cat(inputs).norm(dim=0)  # ||X_j||_2 [in]
    score = down.weight.abs() * channel_norm[None, :]
    pruned = found["model.layers.1.mlp.down_proj.weight"]
    count = int(down.weight.shape[1] * 0.3)
    for row in range(down.weight.shape[0]):
        lowest = set(score[row].argsort()[:count].tolist())
        assert set((pruned[row] == 0).nonzero()[:, 0].tolist()) == lowest
    kept = pruned != 0
    assert torch.equal(pruned[kept], down.weight[kept])


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "phi3"])
def test_slicegpt_without_slicing_is_the_same_model(model_type, batches):
    # slicing 0 keeps a full rotation: RMSNorm commutes with an orthogonal Q, so only the folding can err
    # (phi3: its fused qkv_proj and gate_up_proj read the norms)
    tiny = tiny_model(model_type, layers=3)
    with torch.no_grad():  # norm scales far from 1, so that a scale left unfolded shows
        for name, p in tiny.named_parameters():
            if "norm" in name:
                p.mul_(torch.rand_like(p) + 0.5)
    weights = baselines.slicegpt_weights(tiny, batches, baselines.BaselineOptions(slicing=0.0))
    ids = torch.randint(0, 97, (2, 16))
    full = _logits(tiny, ids, Variant(3))
    rotated = _logits(tiny, ids, Variant(3, weights=weights))
    assert (rotated - full).abs().max() < 1e-4
    assert (rotated - full).abs().max() < 0.01 * full.abs().max()


def test_slicegpt_slices_a_quarter_of_the_hidden_dimension(model, batches):
    weights = baselines.slicegpt_weights(model, batches)
    d, k = 64, 48
    assert (weights["model.embed_tokens.weight"].shape == (97, k)
            and weights["lm_head.weight"].shape == (97, k))
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (64, k)
    assert weights["model.layers.2.mlp.up_proj.weight"].shape == (128, k)
    assert weights["model.layers.0.self_attn.o_proj.weight"].shape == (k, 64)
    assert weights["model.layers.3.mlp.down_proj.weight"].shape == (k, 128)
    for norm in ("model.norm.weight", "model.layers.1.input_layernorm.weight",
                 "model.layers.1.post_attention_layernorm.weight"):
        assert torch.allclose(weights[norm], torch.full((k,), math.sqrt(d / k)))
    ids = torch.randint(0, 97, (2, 16))
    full = _logits(model, ids, Variant(LAYERS))
    sliced = _logits(model, ids, Variant(LAYERS, weights=weights))
    assert torch.isfinite(sliced).all() and (sliced - full).abs().max() > 1e-3


def test_slicegpt_keeps_the_top_principal_directions():
    cov = torch.diag(torch.tensor([1.0, 5.0, 3.0, 0.5], dtype=torch.float64))
    q = baselines.pca_rotation(cov)
    assert torch.allclose(q.T @ q, torch.eye(4, dtype=torch.float64))
    assert q[:, 0].abs().argmax() == 1 and q[:, 1].abs().argmax() == 2
    assert baselines.kept_dims(576, 0.25) == 432 and baselines.kept_dims(64, 0.0) == 64


def test_the_swap_restores_the_model_exactly(model, batches):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    objects = {n: p for n, p in model.named_parameters()}
    weights = baselines.slicegpt_weights(model, batches)
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding  # the tiny models tie them
    with reference.swapped_parameters(model, weights):
        assert model.lm_head.weight.shape == (97, 48) and model.model.embed_tokens.weight.shape == (97, 48)
        with reference.swapped_parameters(model, {"lm_head.weight": torch.zeros(97, 48)}):
            assert model.model.embed_tokens.weight.abs().sum() > 0  # setting the head leaves the embedding
    assert model.lm_head.weight is embedding and model.model.embed_tokens.weight is embedding
    reference.generate(model, torch.tensor([[3, 5, 7, 9]]), 4, Variant(LAYERS, weights=weights))
    for name, p in model.named_parameters():
        assert p is objects[name] and torch.equal(p, before[name]), name
    with pytest.raises(RuntimeError), reference.swapped_parameters(model, weights):
        raise RuntimeError("restored on errors too")
    assert (model.lm_head.weight is embedding
            and model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64))


def test_gemma3_refuses_slicegpt(batches, monkeypatch):
    gemma = tiny_model("gemma3_text", layers=LAYERS)
    with pytest.raises(ConfigError, match="not rotation invariant") as refused:
        baselines.slicegpt_weights(gemma, batches)
    assert "\n" not in str(refused.value) and "gemma3_text" in str(refused.value)
    assert ("slicegpt" not in scoring.default_variant_names(gemma)
            and "wanda" in scoring.default_variant_names(gemma))
    assert "slicegpt" in scoring.default_variant_names(tiny_model("llama", layers=2))
    loaded = LoadedModel(gemma, CharTokenizer(), ModelSource("tiny", "folder", "tiny", None))
    config = EvalConfig(tasks=("continuation",), variants=("pop-kvfit", "slicegpt"), cut=2, limit=1,
                        prefix_len=24, cont_len=8)
    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated before refusing slicegpt")
    monkeypatch.setattr(eval_run, "default_kv_fit", lambda *args: no_calibration)
    with pytest.raises(ConfigError, match="slicegpt cannot rotate gemma3_text"):
        eval_run.reference_eval(loaded, "tiny", config)  # before pop-kvfit's calibration
    wanda = baselines.wanda_weights(gemma, batches)  # Wanda needs no rotation
    assert len(wanda) == LAYERS * 7 and all((w == 0).any() for w in wanda.values())


@pytest.mark.parametrize("options", [dict(sparsity=1.0), dict(sparsity=-0.1), dict(slicing=True),
                                     dict(slicing="1")])
def test_options_are_fractions(options):
    with pytest.raises(ConfigError, match="must be a fraction"):
        baselines.BaselineOptions(**options)


def test_make_variants_builds_both_from_the_calibration_corpus(model):
    with pytest.raises(ValueError, match="wanda needs a model to calibrate on"):
        scoring.make_variants(["wanda"], cut=2, num_layers=LAYERS)
    loaded = LoadedModel(model, CharTokenizer(), ModelSource("tiny", "folder", "tiny", None))
    fit = scoring.default_baseline_fit(loaded)
    variants = scoring.make_variants(["wanda", "slicegpt"], cut=2, num_layers=LAYERS, baseline_fit=fit)
    assert list(variants) == ["full", "wanda", "slicegpt"]
    assert all(v.cut == LAYERS and not v.shortgpt for v in variants.values())  # nothing POP-pruned
    assert variants["wanda"].weights is fit("wanda") and variants["slicegpt"].weights is fit("slicegpt")
    assert scoring.describe(variants["slicegpt"])["weights_replaced"] == len(fit("slicegpt"))
    found, _ = eval_data.make_documents({"stdlib": corpus.stdlib_texts()[:3]}, CharTokenizer(), 24, 8)
    scores = scoring.continuation_eval(model, found, variants)
    for name in ("wanda", "slicegpt"):
        assert math.isfinite(scores[name]["nll"]) and scores[name]["kl_to_full"] > 0


def test_eval_runs_the_baselines_end_to_end(model):
    loaded = LoadedModel(model, CharTokenizer(), ModelSource("tiny", "folder", "tiny", None))
    config = EvalConfig(tasks=("continuation", "generation"), variants=("wanda", "slicegpt"), limit=2,
                        prefix_len=24, cont_len=8, gen_tokens=4)
    results = eval_run.reference_eval(loaded, "tiny", config)
    assert (results["variants"]["wanda"]["cut"] == LAYERS
            and results["variants"]["wanda"]["weights_replaced"] == 28)
    assert results["variants"]["full"]["weights_replaced"] == 0
    cont, gen = results["tasks"]["continuation"]["variants"], results["tasks"]["generation"]["variants"]
    assert set(cont) == set(gen) == {"full", "wanda", "slicegpt"}
    assert cont["slicegpt"]["kl_to_full"] > 0 and all(len(t) == 4 for t in gen["slicegpt"]["tokens"])
