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

A vision-language model (frontend/vision.py) is captured over its text decoder (``VisionDecoderWithKV``):
M-RoPE ``position_ids`` [3, B, T], and ``visual_embeds`` [1 + k, B, T, d] (the image features; zeros for
text tokens, and for decode steps) after ``attention_mask``. A graph's flat inputs before the KV rows
are an ``Interface``.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.fx.experimental._config as fx_config
from torch.export import Dim, ExportedProgram
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer

from ..engine.kv import DEFAULT_MAX_SEQ, KVLayout
from .arch import ArchSpec, arch_spec, attention_windows, finish_logits
from .experts import experts_for_capture
from .vision import VisionLanguageSpec, deepstack_layers, vision_spec

ATTN_IMPLEMENTATION = "popcompile"


def pop_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention with an explicit boolean mask; GQA by repeating K/V heads.

    query: [B, H, T, D]; key, value: [B, H_kv, P+T, D]; attention_mask: [B, 1, T, P+T] bool.
    Returns ([B, T, H, D], None) as transformers' attention functions do. With ``softcap`` (Gemma 2's
    attn_logit_softcapping) the scores are capped (``softcapped_attention``).
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if kwargs.get("softcap") is not None:
        return softcapped_attention(query, key, value, attention_mask, scaling, kwargs["softcap"]), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling
    )
    # SDPA's output has the query's layout: a view of [B, T, H, D] rows where the query is the projection's
    # view (Llama), [B, H, T, D] rows where RoPE concatenated it (Phi-3's partial rotary). ``contiguous()``
    # on the latter asks whether T == 1, a guard that export refuses on a dynamic T; a clone never asks
    # (and is an Identity in ONNX, which the exporter's optimiser drops).
    return out.transpose(1, 2).clone(memory_format=torch.contiguous_format), None


