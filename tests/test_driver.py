"""The compile driver (driver.py) and its config (config.py): one request object, one function, named
steps."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
from tiny import tiny_model
from tiny_engine import has_tensorrt_gpu, tiny_hf_folder, tiny_tokenizer

import popcompile
from popcompile.cli import main
from popcompile.config import DistillConfig, KVCalibration, KVFitConfig, PopConfig, WeightQuantization
from popcompile.driver import StepRecord, compile, rss_bytes, steps
from popcompile.engine.manifest import EngineManifest
from popcompile.engine.tensorrt import TensorRTUnavailable
from popcompile.errors import ConfigError
from popcompile.exporters.targets import TARGETS, OnnxTarget, TensorRTTarget, target_for
from popcompile.exporters.tensorrt import TrtBuildConfig
from popcompile.frontend.models import LoadedModel, ModelSource, load_model
from popcompile.kvfit.calibrate import ridge_fit, save_fit

LAYERS = 6


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return tiny_hf_folder(tmp_path_factory.mktemp("tiny-hf"), layers=LAYERS, max_position_embeddings=256)


@pytest.fixture(scope="module")
def fit_file(tmp_path_factory) -> Path:
    """A POP+ fit of the tiny llama for cut 4."""
    path = tmp_path_factory.mktemp("fit") / "kv.safetensors"
    model = tiny_model("llama", layers=LAYERS, max_position_embeddings=256)
    with torch.no_grad():
        save_fit(ridge_fit(model, [torch.randint(0, 97, (2, 16))], 4), path)
    return path


@pytest.mark.parametrize("field, value, flag", [
    ("cut", 0, "--cut 0 (cut=0)"), ("cut", True, "--cut True"), ("prune_ratio", 1.0, "--prune-ratio 1.0"),
    ("prune_ratio", float("nan"), "--prune-ratio nan"), ("boundary", "inside", "--boundary 'inside'"),
    ("dtype", "int8", "--dtype 'int8'"), ("max_seq", 4, "--max-seq 4"),
    ("min_prompt_tokens", -1, "--min-prompt-tokens -1"),
    ("min_prompt_tokens", "often", "--min-prompt-tokens 'often'"), ("kv_calibration", 3, "kv_calibration=3"),
])
def test_config_names_the_bad_field_as_flag_and_keyword(field, value, flag):
    with pytest.raises(ConfigError, match=flag.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        PopConfig(**{field: value})


def test_config_is_frozen_and_normalises_kv_calibration(fit_file):
    config = PopConfig(kv_calibration=str(fit_file))
    assert (config.kv_calibration == KVCalibration("file", fit_file)
            and str(config.kv_calibration) == str(fit_file))
    assert (PopConfig().kv_calibration.mode == "auto"
            and PopConfig(kv_calibration=None).kv_calibration.mode == "none")
    assert PopConfig(kv_calibration=True).kv_calibration.mode == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cut = 3
    with pytest.raises(ConfigError, match="either cut or prune_ratio"):
        PopConfig(cut=3, prune_ratio=0.5)
    with pytest.raises(ConfigError, match="nope.safetensors does not exist"):
        PopConfig(kv_calibration="nope.safetensors")


def test_distill_is_a_kv_calibration_mode_and_a_misspelling_names_the_modes():
    assert (KVCalibration.of("distill") == KVCalibration("distill")
            == PopConfig(kv_calibration="distill").kv_calibration)
    assert (KVCalibration("distill").fits_now and KVCalibration("auto").fits_now
            and not KVCalibration("none").fits_now)
    for bad in ("distil", "Distill"):
        with pytest.raises(ConfigError) as err:
            PopConfig(kv_calibration=bad)
        assert "\n" not in str(err.value) and f"{bad} does not exist" in str(err.value)
        assert "auto, none, ridge, distill, or a file" in str(err.value)
    with pytest.raises(ConfigError, match="'distil' is not one of none, auto, ridge, distill, file"):
        KVCalibration("distil")


def test_export_auto_distils_a_text_model_in_a_step_of_its_own(tiny_folder, tmp_path):
    """kv_calibration auto (the default) on a text model: the ridge fit and its distillation
    (distill.ridge_then_distill) on the built-in prompts (the tiny tokenizer reads them as unknown words: the
    windows exist, the quality does not matter here)."""
    config = PopConfig(cut=2, max_seq=64, min_prompt_tokens=0)
    seen: list[str] = []
    manifest = compile(str(tiny_folder), config, out=tmp_path / "engine", progress=seen.append)
    assert seen == steps(config) and seen[:4] == ["load", "calibrate", "distill", "capture"]
    recorded = EngineManifest.read(tmp_path / "engine").extra["kv_calibration"]
    assert recorded == manifest.extra["kv_calibration"]
    assert recorded["method"] == "distill" and recorded["cut"] == 2 and recorded["num_layers"] == LAYERS
    assert recorded["tokens"] == 64 * 512  # the distillation windows: 64 prompts of 512 tokens
    assert "distill" not in steps(PopConfig(kv_calibration="ridge"))
    assert steps(PopConfig(cut=2, kv_calibration="distill", max_seq=64, min_prompt_tokens=0)) == seen


def test_compile_takes_the_fits_own_config(tiny_folder, tmp_path):
    """PopConfig(kv_fit=...) reaches the fit: a short distillation (4 windows of 64 tokens, 3 steps) instead
    of the default's 64 x 512 tokens and 900 steps."""
    short = KVFitConfig(seq_len=64, distill=DistillConfig(steps=3, windows=4, eval_every=1))
    config = PopConfig(cut=2, max_seq=64, min_prompt_tokens=0, kv_fit=short)
    manifest = compile(str(tiny_folder), config, out=tmp_path / "engine")
    recorded = manifest.extra["kv_calibration"]
    assert recorded["method"] == "distill" and recorded["tokens"] == 4 * 64, recorded
    with pytest.raises(ConfigError, match="kv_fit=.* is not a KVFitConfig"):
        PopConfig(kv_fit={"steps": 3})


