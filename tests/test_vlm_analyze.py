"""``popcompile analyze`` on a vision-language model (tiny random Qwen3-VL): the gates are measured on
image+text prompts whose image tokens are prefill positions, the gated graph is transformers' forward, the
images matter, and the recommended cut keeps the deepstack layers. A text model's report is as before."""
from __future__ import annotations

import json
import random

import pytest
import torch
from tiny import VL_IDS, tiny_model, tiny_vlm
from tiny_engine import tiny_tokenizer, tiny_vl_folder, tiny_vl_tokenizer

from popcompile.cli import main
from popcompile.errors import ConfigError
from popcompile.frontend.vision import check_cut, deepstack_layers
from popcompile.measure import analyze
from popcompile.measure.analyze_vision import capture_vision_scorer, fitted_processing, image_samples
from popcompile.measure.eval.images import QUESTIONS, image_prompt, synthetic_image

CONTEXT, GEN, BATCH, SAMPLES = 64, 8, 2, 3
LAYERS, DEEPSTACK = 6, (0, 1)
# fp32: the gated graph (popcompile's attention, functional M-RoPE, dense deepstack) against transformers
LOSS_ATOL = 1e-5
# Central difference against autograd's dL/dg (tests/test_analyze.py's bound)
FD_EPS, FD_ATOL, FD_RTOL = 1e-2, 1e-4, 1e-2


def words(count=2000, top=140, seed=0):
    """Text the tiny tokenizers know: whitespace words t3..t{top - 1} (one id each)."""
    rng = random.Random(seed)
    return " ".join(f"t{rng.randrange(3, top)}" for _ in range(count))


@pytest.fixture(scope="module")
def model():
    return tiny_vlm(layers=LAYERS, deepstack=DEEPSTACK)


@pytest.fixture(scope="module")
def tok():
    return tiny_vl_tokenizer()


@pytest.fixture(scope="module")
def samples(model, tok):
    windows, taken = analyze.token_windows({"words": [words()]}, tok, CONTEXT + GEN, SAMPLES)
    return image_samples(model, tok, windows, taken, CONTEXT)


@pytest.fixture(scope="module")
def gated(model):
    return capture_vision_scorer(model, BATCH, CONTEXT + GEN - 1, GEN)


def _hf_loss(model, ids, images):
    """Mean cross-entropy of the last GEN tokens from Qwen3VLForConditionalGeneration's own forward."""
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1], pixel_values=images.pixel_values,
                       image_grid_thw=images.image_grid_thw,
                       mm_token_type_ids=(ids[:, :-1] == VL_IDS["image_token_id"]).int()).logits
    return torch.nn.functional.cross_entropy(logits[0, -GEN:], ids[0, CONTEXT:])


