"""float16 engines: export(dtype="float16") on tiny models, numerics against the float32 engine,
the manifest and KV buffer dtype, and the CPU provider's refusal."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from tiny import tiny_model

from popcompile.driver import cast_model, export
from popcompile.engine.manifest import EngineError, EngineManifest
from popcompile.runtime.kvbuffer import KVBuffer
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig

# float16 keeps 11 significant bits (relative step 4.9e-4); through 4 tiny layers the rounding of
# weights and activations adds up to ~1e-3 on logits and K/V of magnitude ~1 (measured 4-7e-4).
FP16_ATOL = 5e-3
FP16_RTOL = 1e-2
PROMPT = np.array([[1, 5, 7, 9, 11, 13, 40, 41, 42, 90, 3, 17]], dtype=np.int64)


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def folders(request, engines) -> dict[str, Path]:
    return {dtype: engines.tiny(request.param, cut=3, max_seq=64, dtype=dtype)
            for dtype in ("float32", "float16")}


def _feeds(layout, ids: np.ndarray, past: list[np.ndarray], start: int) -> dict[str, np.ndarray]:
    batch, seq = ids.shape
    return {"input_ids": ids, "position_ids": np.arange(start, start + seq)[None].repeat(batch, 0),
            "attention_mask": np.ones((batch, start + seq), np.int64), **dict(zip(layout.past_names, past))}


def _run_graphs(folder: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The prefill graph on the prompt (folded boundary: all of it, logits first in its outputs), then
    the decode graph on one more token over its rows. The CPU provider computes float16 graphs correctly
    (through casts), only not fast."""
    manifest = EngineManifest.read(folder)
    layout = manifest.kv_layout
    dtype = np.float16 if layout.dtype == "float16" else np.float32
    sessions = {name: ort.InferenceSession(str(folder / f"{name}.onnx"), providers=["CPUExecutionProvider"])
                for name in ("prefill", "decode")}
    empty = [np.zeros((1, layout.num_kv_heads, 0, layout.head_dim), dtype) for _ in layout.past_names]
    assert manifest.boundary == "folded"  # the default; tests/test_engine.py runs "separate" engines too
    prefill = sessions["prefill"].run(None, _feeds(layout, PROMPT, empty, 0))
    decode = sessions["decode"].run(None, _feeds(layout, PROMPT[:, :1], prefill[1:], PROMPT.shape[1]))
    if manifest.shares_kv("decode"):  # its presents are past + new rows (docs/kv.md): keep the new row
        decode = [decode[0], *(rows[:, :, PROMPT.shape[1]:] for rows in decode[1:])]
    return prefill, decode


def test_manifest_graphs_and_weights_are_float16(folders):
    manifest = EngineManifest.read(folders["float16"])
    assert manifest.dtype == "float16" and manifest.kv_layout.dtype == "float16"
    for name in ("prefill", "decode"):
        graph = onnx.load(str(folders["float16"] / f"{name}.onnx"), load_external_data=False).graph
        kv = [v for v in [*graph.input, *graph.output] if v.name.startswith(("past_", "present."))]
        assert {v.type.tensor_type.elem_type for v in kv} == {onnx.TensorProto.FLOAT16}
    full = EngineManifest.read(folders["float32"]).weights["bytes"]
    assert 0.45 * full <= manifest.weights["bytes"] <= 0.55 * full  # half the bytes, each tensor once


def test_float16_graphs_match_float32(folders):
    pre16, dec16 = _run_graphs(folders["float16"])
    pre32, dec32 = _run_graphs(folders["float32"])
    assert all(a.dtype == np.float16 for a in [*pre16, *dec16])
    assert pre16[0].argmax() == pre32[0].argmax()
    for index, (a, b) in enumerate(zip(pre16 + dec16, pre32 + dec32)):
        np.testing.assert_allclose(a.astype(np.float32), b, rtol=FP16_RTOL, atol=FP16_ATOL,
                                   err_msg=f"output {index}")
    assert dec16[0].argmax() == dec32[0].argmax()


def test_session_buffer_takes_the_engine_dtype(folders):
    layout = EngineManifest.read(folders["float16"]).kv_layout
    buffer = KVBuffer(layout, batch=2)
    assert buffer.data.dtype == np.float16 and buffer.staging.dtype == np.float16
    assert buffer.data.nbytes == 2 * layout.max_seq * layout.bytes_per_token()


def test_cpu_provider_refuses_float16_engines(folders):
    with pytest.raises(EngineError) as error:
        OrtSession(folders["float16"])
    message = str(error.value)
    assert isinstance(error.value, ValueError)
    assert "CPUExecutionProvider" in message and "--provider cuda" in message and "--dtype float32" in message


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime-gpu with the CUDAExecutionProvider and an NVIDIA GPU")
def test_float16_engine_generates_on_cuda(folders):
    sampling = SamplingConfig(max_new_tokens=4)
    fp16 = OrtSession(folders["float16"], provider="cuda").generate([PROMPT[0].tolist()], sampling)[0]
    fp32 = OrtSession(folders["float32"]).generate([PROMPT[0].tolist()], sampling)[0]
    assert fp16.token_ids[0] == fp32.token_ids[0] and len(fp16.token_ids) == 4


def test_cast_leaves_the_callers_model_and_rope_in_float32():
    model = tiny_model("llama")
    half = cast_model(model, "float16", in_place=False)
    assert next(model.parameters()).dtype == torch.float32
    assert {p.dtype for p in half.parameters()} == {torch.float16}
    assert {b.dtype for b in half.buffers() if b.is_floating_point()} == {torch.float32}  # RoPE inv_freq
    assert cast_model(model, "float32", in_place=False) is model


def test_unknown_dtype_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="float32, float16"):
        export("not-loaded", tmp_path / "engine", dtype="bfloat16")
    assert not list(tmp_path.iterdir())
