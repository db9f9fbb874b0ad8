"""``export --target vllm``: the folder vLLM loads with POP (no vLLM needed; tests_vllm/ serves it).

What the plugin reads is checked here by name and value: config.json's architecture and ``popcompile``
entry, the untouched weights and the POP+ tensors; options that shape only popcompile's own engines are
refused before the model loads.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib
import torch
from safetensors.torch import load_file
from test_adversarial_cli import fails, fit_file
from tiny_engine import tiny_hf_folder

from popcompile.cli import main
from popcompile.engine.manifest import EngineManifest
from popcompile.engine.vllm_folder import is_vllm_folder
from popcompile.errors import EngineError, EnvironmentUnavailable, ModelError, UnsupportedModelError
from popcompile.exporters.vllm import pop_architecture
from popcompile.kvfit.calibrate import load_fit
from popcompile.threshold import FIXED_MIN_PROMPT_TOKENS
from popcompile.vllm_plugin.settings import (
    KV_WEIGHTS_FILE,
    MOE_FAMILIES,
    UNSERVED_MOE,
    VLLM_VERSION,
    PopSettings,
    check_served,
    check_vllm_version,
)

LAYERS = 4


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return tiny_hf_folder(tmp_path_factory.mktemp("tiny-hf"), layers=LAYERS, max_position_embeddings=512)


def export(hf: Path, out: Path, *extra: str, cut: int = 3) -> dict:
    assert main(["export", str(hf), "--out", str(out), "--target", "vllm", "--cut", str(cut), "--json",
                 *extra]) == 0
    return json.loads((out / "config.json").read_text())


def test_folder_names_the_pop_class_and_keeps_the_weights(hf, tmp_path, capsys):
    config = export(hf, tmp_path / "served", "--kv-calibration", "none")
    report = json.loads(capsys.readouterr().out)
    assert config["architectures"] == ["PopLlamaForCausalLM"]
    assert {k: config["popcompile"][k] for k in ("format", "cut", "kv_weights", "min_prompt_tokens")} == {
        "format": 1, "cut": 3, "kv_weights": None,
        "min_prompt_tokens": FIXED_MIN_PROMPT_TOKENS}  # auto: the fixed 64
    assert (report["cut"], report["num_layers"], report["target"]) == (3, LAYERS, "vllm")
    assert report["min_prompt_tokens"] == FIXED_MIN_PROMPT_TOKENS == 64
    original, written = (load_file(hf / "model.safetensors"),
                         load_file(tmp_path / "served" / "model.safetensors"))
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)
    assert ((tmp_path / "served" / "tokenizer.json").is_file()
            and not (tmp_path / "served" / KV_WEIGHTS_FILE).exists())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]  # no staging folder, no lock left
    umask = os.umask(0)
    os.umask(umask)
    # readable by a server of another user
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "served").iterdir()} == {
        p.name: 0o666 & ~umask for p in (tmp_path / "served").iterdir()}


def test_pop_plus_weights_are_written_under_the_names_the_plugin_loads(hf, tmp_path):
    # layers cut+1..L-1
    fit = fit_file(tmp_path / "fit.safetensors", cut=2, layers=range(3, LAYERS), value=0.25)
    config = export(hf, tmp_path / "served", "--kv-calibration", str(fit), cut=2)
    tensors = load_file(tmp_path / "served" / KV_WEIGHTS_FILE)
    expected = load_fit(fit).weights
    assert config["popcompile"]["kv_weights"] == KV_WEIGHTS_FILE
    assert sorted(tensors) == [f"pop_kv.layers.3.{p}.weight" for p in ("k_proj", "v_proj")]
    assert torch.equal(tensors["pop_kv.layers.3.k_proj.weight"], expected[3]["k_proj"].weight)


def test_a_fitted_bias_is_written_where_the_model_has_none(hf, tmp_path):
    """A fit made with `calibrate --bias` (distill's default) has a k/v bias for llama too: the plugin's PopKV
    then builds every pair with a bias (zero where none is loaded) and loads these tensors over it
    (vllm_plugin/model.py)."""
    from popcompile.kvfit.calibrate import CalibrationInfo, KVFit, save_fit
    from popcompile.passes.pop import Projection

    plain = load_fit(fit_file(tmp_path / "plain.safetensors", cut=2, layers=range(3, LAYERS), value=0.25))
    weights = {i: {part: Projection(p.weight, torch.full((p.weight.shape[0],), 0.5))
                   for part, p in parts.items()}
               for i, parts in plain.weights.items()}
    save_fit(KVFit(CalibrationInfo(**{**plain.info.__dict__, "bias": True}), weights),
             tmp_path / "fit.safetensors")
    export(hf, tmp_path / "served", "--kv-calibration", str(tmp_path / "fit.safetensors"), cut=2)
    tensors = load_file(tmp_path / "served" / KV_WEIGHTS_FILE)
    assert sorted(tensors) == [f"pop_kv.layers.3.{p}.{n}" for p in ("k_proj", "v_proj")
                               for n in ("bias", "weight")]
    assert torch.equal(tensors["pop_kv.layers.3.v_proj.bias"], weights[3]["v_proj"].bias)


def test_force_replaces_a_vllm_folder_and_run_refuses_one(hf, tmp_path, capsys):
    out = tmp_path / "served"
    export(hf, out, "--kv-calibration", "none")
    assert main(["export", str(hf), "--out", str(out), "--target", "vllm", "--cut", "2", "--force",
                 "--kv-calibration", "none"]) == 0
    assert json.loads((out / "config.json").read_text())["popcompile"]["cut"] == 2 and is_vllm_folder(out)
    capsys.readouterr()
    fails(capsys, ["run", out, "--prompt", "hi"], "vllm serve")
    with pytest.raises(EngineError, match="is a vLLM folder"):
        EngineManifest.read(out)


@pytest.mark.parametrize("threshold", ["0", "8"])
def test_min_prompt_tokens_is_written_as_given(hf, tmp_path, threshold):
    config = export(hf, tmp_path / "served", "--kv-calibration", "none", "--min-prompt-tokens", threshold)
    assert config["popcompile"]["min_prompt_tokens"] == int(threshold)
    assert PopSettings.of(SimpleNamespace(**config)).min_prompt_tokens == int(threshold)


@pytest.mark.parametrize("args, culprit", [
    (["--boundary", "separate"], "--boundary separate"),
    (["--max-seq", "64"], "--max-seq 64"),
])
def test_options_that_only_shape_popcompile_engines_are_refused(hf, tmp_path, capsys, args, culprit):
    fails(capsys, ["export", hf, "--out", tmp_path / "served", "--target", "vllm", *args], culprit,
          within_s=5.0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("architecture", ["PhiForCausalLM", "Phi3ForCausalLM"])
def test_an_architecture_without_a_pop_class_is_named(architecture):
    """Phi-3 exports to ONNX and torch.compile, not to vLLM: its fused qkv_proj has no POP class there."""
    model = SimpleNamespace(config=SimpleNamespace(architectures=[architecture]))
    with pytest.raises(UnsupportedModelError, match=f"{architecture} has no POP class for vLLM yet") as err:
        pop_architecture(SimpleNamespace(model=model))
    assert "LlamaForCausalLM" in str(err.value) and "--target onnx" in str(err.value)
    model.config.architectures = ["Qwen3ForCausalLM"]
    assert pop_architecture(SimpleNamespace(model=model)) == "PopQwen3ForCausalLM"


@pytest.mark.parametrize("model_type, pop_class", [("granite", "PopGraniteForCausalLM"),
                                                   ("gemma2", "PopGemma2ForCausalLM")])
def test_granite_and_gemma2_get_their_pop_class_and_keep_their_weights(model_type, pop_class, tmp_path):
    """Granite's multipliers and logits_scaling, Gemma 2's soft-caps are the stock vLLM classes'; tests_vllm
    serves these folders (test_tiny_architecture_equals_the_reference)."""
    hf = tiny_hf_folder(tmp_path / "hf", model_type, layers=LAYERS, max_position_embeddings=512)
    config = export(hf, tmp_path / "served", "--kv-calibration", "none")
    assert config["architectures"] == [pop_class] and config["popcompile"]["cut"] == 3
    original, written = (load_file(hf / "model.safetensors"),
                         load_file(tmp_path / "served" / "model.safetensors"))
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)


def test_olmo2_is_refused_by_name_also_where_a_folder_names_a_pop_class():
    """The plugin refuses a config.json naming a stock POP class over OLMo 2 (a folder edited by hand)."""
    with pytest.raises(UnsupportedModelError, match="model_type 'olmo2': popcompile's vLLM plugin does not "
                                                    "serve it"):
        check_served("PopLlamaForCausalLM", SimpleNamespace(model_type="olmo2"))


#: what a served family's tiny checkpoint changes from tests/tiny.py's: OLMoE's clip_qkv and tied embeddings,
#: which vLLM's class would ignore (settings.MOE_FAMILIES refuses them)
SERVED_CONFIG = {"olmoe": {"clip_qkv": None, "tie_word_embeddings": False}}


@pytest.mark.parametrize("model_type, pop_class", [("qwen3_moe", "PopQwen3MoeForCausalLM"),
                                                   ("mixtral", "PopMixtralForCausalLM"),
                                                   ("olmoe", "PopOlmoeForCausalLM")])
def test_a_mixture_of_experts_gets_its_pop_class_and_keeps_its_weights(model_type, pop_class, tmp_path):
    """tests_vllm/test_vllm_plugin.py serves these folders (test_moe_*)."""
    hf = tiny_hf_folder(tmp_path / "hf", model_type, layers=LAYERS, max_position_embeddings=512,
                        **SERVED_CONFIG.get(model_type, {}))
    config = export(hf, tmp_path / "served", "--kv-calibration", "none")
    assert config["architectures"] == [pop_class] and config["popcompile"]["cut"] == 3
    assert MOE_FAMILIES[pop_class][0] == model_type  # the plugin's check of what the folder's class serves
    original, written = (load_file(hf / "model.safetensors"),
                         load_file(tmp_path / "served" / "model.safetensors"))
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)
    assert any(".experts." in name for name in written)


def test_a_family_the_onnx_engine_prunes_but_the_plugin_does_not_serve_is_named(tmp_path, capsys):
    """OLMo 2 (post-norm layers, full-width q/k norms): the ONNX engine and torch.compile prune it; vLLM 0.32
    runs it through its Transformers backend, which has no vLLM decoder stack for POP's units: one line
    naming the family, before anything is written."""
    hf = tiny_hf_folder(tmp_path / "hf", "olmo2", layers=2, max_position_embeddings=512)
    capsys.readouterr()  # save_pretrained's progress bar (shown until popcompile's CLI first hides it)
    line = fails(capsys, ["export", hf, "--out", tmp_path / "served", "--target", "vllm", "--cut", "1",
                          "--kv-calibration", "none"],
                 "OLMo 2 (vLLM 0.32 runs it through its Transformers backend")
    assert "--target onnx" in line and not (tmp_path / "served").exists()


def _unserved_moe(model_type: str, folder: Path) -> Path:
    """A tiny random checkpoint of a mixture of experts the plugin does not serve, from transformers' own
    classes."""
    import transformers

    classes = {"qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
               "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM)}
    config_cls, model_cls = classes[model_type]
    config = config_cls(vocab_size=97, hidden_size=64, intermediate_size=32, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_experts=4, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=128)
    model_cls(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("model_type", sorted(UNSERVED_MOE))
def test_a_mixture_of_experts_the_plugin_does_not_serve_is_refused_by_name(model_type, tmp_path, capsys):
    """Qwen2-MoE (shared experts), gpt-oss: one line naming the model type, before anything is
    written; the plugin refuses a POP folder of one where it loads (check_served; tests_vllm: test_moe_*)."""
    hf = _unserved_moe(model_type, tmp_path / "hf")
    capsys.readouterr()  # save_pretrained's progress bar (shown until popcompile's CLI first hides it)
    fails(capsys, ["export", hf, "--out", tmp_path / "served", "--target", "vllm", "--cut", "1",
                   "--kv-calibration", "none"], repr(model_type))
    assert not (tmp_path / "served").exists()
    with pytest.raises(UnsupportedModelError, match=f"model_type {model_type!r}: a mixture of experts "
                                                    "popcompile's vLLM plugin does not serve"):
        check_served("PopQwen3MoeForCausalLM", SimpleNamespace(model_type=model_type))


@pytest.mark.parametrize("model_type, field, value", [("qwen3_moe", "shared_expert_intermediate_size", 32),
                                                      ("qwen3_moe", "hidden_act", "gelu"),
                                                      ("mixtral", "hidden_act", "gelu"),
                                                      ("olmoe", "clip_qkv", 10.0),
                                                      ("olmoe", "tie_word_embeddings", True),
                                                      ("olmoe", "norm_topk_prob", True),
                                                      ("olmoe", "rms_norm_eps", 1e-6)])
def test_a_moe_checkpoint_vllm_would_serve_otherwise_is_refused(model_type, field, value, tmp_path, capsys):
    """vLLM's Qwen3-MoE and Mixtral classes run SiLU experts whatever hidden_act says, and its Qwen3-MoE adds
    a shared expert when the config sizes one (transformers' has none); its OLMoE clamps nothing, ties no
    head, never renormalises the top-k weights and builds its norms at eps 1e-5: such a checkpoint is refused
    by the exporter, before the fit, rather than served otherwise than the reference computes it."""
    hf = tiny_hf_folder(tmp_path / "hf", model_type, layers=2, max_position_embeddings=512,
                        **{**SERVED_CONFIG.get(model_type, {}), field: value})
    line = fails(capsys, ["export", hf, "--out", tmp_path / "served", "--target", "vllm", "--cut", "1"],
                 f"with {field}={value!r}")
    assert "not supported" in line and not (tmp_path / "served").exists()
    pop_class = next(pop for pop, (family, _) in MOE_FAMILIES.items() if family == model_type)
    with pytest.raises(UnsupportedModelError, match=f"serves model_type '{model_type}', and this config.json "
                                                    "has 'llama'"):
        check_served(pop_class, SimpleNamespace(model_type="llama"))
    check_served(pop_class, SimpleNamespace(model_type=model_type, hidden_act="silu"))  # as exported


@pytest.mark.parametrize("entry, culprit", [
    (None, "no readable 'popcompile' entry"),
    ({"format": 1, "cut": 0}, "popcompile.cut=0"),
    ({"format": 1, "cut": LAYERS + 1}, f"popcompile.cut={LAYERS + 1}"),
    ({"format": 1, "cut": 2, "kv_weights": "other.safetensors"}, "kv_weights='other.safetensors'"),
    ({"format": 2, "cut": 2}, "format 1"),
    ({"format": 1, "cut": 2, "min_prompt_tokens": -1}, "min_prompt_tokens=-1"),
    ({"format": 1, "cut": 2, "min_prompt_tokens": "64"}, "min_prompt_tokens='64'"),
])
def test_the_plugin_refuses_a_config_entry_it_cannot_serve(entry, culprit):
    class HFConfig:
        num_hidden_layers = LAYERS
        popcompile = entry

    with pytest.raises(ModelError, match=culprit.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        PopSettings.of(HFConfig())
    older = PopSettings.of(type("C", (), {"num_hidden_layers": LAYERS,
                                          "popcompile": {"format": 1, "cut": LAYERS}})())
    # a folder from before the field: as it served
    assert older.prunes is False and older.min_prompt_tokens == 0


def test_another_vllm_version_is_refused_by_name():
    extra = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    # the extra installs the one we serve
    assert extra["optional-dependencies"]["vllm"] == [f"vllm=={VLLM_VERSION}"]
    check_vllm_version(VLLM_VERSION)
    with pytest.raises(EnvironmentUnavailable,
                       match=f"vLLM 0.31.1 is installed; .* built for vLLM {VLLM_VERSION}"):
        check_vllm_version("0.31.1")
