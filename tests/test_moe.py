"""Mixtures of experts: ``popcompile::experts`` (frontend/experts.py), its ONNX lowerings (exporters/moe.py).

The families' other paths (capture, POP pass, folded boundary, torch.compile, fits, onnxruntime's fused
attention) run in the per-architecture tests, which include every MoE family of tests/tiny.py."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import transformers
from onnx import helper, numpy_helper
from tiny import MOE, empty_past, tiny_model
from tiny_engine import tiny_hf_folder

from popcompile import reference
from popcompile.config import WeightQuantization
from popcompile.engine.manifest import EngineManifest
from popcompile.errors import ModelError
from popcompile.exporters.quantize import quantize_weights
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


def _moe_model(node, weights: dict[str, np.ndarray], tokens: int, width: int,
               experts: int) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [tokens, width]),
              helper.make_tensor_value_info("router", onnx.TensorProto.FLOAT, [tokens, experts])]
    output = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [tokens, width])
    graph = helper.make_graph([node], "moe", inputs, [output],
                              [numpy_helper.from_array(array, name) for name, array in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _run(model: onnx.ModelProto, feeds) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _dequantised(packed: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """[E, rows, cols*bits/8] uint8 + scales [E, rows, cols/bs] (int4) or [E, rows] (int8) -> [E, rows, cols]:
    symmetric, zero point 2^(bits-1), two 4-bit values per byte low nibble first."""
    q = np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:2], -1) if bits == 4 else packed
    scales = scales if scales.ndim == 3 else scales[..., None]
    return (q.astype(np.float32) - 2 ** (bits - 1)) * np.repeat(scales, q.shape[-1] // scales.shape[-1], -1)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_int_weights_turn_onnxruntimes_moe_into_qmoe_on_the_same_routing(fmt):
    """exporters/quantize.py: MoE(x, router, fc1 [E, 2I, d], -, fc2 [E, d, I]) becomes QMoE over block-wise
    int weights; onnxruntime's QMoE equals its float MoE on the dequantised weights (the same kernel sums:
    1e-5), and differs from the float weights by the quantisation error only."""
    experts, inter, width, tokens = 4, 32, 64, 7
    rng = np.random.default_rng(0)
    weights = {"fc1": 0.1 * rng.standard_normal((experts, 2 * inter, width)).astype(np.float32),
               "fc2": 0.1 * rng.standard_normal((experts, width, inter)).astype(np.float32)}
    feeds = {"x": rng.standard_normal((tokens, width)).astype(np.float32),
             "router": rng.standard_normal((tokens, experts)).astype(np.float32)}
    attributes = dict(activation_type="swiglu", swiglu_fusion=1, k=2, normalize_routing_weights=1,
                      activation_alpha=1.0, activation_beta=0.0)
    moe = helper.make_node("MoE", ["x", "router", "fc1", "", "fc2"], ["y"], domain="com.microsoft",
                           **attributes)
    quantization = WeightQuantization(fmt, block_size=16, accuracy_level=0)
    model = quantize_weights(_moe_model(moe, weights, tokens, width, experts), quantization)

    (node,) = model.graph.node
    assert (node.op_type, node.domain) == ("QMoE", "com.microsoft")
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert set(stored) == {"fc1_Q" + fmt[3:], "fc1_scales", "fc2_Q" + fmt[3:], "fc2_scales"}
    # int4 in blocks of 16 input channels, int8 one scale per row (exporters/quantize.py's _qmoe)
    assert stored["fc1_scales"].shape == (experts, 2 * inter, width // 16)[:3 if fmt == "int4" else 2]
    dequantised = {name: _dequantised(stored[f"{name}_Q{quantization.bits}"], stored[f"{name}_scales"],
                                      quantization.bits) for name in weights}
    for name, array in weights.items():  # symmetric blocks [-2^(b-1), 2^(b-1) - 1]: the top clips to a step
        scales = stored[f"{name}_scales"]
        step = np.abs(np.repeat(scales, 16, -1) if scales.ndim == 3 else scales[..., None])  # signed scales
        assert (np.abs(dequantised[name] - array) <= step + 1e-7).all(), name
    on_dequantised = _run(_moe_model(moe, dequantised, tokens, width, experts), feeds)
    np.testing.assert_allclose(_run(model, feeds), on_dequantised, atol=1e-5, rtol=0)
    float_out = _run(_moe_model(moe, weights, tokens, width, experts), feeds)
    assert np.abs(on_dequantised - float_out).max() > 1e-6  # the weights did change


def test_an_int4_moe_engine_runs_qmoe_and_stays_near_the_float_engine(lowered, engines):
    arch, folders = lowered
    folder = engines.tiny(arch, cut=CUT, max_seq=64,
                          target=OnnxTarget(WeightQuantization("int4", block_size=16)))
    for name in ("decode", "prefill"):
        graph = onnx.load(str(folder / f"{name}.onnx"), load_external_data=False).graph
        ops = [n.op_type for n in graph.node]
        assert ops.count("QMoE") == LAYERS and "MoE" not in ops, (arch, name)
    prompt = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(3))
    got, want = _prefill(folder, prompt)[0], _prefill(folders["fused"], prompt)[0]
    # int4 in blocks of 16 through 4 random layers (tests/test_quantize.py's bound for int4)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.6