@pytest.mark.parametrize("layers, config, cut", [
    (30, PopConfig(), 20), (6, PopConfig(), 4), (6, PopConfig(cut=6), 6), (6, PopConfig(prune_ratio=0.5), 3),
])
def test_config_resolves_the_cut_for_a_depth(layers, config, cut):
    assert config.resolve_cut(layers) == cut


def test_config_cut_beyond_the_model_is_named():
    with pytest.raises(ConfigError, match="cut=9 is out of range for a model with 6 layers"):
        PopConfig(cut=9).resolve_cut(6)


def test_targets_registry():
    assert set(TARGETS) == {"onnx", "tensorrt", "vllm"}
    assert target_for("onnx") == OnnxTarget() and target_for("tensorrt") == TensorRTTarget()
    custom = TensorRTTarget(TrtBuildConfig(precision="fp16"))
    assert target_for(custom) is custom
    with pytest.raises(ConfigError,
                       match="'tflite' is not an export target: choose one of onnx, tensorrt, vllm"):
        target_for("tflite")


def test_unknown_target_fails_before_anything(tiny_folder, tmp_path):
    with pytest.raises(ConfigError, match="not an export target"):
        compile(str(tiny_folder), out=tmp_path / "engine", target="tflite")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(has_tensorrt_gpu(),
                    reason="checks the no-GPU path: this machine has an NVIDIA GPU and tensorrt")
def test_tensorrt_target_without_gpu_fails_before_the_model_loads(tmp_path):
    started = time.monotonic()
    with pytest.raises(TensorRTUnavailable, match="NVIDIA GPU"):
        compile("no-such-model", PopConfig(kv_calibration="none"), out=tmp_path / "engine", target="tensorrt")
    assert time.monotonic() - started < 5.0 and list(tmp_path.iterdir()) == []


