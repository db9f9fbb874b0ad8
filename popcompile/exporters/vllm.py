"""The vLLM target's writer: a Hugging Face folder that ``vllm serve DIR`` / ``vllm.LLM(DIR)`` load with POP.

    DIR/
      config.json            the model's, with "architectures": ["Pop<Arch>"] and "popcompile":
                             {cut, kv_weights, min_prompt_tokens}
      model.safetensors      the model's weights, untouched (save_pretrained; sharded with an index if large)
      pop_kv.safetensors     POP+ only: pop_kv.layers.{l}.{k_proj|v_proj}.{weight|bias} for l >= cut
      tokenizer, chat template, generation_config.json

The POP classes live in popcompile.vllm_plugin (the ``vllm.general_plugins`` entry point); this module
needs no vLLM. ``ServingFolder`` is what the export reports (``--json``).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import UnsupportedModelError
from ..frontend.models import LoadedModel
from ..fsutil import atomic_write
from ..kvfit.calibrate import KVFit
from ..vllm_plugin.settings import (
    BASE_TO_POP,
    CONFIG_KEY,
    KV_PREFIX,
    KV_WEIGHTS_FILE,
    POP_ARCHITECTURES,
    VLLM_VERSION,
    PopSettings,
    check_served,
)

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ServingFolder:
    """What ``export --target vllm`` wrote (printed by the CLI): the folder's record, as the engine manifest
    is the ONNX folder's. ``write`` puts it into config.json, where vLLM and the plugin read it."""

    model: str
    architecture: str
    num_layers: int
    cut: int
    kv_weights: str | None
    dtype: str
    min_prompt_tokens: int | None = None  # shorter prompts run the full model (the plugin's runner.py);
    #                                        None until the driver's threshold step sets it
    vllm_version: str = VLLM_VERSION
    target: str = "vllm"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def with_min_prompt_tokens(self, value: int, record: dict | None = None) -> ServingFolder:
        """This record with the threshold ``value`` (``record``, how it was chosen, has no place in
        config.json: the fixed default is the only rule for vLLM folders)."""
        return replace(self, min_prompt_tokens=value)

    def write(self, folder: Path) -> None:
        """config.json names the POP class and holds the plugin's settings (PopSettings)."""
        settings = PopSettings(cut=self.cut, num_layers=self.num_layers, kv_weights=self.kv_weights,
                               min_prompt_tokens=self.min_prompt_tokens)
        path = Path(folder) / "config.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        data["architectures"] = [self.architecture]
        version = importlib.metadata.version("popcompile")
        data[CONFIG_KEY] = {**settings.to_json(), "popcompile_version": version}
        atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
        _readable_as_umask_allows(folder)

    def summary(self, folder: Path) -> str:
        pruned = (f"layers {self.cut}..{self.num_layers - 1} pruned in prefill" if self.cut < self.num_layers
                  else "nothing pruned")
        calibration = "POP+ K/V weights" if self.kv_weights else "the model's own K/V projections (POP)"
        return (f"{folder}: {self.model} as {self.architecture}, {self.num_layers} layers, "
                f"cut {self.cut} ({pruned}), {calibration}, {self.dtype}, "
                f"prompts under {self.min_prompt_tokens} tokens run the full model\n"
                f"serve it with vLLM {self.vllm_version} and popcompile installed: "
                f"`vllm serve {folder}` or vllm.LLM({str(folder)!r})")


def pop_architecture(loaded: LoadedModel) -> str:
    """The POP class serving this model; UnsupportedModelError naming the ones the plugin has, or what the
    plugin would not serve as transformers computes it (settings.check_served: a mixture of experts it does
    not serve, or a config field its vLLM class does not read)."""
    names = list(getattr(loaded.model.config, "architectures", None) or [type(loaded.model).__name__])
    pop = next((BASE_TO_POP[name] for name in names if name in BASE_TO_POP), None)
    check_served(pop, loaded.model.config)
    if pop is not None:
        return pop
    raise UnsupportedModelError(f"{'/'.join(names)} has no POP class for vLLM yet (supported: "
                                f"{', '.join(BASE_TO_POP)}): export it with --target onnx")


def write_folder(tmp: Path, loaded: LoadedModel, cut: int, fit: KVFit | None) -> ServingFolder:
    """The model's weights, tokenizer and configs (and POP+ weights) into ``tmp``; returns the folder's
    record, not yet in config.json (ServingFolder.write, by the driver once the threshold is set)."""
    architecture = pop_architecture(loaded)
    loaded.model.save_pretrained(tmp)
    loaded.tokenizer.save_pretrained(tmp)
    if fit is not None:
        tensors = kv_tensors(fit, dtype=next(loaded.model.parameters()).dtype)
        save_file(tensors, str(tmp / KV_WEIGHTS_FILE), metadata={"format": "pt"})
        _add_to_index(tmp, tensors)
    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    return ServingFolder(model=loaded.source.name, architecture=architecture,
                         num_layers=loaded.model.config.num_hidden_layers, cut=cut,
                         kv_weights=fit and KV_WEIGHTS_FILE, dtype=dtype)


def _readable_as_umask_allows(folder: Path) -> None:
    """save_pretrained leaves model.safetensors 0600 (written through a private temporary file): the server
    that loads the folder may run as another user. Every file gets the mode a plain ``open`` would give."""
    umask = os.umask(0)
    os.umask(umask)
    for item in folder.iterdir():
        if item.is_file():
            item.chmod(0o666 & ~umask)


def kv_tensors(fit: KVFit, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """POP+ weights under the names the plugin loads: pop_kv.layers.{l}.{k_proj|v_proj}.{weight|bias}."""
    tensors = {}
    for layer, parts in fit.weights.items():
        for part, projection in parts.items():
            tensors[f"{KV_PREFIX}layers.{layer}.{part}.weight"] = projection.weight.to(dtype).contiguous()
            if projection.bias is not None:
                tensors[f"{KV_PREFIX}layers.{layer}.{part}.bias"] = projection.bias.to(dtype).contiguous()
    return tensors


def _add_to_index(folder: Path, tensors: dict) -> None:
    """A sharded checkpoint's index lists every file vLLM may load: add the POP+ file to it."""
    index = folder / INDEX
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        data["weight_map"].update({name: KV_WEIGHTS_FILE for name in tensors})
        atomic_write(index, json.dumps(data, indent=2, sort_keys=True) + "\n")


def stock_view(folder: Path, out: Path) -> Path:
    """``out``: the vLLM folder ``folder`` as stock vLLM sees it (the base architecture, no popcompile entry),
    its other files linked, not copied: the unpruned baseline of A/B comparisons (tests, benchmarks)."""
    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    config["architectures"] = [POP_ARCHITECTURES[config["architectures"][0]]]
    del config[CONFIG_KEY]
    out.mkdir(parents=True)
    for item in Path(folder).iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    atomic_write(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