def softcapped_attention(query, key, value, attention_mask, scaling, cap: float) -> torch.Tensor:
    """softmax(tanh(q k^T * scale / cap) * cap, masked) v as plain ops (SDPA has no cap; onnxruntime's fused
    attention on this version neither, so these layers stay standard ONNX ops: exporters/onnx.py refuses a
    capped layer that got fused). query [B, H, T, D]; key, value [B, H, P+T, D] (repeated per query head);
    attention_mask [B, 1, T, P+T] bool. Returns [B, T, H, D] (pop_attention's). The softmax runs in float32,
    as transformers' eager attention does."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    # bmm of [B*H, ...] views of contiguous copies: matmul, reshape or contiguous() of a transposed query
    # guard T != 1 (a copy or a view depends on it), which export refuses; clone always copies
    batch, heads, seq, dim = query.shape

    def flat(x):  # [B, H, S, D] -> [B*H, S, D]
        return x.clone(memory_format=torch.contiguous_format).view(batch * heads, -1, dim)

    scores = torch.bmm(flat(query), flat(key).transpose(1, 2))
    scores = scores.view(batch, heads, seq, -1) * scale  # [B, H, T, P+T]
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.bmm(probs.view(batch * heads, seq, -1), flat(value)).view(batch, heads, seq, dim)
    return out.transpose(1, 2).clone(memory_format=torch.contiguous_format)


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
        logits = finish_logits(self.model.config, self.model.lm_head(out.last_hidden_state[:, -1]))  # [B, V]
        present = [t for layer in layers for t in layer.new]
        return (logits, *present)


class VisionDecoderWithKV(torch.nn.Module):
    """A vision-language model's text decoder behind the flat interface, with M-RoPE ``position_ids``
    [3, B, T] and ``visual_embeds`` [1 + k, B, T, d] after ``attention_mask``: row 0 the merged image
    features at the image placeholders (they replace those tokens' embeddings:
    ``where(input_ids == image_token_id, ...)``), rows 1..k the deepstack features added to the output of
    decoder layers 0..k-1, zeros at text tokens (the dense form of transformers' boolean-mask assignment:
    adding zeros leaves text tokens exactly as they were). Only the text decoder and the LM head are
    held: the graph carries no vision weights."""

    def __init__(self, model: torch.nn.Module, spec: ArchSpec, vspec: VisionLanguageSpec):
        super().__init__()
        self.spec = spec
        self.text = model.get_submodule(vspec.text)
        self.lm_head = model.get_output_embeddings()
        self.config = model.config
        self.image_token_id = getattr(model.config, vspec.image_token)
        self.windows = attention_windows(model.config.get_text_config())

    def forward(self, input_ids, position_ids, attention_mask, visual_embeds, *past):
        layers = [_RecordingLayer(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        mask = next(iter({kind: build_mask(attention_mask, input_ids.shape[1], w)
                          for kind, w in self.windows.items()}.values()))
        out = run_with_images(self.text, self.image_token_id, input_ids, visual_embeds,
                              position_ids=position_ids, attention_mask=mask, use_cache=True,
                              **{cache_keyword(self.text): Cache(layers=layers)})
        logits = finish_logits(self.config, self.lm_head(out.last_hidden_state[:, -1]))  # [B, V]
        return (logits, *[t for layer in layers for t in layer.new])


def run_with_images(text: torch.nn.Module, image_token_id: int, input_ids: torch.Tensor,
                    visual_embeds: torch.Tensor, **kwargs):
    """A VLM's text decoder on ``input_ids`` [B, T] with ``visual_embeds`` [1 + k, B, T, d]
    (VisionDecoderWithKV: row 0 replaces the image placeholders' embeddings, rows 1..k are added to the
    outputs of layers 0..k-1); ``kwargs`` (positions, mask, cache) go to the text model, whose output it
    returns."""
    embeds = text.get_input_embeddings()(input_ids)  # [B, T, d]
    image = (input_ids == image_token_id)[..., None]  # [B, T, 1]
    embeds = torch.where(image, visual_embeds[0].to(embeds.dtype), embeds)
    hooks = [layer.register_forward_hook(_add_to_output(visual_embeds[1 + i]))
             for i, layer in enumerate(text.layers[:visual_embeds.shape[0] - 1])]
    try:
        return text(inputs_embeds=embeds, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()


class FunctionalMRope(torch.nn.Module):
    """Qwen3-VL's interleaved M-RoPE (transformers' ``Qwen3VLTextRotaryEmbedding``) without its in-place
    slice assignment, on which torch.export guards batch >= 2 and seq >= 2. Frequency j reads the position
    row the interleaving gives it (height for j = 1, 4, ... below 3 * section[1], width for j = 2, 5, ...
    below 3 * section[2], time otherwise): the same products, so the same cos and sin, bit for bit.

        position_ids [3, B, T] -> rows[j] -> [D/2, B, T] -> * inv_freq -> [B, T, D/2]
                               -> cat -> cos, sin [B, T, D]
    """

    def __init__(self, rope: torch.nn.Module):
        super().__init__()
        self.inv_freq, self.scaling = rope.inv_freq, rope.attention_scaling
        rows = [0] * self.inv_freq.numel()
        for row in (1, 2):
            for j in range(row, 3 * rope.mrope_section[row], 3):
                rows[j] = row
        self.register_buffer("rows", torch.tensor(rows), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = position_ids.expand(3, -1, -1)[self.rows]  # [D/2, B, T]
        freqs = positions.permute(1, 2, 0).float() * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(x.dtype), (emb.sin() * self.scaling).to(x.dtype)


@contextlib.contextmanager
def functional_mrope(text: torch.nn.Module) -> Iterator[None]:
    """``text.rotary_emb`` as FunctionalMRope while a graph is captured, the model's own again after."""
    original = text.rotary_emb
    text.rotary_emb = FunctionalMRope(original)
    try:
        yield
    finally:
        text.rotary_emb = original


def _add_to_output(features: torch.Tensor):
    """A forward hook adding ``features`` [B, T, d] to a decoder layer's output hidden state."""
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + features.to(output[0].dtype), *output[1:])
        return output + features.to(output.dtype)
    return hook


