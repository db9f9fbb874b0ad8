"""POP in plain eager PyTorch: the executable specification every graph and engine is tested against.

It runs the Hugging Face model itself; pruning is a forward hook that makes a deep layer return its
input. Because every deep layer then receives ``h_cut``, its own attention module writes exactly
POP's independent KV projection ``RoPE_l(k_norm_l(W_K^l input_norm_l(h_cut)))`` into the cache, so
the reference shares no code with the graph pass.

    prefill  x_1..x_{N-1}   layers 0..cut-1 full, deep layers: KV projection of h_cut only
    boundary x_N            full model -> first generated token
    decode   x_{N+1}...     full model

A vision-language model (frontend/vision.py) runs the same stages over its text decoder: the prompt's
embeddings, M-RoPE positions and deepstack features are computed once by the model's own modules
(``VisionFeed``), image tokens are pruned like any other prompt token, and decode tokens sit at
``cache row + rope_delta``. Its cut must keep the deepstack layers (vision.check_cut).

Ablations (``Variant``): ``boundary=False`` prunes x_N too; ``kv_projection=False`` hides the
pruned positions from the deep layers' attention (they leave no cache); ``shortgpt=True`` removes
the deep layers in every stage. ``weights`` (``"module path.param" -> tensor``) replaces parameters in
every stage (the Wanda and SliceGPT baselines of measure/eval/baselines.py).
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from transformers.cache_utils import DynamicCache

from .frontend.arch import arch_spec, finish_logits, kv_projections
from .frontend.capture import cache_keyword, use_attention
from .frontend.vision import ImageInputs, VisionPrompt, check_cut, encode_prompt, vision_spec


@dataclass(frozen=True)
class Variant:
    cut: int
    boundary: bool = True
    kv_projection: bool = True
    shortgpt: bool = False
    # POP+: layer -> {"k_proj"|"v_proj": Projection} used by the pruned prefill (kvfit/calibrate.py)
    kv_weights: Mapping[int, Mapping[str, Any]] | None = field(default=None, compare=False, repr=False)
    # "module path.param" -> replacement tensor (any shape), swapped in for every stage (swapped_parameters)
    weights: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.cut, bool) or not isinstance(self.cut, int) or self.cut < 1:
            raise ValueError(f"Variant.cut must be a layer index >= 1, got {self.cut!r}")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.get_decoder().layers


@contextlib.contextmanager
def bypass_layers(model: torch.nn.Module, start: int) -> Iterator[None]:
    """Layers ``start..L-1`` return their input hidden state unchanged (their attention still runs
    and writes K/V of that input into the cache)."""
    def passthrough(module, args, kwargs, output):
        return args[0] if args else kwargs["hidden_states"]

    with _removed_after([layer.register_forward_hook(passthrough, with_kwargs=True)
                         for layer in decoder_layers(model)[start:]]):
        yield


@contextlib.contextmanager
def hide_positions(model: torch.nn.Module, start: int, hidden: int) -> Iterator[None]:
    """Layers ``start..L-1`` cannot attend to cache rows ``0..hidden-1`` (they have no KV there).

    Needs a materialised mask: the caller runs the model with eager attention.
    """
    def mask_rows(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        assert mask is not None and mask.dim() == 4, "hide_positions needs eager attention's 4D mask"
        mask = mask.clone()
        mask[..., :hidden] = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        return args, {**kwargs, "attention_mask": mask}

    with _removed_after([layer.self_attn.register_forward_pre_hook(mask_rows, with_kwargs=True)
                         for layer in decoder_layers(model)[start:]]):
        yield


@contextlib.contextmanager
def replaced_projections(model: torch.nn.Module, weights: Mapping[int, Mapping[str, Any]]) -> Iterator[None]:
    """The named k/v projections of the given layers compute with replacement weights (POP+); a fused qkv_proj
    (Phi-3) keeps its Q rows and computes its K/V rows with them."""
    def hook_for(rows, projection):
        def hook(module, args, output):
            new = torch.nn.functional.linear(args[0], projection.weight, projection.bias)
            if rows is None:
                return new
            output = output.clone()
            output[..., rows] = new.to(output.dtype)
            return output
        return hook

    spec, layers = arch_spec(model.config), decoder_layers(model)
    handles = []
    for i, parts in weights.items():
        own = kv_projections(spec, layers[i])
        handles += [own[part].module.register_forward_hook(hook_for(own[part].rows, p))
                    for part, p in parts.items()]
    with _removed_after(handles):
        yield


@contextlib.contextmanager
def swapped_parameters(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Each ``"module path.param"`` of ``model`` is the given tensor (any shape) inside the block, then the
    original Parameter object again. Only the named module's attribute changes: replacing a tied
    ``lm_head.weight`` leaves the embedding as it was, and the restore re-ties them."""
    swapped = []
    try:
        for key, tensor in weights.items():
            path, _, name = key.rpartition(".")
            module = model.get_submodule(path)
            swapped.append((module, name, module._parameters[name]))
            module._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)
        yield
    finally:
        for module, name, original in reversed(swapped):
            module._parameters[name] = original


