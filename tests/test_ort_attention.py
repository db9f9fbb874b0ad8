"""Attention lowered to onnxruntime's fused ops (ort_passes/attention.py), every registered architecture.

The fused graphs are the standard-op graphs of the same tiny engine rewritten by ``lower_for_ort``; both run
on onnxruntime on the same inputs: a left-padded batch (P = 0), a continuation after cached rows (P > 0,
T > 1: a chat turn), a decode step, and past the sliding windows of Mistral and Gemma 3."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from tiny import CAPPED, MOE
from tiny_engine import tiny_engine

from popcompile import reference
from popcompile.engine.manifest import EngineError, EngineManifest
from popcompile.errors import ConfigError, UnsupportedModelError
from popcompile.exporters.onnx import check_capped_attention
from popcompile.exporters.steps import FUSE_STEP
from popcompile.exporters.targets import OnnxTarget
from popcompile.exporters.tensorrt import build_engines
from popcompile.frontend.arch import ARCHITECTURES, DECODER_TYPES
from popcompile.ort_passes.attention import GQA, MHA, lower_for_ort
from popcompile.ort_passes.pack import pack_projections
from popcompile.ort_passes.rotary import fuse_rotary
from popcompile.ort_passes.shared_kv import PRESENT_DIM, share_kv_buffer
from popcompile.ort_passes.views import drop_round_trip_views
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig

LAYERS, CUT = 4, 3
# fp32, the same products summed in another order (GQA's kernel vs MatMul + Softmax): measured <= 3e-6 here
ATOL = 2e-5


@pytest.fixture(scope="module", params=sorted(set(DECODER_TYPES) - CAPPED))  # capped: test_soft_capped_*
def graphs(request, engines) -> dict:
    """standard and fused sessions of both graphs of one tiny engine, and the fused forms per graph."""
    folder = engines.tiny(request.param, cut=CUT, max_seq=64, target=OnnxTarget(attention="standard"))
    out = {"manifest": EngineManifest.read(folder), "forms": {},
           "moe_layers": LAYERS * (request.param in MOE), "fused_qkv": ARCHITECTURES[request.param].fused_qkv}
    for name in ("prefill", "decode"):
        proto = onnx.load(str(folder / f"{name}.onnx"))
        out[name] = {"standard": _session(proto)}  # before the lowering, which consumes ``proto``
        fused, out["forms"][name] = lower_for_ort(proto, LAYERS)
        shared = onnx.ModelProto()
        shared.CopyFrom(fused)
        if share_kv_buffer(shared, out["manifest"].kv_layout):  # as the exporter: share, then fuse RoPE
            out["rotary"] = fuse_rotary(shared)
            out[name]["shared_proto"] = shared
        out["rotary_" + name] = fuse_rotary(fused)
        out[name]["proto"] = fused
    # as the exporter, across the graphs it writes: the shared decode graph and the prefill graph
    out["packed"] = pack_projections({"decode": out["decode"]["shared_proto"],
                                      "prefill": out["prefill"]["proto"]})
    out["packed_alone"] = pack_projections({"decode": out["decode"]["proto"]})  # no other graph to share with
    out["views"] = {(name, form): drop_round_trip_views(out[name][form])
                    for name, form in (("decode", "shared_proto"), ("decode", "proto"), ("prefill", "proto"))}
    for name in ("prefill", "decode"):
        out[name].update({form: _session(out[name][proto]) for form, proto in
                          (("fused", "proto"), ("shared", "shared_proto")) if proto in out[name]})
    return out


def _session(proto: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _feeds(manifest: EngineManifest, batch: int, past: int, seq: int, pad: int = 0, seed: int = 0) -> dict:
    """Random ids and past rows; row 0 left-padded by ``pad`` (mask 0 over its first ``pad`` positions)."""
    rng = np.random.default_rng(seed)
    layout = manifest.kv_layout
    mask = np.ones((batch, past + seq), np.int64)
    mask[0, :pad] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, past:]
    feeds = {"input_ids": rng.integers(3, 97, (batch, seq)), "position_ids": positions,
             "attention_mask": mask}
    for name in layout.past_names:
        rows = rng.standard_normal((batch, layout.num_kv_heads, past, layout.head_dim))
        feeds[name] = rows.astype(np.float32)
    return feeds


CASES = {  # (batch, past, seq, pad): beyond Mistral's window of 5 and Gemma 3's of 4
    "prompt, left-padded batch": (2, 0, 11, 3),
    "chat turn after cached rows": (1, 7, 6, 0),
    "decode step": (2, 13, 1, 2),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_fused_graphs_equal_standard(graphs, graph, case):
    feeds = _feeds(graphs["manifest"], *CASES[case])
    sessions = graphs[graph]
    names = [o.name for o in sessions["standard"].get_outputs()]
    assert names == [o.name for o in sessions["fused"].get_outputs()]  # the KV contract is untouched
    wanted, got_all = sessions["standard"].run(None, feeds), sessions["fused"].run(None, feeds)
    for name, want, got in zip(names, wanted, got_all):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=name)


def _bound_run(session: ort.InferenceSession, feeds: dict, buffer: np.ndarray, batch: int) -> np.ndarray:
    """Run with every layer's buffer rows buffer[l, kind, :batch] bound as both its past and its present."""
    binding = session.io_binding()
    for name, value in feeds.items():
        if not name.startswith("past_"):
            binding.bind_cpu_input(name, value)
    binding.bind_output("logits", "cpu")
    for layer in range(LAYERS):
        for kind, part in (("key", 0), ("value", 1)):
            rows = ort.OrtValue.ortvalue_from_numpy(buffer[layer, part, :batch])
            binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", rows)
            binding.bind_ortvalue_output(f"present.{layer}.{kind}", rows)
    session.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()


