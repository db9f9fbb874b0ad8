"""popcompile analyze: the virtual-gates pass, Fisher scores, the recommended cut, corpus and CLI.

Tiny random models of every architecture for the pass and the gradients; the real shipped models
for one short end-to-end run each (a few sequences of 64 + 16 tokens).
"""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
from tiny import tiny_model

from popcompile.cli import main
from popcompile.frontend.arch import DECODER_TYPES
from popcompile.frontend.experts import is_moe
from popcompile.measure import analyze
from popcompile.measure.gates import gate_pass

# one worker runs this file: each architecture's gated scorer, captured once per module (conftest.py)
pytestmark = pytest.mark.xdist_group("test_analyze")

LAYERS = 4
CONTEXT, GEN, BATCH = 12, 6, 2
# Central difference (L(1+eps) - L(1-eps)) / 2eps against autograd's dL/dg, float32 model:
# |fd - dL/dg| <= FD_ATOL + FD_RTOL * |dL/dg|. Measured worst case: 0.42 of this bound (qwen3).
FD_EPS, FD_ATOL, FD_RTOL = 1e-2, 1e-4, 1e-2
# The graph (capture's attention function) against eager HF with hooks: capture's logit bound.
EAGER_ATOL = 1e-4
# The module whose output is the residual branch, per architecture (Gemma 3: sandwich norms).
BRANCH_MODULES = {
    **dict.fromkeys(("gemma3_text", "gemma2", "olmo2"),
                    ("post_attention_layernorm", "post_feedforward_layernorm")),
    **{arch: ("self_attn", "mlp") for arch in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral",
                                               "granite", "olmoe", "phi3")},
}
#: the part of the layer whose node is the branch output the gate multiplies, where it is not the module's own
#: last op: Granite multiplies each branch by residual_multiplier in the layer itself (part "")
BRANCH_OUTPUT_PARTS = {"granite": {"attn": ("",), "mlp": ("",)}}
#: mixtures of experts: a perturbation of 1e-2 flips some tokens' top-k routing (a step in the loss that
#: a central difference reads as a slope); 1e-4 (in float64) stays inside every routing region here
MOE_FD_EPS = 1e-4


