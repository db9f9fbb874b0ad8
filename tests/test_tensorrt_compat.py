"""The GPU-free TensorRT check: the pinned support matrix, hand-made graphs, and real exported engines."""
from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from popcompile.engine import tensorrt as trt
from popcompile.engine.tensorrt import TensorRTUnavailable, require_gpu
from popcompile.exporters.targets import OnnxTarget
from popcompile.exporters.tensorrt_compat import (
    CompatReport,
    Finding,
    check_engine,
    check_model,
    dynamic_dims,
    format_table,
    support_matrix,
)

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def model(nodes, inputs, outputs, initializers=(), opset=20, domains=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domains)]
    return helper.make_model(graph, opset_imports=opsets)


def x_input(name="x", shape=("batch", "seq", 8), dtype=FLOAT):
    return helper.make_tensor_value_info(name, dtype, list(shape))


def ints(name, values):
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def supported_model():
    """MatMul -> Add -> RMS-style norm (Pow, ReduceMean, Sqrt, Div) -> Unsqueeze/Squeeze -> Softmax."""
    w = numpy_helper.from_array(np.ones((8, 8), np.float32), "w")
    b = numpy_helper.from_array(np.zeros(8, np.float32), "b")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["h2"]),
        helper.make_node("Pow", ["h2", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes_last"], ["ms"]),
        helper.make_node("Sqrt", ["ms"], ["rms"]),
        helper.make_node("Div", ["h2", "rms"], ["n"]),
        helper.make_node("Constant", [], ["axes0"], value=ints("c", [0])),
        helper.make_node("Add", ["axes0", "zero"], ["axes_folded"]),   # foldable: still a constant
        helper.make_node("Unsqueeze", ["n", "axes_folded"], ["u"]),
        helper.make_node("Squeeze", ["u", "axes0"], ["s"]),
        helper.make_node("Softmax", ["s"], ["y"], axis=-1),
    ]
    return model(nodes, [x_input()], [x_input("y")], [w, b, two, ints("axes_last", [-1]), ints("zero", [0])])


def statuses(findings, status):
    return [f for f in findings if f.status == status]


def report(findings):
    return CompatReport("10.15", "test", tuple(findings))


# ------------------------------------------------------------------------------------------- the data

def test_support_matrix_is_pinned_data():
    m = support_matrix()
    assert m["tensorrt_version"] == "10.15" and "onnx/onnx-tensorrt docs/operators.md" in m["source"]
    assert (m["min_opset"], m["max_opset"]) == (9, 24)
    assert len(m["ops"]) >= 150
    assert {"FP32", "FP16", "BF16", "INT32", "INT64"} <= set(m["ops"]["Add"]["dtypes"])
    assert m["ops"]["MatMul"]["dtypes"] == ["FP32", "FP16", "BF16"]
    for op in ("Attention", "RMSNormalization", "RotaryEmbedding", "TensorScatter"):  # 10.14/10.15 additions
        assert op in m["ops"]
    assert "past_key" in m["ops"]["Attention"]["restrictions"]
    assert "constant" in m["ops"]["Unsqueeze"]["restrictions"]
    assert "Unique" in m["not_supported"] and "GroupQueryAttention" not in m["ops"]
    assert set(m["domains"]) == {"", "ai.onnx"} and "com.microsoft" in m["domain_rule"]
    assert not set(m["ops"]) & set(m["not_supported"])


# ------------------------------------------------------------------------------------------- hand-made graphs

def test_supported_ops_pass():
    findings = check_model(supported_model(), "g")
    r = report(findings)
    assert r.ok and not r.warnings, format_table(r)
    ops = {f.op: f for f in statuses(findings, "ok")}
    assert {"MatMul", "Add", "Pow", "ReduceMean", "Sqrt", "Div", "Unsqueeze", "Squeeze",
            "Softmax"} <= set(ops)
    assert ops["Add"].count == 2 and "FP32" in ops["Add"].detail and "INT64" in ops["Add"].detail
    assert "axes constant" in ops["Unsqueeze"].detail and "axes constant" in ops["ReduceMean"].detail


def test_unsupported_ops_fail_and_are_named():
    nodes = [
        helper.make_node("GroupQueryAttention", ["x", "x", "x"], ["a"], domain="com.microsoft", num_heads=1,
                         kv_num_heads=1),
        helper.make_node("Unique", ["a"], ["y"]),                   # standard op, marked N in the matrix
        helper.make_node("MyCustomOp", ["y"], ["z"]),               # default domain, not an ONNX op at all
    ]
    m = model(nodes, [x_input()], [x_input("z", ("n",))], domains=["com.microsoft"])
    findings = check_model(m, "prefill")
    r = report(findings)
    assert not r.ok
    bad = {f.op: f for f in r.failures}
    assert set(bad) == {"com.microsoft.GroupQueryAttention", "Unique", "MyCustomOp"}
    assert all(f.status == "unsupported" and f.graph == "prefill" for f in bad.values())
    assert "onnxruntime contrib op" in bad["com.microsoft.GroupQueryAttention"].detail
    assert "not supported by the TensorRT 10.15" in bad["Unique"].detail
    table = format_table(r)
    lines = table.splitlines()
    assert lines[0].split()[:5] == ["op", "graphs", "count", "status", "detail"]
    assert "unsupported" in lines[1] and "NOT ok" in lines[-1]


def test_computed_axes_is_a_restriction():
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Slice", ["shape", "s0", "s1"], ["first"]),
        helper.make_node("Sub", ["first", "first"], ["axes"]),       # computed from the input: not constant
        helper.make_node("Unsqueeze", ["x", "axes"], ["y"]),
    ]
    m = model(nodes, [x_input()], [x_input("y", ("a", "b", "c", "d"))], [ints("s0", [0]), ints("s1", [1])])
    findings = check_model(m, "decode")
    r = report(findings)
    warn = [f for f in r.warnings if f.op == "Unsqueeze"]
    assert (len(warn) == 1 and "`axes` input is computed" in warn[0].detail
            and "resolvable to a constant" in warn[0].detail)
    assert r.ok  # a restriction warns, it does not fail