def test_compile_reports_its_named_steps_and_writes_the_config(tiny_folder, tmp_path, fit_file):
    config = PopConfig(cut=4, kv_calibration=fit_file, max_seq=64, min_prompt_tokens=0,
                       cut_choice={"method": "test"})
    seen: list[str] = []
    records: list[StepRecord] = []
    manifest = compile(str(tiny_folder), config, out=tmp_path / "engine", progress=seen.append,
                       measured=records.append)
    assert seen == steps(config) == ["load", "calibrate", "capture", "POP pass", "export decode graph",
                                     "export prefill graph", "fuse attention for onnxruntime",
                                     "write engine folder", "write manifest"]
    # every step measured, the silent ones (cast, threshold) under their own names, in order
    assert [r.name for r in records] == [*seen[:2], "cast", *seen[2:-1], "threshold", seen[-1]]
    assert all(r.seconds >= 0 and r.peak_rss >= r.end_rss > 0 for r in records)
    assert 2**24 < max(r.peak_rss for r in records) <= 4 * rss_bytes()  # bytes (not KiB or pages)
    on_disk = EngineManifest.read(tmp_path / "engine")
    assert on_disk == manifest and manifest.cut == 4 and manifest.kv_layout.max_seq == 64
    assert manifest.min_prompt_tokens == 0 and manifest.extra["cut_choice"] == {"method": "test"}
    assert manifest.extra["kv_calibration"]["cut"] == 4
    assert steps(PopConfig(), "tensorrt")[-2:] == ["measure min_prompt_tokens", "write manifest"]


def test_the_vllm_target_writes_no_graphs_and_measures_nothing(tiny_folder, tmp_path, fit_file):
    """No capture, no POP pass, no threshold: vLLM runs the model; the caller's float32 model is kept."""
    model = tiny_model("llama", layers=LAYERS, max_position_embeddings=256)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loaded = LoadedModel(model, tiny_tokenizer(97), ModelSource("tiny", "folder", "tiny", None))
    seen: list[str] = []
    config = PopConfig(cut=4, kv_calibration=fit_file, dtype="float16")
    folder = compile(loaded, config, out=tmp_path / "served", target="vllm", progress=seen.append)
    assert seen == steps(config, "vllm") == ["load", "calibrate", "write vLLM folder", "write manifest"]
    assert (folder.cut, folder.dtype, folder.kv_weights) == (4, "float16", "pop_kv.safetensors")
    assert sorted(p.name for p in (tmp_path / "served").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "pop_kv.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_compile_keeps_the_callers_model(tiny_folder, tmp_path):
    """A LoadedModel passed in is not cast or changed: float16 compiles a copy."""
    model = tiny_model("llama", layers=LAYERS, max_position_embeddings=256)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loaded = LoadedModel(model, tiny_tokenizer(97), ModelSource("tiny", "folder", "tiny", None))
    manifest = popcompile.compile(loaded, PopConfig(kv_calibration="none", dtype="float16", max_seq=32,
                                                    min_prompt_tokens=0), out=tmp_path / "engine")
    assert manifest.dtype == "float16" and manifest.cut == 4
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_cli_cut_auto_with_a_calibration_file_is_refused_before_work(tiny_folder, tmp_path, fit_file, capsys):
    """The file was fitted for one cut; --cut auto would choose (minutes), then fail unless they happened
    to agree."""
    started = time.monotonic()
    assert main(["export", str(tiny_folder), "--out", str(tmp_path / "engine"), "--cut", "auto",
                 "--kv-calibration", str(fit_file)]) == 2
    err = capsys.readouterr().err
    assert ("fitted for cut 4: give --cut 4, or --kv-calibration auto" in err
            and len(err.strip().splitlines()) == 1)
    assert time.monotonic() - started < 10.0 and not (tmp_path / "engine").exists()


def test_public_api_names_resolve():
    for name in popcompile.__all__:
        assert getattr(popcompile, name) is not None, name
    assert popcompile.compile is compile and popcompile.PopConfig is PopConfig


def test_a_model_built_without_its_weights_writes_the_same_engine(tiny_folder, tmp_path):
    """--kv-calibration none from a folder: the model is built with placeholders (LazyWeights) and the writer
    reads each weight from the checkpoint as it saves it; the engine is byte for byte the loaded model's, and
    no scratch file is left in it."""
    assert load_model(str(tiny_folder), lazy=True).lazy is not None
    config = PopConfig(cut=4, kv_calibration="none", max_seq=64, min_prompt_tokens=0)
    target = OnnxTarget(WeightQuantization("int4"))
    compile(str(tiny_folder), config, out=tmp_path / "lazy", target=target)
    compile(load_model(str(tiny_folder)), config, out=tmp_path / "loaded", target=target)
    lazy, loaded = ((tmp_path / name / "weights.bin").read_bytes() for name in ("lazy", "loaded"))
    assert lazy == loaded
    assert not [p.name for p in (tmp_path / "lazy").iterdir() if p.name.startswith(".")]