class CharTokenizer:
    """Character-level stand-in for a HF tokenizer, with a BOS (id 1) like Gemma's. Printable ASCII
    maps one to one onto ids 2..96 (the tiny models' vocabulary is 97)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) % 95 + 2 for c in text]}

    def decode(self, ids):
        return "".join(chr(i - 2 if i - 2 >= 32 else i - 2 + 95) for i in ids)


def windows(batch=BATCH, seed=1):
    torch.manual_seed(seed)
    return torch.randint(0, 97, (batch, CONTEXT + GEN))


@pytest.fixture(scope="module", params=sorted(DECODER_TYPES))
def gated(request):
    model = tiny_model(request.param, layers=LAYERS)
    if is_moe(model):  # float64: the small difference MOE_FD_EPS needs stays far above rounding
        model = model.double()
        model.config._experts_implementation = "eager"  # the hooks' reference (grouped_mm takes no float64)
    return request.param, model, analyze.capture_scorer(model, BATCH, CONTEXT + GEN - 1, GEN)


def test_every_architecture_has_a_tiny_model():
    assert set(BRANCH_MODULES) == set(DECODER_TYPES)


def test_branches_found_in_every_layer(gated):
    arch, _, result = gated
    assert [(b.layer, b.kind) for b in result.branches] == [(l, k) for l in range(LAYERS)
                                                            for k in ("attn", "mlp")]
    # mlp: a MoE block's output; resid_*_dropout: Phi-3's dropout on each branch (the identity in eval)
    expected = BRANCH_OUTPUT_PARTS.get(arch, {
        "attn": ("self_attn.o_proj", "post_attention_layernorm", "resid_attn_dropout"),
        "mlp": ("mlp.down_proj", "post_feedforward_layernorm", "mlp", "resid_mlp_dropout")})
    for branch in result.branches:
        assert branch.module in expected[branch.kind], (arch, branch)
    names = [n.name for n in result.graph_module.graph.nodes if n.op == "placeholder"]
    assert names == ["input_ids", "gates", "stage"]
    asserts = torch.ops.aten._assert_tensor_metadata.default  # returns nothing
    values = [n.meta.get("val") for n in result.graph_module.graph.nodes
              if n.op in ("placeholder", "call_function") and n.target is not asserts]
    # tuple: a router's top-k; list: Phi-3's chunk of its fused gate_up_proj
    assert all(isinstance(v, torch.Tensor) or isinstance(v, (tuple, list)) and all(
        isinstance(t, torch.Tensor) for t in v) for v in values)


def test_gates_at_one_leave_outputs_exactly_unchanged(gated):
    arch, model, result = gated
    ids = windows()[:, :-1]
    from popcompile.frontend.capture import attention_for_capture

    with attention_for_capture(model):
        plain = torch.export.export(analyze.Scorer(model, GEN), (ids,), strict=False).module()
    stage = torch.rand(BATCH, ids.shape[1]).round()  # any stage mask: at g = 1 it cannot matter
    with torch.no_grad():
        expected = plain(ids)
        (got,) = result.graph_module(ids, torch.ones(BATCH, LAYERS, 2, 2), stage)
    assert torch.equal(got, expected), arch


def test_gates_scale_the_branches_like_eager_hooks(gated):
    """Random gates in [0, 2]: the gated graph equals the HF model whose branch modules' outputs are
    multiplied by the gate of their layer, branch and each position's stage."""
    arch, model, result = gated
    ids = windows()[:, :-1]
    torch.manual_seed(2)
    gates = 2 * torch.rand(BATCH, LAYERS, 2, 2)
    stage = analyze.stage_mask(BATCH, CONTEXT, GEN)
    scale = gates[..., 0][:, None] + stage[:, :, None, None] * (gates[..., 1] - gates[..., 0])[:, None]

    def hook_for(layer, kind):
        def hook(module, args, output):
            factor = scale[:, :, layer, kind, None]
            return (output[0] * factor, *output[1:]) if isinstance(output, tuple) else output * factor
        return hook

    handles = [getattr(layer, BRANCH_MODULES[arch][kind]).register_forward_hook(hook_for(i, kind))
               for i, layer in enumerate(model.model.layers) for kind in (0, 1)]
    try:
        with torch.no_grad():
            expected = model(ids).logits[:, -GEN:]
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        (got,) = result.graph_module(ids, gates, stage)
    assert (got - expected).abs().max().item() <= EAGER_ATOL, arch


def test_fisher_first_order_term_matches_finite_difference(gated):
    arch, model, result = gated
    eps = MOE_FD_EPS if is_moe(model) else FD_EPS
    rows = windows()
    grads, _ = analyze.gate_gradients(result, rows, CONTEXT, GEN)
    stage = analyze.stage_mask(BATCH, CONTEXT, GEN)
    for layer in range(LAYERS):
        for kind in range(2):
            for s in range(2):
                losses = []
                for sign in (1, -1):
                    gates = torch.ones(BATCH, LAYERS, 2, 2)
                    gates[:, layer, kind, s] += sign * eps
                    with torch.no_grad():
                        losses.append(analyze.sequence_losses(result.graph_module, rows, gates, stage,
                                                              CONTEXT))
                fd = (losses[0] - losses[1]).double() / (2 * eps)
                exact = grads[:, layer, kind, s]
                assert ((fd - exact).abs() <= FD_ATOL + FD_RTOL * exact.abs()).all(), (
                    arch, layer, kind, s, fd, exact)
    # not vacuous: most gradients are well above the tolerance, and the last layer's prefill ones are 0
    assert (grads.abs() > 10 * FD_ATOL).float().mean() > 0.7
    assert torch.equal(grads[:, -1, :, 0], torch.zeros(BATCH, 2, dtype=grads.dtype))


