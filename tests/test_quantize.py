"""export --weights int8/int4: MatMulNBits graphs (exporters/quantize.py) on tiny engines, every architecture.

What is asserted here is the rewrite: which nodes become MatMulNBits, that the LM head's Gemm is untied
exactly, the manifest, the refusals, and numerics against the float engine. The cost in quality on real
weights is measured in docs/results.md (random tiny weights have no structure for 4 bits to keep)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from tiny import tiny_model
from tiny_engine import tiny_hf_folder, tiny_tokenizer

from popcompile.config import PopConfig, WeightQuantization
from popcompile.driver import compile as compile_model
from popcompile.driver import steps
from popcompile.engine.manifest import EngineError, EngineManifest
from popcompile.errors import ConfigError
from popcompile.exporters.quantize import Quantised, quantize_weights, untie_gemm_heads
from popcompile.exporters.steps import QUANTIZE_STEP
from popcompile.exporters.targets import OnnxTarget
from popcompile.exporters.tensorrt import build_engines
from popcompile.frontend.models import LoadedModel, ModelSource
from popcompile.ort_passes.attention import GQA, MHA
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig

ARCHS = ("llama", "gemma3_text")
LAYERS, CUT = 4, 3
PROMPT = np.random.default_rng(0).integers(3, 97, (1, 12))
# int8 in blocks of 16 with int8 activations (accuracy level 4): each weight and activation off by at most
# half a step of 1/127 of its block's largest magnitude; through 4 random layers the logits move by 1.1%
# (llama) and 3.7% (gemma3: its norms scale the error up) of their norm.
INT8_REL = 0.06


@pytest.fixture(scope="module", params=ARCHS)
def folders(request, engines) -> dict[str, Path]:
    """The float engine (the tests' common tiny engine: tiny_model's depth is LAYERS) and its int8 and int4
    exports."""
    quantized = {fmt: OnnxTarget(WeightQuantization(fmt, block_size=16)) for fmt in ("int8", "int4")}
    return {fmt: engines.tiny(request.param, cut=CUT, max_seq=64, target=target)
            for fmt, target in {"float": OnnxTarget(), **quantized}.items()}


def test_the_quantize_step_runs_and_is_reported(tmp_path):
    """What a progress bar counts is what runs: the quantize step for int4, none for float."""
    model = tiny_model("llama", layers=LAYERS)
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    loaded = LoadedModel(model, tokenizer, ModelSource(name="tiny", kind="folder", path="tiny", sha256=None))
    config = PopConfig(cut=CUT, max_seq=64, kv_calibration="none", min_prompt_tokens=0)
    reported = []
    target = OnnxTarget(WeightQuantization("int4", block_size=16))
    compile_model(loaded, config, out=tmp_path / "int4", target=target, progress=reported.append)
    assert reported == steps(config, target) and QUANTIZE_STEP in reported
    assert QUANTIZE_STEP not in steps(config, OnnxTarget())


def _graph(folder: Path, name: str) -> onnx.ModelProto:
    return onnx.load(str(folder / f"{name}.onnx"), load_external_data=False)


def op_counts(proto: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in proto.graph.node)


def _constant_matmuls(proto: onnx.ModelProto) -> int:
    weights = {t.name for t in proto.graph.initializer}
    return sum(n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in weights
               for n in proto.graph.node)


def _decode_outputs(folder: Path) -> list[np.ndarray]:
    layout = EngineManifest.read(folder).kv_layout
    session = ort.InferenceSession(str(folder / "decode.onnx"), providers=["CPUExecutionProvider"])
    empty = [np.zeros((1, layout.num_kv_heads, 0, layout.head_dim), np.float32) for _ in layout.past_names]
    seq = PROMPT.shape[1]
    return session.run(None, {"input_ids": PROMPT, "position_ids": np.arange(seq)[None],
                              "attention_mask": np.ones((1, seq), np.int64),
                              **dict(zip(layout.past_names, empty))})


def test_every_constant_weight_matmul_becomes_matmulnbits(folders):
    # decode: 4 projections per layer (q/k/v and gate/up packed: ort_passes/pack.py; o, down), q apart in
    # the pruned layers (the prefill reads it over x_N alone), and the LM head (a Gemm over the tied
    # embedding, untied first); prefill: at least layers 0..cut-1 whole, the pruned layers' packed k/v
    # projection (POP), x_N's q and the head.
    assert _constant_matmuls(_graph(folders["float"], "decode")) == 4 * LAYERS + (LAYERS - CUT) + 1
    assert _constant_matmuls(_graph(folders["float"], "prefill")) >= 4 * CUT + 2 * (LAYERS - CUT) + 1
    for fmt in ("int8", "int4"):
        for name in ("decode", "prefill"):
            float_graph, graph = _graph(folders["float"], name), _graph(folders[fmt], name)
            assert op_counts(graph)["MatMulNBits"] == _constant_matmuls(float_graph), (fmt, name)
            assert _constant_matmuls(graph) == 0, (fmt, name)
            bits = {helper.get_attribute_value(a) for n in graph.graph.node if n.op_type == "MatMulNBits"
                    for a in n.attribute if a.name == "bits"}
            assert bits == {4 if fmt == "int4" else 8}
            # attention's activation-by-activation products (Q.K^T, P.V) stay float, inside the fused
            # attention ops (ort_passes/attention.py); no other MatMul is left
            activation_products = op_counts(float_graph)["MatMul"] + op_counts(float_graph)["Gemm"] \
                - _constant_matmuls(float_graph)
            assert op_counts(graph)["MatMul"] == activation_products == 0
            attention = {op: op_counts(graph)[op] for op in (GQA, MHA)}
            assert attention == {op: op_counts(float_graph)[op] for op in (GQA, MHA)}
            assert sum(attention.values()) == LAYERS


def test_weights_file_shrinks_and_the_manifest_records_the_format(folders):
    sizes = {fmt: EngineManifest.read(folder).weights["bytes"] for fmt, folder in folders.items()}
    manifest = EngineManifest.read(folders["int4"])
    assert manifest.quantization == {"format": "int4", "op": "com.microsoft.MatMulNBits", "bits": 4,
                                     "block_size": 16, "accuracy_level": 4, "symmetric": True}
    assert EngineManifest.read(folders["float"]).quantization == {}
    # the float embedding rows (Gather) stay; every matmul weight shrinks: int8 ~1/4 + scales, int4 ~1/8
    assert sizes["int4"] < sizes["int8"] < 0.6 * sizes["float"]


def test_int8_logits_and_kv_stay_close_to_float(folders):
    reference = _decode_outputs(folders["float"])
    for fmt, bound in (("int8", INT8_REL), ("int4", 0.6)):
        outputs = _decode_outputs(folders[fmt])
        for index, (got, want) in enumerate(zip(outputs, reference)):
            assert np.isfinite(got).all()
            rel = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert rel < bound, (fmt, index, rel)


def test_quantised_engine_generates_with_pop_and_full(folders):
    session = OrtSession(folders["int4"], threads=1)
    sampling = SamplingConfig(max_new_tokens=5)
    for mode in ("pop", "full"):
        result = session.generate([PROMPT[0].tolist()], sampling, mode=mode)[0]
        assert len(result.token_ids) == 5 and result.prefill == mode


def test_tensorrt_refuses_a_quantised_folder_before_looking_for_a_gpu(folders):
    with pytest.raises(EngineError, match="MatMulNBits.*--weights float"):
        build_engines(folders["int8"])


def test_untie_gemm_head_is_exact():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((11, 8)).astype(np.float32)
    bias = rng.standard_normal(11).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["h", "E"], ["y"], transB=1, name="head"),
             helper.make_node("Gemm", ["h", "E", "b"], ["z"], transB=1, name="biased"),
             helper.make_node("Gemm", ["h", "E"], ["w"], transB=1, alpha=0.5, name="scaled")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [3, 11]) for n in ("y", "z", "w")],
        [numpy_helper.from_array(table, "E"), numpy_helper.from_array(bias, "b")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    h = rng.standard_normal((3, 8)).astype(np.float32)
    before = ort.InferenceSession(proto.SerializeToString()).run(None, {"h": h})
    assert untie_gemm_heads(proto) == 2  # alpha != 1 is left alone
    assert [n.op_type for n in proto.graph.node] == ["MatMul", "MatMul", "Add", "Gemm"]
    assert sum(t.name == "E.T" for t in proto.graph.initializer) == 1  # one transposed copy for both heads
    after = ort.InferenceSession(proto.SerializeToString()).run(None, {"h": h})
    for a, b in zip(after, before):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_weight_two_graphs_read_is_quantised_once():
    # the decode and prefill graphs read the same weights: the second graph reuses the first's packed tensors
    rng = np.random.default_rng(2)
    weight, other = (rng.standard_normal((64, 32)).astype(np.float32) for _ in range(2))

    def graph(name: str, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
        nodes = [helper.make_node("MatMul", ["x", w], [f"y{i}"]) for i, w in enumerate(weights)]
        body = helper.make_graph(
            nodes, name, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 64])],
            [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, [3, 32])
             for i in range(len(nodes))],
            [numpy_helper.from_array(v, k) for k, v in weights.items()])
        return helper.make_model(body, opset_imports=[helper.make_opsetid("", 20)])

    quantised = Quantised()
    x = rng.standard_normal((3, 64)).astype(np.float32)
    decode = quantize_weights(graph("decode", {"W": weight}), WeightQuantization("int4"), quantised=quantised)
    prefill = quantize_weights(graph("prefill", {"W_again": weight, "V": other}), WeightQuantization("int4"),
                               quantised=quantised)
    assert quantised.made == 2  # W once for both graphs, V
    assert {t.name for t in prefill.graph.initializer} == {"W_again_Q4", "W_again_scales", "V_Q4", "V_scales"}
    (y_decode,) = ort.InferenceSession(decode.SerializeToString()).run(None, {"x": x})
    y_prefill, _ = ort.InferenceSession(prefill.SerializeToString()).run(None, {"x": x})
    np.testing.assert_array_equal(y_prefill, y_decode)
    exact = x @ weight  # int4 (7 steps each side of a block's max) with int8 activations: ~10% of the norm
    assert np.linalg.norm(y_decode - exact) < 0.25 * np.linalg.norm(exact)


def test_float_is_a_no_op():
    proto = helper.make_model(helper.make_graph([], "g", [], []))
    assert quantize_weights(proto, WeightQuantization()) is proto


@pytest.mark.parametrize("kwargs, match", [
    ({"format": "int2"}, "float, int8, int4"),
    ({"format": "int4", "block_size": 48}, "power of two"),
    ({"format": "int4", "block_size": 8}, "power of two"),
    ({"format": "int4", "accuracy_level": 5}, "0..4"),
    ({"format": "int4", "block_size": True}, "power of two"),
])
def test_bad_quantization_values_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        WeightQuantization(**kwargs)


def test_float16_graphs_are_not_quantised(tmp_path):
    with pytest.raises(ConfigError, match="--weights int4 with --dtype float16"):
        compile_model("not-loaded", PopConfig(dtype="float16"), out=tmp_path / "e",
                      target=OnnxTarget(WeightQuantization("int4")))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, match", [
    (["--weights", "int4", "--target", "vllm"], "--target vllm takes float weights"),
    (["--block-size", "64"], "go with --weights int8 or int4"),
    (["--weights", "int4", "--block-size", "48"], "power of two"),
])
def test_cli_refuses_quantisation_it_cannot_do(tmp_path, args, match, cli):
    run = cli("export", "smollm2-135m", "--out", str(tmp_path / "e"), *args, check=False)
    assert run.returncode == 2 and match in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "e").exists()


def test_cli_exports_int4_and_info_says_so(tmp_path, cli):
    model = tiny_hf_folder(tmp_path / "hf")
    out = tmp_path / "int4"
    run = cli("export", str(model), "--out", str(out), "--weights", "int4", "--block-size", "16",
              "--cut", "3", "--kv-calibration", "none", "--min-prompt-tokens", "0", "--json")
    assert json.loads(run.stdout)["quantization"]["block_size"] == 16
    info = cli("info", str(out))
    assert info.returncode == 0 and "weights: int4 (com.microsoft.MatMulNBits, blocks of 16" in info.stdout
