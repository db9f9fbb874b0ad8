"""Attention lowered to onnxruntime's fused ops (exporters/ort_attention.py), every registered architecture.

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

from popcompile.arch import ARCHITECTURES
from popcompile.engine.manifest import EngineError, EngineManifest
from popcompile.errors import ConfigError
from popcompile.exporters.ort_attention import GQA, MHA, lower_for_ort
from popcompile.exporters.steps import FUSE_STEP
from popcompile.exporters.targets import OnnxTarget
from popcompile.exporters.tensorrt import build_engines
from tiny_engine import tiny_engine

LAYERS, CUT = 4, 3
# fp32, the same products summed in another order (GQA's kernel vs MatMul + Softmax): measured <= 3e-6 here
ATOL = 2e-5


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def graphs(request, tmp_path_factory) -> dict:
    """standard and fused sessions of both graphs of one tiny engine, and the fused forms per graph."""
    folder = tiny_engine(request.param, tmp_path_factory.mktemp(request.param) / "engine", cut=CUT, max_seq=64,
                         target=OnnxTarget(attention="standard"))
    out = {"manifest": EngineManifest.read(folder), "forms": {}}
    for name in ("prefill", "decode"):
        proto = onnx.load(str(folder / f"{name}.onnx"))
        standard = _session(proto)  # before the lowering, which consumes ``proto``
        fused, out["forms"][name] = lower_for_ort(proto, LAYERS)
        out[name] = {"standard": standard, "fused": _session(fused), "proto": fused}
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
    feeds = {"input_ids": rng.integers(3, 97, (batch, seq)), "position_ids": positions, "attention_mask": mask}
    for name in layout.past_names:
        feeds[name] = rng.standard_normal((batch, layout.num_kv_heads, past, layout.head_dim)).astype(np.float32)
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
    for name, want, got in zip(names, sessions["standard"].run(None, feeds), sessions["fused"].run(None, feeds)):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=name)


def test_every_layer_takes_a_fused_form(graphs):
    """decode: every layer GQA; prefill (folded): layers below the cut GQA, the pruned ones MHA (only the last
    token's query over all N rows, unequal lengths GQA does not take)."""
    assert graphs["forms"]["decode"] == {GQA: LAYERS, MHA: 0, "standard": 0}
    assert graphs["forms"]["prefill"] == {GQA: CUT, MHA: LAYERS - CUT, "standard": 0}
    ops = Counter(node.op_type for node in graphs["decode"]["proto"].graph.node)
    assert ops[GQA] == LAYERS and ops["Softmax"] == 0 and ops["Expand"] <= 1  # no K/V repeat is left


def test_export_fuses_by_default_and_records_it(tmp_path):
    steps: list[str] = []
    folder = tiny_engine("llama", tmp_path / "engine", cut=CUT, max_seq=64, progress=steps.append)
    assert FUSE_STEP in steps
    manifest = EngineManifest.read(folder)
    assert manifest.attention["lowering"] == "onnxruntime"
    assert manifest.attention["layers"]["decode"] == {GQA: LAYERS, MHA: 0, "standard": 0}
    with pytest.raises(EngineError, match="attention=standard"):
        build_engines(folder)
    data = json.loads((folder / "popcompile.json").read_text())
    data["attention"] = {"lowering": "tensorrt-plugin"}
    with pytest.raises(EngineError, match="attention"):
        EngineManifest.from_dict(data, folder)


def test_attention_lowering_is_validated():
    with pytest.raises(ConfigError, match="auto, fused, standard"):
        OnnxTarget(attention="flash")


def test_auto_keeps_float16_graphs_standard_and_fused_float16_is_refused(tmp_path):
    from popcompile.config import PopConfig

    assert OnnxTarget().lowering("float32") == "fused" and OnnxTarget().lowering("float16") == "standard"
    with pytest.raises(ConfigError, match="--attention fused with --dtype float16"):
        OnnxTarget(attention="fused").preflight(PopConfig(dtype="float16"))