def test_per_sequence_gradients_do_not_depend_on_the_batch():
    """Each row's gates reach only its own loss; a short last batch is padded without effect."""
    model = tiny_model("llama", layers=LAYERS)
    rows = windows(batch=3)
    together, losses = analyze.gate_gradients(analyze.capture_scorer(model, 2, CONTEXT + GEN - 1, GEN),
                                              rows, CONTEXT, GEN)
    alone, _ = analyze.gate_gradients(analyze.capture_scorer(model, 1, CONTEXT + GEN - 1, GEN),
                                      rows, CONTEXT, GEN)
    assert together.shape == (3, LAYERS, 2, 2) and losses.shape == (3,)
    assert torch.allclose(together, alone, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(together[0], together[1])


def test_the_pass_refuses_a_graph_without_metadata():
    gm = torch.fx.symbolic_trace(tiny_model("llama", layers=2).model.norm)
    with pytest.raises(ValueError, match="no decoder layers"):
        gate_pass(gm)


# --- scores and the cut --------------------------------------------------------------------------

def test_layer_scores_from_known_gradients():
    grads = torch.zeros(2, 3, 2, 2, dtype=torch.float64)
    grads[:, 1, 0, 0] = torch.tensor([1.0, -3.0])  # layer 1 attention, prefill
    grads[:, 1, 1, 0] = torch.tensor([1.0, 1.0])  # layer 1 MLP, prefill
    grads[:, 2, 1, 1] = torch.tensor([2.0, 2.0])  # layer 2 MLP, decode
    scores = analyze.layer_scores(grads)
    assert scores[1].prefill == analyze.StageScores(attn=5.0, mlp=1.0, layer=(4 + 4) / 2)  # (1+1)^2, (-3+1)^2
    assert scores[1].prefill_grad == analyze.StageScores(attn=-1.0, mlp=1.0, layer=0.0)
    assert scores[2].decode == analyze.StageScores(attn=0.0, mlp=4.0, layer=4.0)
    # squares 1 and 9: sample std sqrt(32), over sqrt(2) sequences
    assert scores[2].decode_stderr.mlp == 0.0 and scores[1].prefill_stderr.attn == pytest.approx(4.0)
    assert scores[0].prefill == scores[0].decode == analyze.StageScores(0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"\[N, L, 2, 2\]"):
        analyze.layer_scores(torch.zeros(2, 3, 2))


@pytest.mark.parametrize("budget, cut", [(0.0, 5), (0.05, 5), (0.06, 4), (0.12, 4), (0.2, 3), (0.99, 1)])
def test_cut_is_the_deepest_block_within_the_budget(budget, cut):
    prefill = [5.0, 2.0, 1.0, 1.0, 0.5, 0.0]  # total 9.5; tails from layer 4: 0.053, 0.158, 0.263, 0.474
    assert analyze.cut_from_scores(prefill, budget) == cut


def test_cut_prunes_nothing_when_the_last_layer_is_over_budget():
    assert analyze.cut_from_scores([1.0, 1.0, 1.0], 0.1) == 3
    assert analyze.cut_from_scores([0.0], 0.1) == 1  # one layer: nothing to prune


@pytest.mark.parametrize("prefill, budget, message", [
    ([1.0, 2.0], 1.0, "out of range"), ([1.0, 2.0], -0.1, "out of range"),
    ([0.0, 0.0], 0.1, "not all 0"), ([1.0, -2.0, 4.0], 0.1, ">= 0"), ([1.0, float("nan")], 0.1, "finite"),
])
def test_cut_rejects_bad_input(prefill, budget, message):
    with pytest.raises(ValueError, match=message):
        analyze.cut_from_scores(prefill, budget)


@pytest.mark.parametrize("kwargs, message", [
    (dict(samples=0), "samples"), (dict(context_len=1), "context_len"), (dict(gen_len=0), "gen_len"),
    (dict(batch_size=True), "batch_size"), (dict(budget=1.0), "budget"), (dict(samples=2.0), "samples"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        analyze.AnalyzeConfig(**kwargs)


# --- corpus ------------------------------------------------------------------------------------------

def test_windows_take_sources_in_turn_and_start_with_the_special_tokens():
    sources = {"a": ["a" * 30], "b": ["b" * 10, "c" * 40]}
    found, taken = analyze.token_windows(sources, CharTokenizer(), length=11, count=5)
    # b's second window starts with the blank line that joins its two texts
    expected = CharTokenizer()("aba\na", add_special_tokens=False)["input_ids"]
    assert found.shape == (5, 11) and (found[:, 0] == 1).all()
    assert found[:, 1].tolist() == expected and taken == {"a": 3, "b": 2}


def test_windows_stop_when_the_text_runs_out():
    found, taken = analyze.token_windows({"a": ["x" * 25]}, CharTokenizer(), length=11, count=10)
    assert len(found) == 2 and taken == {"a": 2}  # 25 chars + 2 separator chars = 27 -> two windows of 10
    with pytest.raises(ValueError, match="fewer than 40 tokens"):
        analyze.token_windows({"a": ["short"]}, CharTokenizer(), length=40, count=1)


def test_default_corpus_is_humaneval_prompts_and_stdlib_docstrings():
    found, taken = analyze.token_windows(analyze.default_sources(), CharTokenizer(), length=200, count=4)
    assert taken == {"humaneval": 2, "stdlib-docstrings": 2}
    text = CharTokenizer().decode(found[0, 1:].tolist())
    assert "def " in text  # HumanEval/0's prompt
    docs = next(analyze.stdlib_docstrings())
    assert isinstance(docs, str) and len(docs) > 50


def test_jsonl_texts():
    from popcompile.commands.common import jsonl_texts

    text = '"plain"\n\n{"text": "obj"}\n{"body": "other", "text": "x"}\n'
    assert jsonl_texts(text) == ["plain", "obj", "x"]
    assert jsonl_texts('{"body": "b"}', field="body") == ["b"]
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        jsonl_texts('"a"\n{oops')
    with pytest.raises(ValueError, match="line 1: expected a string"):
        jsonl_texts('{"body": 3}')


# --- end to end --------------------------------------------------------------------------------------

TEXT = "\n".join(analyze.humaneval_prompts()[:6])


def test_run_analyze_tiny_writes_the_outputs(tmp_path):
    model = tiny_model("gemma3_text", layers=LAYERS)
    config = analyze.AnalyzeConfig(samples=5, context_len=CONTEXT, gen_len=GEN, batch_size=2, budget=0.2)
    calls = []
    report = analyze.run_analyze(model, CharTokenizer(), config, sources={"t": [TEXT]}, name="tiny",
                                 progress=lambda done, total: calls.append((done, total)))
    assert calls == [(0, 5), (2, 5), (2, 5), (1, 5)]
    assert report.samples == 5 and report.corpus == {"t": 5} and report.num_layers == LAYERS
    assert report.layers[-1].prefill == analyze.StageScores(0.0, 0.0, 0.0)  # nothing reads it
    assert all(layer.decode.layer > 0 for layer in report.layers)
    assert report.recommended_cut == analyze.recommend_cut(report, 0.2)
    assert report.deep.cut == 3 and report.deep.prefill == 0.0
    json_path, png_path = analyze.write_outputs(report, tmp_path / "out")
    data = json.loads(json_path.read_text())
    assert data["config"]["budget"] == 0.2 and len(data["layers"]) == LAYERS
    assert data["layers"][1]["decode"]["mlp"] == report.layers[1].decode.mlp
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = analyze.format_table(report)
    assert len([line for line in table.splitlines() if line.lstrip()[:1].isdigit() and "|" in line]) == LAYERS
    assert "recommended cut" in table


def test_recommended_cut_for_the_exporter():
    model = tiny_model("llama", layers=LAYERS)
    config = analyze.AnalyzeConfig(samples=3, context_len=CONTEXT, gen_len=GEN)
    sources = {"t": [TEXT]}
    scores = [layer.prefill.layer for layer in
              analyze.run_analyze(model, CharTokenizer(), config, sources=sources).layers]
    for budget in (0.0, 0.3, 0.9):
        cut = analyze.recommended_cut(model, CharTokenizer(), budget=budget, config=config, sources=sources)
        assert cut == analyze.cut_from_scores(scores, budget)
    assert analyze.AUTO_CONFIG.budget == analyze.DEFAULT_BUDGET


def test_analyze_refuses_other_dtypes():
    model = tiny_model("llama", layers=2).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        analyze.run_analyze(model, CharTokenizer(), sources={"t": [TEXT]})


@pytest.fixture
def fake_loader(monkeypatch):
    """``popcompile analyze tiny``: load_model returns a tiny model with the char tokenizer."""
    from popcompile.frontend import models

    loaded = SimpleNamespace(model=tiny_model("qwen3", layers=3), tokenizer=CharTokenizer())
    monkeypatch.setattr(models, "load_model", lambda name, revision=None: loaded)
    return loaded


def test_cli_writes_table_json_and_plot(tmp_path, fake_loader, capsys):
    text = tmp_path / "in.txt"
    text.write_text(TEXT)
    out = tmp_path / "out"
    argv = ["analyze", "tiny", "--out", str(out), "--text", str(text), "--samples", "3",
            "--context-len", "10", "--gen-len", "4", "--budget", "0.3"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "recommended cut (budget 30.0%" in printed and (out / "analyze.json").exists()
    assert main(argv) == 2 and "exists" in capsys.readouterr().err  # no silent overwrite
    assert main([*argv, "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 3


@pytest.mark.parametrize("extra, message", [
    (["--budget", "1.5"], "budget"), (["--samples", "0"], "samples"),
    (["--text", "/nonexistent/file.txt"], "cannot read --text"), (["--out", __file__], "is a file"),
])
def test_cli_errors_are_one_line(tmp_path, fake_loader, capsys, extra, message):
    assert main(["analyze", "tiny", "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_jsonl_errors_name_the_file(tmp_path, fake_loader, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    assert main(["analyze", "tiny", "--out", str(tmp_path / "o"), "--jsonl", str(bad)]) == 2
    assert f"--jsonl {bad}: JSONL line 1" in capsys.readouterr().err


def test_cli_defaults_are_the_config_defaults():
    from popcompile.cli import build_parser
    from popcompile.commands.analyze import config_from_args

    parser = build_parser()
    assert config_from_args(parser.parse_args(["analyze", "m", "--out", "o"])) == analyze.AnalyzeConfig()
    sub = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("analyze"))
    help_text = " ".join(sub.format_help().split())
    defaults = analyze.AnalyzeConfig()
    for value in (defaults.samples, defaults.context_len, defaults.gen_len, defaults.budget,
                  defaults.batch_size):
        assert f"(default {value})" in help_text


# --- the real models ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_model_small_run(name, tmp_path, real_model):
    loaded = real_model(name)
    config = analyze.AnalyzeConfig(samples=4, context_len=64, gen_len=16, batch_size=2)
    start = time.perf_counter()
    report = analyze.run_analyze(loaded.model, loaded.tokenizer, config, name=name)
    json_path, png_path = analyze.write_outputs(report, tmp_path)
    assert time.perf_counter() - start < 240  # 14-105 s measured on the shared 2-core CPU, by its load
    assert report.samples == 4 and report.corpus == {"humaneval": 2, "stdlib-docstrings": 2}
    assert 0.5 < report.loss < 5.0  # real text through a real model (nats per token)
    assert report.layers[-1].prefill.layer == 0.0 and report.layers[-1].decode.layer > 0
    assert sum(layer.prefill.layer for layer in report.layers) > 0
    assert 1 <= report.recommended_cut <= report.num_layers
    assert json.loads(json_path.read_text())["num_layers"] == report.num_layers
    assert png_path.stat().st_size > 10_000
    assert str(report.num_layers - 1) in analyze.format_table(report)