@contextlib.contextmanager
def _removed_after(handles: list) -> Iterator[None]:
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _forward(model, ids: torch.Tensor, cache: DynamicCache, start: int) -> torch.Tensor:
    """One forward of ``ids`` [B, T] after ``cache``; returns logits [B, T, V]."""
    positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
    return model(input_ids=ids, position_ids=positions, use_cache=True,
                 **{cache_keyword(model): cache}).logits


class TextFeed:
    """A text decoder's forwards: ids [B, T] at positions ``start..start+T-1``; logits [B, T, V]."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def prompt(self, prompt: torch.Tensor, lo: int, hi: int, cache: DynamicCache) -> torch.Tensor:
        """Prompt rows ``lo..hi-1`` after ``lo`` cached rows."""
        return _forward(self.model, prompt[:, lo:hi], cache, lo)

    def tokens(self, ids: torch.Tensor, cache: DynamicCache, start: int) -> torch.Tensor:
        return _forward(self.model, ids, cache, start)


class VisionFeed:
    """A vision-language model's forwards over one encoded prompt (frontend/vision.VisionPrompt): prompt rows
    take its embeddings, M-RoPE positions and deepstack features; later tokens are text at
    ``row + rope_delta`` on all three M-RoPE rows. The text decoder runs with explicit positions
    [4, B, T] (row 0: the cache rows, which the causal mask reads; rows 1-3: M-RoPE), the model's
    ``lm_head`` after it."""

    def __init__(self, model: torch.nn.Module, encoded: VisionPrompt):
        spec = vision_spec(model.config)
        self.model, self.encoded = model, encoded
        self.text = model.get_submodule(spec.text)

    def prompt(self, prompt: torch.Tensor, lo: int, hi: int, cache: DynamicCache) -> torch.Tensor:
        e = self.encoded
        visual = e.visual_mask[:, lo:hi]
        deepstack = [_at_positions(f, e.visual_mask)[:, lo:hi][visual] for f in e.deepstack] \
            if visual.any() else None
        return self._run(e.embeds[:, lo:hi], e.positions[:, :, lo:hi], cache, lo, visual, deepstack)

    def tokens(self, ids: torch.Tensor, cache: DynamicCache, start: int) -> torch.Tensor:
        rows = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
        positions = (rows + self.encoded.rope_delta).expand(3, -1, -1)  # [3, B, T]
        return self._run(self.text.get_input_embeddings()(ids), positions, cache, start)

    def _run(self, embeds, positions, cache, start, visual=None, deepstack=None) -> torch.Tensor:
        rows = torch.arange(start, start + embeds.shape[1]).expand(1, embeds.shape[0], -1)
        hidden = self.text(inputs_embeds=embeds, position_ids=torch.cat([rows, positions]), use_cache=True,
                           visual_pos_masks=visual, deepstack_visual_embeds=deepstack,
                           **{cache_keyword(self.text): cache}).last_hidden_state
        return finish_logits(self.model.config, self.model.get_output_embeddings()(hidden))


def _at_positions(features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Features [V, d] of the mask's True positions (row-major, as boolean indexing reads them) placed at
    those positions of a [B, N, d] tensor (zeros elsewhere)."""
    placed = features.new_zeros(*mask.shape, features.shape[-1])
    placed[mask] = features
    return placed


def feed_for(model: torch.nn.Module, prompt: torch.Tensor, images: ImageInputs | None = None):
    """The forwards one prompt runs with: TextFeed for a text decoder, VisionFeed (the prompt encoded with
    its images, or none) for a vision-language model. ValueError for images given to a text model."""
    if vision_spec(model.config) is None:
        if images is not None:
            raise ValueError(f"{model.config.model_type} is a text model: it takes no images")
        return TextFeed(model)
    return VisionFeed(model, encode_prompt(model, prompt, images))


@torch.no_grad()
def prefill_cache(model: torch.nn.Module, ids: torch.Tensor, cut: int, kv_weights=None) -> DynamicCache:
    """The cache POP's prefill graph fills for ``ids`` [B, T] (every row pruned, no boundary step)."""
    cache = DynamicCache()
    with bypass_layers(model, cut), replaced_projections(model, kv_weights or {}):
        _forward(model, ids, cache, 0)
    return cache


