"""generation_config.json's sampling defaults under the user's options (runtime/defaults.py), and `run` using
them and reporting them (`--json` "sampling"). One tiny engine exported here with the generation config
and a chat template under test (tests/tiny.py weights, tests/tiny_engine.py's word tokenizer): the
template tries to escape the sandbox, so the sampling runs send plain prompts (--no-chat)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from tiny import tiny_model
from tiny_engine import tiny_tokenizer

from popcompile.cli import main
from popcompile.driver import export
from popcompile.errors import ConfigError, EngineError
from popcompile.frontend.models import LoadedModel, ModelSource
from popcompile.runtime.defaults import SamplingOptions, engine_sampling, resolve_sampling
from popcompile.runtime.loop import encode_prompt
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig

# one worker runs this file: its engines, exported once per module (conftest.py)
pytestmark = pytest.mark.xdist_group("test_generation_defaults")

LLAMA3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 2]}
FILE = "generation_config.json"


# ------------------------------------------------------------------------------------- resolve_sampling
def test_no_do_sample_is_greedy():
    choice = resolve_sampling({"eos_token_id": 2, "temperature": 0.6})
    assert choice.greedy and choice.sources["greedy"] == f"default: {FILE} sets no do_sample"
    assert choice.to_dict() == {"greedy": True, "sources": {"greedy": f"default: {FILE} sets no do_sample"},
                                "ignored": {}}
    assert resolve_sampling({"do_sample": False, "top_k": 5}).greedy


def test_the_files_values_are_used_and_unset_ones_are_off():
    choice = resolve_sampling(LLAMA3)
    assert (choice.greedy, choice.temperature, choice.top_k, choice.top_p) == (False, 0.6, 0, 0.9)
    assert choice.sources == {"greedy": f"{FILE} do_sample=true", "temperature": FILE, "top_k": "off",
                              "top_p": FILE, "seed": "none: a new random seed"}
    assert choice.config(7, ("x",)) == SamplingConfig(greedy=False, temperature=0.6, top_k=0, top_p=0.9,
                                                      max_new_tokens=7, stop=("x",))


def test_the_users_options_win():
    choice = resolve_sampling(LLAMA3, SamplingOptions(temperature=1.3, top_k=4, seed=9))
    got = (choice.greedy, choice.temperature, choice.top_k, choice.top_p, choice.seed)
    assert got == (False, 1.3, 4, 0.9, 9)
    assert choice.sources["temperature"] == "--temperature" and choice.sources["top_p"] == FILE
    greedy = resolve_sampling(LLAMA3, SamplingOptions(greedy=True))
    assert greedy.greedy and greedy.sources["greedy"] == "--greedy"
    asked = resolve_sampling({"do_sample": False, "temperature": 0.5}, SamplingOptions(top_p=0.8))
    # a sampling option asks to sample
    assert (asked.greedy, asked.temperature, asked.top_p) == (False, 0.5, 0.8)


@pytest.mark.parametrize("config, options, why", [
    (LLAMA3, SamplingOptions(temperature=0), "temperature 0 (--temperature)"),
    ({"do_sample": True, "temperature": 0.0}, SamplingOptions(), f"temperature 0 ({FILE})"),
])
def test_temperature_zero_is_greedy(config, options, why):
    choice = resolve_sampling(config, options)
    assert choice.greedy and choice.sources["greedy"] == why
    assert choice.config(4).greedy


@pytest.mark.parametrize("options, flag", [
    (dict(temperature=math.inf), "--temperature"), (dict(temperature=math.nan), "--temperature"),
    (dict(temperature=-0.5), "--temperature"), (dict(top_k=-1), "--top-k"), (dict(top_p=0.0), "--top-p"),
    (dict(top_p=1.5), "--top-p"), (dict(seed=-3), "--seed"), (dict(greedy=True, top_k=3), "--greedy"),
])
def test_bad_options_are_config_errors_naming_the_flag(options, flag):
    with pytest.raises(ConfigError, match=flag):
        SamplingOptions(**options)


@pytest.mark.parametrize("key, value", [("do_sample", "yes"), ("temperature", -1), ("temperature", "hot"),
                                        ("top_k", 2.5), ("top_p", 0), ("top_p", True)])
def test_bad_file_values_are_engine_errors_naming_the_file(key, value):
    with pytest.raises(EngineError, match=f"engine/{FILE}: {key} must be"):
        resolve_sampling({key: value}, origin=f"engine/{FILE}")


def test_keys_popcompile_does_not_apply_are_reported():
    config = {**LLAMA3, "repetition_penalty": 1.3, "num_beams": 1, "typical_p": 1.0, "min_p": None}
    assert resolve_sampling(config).ignored == {"repetition_penalty": 1.3}
    assert resolve_sampling(config).to_dict()["ignored"] == {"repetition_penalty": 1.3}


def test_the_api_decodes_as_the_file_says_under_a_dicts_values():
    assert engine_sampling(LLAMA3) == SamplingConfig(greedy=False, temperature=0.6, top_k=0, top_p=0.9)
    assert engine_sampling({"eos_token_id": 2}) == SamplingConfig()  # no do_sample: greedy, as before
    assert engine_sampling(LLAMA3, {"max_new_tokens": 5, "stop": ["x"], "seed": 2}) == SamplingConfig(
        greedy=False, temperature=0.6, top_p=0.9, max_new_tokens=5, stop=("x",), seed=2)
    assert engine_sampling(LLAMA3, {"greedy": True, "max_new_tokens": 5}).greedy
    assert engine_sampling({}, {"top_k": 3}) == SamplingConfig(greedy=False, top_k=3)  # a sampling value asks
    assert engine_sampling({}, {"greedy": False}) == SamplingConfig(greedy=False)
    # numpy numbers, as SamplingConfig takes
    numpy_numbers = {"top_k": np.int64(3), "temperature": np.float32(0.5), "seed": np.int64(1)}
    expected = SamplingConfig(greedy=False, top_k=3, temperature=0.5, seed=1)
    assert engine_sampling({}, numpy_numbers) == expected
    config = SamplingConfig(max_new_tokens=3)
    assert engine_sampling(LLAMA3, config) is config  # a SamplingConfig is used exactly as given


@pytest.mark.parametrize("sampling, says", [({"max_tokens": 2}, "unknown sampling options"),
                                            (5, "SamplingConfig"),
                                            ({"temperature": "hot"}, "temperature must be"),
                                            ({"greedy": True, "top_p": 0.5}, "cannot be combined")])
def test_the_api_refuses_bad_sampling(sampling, says):
    with pytest.raises(ConfigError, match=says):
        engine_sampling(LLAMA3, sampling)


# ------------------------------------------------------------------------------------------- the CLI
def engine(folder, *, template: str, **generation) -> str:
    """A tiny llama engine whose generation_config.json and chat template are the given ones."""
    model = tiny_model("llama")
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    tokenizer.chat_template = template
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.update(**generation)
    export(LoadedModel(model, tokenizer, ModelSource("tiny", "folder", "tiny", None)), folder, cut=2,
           kv_calibration="none", max_seq=64, min_prompt_tokens=0)
    return str(folder)


@pytest.fixture(scope="module")
def sampling_engine(tmp_path_factory):
    return engine(tmp_path_factory.mktemp("sampling") / "engine", template="{{ messages.__class__.__mro__ }}",
                  do_sample=True, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3)


def run_json(capsys, folder, *flags) -> tuple[dict, str]:
    assert main(["run", folder, "--prompt", "t5 t6 t7", "--max-new-tokens", "6", "--no-warmup", "--json",
                 "--no-chat", *flags]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_run_samples_with_the_engines_defaults(sampling_engine, capsys):
    result, err = run_json(capsys, sampling_engine, "--seed", "3")
    assert result["sampling"] == {
        "greedy": False, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3,
        "sources": {"greedy": f"{FILE} do_sample=true", "temperature": FILE, "top_k": FILE, "top_p": FILE,
                    "seed": "--seed"},
        "ignored": {"repetition_penalty": 1.3}}
    assert "repetition_penalty=1.3, which popcompile does not apply" in err
    session = OrtSession(sampling_engine, threads=1)
    prompt_ids = encode_prompt(session.tokenizer, "t5 t6 t7", chat=False)
    assert result["prompt_token_ids"] == prompt_ids == [8, 9, 10]
    expected = session.generate("t5 t6 t7", SamplingConfig(greedy=False, temperature=0.7, top_k=5, top_p=0.9,
                                                           seed=3, max_new_tokens=6), chat=False)[0]
    assert result["token_ids"] == expected.token_ids
    assert session.generate("t5 t6 t7", {"seed": 3, "max_new_tokens": 6}, chat=False)[0].token_ids == \
        expected.token_ids  # the API decodes with the same defaults
    greedy = session.generate("t5 t6 t7", SamplingConfig(max_new_tokens=6), chat=False)[0].token_ids
    asked_greedy = session.generate("t5 t6 t7", {"greedy": True, "max_new_tokens": 6}, chat=False)[0]
    assert asked_greedy.token_ids == greedy
    assert run_json(capsys, sampling_engine, "--greedy")[0]["token_ids"] == greedy
    zero, _ = run_json(capsys, sampling_engine, "--temperature", "0")
    assert zero["token_ids"] == greedy
    assert zero["sampling"]["sources"]["greedy"] == "temperature 0 (--temperature)"


def test_run_flag_overrides_one_value(sampling_engine, capsys):
    sampling = run_json(capsys, sampling_engine, "--temperature", "1.5", "--seed", "1")[0]["sampling"]
    assert (sampling["temperature"], sampling["top_k"]) == (1.5, 5)
    assert sampling["sources"]["temperature"] == "--temperature" and sampling["sources"]["top_k"] == FILE


@pytest.mark.parametrize("flags, says", [
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be"), (["--top-p", "0"], "--top-p must be"),
    (["--top-k", "-2"], "--top-k must be"), (["--seed", "-1"], "--seed must be"),
    (["--greedy", "--top-k", "3"], "--greedy cannot be combined with --top-k"),
])
def test_run_bad_sampling_flags_are_one_line(sampling_engine, capsys, flags, says):
    assert main(["run", sampling_engine, "--prompt", "t5", "--no-warmup", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def test_run_with_a_template_escaping_the_sandbox_is_one_line(sampling_engine, capsys):
    assert main(["run", sampling_engine, "--prompt", "t5 t6", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "SecurityError" not in err
    assert "chat_template.jinja" in err and "sandbox forbids" in err and "--no-chat" in err