def test_samples_put_an_image_turn_before_the_text(model, tok, samples):
    """Each sequence starts with eval/images.py's prompt for its synthetic image; the image tokens are all
    among POP's prefill positions (before x_N); the targets are text."""
    processing = fitted_processing(model.config, None, CONTEXT // 2)
    image = samples.windows == VL_IDS["image_token_id"]
    for i in range(SAMPLES):
        ids, inputs = image_prompt(model, tok, synthetic_image(i), QUESTIONS[i], processing)
        assert samples.windows[i, :len(ids)].tolist() == ids
        assert int(image[i].sum()) == samples.images.image_tokens[i] == int(inputs.image_grid_thw.prod()) // 4
    assert samples.windows.shape == (SAMPLES, CONTEXT + GEN)
    assert not image[:, CONTEXT - 1:].any()
    assert min(samples.images.image_tokens) > 0 and max(samples.images.image_tokens) <= CONTEXT // 2
    assert samples.images.deepstack == len(DEEPSTACK) and samples.corpus == {"words": SAMPLES}


def test_gated_graph_at_one_is_transformers_forward(model, tok, samples, gated):
    """Gates at 1: each sequence's loss is Qwen3VLForConditionalGeneration's on the same ids and image
    (within 1e-5, fp32); dropping the deepstack rows changes it (they are really fed)."""
    assert [n.name for n in gated.graph_module.graph.nodes if n.op == "placeholder"] == [
        "input_ids", "position_ids", "visual_embeds", "gates", "stage"]
    assert [(b.layer, b.kind) for b in gated.branches] == [(l, k) for l in range(LAYERS)
                                                           for k in ("attn", "mlp")]
    processing = fitted_processing(model.config, None, CONTEXT // 2)
    rows = torch.tensor([0, 1])
    inputs = samples.inputs(rows)
    stage = analyze.stage_mask(BATCH, CONTEXT, GEN)
    with torch.no_grad():
        got = analyze.sequence_losses(gated.graph_module, samples.windows[rows],
                                      torch.ones(BATCH, LAYERS, 2, 2), stage, CONTEXT, inputs)
        no_deepstack = (*inputs[:2], torch.cat([inputs[2][:1], torch.zeros_like(inputs[2][1:])]))
        without = analyze.sequence_losses(gated.graph_module, samples.windows[rows],
                                          torch.ones(BATCH, LAYERS, 2, 2), stage, CONTEXT, no_deepstack)
    for row in rows.tolist():
        _, images = image_prompt(model, tok, synthetic_image(row), QUESTIONS[row], processing)
        expected = _hf_loss(model, samples.windows[row:row + 1], images)
        assert abs(float(got[row]) - float(expected)) <= LOSS_ATOL, (row, got[row], expected)
    assert (got - without).abs().min() > 1e-3


def test_gradients_match_finite_differences_and_the_image_changes_them(model, tok, samples, gated):
    """Autograd's dL/dg through the VLM graph against central differences for layer 1 (a deepstack layer)
    and layer 4; the last layer's prefill gradients are exactly 0; another image of the same size (same
    ids, other pixels) gives other gradients."""
    grads, _ = analyze.gate_gradients(gated, samples.windows, CONTEXT, GEN, inputs=samples.inputs)
    assert grads.shape == (SAMPLES, LAYERS, 2, 2)
    assert torch.equal(grads[:, -1, :, 0], torch.zeros(SAMPLES, 2, dtype=grads.dtype))
    rows = torch.tensor([0, 1])
    inputs, stage = samples.inputs(rows), analyze.stage_mask(BATCH, CONTEXT, GEN)
    for layer, kind, s in ((1, 0, 0), (1, 1, 1), (4, 1, 0), (4, 0, 1)):
        losses = []
        for sign in (1, -1):
            gates = torch.ones(BATCH, LAYERS, 2, 2)
            gates[:, layer, kind, s] += sign * FD_EPS
            with torch.no_grad():
                losses.append(analyze.sequence_losses(gated.graph_module, samples.windows[rows], gates, stage,
                                                      CONTEXT, inputs))
        fd = (losses[0] - losses[1]).double() / (2 * FD_EPS)
        exact = grads[:2, layer, kind, s]
        assert ((fd - exact).abs() <= FD_ATOL + FD_RTOL * exact.abs()).all(), (layer, kind, s, fd, exact)
    windows, taken = analyze.token_windows({"words": [words()]}, tok, CONTEXT + GEN, SAMPLES)
    other = image_samples(model, tok, windows, taken, CONTEXT, image_seed=4)  # same sizes, other drawings
    assert torch.equal(other.windows, samples.windows)
    changed, _ = analyze.gate_gradients(gated, other.windows, CONTEXT, GEN, inputs=other.inputs)
    prefill = grads[:, :-1, :, 0]
    assert ((changed[:, :-1, :, 0] - prefill).abs() > 1e-3 * prefill.abs().max()).float().mean() > 0.5


def test_run_analyze_reports_image_prompts_and_keeps_the_deepstack(model, tok):
    """The report: the last layer's prefill importance is exactly 0, the image prompts are described, and
    with a budget that would prune layer 1 the recommendation stops at k (check_cut passes)."""
    config = analyze.AnalyzeConfig(samples=SAMPLES, context_len=CONTEXT, gen_len=GEN, batch_size=BATCH,
                                   budget=0.9)
    report = analyze.run_analyze(model, tok, config, sources={"words": [words()]}, name="tiny-vl")
    k = deepstack_layers(model.config)
    assert report.layers[-1].prefill == analyze.StageScores(0.0, 0.0, 0.0)
    assert all(layer.decode.layer > 0 for layer in report.layers)
    prefill = [layer.prefill.layer for layer in report.layers]
    assert analyze.cut_from_scores(prefill, 0.9) < k  # without the rule it would prune a deepstack layer
    assert report.recommended_cut == analyze.recommend_cut(report, 0.9) == k
    check_cut(model.config, report.recommended_cut)
    for budget in (0.0, 0.01, 0.3, 0.6, 0.99):
        assert analyze.recommend_cut(report, budget) >= k
    data = json.loads(report.to_json())
    assert data["images"]["deepstack"] == k and len(data["images"]["image_tokens"]) == SAMPLES
    assert "image+text prompts" in analyze.format_table(report)


def test_an_image_turn_longer_than_the_context_is_a_one_line_error(model, tok):
    config = analyze.AnalyzeConfig(samples=1, context_len=12, gen_len=4)
    with pytest.raises(ConfigError, match="--context-len 12 leaves no text") as error:
        analyze.run_analyze(model, tok, config, sources={"words": [words()]})
    assert "\n" not in str(error.value)


def test_cli_analyzes_a_vision_language_folder(tmp_path, capsys):
    folder = tiny_vl_folder(tmp_path / "qwen3-vl", layers=4)
    text = tmp_path / "words.txt"
    text.write_text(words())
    out = tmp_path / "out"
    argv = ["analyze", str(folder), "--out", str(out), "--text", str(text), "--samples", "2",
            "--context-len", "48", "--gen-len", "4", "--budget", "0.5", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    assert data["model_type"] == "qwen3_vl" and data["samples"] == 2 and data["num_layers"] == 4
    assert data["images"]["deepstack"] == 2 and data["recommended_cut"] >= 2
    assert all(0 < n <= 24 for n in data["images"]["image_tokens"])
    assert data["layers"][-1]["prefill"]["layer"] == 0.0
    assert (out / "analyze.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "analyze.json").read_text())["images"] == data["images"]


def test_a_text_models_report_has_no_image_part(tmp_path):
    """Text models: the same keys as before image prompts existed, no image line in the table."""
    report = analyze.run_analyze(tiny_model("qwen3", layers=3), tiny_tokenizer(),
                                 analyze.AnalyzeConfig(samples=2, context_len=10, gen_len=4),
                                 sources={"words": [words(top=90)]})
    assert report.images is None
    assert list(json.loads(report.to_json())) == [
        "model", "model_type", "num_layers", "config", "corpus", "samples", "loss", "layers", "deep",
        "recommended_cut", "seconds", "peak_rss_mb"]
    assert "image" not in analyze.format_table(report)