@dataclass(frozen=True)
class Interface:
    """A captured graph's flat inputs before the KV rows: their names, example tensors (>= 2 in every
    dynamic dim, ``examples(layout, batch, seq, past)``) and torch.export dims (``dims(batch, seq)``)."""

    names: tuple[str, ...]
    examples: Callable[[KVLayout, int, int, int], tuple[torch.Tensor, ...]]
    dims: Callable[[Dim, Dim], tuple]


def _text_examples(vocab_size: int):
    def examples(layout: KVLayout, batch: int, seq: int, past: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, vocab_size, (batch, seq))
        pos = torch.arange(past, past + seq).repeat(batch, 1)
        mask = torch.ones(batch, past + seq, dtype=torch.int64)
        return ids, pos, mask
    return examples


def text_interface(vocab_size: int) -> Interface:
    """(input_ids [B, T], position_ids [B, T], attention_mask [B, P+T]): the text decoders' graphs.
    The mask's length is past + seq: left to export to derive (Dim.DYNAMIC), since a sum of two named
    Dims cannot be declared."""
    return Interface(("input_ids", "position_ids", "attention_mask"), _text_examples(vocab_size),
                     lambda batch, seq: ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: Dim.DYNAMIC}))


def vision_interface(vocab_size: int, hidden: int, deepstack: int) -> Interface:
    """A VLM's graphs (VisionDecoderWithKV): the text interface with position_ids [3, B, T], then
    visual_embeds [1 + deepstack, B, T, hidden]."""
    text = _text_examples(vocab_size)

    def examples(layout: KVLayout, batch: int, seq: int, past: int) -> tuple[torch.Tensor, ...]:
        ids, pos, mask = text(layout, batch, seq, past)
        visual = torch.randn(1 + deepstack, batch, seq, hidden, dtype=getattr(torch, layout.dtype))
        return ids, pos.expand(3, -1, -1).contiguous(), mask, visual

    def dims(batch: Dim, seq: Dim) -> tuple:
        return {0: batch, 1: seq}, {1: batch, 2: seq}, {0: batch, 1: Dim.DYNAMIC}, {1: batch, 2: seq}

    return Interface(("input_ids", "position_ids", "attention_mask", "visual_embeds"), examples, dims)


@dataclass(frozen=True)
class CapturedModel:
    """The decode graph and what the rest of the pipeline needs to know about it; ``interface``: its flat
    inputs before the KV rows (the POP pass keeps them: the prefill graph has the same)."""

    program: ExportedProgram
    layout: KVLayout
    spec: ArchSpec
    num_layers: int
    vocab_size: int
    interface: Interface

    @property
    def input_names(self) -> list[str]:
        return [*self.interface.names, *self.layout.past_names]


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


def example_inputs(layout: KVLayout, interface: Interface, batch=2, seq=3,
                   past=4) -> tuple[torch.Tensor, ...]:
    """Samples >= 2 in every dynamic dim so that export does not specialise them."""
    dtype = getattr(torch, layout.dtype)
    kv = [torch.randn(batch, layout.num_kv_heads, past, layout.head_dim, dtype=dtype)
          for _ in range(2 * layout.num_layers)]
    return (*interface.examples(layout, batch, seq, past), *kv)


def dynamic_shapes(layout: KVLayout, interface: Interface) -> tuple:
    """The interface's dims, then the KV rows' (one tuple: ``*past``)."""
    batch = Dim("batch", min=1, max=4096)
    seq = Dim("seq", min=1, max=layout.max_seq)
    past = Dim("past", min=0, max=layout.max_seq - 1)
    kv = [{0: batch, 2: past} for _ in range(2 * layout.num_layers)]
    return (*interface.dims(batch, seq), tuple(kv))


def export_with_kv(module: torch.nn.Module, layout: KVLayout, interface: Interface) -> ExportedProgram:
    """torch.export of a module taking (interface inputs, *past), every dynamic dim declared.
    backed_size_oblivious: sizes 0/1 are treated like any other size instead of being specialised on."""
    with fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(module, example_inputs(layout, interface),
                                   dynamic_shapes=dynamic_shapes(layout, interface), strict=False)