@pytest.mark.parametrize("case", CASES)
def test_decode_graph_reads_and_writes_the_kv_buffer_in_place(graphs, case):
    """The shared decode graph (ort_passes/shared_kv.py) bound to a max_seq buffer: the standard graph's
    logits and new rows, written at past..past+T-1; rows before (the past) and after (never written: filled
    with 1e3 here, so a read of them would show) are left as they were."""
    batch, past, seq, pad = CASES[case]
    feeds, layout = _feeds(graphs["manifest"], *CASES[case]), graphs["manifest"].kv_layout
    want = graphs["decode"]["standard"].run(None, feeds)
    buffer = np.full((LAYERS, 2, batch + 1, layout.num_kv_heads, layout.max_seq, layout.head_dim), 1e3,
                     np.float32)
    for index, name in enumerate(layout.past_names):
        buffer[index // 2, index % 2, :batch, :, :past] = feeds[name]
    before = buffer.copy()
    logits = _bound_run(graphs["decode"]["shared"], feeds, buffer, batch)
    np.testing.assert_allclose(logits, want[0], atol=ATOL, rtol=0)
    for index, rows in enumerate(want[1:]):
        written_rows = buffer[index // 2, index % 2, :batch, :, past:past + seq]
        np.testing.assert_allclose(written_rows, rows, atol=ATOL, rtol=0)
    written = np.zeros(buffer.shape, bool)
    written[:, :, :batch, :, past:past + seq] = True
    np.testing.assert_array_equal(buffer[~written], before[~written])


@pytest.mark.parametrize("case", CASES)
def test_shared_decode_graph_given_exactly_the_past_returns_past_and_new_rows(graphs, case):
    """Unbound (a first prompt, the plain-run backend): present.i.* is the past followed by the new rows."""
    batch, past, seq, pad = CASES[case]
    feeds = _feeds(graphs["manifest"], *CASES[case])
    want = graphs["decode"]["standard"].run(None, feeds)
    got = graphs["decode"]["shared"].run(None, feeds)
    np.testing.assert_allclose(got[0], want[0], atol=ATOL, rtol=0)
    for name, rows, whole in zip(graphs["manifest"].kv_layout.past_names, want[1:], got[1:]):
        assert whole.shape[2] == past + seq
        np.testing.assert_array_equal(whole[:, :, :past], feeds[name])
        np.testing.assert_allclose(whole[:, :, past:], rows, atol=ATOL, rtol=0)


def test_only_graphs_whose_every_layer_is_gqa_share_the_buffer(graphs):
    """decode shares (its presents are declared [batch, kv_heads, present, head_dim]); the prefill graph's
    pruned layers are MultiHeadAttention, so it keeps the new-rows contract and is left untouched."""
    assert "shared" in graphs["decode"] and "shared" not in graphs["prefill"]
    outputs = {o.name: o.shape for o in graphs["decode"]["shared"].get_outputs()}
    assert outputs["present.0.key"][2] == PRESENT_DIM
    proto = graphs["prefill"]["proto"]
    before = proto.SerializeToString()
    assert not share_kv_buffer(proto, graphs["manifest"].kv_layout)
    assert proto.SerializeToString() == before


def test_every_layer_takes_a_fused_form(graphs):
    """decode: every layer GQA; prefill (folded): layers below the cut GQA, the pruned ones MHA (only the last
    token's query over all N rows, unequal lengths GQA does not take)."""
    assert graphs["forms"]["decode"] == {GQA: LAYERS, MHA: 0, "standard": 0}
    assert graphs["forms"]["prefill"] == {GQA: CUT, MHA: LAYERS - CUT, "standard": 0}
    ops = Counter(node.op_type for node in graphs["decode"]["proto"].graph.node)
    routers = graphs["moe_layers"]  # a mixture of experts' softmax and its dense routing's Expand
    assert ops[GQA] == LAYERS and ops["Softmax"] == routers and ops["Expand"] <= 1 + routers  # no K/V repeat


def test_projections_of_one_activation_are_packed_into_weights_both_graphs_share(graphs):
    """q/k/v and gate/up are one MatMul each (ort_passes/pack.py), and every packed weight the prefill
    graph reads is one the decode graph reads too. The folded prefill's pruned layers read k/v over the prompt
    and q over x_N alone: there both graphs pack [Wk|Wv] and keep Wq apart; a decode graph alone packs all
    three."""
    pruned, packs = LAYERS - CUT, 1 if graphs["moe_layers"] else 2  # experts: no gate|up MatMul to pack
    if graphs["fused_qkv"]:
        _fused_projections_are_packed_in_the_pruned_layers_only(graphs, pruned)
        return
    assert graphs["packed"] == {"decode": packs * LAYERS, "prefill": packs * CUT + packs * pruned}
    assert graphs["packed_alone"] == {"decode": packs * LAYERS}
    matmuls = {name: Counter(n.op_type for n in graphs[name][proto].graph.node)["MatMul"]
               for name, proto in (("decode", "shared_proto"), ("prefill", "proto"))}
    # qkv, o, gate|up, down (a mixture of experts: qkv, o; its router on [B*T, d] is a Gemm, its experts
    # Einsums); q apart where the prefill needs it
    per_layer = 2 if graphs["moe_layers"] else 4
    assert matmuls["decode"] == per_layer * LAYERS + pruned
    assert Counter(n.op_type for n in graphs["decode"]["proto"].graph.node)["MatMul"] == per_layer * LAYERS
    contents = {name: {_content(t) for t in graphs[name][proto].graph.initializer if len(t.dims) == 2}
                for name, proto in (("decode", "shared_proto"), ("prefill", "proto"))}
    packed = {_content(t) for t in graphs["prefill"]["proto"].graph.initializer
              if t.name.endswith("/weight") and t.name.startswith("pop_pack/")}
    assert packed and packed <= contents["decode"]


def _fused_projections_are_packed_in_the_pruned_layers_only(graphs, pruned: int) -> None:
    """Phi-3: qkv_proj and gate_up_proj are one MatMul each already, in both graphs; only a pruned layer's K
    and V rows, split from qkv_proj for the prompt (passes/fused.py), are packed back into one [Wk|Wv] MatMul,
    which the prefill graph alone reads (the decode graph reads the whole qkv_proj)."""
    assert graphs["packed"] == {"decode": 0, "prefill": pruned}
    assert graphs["packed_alone"] == {"decode": 0}
    ops = {name: Counter(n.op_type for n in graphs[name][proto].graph.node)
           for name, proto in (("decode", "shared_proto"), ("prefill", "proto"))}
    assert ops["decode"]["MatMul"] == 4 * LAYERS  # qkv, o, gate_up, down
    decode = {_content(t) for t in graphs["decode"]["shared_proto"].graph.initializer if len(t.dims) == 2}
    packed = [t for t in graphs["prefill"]["proto"].graph.initializer if t.name.startswith("pop_pack/")
              and t.name.endswith("/weight")]
    assert len(packed) == pruned and not {_content(t) for t in packed} & decode


def test_views_that_end_where_they_began_are_gone(graphs):
    """The exporter's head views around the fused ops ([B,S,H*D] -> [B,S,H,D] -> [B,S,H*D], and v's two
    Transposes) are removed (ort_passes/views.py). The shared decode graph keeps no Transpose, and a
    Reshape only where an op reads the head view (Gemma 3's per-head q/k norm) or for RotaryEmbedding's caches
    (the graph that is not shared keeps its presents' [B,H,S,D] views)."""
    assert min(graphs["views"][("decode", form)] for form in ("shared_proto", "proto")) >= 5 * LAYERS
    assert graphs["views"][("prefill", "proto")] >= 5 * CUT
    nodes = graphs["decode"]["shared_proto"].graph.node
    producer = {out: node for node in nodes for out in node.output}
    readers = {name: [n.op_type for n in nodes if name in n.input] for node in nodes for name in node.output}
    assert Counter(node.op_type for node in nodes)["Transpose"] == 0
    for node in nodes:
        caches = ("pop_rope/cache/", "pop_rope/positions/")
        if node.op_type == "Reshape" and not node.output[0].startswith(caches):
            near = {producer[node.input[0]].op_type, *readers[node.output[0]]}
            # or a mixture of experts' [B, T, d] <-> [B*T, d] around its router and experts
            experts = {"Einsum", "Gemm"} if graphs["moe_layers"] else set()
            assert "SimplifiedLayerNormalization" in near or near & experts, (node.name, near)


def _content(tensor: onnx.TensorProto) -> bytes:
    return numpy_helper.to_array(tensor).tobytes()


def test_rope_becomes_rotary_embedding_on_the_token_rows(graphs):
    """Every query's and key's rotation is one RotaryEmbedding (ort_passes/rotary.py), in both graphs:
    no rotate-half ops are left, and in the decode graphs q and k reach GroupQueryAttention without a
    Transpose."""
    assert graphs["rotary"] == graphs["rotary_decode"] == graphs["rotary_prefill"] == 2 * LAYERS
    for proto in (graphs["decode"]["proto"], graphs["decode"]["shared_proto"]):
        ops = Counter(node.op_type for node in proto.graph.node)
        assert ops["RotaryEmbedding"] == 2 * LAYERS and ops["Neg"] == 0
    nodes = graphs["decode"]["shared_proto"].graph.node
    producer = {out: node for node in nodes for out in node.output}
    for node in nodes:
        if node.op_type == GQA:
            for name in node.input[:2]:  # q, k: RotaryEmbedding's [B, S, H*D] rows, passed on as they are
                source = producer[name]
                while source.op_type == "Identity":
                    source = producer[source.input[0]]
                assert source.op_type == "RotaryEmbedding", (node.name, source.op_type)


@pytest.mark.parametrize("model_type", sorted(CAPPED | {"granite"}))
def test_soft_capped_and_scaled_families_generate_the_reference_through_the_engine(engines, model_type):
    """Gemma 2 (soft-capped attention and logits) and Granite (multipliers, logits_scaling) through the
    default (fused) engine at the default cut (L-1 here; cut 2: the graphs' tests): POP's greedy tokens
    equal the eager reference, full prefill equals model.generate. Capped attention stays standard ONNX ops
    in both graphs (no decode graph on the shared buffer); a capped layer fused would be refused
    (check_capped_attention)."""
    from tiny import tiny_model

    model, prompt, new = tiny_model(model_type), [5, 9, 12, 40, 41, 7, 3, 88, 19, 4, 60], 6
    ids = torch.tensor([prompt])
    session = OrtSession(engines.tiny(model_type, max_seq=64))
    assert session.manifest.cut == LAYERS - 1
    sampling = SamplingConfig(max_new_tokens=new)
    want = [reference.generate(model, torch.tensor([p]), new, reference.Variant(cut=LAYERS - 1))
            for p in (prompt, prompt[4:])]
    assert session.generate([prompt], sampling)[0].token_ids == want[0]
    # a left-padded batch of two lengths: padding reaches the capped scores through the mask only
    assert [r.token_ids for r in session.generate([prompt, prompt[4:]], sampling)] == want
    full = model.generate(ids, max_new_tokens=new, do_sample=False)[0, len(prompt):].tolist()
    assert session.generate([prompt], sampling, mode="full")[0].token_ids == full
    layers = session.manifest.attention["layers"]
    if model_type in CAPPED:
        assert all(forms == {GQA: 0, MHA: 0, "standard": LAYERS} for forms in layers.values())
        assert not session.manifest.shares_kv("decode")
        with pytest.raises(UnsupportedModelError, match="were fused into onnxruntime attention"):
            check_capped_attention(model.config, {**layers, "decode": {GQA: 1, MHA: 0, "standard": 3}})
    else:
        assert layers["decode"] == {GQA: LAYERS, MHA: 0, "standard": 0}


def test_export_fuses_by_default_and_records_it(tmp_path):
    steps: list[str] = []
    folder = tiny_engine("llama", tmp_path / "engine", cut=CUT, max_seq=64, progress=steps.append)
    assert FUSE_STEP in steps
    manifest = EngineManifest.read(folder)
    assert manifest.attention["lowering"] == "onnxruntime"
    assert manifest.attention["layers"]["decode"] == {GQA: LAYERS, MHA: 0, "standard": 0}
    assert manifest.shares_kv("decode") and not manifest.shares_kv("prefill")
    assert manifest.format_version == 3  # a version-2 runtime would bind the shared decode graph wrongly
    with pytest.raises(EngineError, match="attention=standard"):
        build_engines(folder)
    data = json.loads((folder / "popcompile.json").read_text())
    for bad in ({"lowering": "tensorrt-plugin"}, {**data["attention"], "shared_kv": ["encoder"]},
                {**data["attention"], "shared_kv": "decode"}):
        with pytest.raises(EngineError, match="attention"):
            EngineManifest.from_dict({**data, "attention": bad}, folder)


def test_attention_lowering_is_validated():
    with pytest.raises(ConfigError, match="auto, fused, standard"):
        OnnxTarget(attention="flash")


def test_auto_keeps_float16_graphs_standard_and_fused_float16_is_refused(tmp_path):
    from popcompile.config import PopConfig

    assert OnnxTarget().lowering("float32") == "fused" and OnnxTarget().lowering("float16") == "standard"
    with pytest.raises(ConfigError, match="--attention fused with --dtype float16"):
        OnnxTarget(attention="fused").preflight(PopConfig(dtype="float16"))


@pytest.fixture(scope="module")
def engine_pair(engines) -> dict[str, Path]:
    """A fused and a standard-op engine of the same tiny model."""
    return {attention: engines.tiny("qwen3", cut=CUT, max_seq=64, target=OnnxTarget(attention=attention))
            for attention in ("fused", "standard")}


@pytest.mark.parametrize("io_binding", [True, False])
def test_fused_engine_samples_what_the_standard_engine_samples(engine_pair, io_binding):
    """End to end through OrtSession, a fused engine (decode on the shared buffer) against a standard-op
    engine of the same model: sampled tokens (seeded, temperature 1: they follow small logit changes, unlike
    the tiny model's greedy repeats) for POP and full prefill, a left-padded batch and a one-token prompt."""
    fused = OrtSession(engine_pair["fused"], io_binding=io_binding)
    standard = OrtSession(engine_pair["standard"])
    assert fused.manifest.shares_kv("decode") and not standard.manifest.shares_kv("decode")
    sampling = SamplingConfig(greedy=False, temperature=1.0, seed=7, max_new_tokens=24)
    for prompts in ([[5, 9, 12, 40, 41, 7, 3, 88, 19, 4, 60], [61, 3, 70]], [[11]]):
        for mode in ("pop", "full"):
            want = [r.token_ids for r in standard.generate(prompts, sampling, mode=mode)]
            assert [r.token_ids for r in fused.generate(prompts, sampling, mode=mode)] == want
            assert len(set(want[0])) > 4  # sampled, not one repeated token


def _rope_graph(x_shape: list, unsqueeze_axis: int) -> onnx.ModelProto:
    """y = x*cos + rotate_half(x)*sin with HF's cos = Cos(Concat(f, f)) [B,S,D] unsqueezed at
    ``unsqueeze_axis`` (1: x is [B,H,S,D]; 2: x is [B,S,H,D]), shapes declared by onnx's inference."""
    from onnx import TensorProto, helper

    d = x_shape[3]
    seq = x_shape[2] if unsqueeze_axis == 1 else x_shape[1]
    consts = {"zero": [0], "half": [d // 2], "end": [d], "last": [-1], "axis": [unsqueeze_axis]}
    nodes = [helper.make_node("Concat", ["f", "f"], ["emb"], axis=-1),
             helper.make_node("Cos", ["emb"], ["cos3"]), helper.make_node("Sin", ["emb"], ["sin3"]),
             helper.make_node("Unsqueeze", ["cos3", "axis"], ["cos"]),
             helper.make_node("Unsqueeze", ["sin3", "axis"], ["sin"]),
             helper.make_node("Slice", ["x", "zero", "half", "last"], ["lo"]),
             helper.make_node("Slice", ["x", "half", "end", "last"], ["hi"]),
             helper.make_node("Neg", ["hi"], ["neg"]),
             helper.make_node("Concat", ["neg", "lo"], ["rot"], axis=-1),
             helper.make_node("Mul", ["x", "cos"], ["straight"]),
             helper.make_node("Mul", ["rot", "sin"], ["turned"]),
             helper.make_node("Add", ["straight", "turned"], ["y"])]
    graph = helper.make_graph(
        nodes, "rope", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
                        helper.make_tensor_value_info("f", TensorProto.FLOAT, [x_shape[0], seq, d // 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape)],
        [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    return onnx.shape_inference.infer_shapes(model)


def test_rope_on_one_position_is_fused_only_in_the_heads_first_layout():
    """A last-position copy has S = 1: a [B,S,H,D] x then has a static dim 1 like a [B,H,S,D] one. RoPE is
    rewritten only where cos/sin's rows lie along x's dim 2 ([B,H,1,D]); a [B,1,H,D] x keeps its ops (read as
    [B,H,S,D] it would rotate each head by another position)."""
    rng = np.random.default_rng(0)
    for shape, axis, fused in (([2, 4, 1, 8], 1, 1), ([2, 1, 4, 8], 2, 0)):
        model = _rope_graph(shape, axis)
        feeds = {"x": rng.standard_normal(shape).astype(np.float32),
                 "f": rng.standard_normal((2, 1, 4)).astype(np.float32)}
        want = _session(model).run(None, feeds)[0]
        rewritten = onnx.ModelProto()
        rewritten.CopyFrom(model)
        assert fuse_rotary(rewritten) == fused
        np.testing.assert_allclose(_session(rewritten).run(None, feeds)[0], want, atol=1e-6, rtol=0)