def test_if_node_is_reported():
    def branch(name, shape):
        out = helper.make_tensor_value_info(f"{name}_out", FLOAT, shape)
        return helper.make_graph([helper.make_node("Identity", ["x"], [f"{name}_out"])], name, [], [out])

    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    same = helper.make_node("If", ["cond"], ["y"], then_branch=branch("t", ["a", "b", "c"]),
                            else_branch=branch("e", ["a", "b", "c"]))
    findings = check_model(model([same], [x_input(), cond], [x_input("y")]), "g")
    f = [f for f in findings if f.op == "If"]
    assert len(f) == 1 and f[0].status == "restriction" and "must not contain If" in f[0].detail

    ranks = helper.make_node("If", ["cond"], ["y"], then_branch=branch("t", ["a", "b", "c"]),
                             else_branch=branch("e", ["a", "b"]))
    findings = check_model(model([ranks], [x_input(), cond], [x_input("y")]), "g")
    f = [f for f in findings if f.op == "If"]
    assert [x.status for x in f] == ["unsupported"] and "differ in rank" in f[0].detail
    assert not report(findings).ok


def test_dtypes_double_and_opset():
    nodes = [helper.make_node("MatMul", ["i", "i"], ["m"]), helper.make_node("Add", ["d", "d"], ["e"])]
    m = model(nodes, [x_input("i", ("n", "n"), TensorProto.INT32), x_input("d", ("n",), TensorProto.DOUBLE)],
              [x_input("m", ("n", "n"), TensorProto.INT32), x_input("e", ("n",), TensorProto.DOUBLE)],
              opset=25)
    findings = check_model(m, "g")
    dtype = statuses(findings, "dtype")
    assert ([f.op for f in dtype] == ["MatMul"] and "INT32" in dtype[0].detail
            and "FP32, FP16, BF16" in dtype[0].detail)
    warn = {f.op: f.detail for f in statuses(findings, "restriction")}
    assert "casts them down" in warn["Add"]
    assert "opset 25" in warn["opset"]


def test_dynamic_dims():
    m = model([helper.make_node("Identity", ["x"], ["y"])],
              [x_input("x", ("batch", "seq", 8)), x_input("past_key_values.0.key", ("batch", 2, "past", 4)),
               x_input("anon", (None, 3))],
              [x_input("y")])
    assert dynamic_dims(m) == {"x": ["batch", "seq"], "past_key_values.0.key": ["batch", "past"],
                               "anon": ["dim0"]}
    findings = check_model(m, "prefill")
    past = [f for f in findings if f.op == "profile" and f.status == "restriction"]
    assert len(past) == 1 and ">= 1" in past[0].detail and "separate first-chunk" in past[0].detail


# ------------------------------------------------------------------------------------------- real engines

@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def engine(request, engines):
    # what the tensorrt target writes
    return engines.tiny(request.param, cut=3, max_seq=64, target=OnnxTarget(attention="standard"))


def test_real_engine_passes(engine):
    r = check_engine(engine)
    assert r.ok, format_table(r)
    # the only warnings: `past` can be 0 and a profile cannot (one per graph)
    assert [(f.graph, f.op) for f in r.warnings] == [("decode", "profile"), ("prefill", "profile")], (
        format_table(r))
    ok_ops = {f.op for f in r.findings if f.status == "ok"}
    assert {"MatMul", "Softmax", "ReduceMean", "Slice", "Unsqueeze", "opset"} <= ok_ops
    assert not any(f.op.startswith("com.") for f in r.findings)
    for graph in ("prefill", "decode"):
        dims = r.dims[graph]
        assert dims["input_ids"] == ["batch", "seq"] and dims["attention_mask"] == ["batch", "total"]
        assert dims["past_key_values.0.key"] == ["batch", "past"]
    assert "ok" in format_table(r).splitlines()[-1]
    # the weights were not loaded: initializers stay external in what the check reads
    proto = onnx.load(str(engine / "decode.onnx"), load_external_data=False)
    assert any(t.data_location == TensorProto.EXTERNAL for t in proto.graph.initializer)


# ------------------------------------------------------------------------------------------- GPU requirement

def test_require_gpu_message():
    if shutil.which("nvidia-smi") and importlib.util.find_spec("tensorrt"):
        pytest.skip("this machine has an NVIDIA GPU and tensorrt")
    with pytest.raises(ValueError) as err:
        require_gpu()
    assert isinstance(err.value, TensorRTUnavailable) and isinstance(err.value, RuntimeError)
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("NVIDIA GPU", "CUDA", "`tensorrt`", 'pip install "popcompile[gpu]"',
                 "popcompile export MODEL --out DIR", "onnxruntime",
                 "popcompile check DIR --target tensorrt"):
        assert part in msg


def test_require_gpu_passes_with_gpu_and_tensorrt(monkeypatch):
    monkeypatch.setattr(trt.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(trt.importlib.util, "find_spec", lambda name: object())
    require_gpu()


def test_finding_is_frozen():
    f = Finding("prefill", "Add", 1, "ok", "")
    with pytest.raises(AttributeError):
        f.count = 2  # type: ignore[misc]