class PopRun:
    """The stages of one POP variant over one prompt, as context managers and forwards."""

    def __init__(self, model: torch.nn.Module, variant: Variant, prompt_len: int, feed=None):
        check_cut(model.config, variant.cut)
        self.model, self.variant = model, variant
        self.feed = feed or TextFeed(model)
        self.pruned_rows = prompt_len if not variant.boundary else prompt_len - 1
        self.cache = DynamicCache()

    def stage(self, pruned: bool) -> contextlib.AbstractContextManager:
        v, stack = self.variant, contextlib.ExitStack()
        if v.weights:
            stack.enter_context(swapped_parameters(self.model, v.weights))
        if pruned or v.shortgpt:
            stack.enter_context(bypass_layers(self.model, v.cut))
        if pruned and v.kv_weights:
            stack.enter_context(replaced_projections(self.model, v.kv_weights))
        elif not v.kv_projection and self.pruned_rows > 0:
            stack.enter_context(hide_positions(self.model, v.cut, self.pruned_rows))
        return stack

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Prompt [B, N] -> logits [B, V] predicting the first new token."""
        rows, length = self.pruned_rows, prompt.shape[1]
        with self.stage(pruned=True):
            logits = self.feed.prompt(prompt, 0, rows, self.cache) if rows else None
        if rows == length:
            return logits[:, -1]
        with self.stage(pruned=False):
            return self.feed.prompt(prompt, rows, length, self.cache)[:, -1]

    def step(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        with self.stage(pruned=False):
            return self.feed.tokens(ids, self.cache, start)

    def extend(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """A chat's next turn: the cache cut back to its first ``start`` rows, then ``ids`` [B, M] prefilled
        after them on the prefill's schedule (all pruned but the last, with a boundary); logits [B, V]."""
        surplus = self.cache.get_seq_length() - start
        # a negative count removes rows in every transformers 5.x (a positive one changed meaning)
        if surplus:
            self.cache.crop(-surplus)
        rows = ids.shape[1] - 1 if self.variant.boundary else ids.shape[1]
        logits = None
        if rows:
            with self.stage(pruned=True):
                logits = self.feed.tokens(ids[:, :rows], self.cache, start)
        if rows == ids.shape[1]:
            return logits[:, -1]
        with self.stage(pruned=False):
            return self.feed.tokens(ids[:, rows:], self.cache, start + rows)[:, -1]


def attention_for(model, variant: Variant) -> contextlib.AbstractContextManager:
    """Eager attention where the variant needs a materialised mask (kv_projection=False), else as is."""
    return use_attention(model, "eager") if not variant.kv_projection else contextlib.nullcontext()


@torch.no_grad()
def generate(
    model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int, variant: Variant,
    eos_token_id: int | None = None, images: ImageInputs | None = None,
) -> list[int]:
    """Greedy generation of one prompt [1, N] under a POP variant; returns the new token ids. ``images``: a
    vision-language model's preprocessed images (their placeholders expanded in ``prompt``)."""
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] < 2:
        raise ValueError(f"prompt must have shape [1, N] with N >= 2, got {tuple(prompt.shape)}")
    with attention_for(model, variant):
        run = PopRun(model, variant, prompt.shape[1], feed_for(model, prompt, images))
        return greedy(run, run.prefill(prompt), prompt.shape[1], max_new_tokens, eos_token_id)


@torch.no_grad()
def greedy(run: PopRun, logits: torch.Tensor, position: int, max_new_tokens: int,
           eos_token_id: int | None = None) -> list[int]:
    """Greedy decode steps from ``logits`` [1, V] (predicting the token at ``position``); the new ids, up to
    and including an eos. The last token is never run (nothing comes after it)."""
    tokens = []
    for _ in range(max_new_tokens):
        tokens.append(int(logits[0].argmax()))
        if tokens[-1] == eos_token_id or len(tokens) == max_new_tokens:
            break
        logits = run.step(torch.tensor([tokens[-1:]]), position + len(tokens) - 1)[:, -1]
    return tokens


@torch.no_grad()
def continuation_logits(
    model: torch.nn.Module, prefix: torch.Tensor, continuation: torch.Tensor, variant: Variant,
    images: ImageInputs | None = None,
) -> torch.Tensor:
    """Teacher-forced: logits [B, C, V] predicting each token of ``continuation`` [B, C] after
    ``prefix`` [B, N] (with ``images``, for a vision-language model) was prefilled under ``variant`` (the
    continuation runs as decode steps)."""
    with attention_for(model, variant):
        run = PopRun(model, variant, prefix.shape[1], feed_for(model, prefix, images))
        first = run.prefill(prefix)[:, None]
        if continuation.shape[1] == 1:
            return first
        rest = run.step(continuation[:, :-1], prefix.shape[1])
    return torch.cat([first, rest], dim=1)