def capture(model: torch.nn.Module, max_seq: int | None = None) -> CapturedModel:
    """torch.export the decoder with the explicit KV interface; the result is the decode graph (a
    vision-language model: capture_vision.capture_vision, its decode and prompt graphs)."""
    if vision_spec(model.config) is not None:
        return _capture_vision(model, max_seq)
    spec = arch_spec(model.config)
    layout = kv_layout(model, max_seq)
    interface = text_interface(model.config.vocab_size)
    with attention_for_capture(model):
        program = export_with_kv(DecoderWithKV(model, spec).eval(), layout, interface)
    return CapturedModel(program, layout, spec, layout.num_layers, model.config.vocab_size, interface)


def _capture_vision(model: torch.nn.Module, max_seq: int | None) -> CapturedModel:
    """A VLM's decode graph: ids, M-RoPE positions and image features in (VisionDecoderWithKV)."""
    spec, vspec, config = arch_spec(model.config), vision_spec(model.config), model.config.get_text_config()
    layout = kv_layout(model, max_seq)
    interface = vision_interface(config.vocab_size, config.hidden_size, deepstack_layers(model.config))
    with attention_for_capture(model), functional_mrope(model.get_submodule(vspec.text)):
        program = export_with_kv(VisionDecoderWithKV(model, spec, vspec).eval(), layout, interface)
    return CapturedModel(program, layout, spec, layout.num_layers, config.vocab_size, interface)


@contextlib.contextmanager
def attention_for_capture(model: torch.nn.Module) -> Iterator[None]:
    """``model`` running ``pop_attention`` (transformers' registry of attention functions: our key, our
    function, no patching) and, for a mixture of experts, ``popcompile::experts`` (frontend/experts.py)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, pop_attention)
    settle_longrope(model)
    with use_attention(model, ATTN_IMPLEMENTATION), experts_for_capture(model):
        yield


def settle_longrope(model: torch.nn.Module) -> None:
    """Call each LongRoPE rotary embedding (Phi-3.5, Phi-4-mini) once, eagerly. Its first call computes its
    long-context frequencies and keeps them on the module (``long_inv_freq``, transformers'
    ``dynamic_rope_update``): made inside a trace, that attribute would be the trace's fake tensor, which the
    next capture or eager forward then reads. After this call every trace reads a real constant and picks the
    short or long set per call as the model does (``where(max(position_ids) + 1 > original_max, long,
    short)``)."""
    for module in model.modules():
        settled = getattr(module, "long_inv_freq", None) is not None
        if getattr(module, "rope_type", None) == "longrope" and not settled:
            inv_freq = module.inv_freq
            with torch.no_grad():
                module(inv_freq.new_zeros(1), torch.zeros(1, 1, dtype=torch.long, device=inv_freq.device))


def kv_layout(model: torch.nn.Module, max_seq: int | None = None) -> KVLayout:
    """The KV layout of a HF causal LM (a VLM: of its text decoder); max_seq defaults to
    min(engine.kv.DEFAULT_MAX_SEQ, the model's position limit)."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    limit = int(getattr(config, "max_position_embeddings", DEFAULT_MAX_SEQ) or DEFAULT_MAX_SEQ)
    if max_seq is None:
        max_seq = min(DEFAULT_MAX_SEQ, limit)
    elif max_seq > limit:
        raise ValueError(f"max_seq={max_seq} exceeds the model's max_position_embeddings={limit}: "
                         "lower --max-seq")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return KVLayout(config.num_hidden_layers, config.num_key_value_heads, head_dim, max_seq, dtype)


def export_flat(gm: torch.nn.Module, layout: KVLayout, interface: Interface) -> ExportedProgram:
    """Export a rewritten graph whose inputs are flat: (the interface's inputs, *past)."""
    *dims, kv_dims = dynamic_shapes(layout, interface)
    with fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(gm, example_inputs(layout, interface),
                                   dynamic_shapes=(*dims, *kv_dims), strict=False)
