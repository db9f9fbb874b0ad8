"""The runtime API's inputs are checked at the boundary: token ids, sampling options, session options.

No engine needed: the checks run before any graph does (tests/test_engine_loading.py runs them through
a real OrtSession too).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popcompile.engine.kv import KVLayout
from popcompile.errors import ConfigError, EngineError, EnvironmentUnavailable, InputError
from popcompile.runtime.kvbuffer import KVBuffer
from popcompile.runtime.loop import Generation, prompt_ids
from popcompile.runtime.ort import provider_list, session_options
from popcompile.runtime.sampling import Sampler, SamplingConfig, sampling_config

VOCAB, MAX_SEQ = 100, 16


class WordTokenizer:
    """Just enough of EngineTokenizer for encode_prompt: one id per word."""

    has_chat_template = False

    def encode(self, text: str, **_) -> list[int]:
        return [len(word) for word in text.split()]


def ids(prompts, chat=None):
    return prompt_ids(WordTokenizer(), prompts, chat, MAX_SEQ, VOCAB)


def test_good_prompts_pass_as_lists_of_ints():
    assert ids([[1, 2, 3], (4, 5), np.array([6, 7], np.int32)]) == [[1, 2, 3], [4, 5], [6, 7]]
    assert ids("ab abc") == [[2, 3]]
    assert ids(["a", [99]]) == [[1], [99]]
    assert all(type(t) is int for t in ids([np.array([6, 7], np.int64)])[0])


@pytest.mark.parametrize("prompts, words", [
    ([[1, -5, 3]], "prompt 0, token 1 is int -5"),
    ([[1, 2], [3, 2.0]], "prompt 1, token 1 is float 2.0"),
    ([[1, True]], "bool True"),
    ([[np.bool_(True)]], "np.True_"),
    ([[VOCAB]], f"int {VOCAB}: token ids are integers in 0..{VOCAB - 1}"),
    ([["1"]], "str '1'"),
    ([np.array([1.0, 2.0])], "prompt 0 is ndarray"),
    ([[1, 2, 3]][0], "list of token ids"),
    ([], "non-empty list"),
    ((), "non-empty list"),
    (None, "NoneType"),
    (42, "int 42"),
    ({"ids": [1]}, "dict"),
    ([[]], "no tokens"),
    ([list(range(MAX_SEQ))], f"max length {MAX_SEQ}"),
], ids=lambda v: str(v)[:30])
def test_bad_token_ids_are_input_errors_naming_the_value(prompts, words):
    with pytest.raises(InputError) as error:
        ids(prompts)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_chat_flag_must_be_a_bool():
    with pytest.raises(ConfigError, match="chat='yes'"):
        ids("ab", chat="yes")


@pytest.mark.parametrize("value", [0, 0.0, np.float32(0)])
def test_temperature_zero_means_greedy(value):
    config = SamplingConfig(greedy=False, temperature=value, top_k=5, seed=1)
    logits = np.random.default_rng(0).normal(size=(4, 30))
    assert config.greedy
    assert np.array_equal(Sampler(config)(logits), logits.argmax(axis=-1))


@pytest.mark.parametrize("field, value", [
    ("temperature", math.inf), ("temperature", -math.inf), ("temperature", math.nan), ("temperature", -0.5),
    ("temperature", "0.7"), ("temperature", True), ("top_p", math.nan), ("top_p", math.inf), ("top_p", 0),
    ("top_k", 2.0), ("top_k", -1), ("max_new_tokens", 0), ("max_new_tokens", 1.5), ("max_new_tokens", None),
    ("seed", -1), ("seed", 1.5), ("greedy", "yes"), ("greedy", 1), ("stop", 5), ("stop", [""]),
    ("stop", [None]),
])
def test_bad_sampling_values_are_config_errors(field, value):
    with pytest.raises(ConfigError, match=field) as error:
        SamplingConfig(**{field: value})
    assert isinstance(error.value, ValueError)  # code written against the ValueError contract keeps working


def test_sampling_accepts_a_mapping_of_its_fields():
    expected = SamplingConfig(max_new_tokens=2, temperature=0)
    assert sampling_config({"max_new_tokens": 2, "temperature": 0}) == expected
    assert sampling_config(None) == SamplingConfig()
    config = SamplingConfig(top_k=3)
    assert sampling_config(config) is config
    with pytest.raises(ConfigError, match=r"unknown sampling options \['max_tokens'\].*max_new_tokens"):
        sampling_config({"max_tokens": 2})
    with pytest.raises(ConfigError, match="SamplingConfig or a dict"):
        sampling_config(64)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        sampling_config({"max_new_tokens": "2"})


def test_logits_with_nan_are_an_engine_error():
    with pytest.raises(EngineError, match="NaN"):
        Sampler(SamplingConfig())(np.array([[0.0, np.nan]]))
    with pytest.raises(EngineError, match="finite"):
        Sampler(SamplingConfig(greedy=False))(np.full((1, 3), -np.inf))


def test_generation_mode_and_callback():
    layout = KVLayout(1, 1, 4, 8)
    buffer = KVBuffer(layout, 1)
    with pytest.raises(ConfigError, match="mode must be one of pop, full, got 'fast'"):
        Generation(lambda graph, feeds: [], buffer, WordTokenizer(), SamplingConfig(), "fast")
    with pytest.raises(ConfigError, match="on_text"):
        Generation(lambda graph, feeds: [], buffer, WordTokenizer(), SamplingConfig(), "pop", on_text="print")


def test_kv_buffer_too_large_for_memory_is_an_engine_error():
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, max_seq=1 << 22)  # 12 PB at batch 64
    with pytest.raises(EngineError, match="max_seq=4194304.*--max-seq"):
        KVBuffer(layout, 64)


@pytest.mark.parametrize("kwargs, words", [
    ({"max_seq": 10**12}, "max_seq must be an integer in 1..4194304"),
    ({"max_seq": 1e3}, "max_seq"), ({"num_kv_heads": 0}, "num_kv_heads"), ({"head_dim": True}, "head_dim"),
    ({"dtype": "float8"}, "dtype"), ({"dtype": None}, "dtype"),
])
def test_kv_layout_values(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        KVLayout(**{"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "max_seq": 16, **kwargs})


def test_session_options():
    assert session_options(2).intra_op_num_threads == 2
    assert session_options(None).intra_op_num_threads == 0
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ConfigError, match="threads"):
            session_options(bad)
    with pytest.raises(ConfigError, match="unknown provider"):
        provider_list("tpu")
    with pytest.raises(ConfigError, match="unknown provider"):
        provider_list(["cpu"])
    assert provider_list("cpu") == ["CPUExecutionProvider"]


def test_missing_provider_is_environment_unavailable():
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert provider_list("cuda") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return
    with pytest.raises(EnvironmentUnavailable, match="onnxruntime-gpu"):
        provider_list("cuda")


# ------------------------------------------------------------------------------------------- external data

def _model_with_external_data() -> bytes:
    """A graph with external tensors in an initializer, a Constant's attribute and an If's subgraph."""
    import onnx
    from onnx import TensorProto, helper

    def external(name: str, offset: int) -> TensorProto:
        tensor = helper.make_tensor(name, TensorProto.FLOAT, [4], bytes(16), raw=True)
        onnx.external_data_helper.set_external_data(tensor, "weights.bin", offset=offset, length=16)
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        return tensor

    branch = helper.make_graph([helper.make_node("Identity", ["w2"], ["y"])], "branch", [],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                               [external("w2", 32)])
    nodes = [helper.make_node("Constant", [], ["c"], value=external("c", 16)),
             helper.make_node("If", ["cond"], ["out"], then_branch=branch, else_branch=branch)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])],
                              [external("w", 0)])
    return helper.make_model(graph).SerializeToString()


def test_external_refs_finds_every_tensor_stored_outside():
    from popcompile.runtime.onnx_refs import ExternalRef, external_refs

    refs = external_refs(_model_with_external_data())
    assert sorted(refs, key=lambda r: r.offset) == [
        ExternalRef("weights.bin", "0", "16"), ExternalRef("weights.bin", "16", "16"),
        ExternalRef("weights.bin", "32", "16"), ExternalRef("weights.bin", "32", "16")]  # one If branch each


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_external_refs_on_damaged_bytes_parses_or_raises_proto_error(data):
    from popcompile.runtime.onnx_refs import ProtoError, external_refs

    raw = bytearray(_model_with_external_data())
    for _ in range(data.draw(st.integers(0, 6))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    try:
        refs = external_refs(bytes(raw))
    except ProtoError:
        return
    assert all(ref.location is None or isinstance(ref.location, str) for ref in refs)
