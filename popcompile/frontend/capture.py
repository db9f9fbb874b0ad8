"""Capture: a Hugging Face decoder as a torch.export graph with an explicit, functional KV interface.

The captured graph (it is the decode graph, and the input of the POP pass)::

    input_ids       [B, T]      int64
    position_ids    [B, T]      int64   RoPE positions (left padding: real tokens start at 0)
    attention_mask  [B, P+T]    int64   1 = real token, 0 = padding; covers the cached rows then the new ones
    past_key_values.{i}.key     [B, H_kv, P, D]    rows 0..P-1 of the KV buffer (see engine/kv.py)
    past_key_values.{i}.value   [B, H_kv, P, D]
      -> logits                 [B, V]             last position only (what generation needs)
      -> present.{i}.key        [B, H_kv, T, D]    K after k_norm and RoPE, new rows only
      -> present.{i}.value      [B, H_kv, T, D]

B, T and P are dynamic (B >= 1, T >= 1, P >= 0). The masks are built here from ``attention_mask`` with
plain tensor ops (no data-dependent branch), and attention runs through a registered transformers
attention function, so the graph has no guard on T == 1 or P == 0 and no `If` node.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.fx.experimental._config as fx_config
from torch.export import Dim, ExportedProgram
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer

from ..engine.kv import KVLayout
from .arch import ArchSpec, arch_spec, attention_windows

ATTN_IMPLEMENTATION = "popcompile"


def pop_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention with an explicit boolean mask; GQA by repeating K/V heads.

    query: [B, H, T, D]; key, value: [B, H_kv, P+T, D]; attention_mask: [B, 1, T, P+T] bool.
    Returns ([B, T, H, D], None) as transformers' attention functions do.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit softcapping is not supported by popcompile's capture")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def build_mask(attention_mask: torch.Tensor, seq_len: int, window: int | None) -> torch.Tensor:
    """[B, P+T] padding mask -> [B, 1, T, P+T] bool attention mask (causal, optional sliding window).

    Query t sits at cache row P+t. A query always sees itself, so a padding query never has an
    all-masked row (an all-masked softmax gives NaN, and NaN K/V rows would poison later steps).
    """
    total = attention_mask.shape[1]
    kv_idx = torch.arange(total, device=attention_mask.device)
    q_idx = torch.arange(seq_len, device=attention_mask.device) + (total - seq_len)
    distance = q_idx[:, None] - kv_idx[None, :]  # [T, P+T]
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance < window)
    keep = attention_mask.bool()[:, None, None, :] & allowed[None, None]
    return keep | (distance == 0)[None, None]


class _RecordingLayer(DynamicLayer):
    """A cache layer seeded with the past rows; keeps the new K/V a forward adds."""

    def __init__(self, past_key: torch.Tensor, past_value: torch.Tensor):
        super().__init__()
        self.keys, self.values = past_key, past_value
        self.device = past_key.device
        self.is_initialized = True
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None

    def get_seq_length(self) -> int:
        # No numel() == 0 test: it would specialise the graph on P == 0.
        return self.keys.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        self.new = (key_states, value_states)
        return super().update(key_states, value_states)


class DecoderWithKV(torch.nn.Module):
    """The HF causal LM behind the flat interface of the module docstring."""

    def __init__(self, model: torch.nn.Module, spec: ArchSpec):
        super().__init__()
        self.model = model
        self.spec = spec
        self.windows = attention_windows(model.config)

    def forward(self, input_ids, position_ids, attention_mask, *past: torch.Tensor):
        layers = [_RecordingLayer(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        seq_len = input_ids.shape[1]
        masks = {kind: build_mask(attention_mask, seq_len, w) for kind, w in self.windows.items()}
        mask = masks if self.spec.mask_mapping else next(iter(masks.values()))
        out = self.model.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
            **{cache_keyword(self.model.model): Cache(layers=layers)},
        )
        logits = self.model.lm_head(out.last_hidden_state[:, -1])  # [B, V]
        present = [t for layer in layers for t in layer.new]
        return (logits, *present)


@dataclass(frozen=True)
class CapturedModel:
    """The decode graph and what the rest of the pipeline needs to know about it."""

    program: ExportedProgram
    layout: KVLayout
    spec: ArchSpec
    num_layers: int
    vocab_size: int

    @property
    def input_names(self) -> list[str]:
        return ["input_ids", "position_ids", "attention_mask", *self.layout.past_names]


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward keyword that takes the KV cache: ``cache`` in transformers 5.2x+, ``past_key_values``
    before (vLLM 0.32 pins transformers <5.20, and popcompile.reference runs beside it)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextlib.contextmanager
def use_attention(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run the model with another registered attention function, restoring the user's choice after."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def example_inputs(layout: KVLayout, vocab_size: int, batch=2, seq=3, past=4) -> tuple[torch.Tensor, ...]:
    """Samples >= 2 in every dynamic dim so that export does not specialise them."""
    dtype = getattr(torch, layout.dtype)
    ids = torch.randint(0, vocab_size, (batch, seq))
    pos = torch.arange(past, past + seq).repeat(batch, 1)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    kv = [torch.randn(batch, layout.num_kv_heads, past, layout.head_dim, dtype=dtype)
          for _ in range(2 * layout.num_layers)]
    return (ids, pos, mask, *kv)


def dynamic_shapes(layout: KVLayout) -> tuple:
    batch = Dim("batch", min=1, max=4096)
    seq = Dim("seq", min=1, max=layout.max_seq)
    past = Dim("past", min=0, max=layout.max_seq - 1)
    kv = [{0: batch, 2: past} for _ in range(2 * layout.num_layers)]
    # The mask's length is past + seq: left to export to derive (Dim.DYNAMIC), since a sum of two
    # named Dims cannot be declared.
    # *past is one tuple
    return ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: Dim.DYNAMIC}, tuple(kv))


def capture(model: torch.nn.Module, max_seq: int | None = None) -> CapturedModel:
    """torch.export the decoder with the explicit KV interface; the result is the decode graph."""
    spec = arch_spec(model.config)
    layout = kv_layout(model, max_seq)
    wrapper = DecoderWithKV(model, spec).eval()
    args = example_inputs(layout, model.config.vocab_size)
    # backed_size_oblivious: treat sizes 0/1 like any other size instead of specialising on them.
    # transformers' registry for attention functions: our key, our function, no patching.
    AttentionInterface.register(ATTN_IMPLEMENTATION, pop_attention)
    with use_attention(model, ATTN_IMPLEMENTATION), fx_config.patch(backed_size_oblivious=True):
        program = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes(layout), strict=False)
    return CapturedModel(program, layout, spec, layout.num_layers, model.config.vocab_size)


def kv_layout(model: torch.nn.Module, max_seq: int | None = None) -> KVLayout:
    """The KV layout of a HF causal LM; max_seq defaults to min(4096, the model's position limit)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    limit = int(getattr(config, "max_position_embeddings", 4096) or 4096)
    if max_seq is None:
        max_seq = min(4096, limit)
    elif max_seq > limit:
        raise ValueError(f"max_seq={max_seq} exceeds the model's max_position_embeddings={limit}: "
                         "lower --max-seq")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return KVLayout(config.num_hidden_layers, config.num_key_value_heads, head_dim, max_seq, dtype)


def export_flat(gm: torch.nn.Module, layout: KVLayout, vocab_size: int) -> ExportedProgram:
    """Export a rewritten graph whose inputs are flat: (input_ids, position_ids, attention_mask, *past)."""
    ids_dims, pos_dims, mask_dims, kv_dims = dynamic_shapes(layout)
    args = example_inputs(layout, vocab_size)
    with fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(gm, args, dynamic_shapes=(ids_dims, pos_dims, mask_dims, *kv_dims),
                                   strict=False)
