"""Mixtures of experts: ``popcompile::experts`` (frontend/experts.py), its ONNX lowerings (exporters/moe.py).

The families' other paths (capture, POP pass, folded boundary, torch.compile, fits, onnxruntime's fused
attention) run in the per-architecture tests, which include every MoE family of tests/tiny.py."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import transformers
from tiny import MOE, empty_past, tiny_model
from tiny_engine import tiny_hf_folder

from popcompile import reference
from popcompile.engine.manifest import EngineManifest
from popcompile.errors import ModelError
from popcompile.exporters.targets import OnnxTarget
from popcompile.frontend.experts import check_experts, experts_for_capture, experts_modules
from popcompile.runtime.ort import OrtSession

CUT, LAYERS = 2, 4
# float32 engines against eager float32: the same sums in another order
ONNX_ATOL = 1e-4


@pytest.mark.parametrize("arch", sorted(MOE))
def test_the_op_computes_what_transformers_eager_experts_compute(arch):
    model, ids = tiny_model(arch), torch.randint(0, 97, (2, 11))
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        expected = model(ids).logits
        with experts_for_capture(model):
            got = model(ids).logits
    assert model.config._experts_implementation == "eager"  # the user's choice, restored
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module", params=sorted(MOE))
def lowered(request, engines):
    """(arch, {lowering: engine folder}): one tiny engine per lowering of the experts."""
    return request.param, {attention: engines.tiny(request.param, cut=CUT, max_seq=64,
                                                   target=OnnxTarget(attention=attention))
                           for attention in ("fused", "standard")}


def _prefill(folder, prompt: torch.Tensor) -> list[np.ndarray]:
    layout = EngineManifest.read(folder).kv_layout
    n = prompt.shape[1]
    feeds = {"input_ids": prompt.numpy(), "position_ids": np.arange(n)[None].repeat(len(prompt), 0),
             "attention_mask": np.ones(prompt.shape, np.int64),
             **dict(zip(layout.past_names, (t.numpy() for t in empty_past(layout, len(prompt)))))}
    return OrtSession(folder).sessions["prefill"].run(None, feeds)


def test_both_lowerings_equal_the_pop_reference(lowered):
    """onnxruntime's MoE (active experts) and the dense Einsums (every expert): POP's first logits."""
    arch, folders = lowered
    model = tiny_model(arch)
    prompt = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = torch.cat([reference.PopRun(model, reference.Variant(CUT), 13).prefill(row[None])
                              for row in prompt]).numpy()
    for attention, folder in folders.items():
        np.testing.assert_allclose(_prefill(folder, prompt)[0], expected, atol=ONNX_ATOL, rtol=0,
                                   err_msg=attention)


def test_the_fused_engine_runs_onnxruntimes_moe_on_interleaved_weights(lowered):
    arch, folders = lowered
    for name, pruned in (("decode", 0), ("prefill", LAYERS - CUT)):
        fused = onnx.load(str(folders["fused"] / f"{name}.onnx"), load_external_data=False)
        standard = onnx.load(str(folders["standard"] / f"{name}.onnx"), load_external_data=False)
        ops = [node.op_type for node in fused.graph.node]
        # the prefill's deep layers run their experts on x_N's row: one op per layer in either graph
        assert ops.count("MoE") == LAYERS and "Einsum" not in ops, (arch, name, pruned)
        assert not any(n.op_type == "Gather" and "gate_up" in n.input[0] for n in fused.graph.node)
        assert [n.op_type for n in standard.graph.node].count("Einsum") == 3 * LAYERS
        assert "MoE" not in [n.op_type for n in standard.graph.node]


def test_a_hugging_face_folder_of_per_expert_weights_exports_and_matches(tmp_path, cli):
    """Checkpoints store experts one by one (experts.{e}.gate_proj ...); transformers fuses them on load."""
    folder = tiny_hf_folder(tmp_path / "hf", "qwen3_moe")
    out = tmp_path / "engine"
    cli("export", folder, "--out", out, "--cut", CUT, "--kv-calibration", "none", "--max-seq", "64",
        "--min-prompt-tokens", "0")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference.PopRun(model, reference.Variant(CUT), 9).prefill(prompt).numpy()
    np.testing.assert_allclose(_prefill(out, prompt)[0], expected, atol=ONNX_ATOL, rtol=0)


def test_experts_the_op_does_not_compute_are_refused_by_name():
    config = transformers.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=32,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(config)
    assert experts_modules(model)
    with pytest.raises(ModelError, match=r"layers\.0\.mlp\.experts \(GptOssExperts\) has has_bias=True"):
        check_experts(model)
