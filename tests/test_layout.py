"""A checkpoint that is not its family's layout (frontend/layout.py) is refused by both loaders, with one
line naming what differs, and never compiled with random or dropped weights."""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from cli_lines import error_lines
from tiny_engine import tiny_hf_folder

from popcompile.errors import UnsupportedModelError
from popcompile.frontend.models import load_model

Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def folder(tmp_path):
    return tiny_hf_folder(tmp_path / "model", layers=2, tie_word_embeddings=False)


def rewrite(folder, change) -> None:
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    change(weights)
    safetensors.torch.save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def fuse_qkv(weights) -> None:  # a fused projection the family's code does not read; q/k/v then missing
    names = [Q.replace("q_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
    weights[Q.replace("q_proj", "qkv_proj")] = torch.cat([weights.pop(n) for n in names])


def add_sinks(weights) -> None:  # attention sinks the family's code would never add to its softmax
    weights["model.layers.1.self_attn.sinks"] = torch.zeros(4)


def widen_q(weights) -> None:
    weights[Q] = torch.zeros(weights[Q].shape[0] + 16, weights[Q].shape[1])


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize(("change", "said"), [
    (fuse_qkv, r"lacks model\.layers\.0\.self_attn\.k_proj\.weight, .*q_proj.weight \(\+1 more\); "
               r"has weights the code does not read: model\.layers\.0\.self_attn\.qkv_proj\.weight"),
    (add_sinks, r"has weights the code does not read: model\.layers\.1\.self_attn\.sinks\)"),
    (widen_q, r"has weights of another shape: model\.layers\.0\.self_attn\.q_proj\.weight\)"),
])
def test_a_checkpoint_in_another_layout_is_refused(folder, change, said, lazy):
    rewrite(folder, change)
    with pytest.raises(UnsupportedModelError, match=rf"not transformers' 'llama' layout \(it {said}"):
        load_model(str(folder), lazy=lazy)


def test_the_family_layout_loads_both_ways(folder):
    whole, lazy = load_model(str(folder)), load_model(str(folder), lazy=True)
    assert lazy.lazy is not None and whole.lazy is None
    assert lazy.lazy.read(lazy.model.get_parameter(Q)).equal(whole.model.get_parameter(Q))


def test_export_refuses_it_in_one_line_and_writes_nothing(folder, tmp_path, cli):
    rewrite(folder, add_sinks)
    done = cli("export", folder, "--out", tmp_path / "engine", "--kv-calibration", "none", check=False)
    assert done.returncode == 2
    assert len(error_lines(done.stderr)) == 1
    assert "self_attn.sinks" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize(("setting", "value", "what"), [
    ("attention_chunk_size", 8192, "a chunked attention mask"), ("logits_scaling", 8.0, "scaled logits")])
def test_a_setting_the_family_code_ignores_is_refused_before_the_weights(folder, setting, value, what):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, setting: value}))
    (folder / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(UnsupportedModelError, match=rf"sets {setting}={value!r} \({what}\), which "
                                                    r"transformers' 'llama' code does not read"):
        load_model(str(folder))


def test_neutral_values_of_such_settings_load(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "logits_scaling": 1.0, "clip_qkv": None}))
    assert load_model(str(folder)).model.config.logits_scaling == 1.0
