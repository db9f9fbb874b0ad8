"""Models built without their weights: placeholders read from the safetensors checkpoint when needed.

    placeholders(folder, config, dtype) -> (model, LazyWeights) | None
        every parameter a zero-strided tensor over one element (shape, dtype and device real, 4 bytes of
        storage); LazyWeights maps each placeholder (its storage's data_ptr) to its checkpoint key
    LazyWeights.read(p)        one weight's values, in the model's dtype (the ONNX writer: one at a time)
    LazyWeights.part(p, index) a placeholder of p[index] (the ONNX writer's slice of a weight), read as such
    LazyWeights.streamed(m)    while open, each module that owns placeholders holds its real weights during
                               its own forward only: a forward of the whole model holds one layer's weights
                               at a time (the ridge K/V fit of a model whose float32 weights do not fit)
    LazyWeights.materialise(m) every placeholder replaced by its values, for good (a fit that trains)

Invariant: ``key`` answers for live placeholders only. ``streamed`` puts the placeholders back after each
forward (they stay alive, their data_ptrs stay theirs); ``materialise`` forgets the keys of those it
replaces, so a tensor later allocated at a freed placeholder's address is never read from the checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from .layout import check_layout

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class LazyWeights:
    """Where each placeholder parameter of a model built without its weights lives in its safetensors
    checkpoint (module docstring). ``read`` gives the real values in the model's dtype, cast from the
    checkpoint's as from_pretrained casts."""

    files: dict[str, str]  # checkpoint key -> its safetensors file
    keys: dict[int, str]  # a live placeholder's storage (data_ptr) -> its checkpoint key
    dtype: torch.dtype

    #: a part placeholder's storage (data_ptr) -> its whole's checkpoint key and the part's index (``part``)
    parts: dict[int, tuple[str, tuple]] = field(default_factory=dict)

    def key(self, tensor: torch.Tensor) -> str | None:
        """The checkpoint key of a placeholder, its whole's for a part (None: ``tensor`` is a real tensor)."""
        ptr = tensor.untyped_storage().data_ptr()
        return self.keys[ptr] if ptr in self.keys else self.parts[ptr][0] if ptr in self.parts else None

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """The values of placeholder ``tensor`` (``tensor`` itself if it is real)."""
        key = self.key(tensor)
        if key is None:
            return tensor
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as checkpoint:
            values = checkpoint.get_tensor(key).to(self.dtype)
        index = self.parts.get(tensor.untyped_storage().data_ptr(), (key, None))[1]
        return values if index is None else values[index].contiguous()

    def part(self, tensor: torch.Tensor, index: tuple) -> torch.Tensor:
        """``tensor[index]``; for a placeholder, a placeholder of that shape of its own, read as those
        elements of the whole (a fused projection's K/V rows: exporters/onnx.fold_weight_slices). A
        placeholder's view would not do: its storage is the whole's, so ``read`` would give the whole."""
        key = self.key(tensor)
        if key is None:
            return tensor[index]
        if tensor.untyped_storage().data_ptr() in self.parts:
            raise ValueError("a part of a part placeholder is not supported")
        shape = torch.empty(tensor.shape, device="meta")[index].shape
        made = torch.zeros((), dtype=tensor.dtype).expand(shape)
        self.parts[made.untyped_storage().data_ptr()] = (key, index)
        return made

    def placeholder_bytes(self, model: torch.nn.Module) -> int:
        """What ``model``'s placeholders hold once real (each shared parameter once)."""
        return sum(p.numel() * p.element_size() for p in model.parameters() if self.key(p) is not None)

    @contextlib.contextmanager
    def streamed(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """``model`` runnable while open: each module owning placeholders reads them before its forward
        and drops them after (hooks); peak memory is the largest module's weights plus the activations.
        Every forward reads again: for a fit's few large batches, not for training."""
        handles = []
        for module in model.modules():
            names = [n for n, p in module._parameters.items() if p is not None and self.key(p) is not None]
            if names:
                handles.append(module.register_forward_pre_hook(self._reader(names)))
                handles.append(module.register_forward_hook(self._dropper(names)))
        try:
            yield model
        finally:
            for handle in handles:
                handle.remove()
            for module in model.modules():  # a forward that raised leaves its module's weights read
                if "_lazy_held" in module.__dict__:
                    module._parameters.update(module.__dict__.pop("_lazy_held"))

    def _reader(self, names: list[str]):
        def read(module: torch.nn.Module, args) -> None:
            module._lazy_held = {n: module._parameters[n] for n in names}  # the placeholders, kept alive
            for n, placeholder in module._lazy_held.items():
                module._parameters[n] = torch.nn.Parameter(self.read(placeholder), requires_grad=False)
        return read

    @staticmethod
    def _dropper(names: list[str]):
        def drop(module: torch.nn.Module, args, output) -> None:
            module._parameters.update(module.__dict__.pop("_lazy_held"))
        return drop

    def materialise(self, model: torch.nn.Module) -> None:
        """Every placeholder of ``model`` replaced by its values (a shared one once), its key forgotten."""
        made: dict[int, torch.nn.Parameter] = {}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None or self.key(param) is None:  # keys are forgotten at the end: a shared
                    continue                                    # placeholder is found again, made once
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(self.read(param), requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
        self.keys.clear()
        self.parts.clear()


def placeholders(folder: Path, config: PretrainedConfig, dtype: torch.dtype
                 ) -> tuple[PreTrainedModel, LazyWeights] | None:
    """The model of ``folder`` (``config``, read already) built with placeholder parameters, or None where
    that is not plainly possible: weights not all in safetensors, a parameter whose name is not a checkpoint
    key (a tied head excepted). A damaged checkpoint raises what safetensors or json raise."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig

    from .arch import attention_implementation

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = {key: str(folder / name) for key, name in json.loads(index.read_text())["weight_map"].items()}
    elif (folder / "model.safetensors").is_file():
        with safe_open(folder / "model.safetensors", framework="pt") as checkpoint:
            files = dict.fromkeys(checkpoint.keys(), str(folder / "model.safetensors"))
    else:
        return None
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers (RoPE) real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=attention_implementation(config))
    model.tie_weights()
    names: dict[int, list[str]] = {}  # a tied parameter has several names; the checkpoint holds one
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    keys, made = {}, {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            key = next((n for n in names[id(param)] if n in files), None)
            if key is None:
                return None
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(torch.zeros((), dtype=dtype).expand(param.shape),
                                                     requires_grad=False)
                keys[made[id(param)].untyped_storage().data_ptr()] = key
            module._parameters[name] = made[id(param)]
    shapes = {keys[p.untyped_storage().data_ptr()]: tuple(p.shape) for p in made.values()}
    _check_lazy_layout(folder, model, files, shapes)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model, LazyWeights(files, keys, dtype)


def _check_lazy_layout(folder: Path, model: PreTrainedModel, files: dict[str, str],
                       shapes: dict[str, tuple[int, ...]]) -> None:
    """layout.check_layout for a model every parameter of which found its key: checkpoint tensors no
    parameter reads (buffers and the family's ignored keys aside), and shapes (``shapes``: key -> the
    model's) other than the checkpoint's, read from the safetensors headers."""
    from safetensors import safe_open

    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    buffers = {name for name, _ in model.named_buffers()}
    unexpected = [k for k in files if k not in shapes and k not in buffers
                  and not any(p.search(k) for p in ignored)]
    mismatched = []
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as checkpoint:
            for key in checkpoint.keys():
                if key in shapes and tuple(checkpoint.get_slice(key).get_shape()) != shapes[key]:
                    mismatched.append(key)
    check_layout(folder, model.config.model_type, unexpected=unexpected, mismatched=mismatched)
