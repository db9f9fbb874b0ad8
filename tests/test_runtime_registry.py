"""The runtime registry (runtime/__init__.py) and the session core's public prefill / step
(runtime/session.py)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from popcompile.errors import ConfigError, InputError
from popcompile.runtime import RUNTIMES, open_session, session_class
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig
from popcompile.runtime.session import Session


@pytest.fixture(scope="module")
def engine(engines):
    return engines.tiny("llama", cut=3, max_seq=64)


def test_registry_names_both_runtimes_and_every_session_shares_the_core():
    assert list(RUNTIMES) == ["onnxruntime", "tensorrt"]
    assert session_class("onnxruntime") is OrtSession and issubclass(session_class("onnxruntime"), Session)
    from popcompile.runtime.trt import TrtSession

    assert issubclass(TrtSession, Session)
    assert "generate" not in vars(OrtSession) and "generate" not in vars(TrtSession)  # one copy, in Session


def test_unknown_runtime_or_option_is_named(engine):
    with pytest.raises(ConfigError,
                       match="runtime='vllm' is not a runtime: choose one of onnxruntime, tensorrt"):
        open_session(engine, runtime="vllm")
    with pytest.raises(ConfigError, match="takes no option kv_binding: its options are provider, threads"):
        open_session(engine, kv_binding="static")


def test_open_session_passes_options(engine):
    session = open_session(engine, threads=1, min_prompt_tokens=7)
    assert isinstance(session, OrtSession) and session.min_prompt_tokens == 7


def test_importing_the_registry_loads_no_runtime():
    code = "import sys, popcompile.runtime; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('onnxruntime', 'tensorrt', 'torch', 'onnx')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("mode", ["pop", "full"])
def test_greedy_generate_equals_prefill_then_steps(engine, mode):
    session = open_session(engine)
    prompt = [5, 17, 23, 42, 8, 61, 3, 19]
    expected = session.generate([prompt], SamplingConfig(max_new_tokens=6), mode=mode, min_prompt_tokens=0)[0]
    logits = session.prefill(np.array([prompt]), mode)
    tokens = []
    for _ in range(6):
        tokens.append(int(logits[0].argmax()))
        if len(tokens) < 6:
            logits = session.step(np.array([[tokens[-1]]]))
    assert tokens[:len(expected.token_ids)] == expected.token_ids
    assert session.cache_length == len(prompt) + 5


def test_step_needs_a_prefill_and_a_full_cache_is_an_input_error(engine):
    session = open_session(engine)
    with pytest.raises(InputError, match="call prefill first"):
        session.step(np.array([[1]]))
    with pytest.raises(InputError, match="1 <= N <= max_seq=64"):
        session.prefill(np.ones((1, 65), np.int64))
    session.prefill(np.ones((1, 62), np.int64))
    session.step(np.array([[1, 2]]))
    with pytest.raises(InputError,
                       match="KV buffer full: 65 tokens exceed max_seq=64: give a shorter prompt"):
        session.step(np.array([[1]]))
