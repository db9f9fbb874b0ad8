"""FLOP cost model of a prefill, full and with POP: the bound every measured speed stands next to.

Plain arithmetic on config fields (no torch). A multiply-add counts as 2 FLOPs; norms, RoPE, softmax,
residual adds and the embedding gather are ignored (they are O(hidden) per token). With
``h`` hidden, ``H``/``H_kv`` query/KV heads, ``D`` head dim, ``F`` FFN width, ``V`` vocab, ``L`` layers::

    qkvo(T)     = 2*T*h*(2*H*D + 2*H_kv*D)           Q, K, V, O projections of T tokens
    kv(T)       = 2*T*h*(2*H_kv*D)                   K and V projections only
    mlp(T)      = 3 * 2*T*h*F  (+ 2*T*h*E)             gated MLP: gate, up, down (+ a router over E experts)
    attn(P, T)  = 4*H*D * sum_{t=1..T} (P + t)        QK^T and AV, causal, T queries after P cached rows
    layer(P, T) = qkvo(T) + mlp(T) + attn(P, T)
    head        = 2*h*V                               LM head on ONE position (as generate does)

    full(N)      = L * layer(0, N) + head
    pop(N, cut)  = cut * layer(0, N-1) + (L-cut) * kv(N-1)     prefill graph on x_1..x_{N-1}
                 + L * layer(N-1, 1) + head                     x_N through the full model (boundary)

A mixture of experts counts its active parameters: ``F`` = k experts per token x the expert width
(``moe_intermediate_size``, else ``intermediate_size``), plus the router's ``E`` logits per token.

With ``cut == L``, ``layer(0, N-1) + layer(N-1, 1) == layer(0, N)`` term by term, so
``pop(N, L) == full(N)`` exactly: the sums are done in integers. Attention is counted as full
causal attention for every layer (sliding-window layers, e.g. Gemma 3's local ones, cost less).

A vision-language model (Qwen3-VL) runs its vision tower on every image before either prefill, the same
work for full and POP. Per image of ``P`` patches (``e`` width, ``F_v`` MLP width, ``m`` merge, ``c`` the
patch's values C*T*p*p, ``d`` the text width, ``k`` deepstack mergers), attention bidirectional over the
image's own patches::

    embed      = 2*P*c*e
    block      = 2*P*e*3e + 4*e*P^2 + 2*P*e*e + 2 * 2*P*e*F_v        qkv, attention, proj, fc1 + fc2
    merger     = 2*(P/m^2)*(e*m^2)^2 + 2*(P/m^2)*(e*m^2)*d           fc1, fc2 (1 + k of them)
    vision(P)  = embed + depth * block + (1 + k) * merger

    full_vl = sum vision(P_i) + full(N)      pop_vl = sum vision(P_i) + pop(N, cut)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
           "intermediate_size", "vocab_size", "num_hidden_layers")


@dataclass(frozen=True)
class Geometry:
    """The shape numbers of a decoder that its FLOPs depend on."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_hidden_layers: int
    num_experts: int = 0  # a mixture of experts' router width (intermediate_size: the active width)

    def __post_init__(self) -> None:
        experts = self.num_experts
        if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
            raise ValueError(f"Geometry.num_experts must be an int >= 0, got {self.num_experts!r}")
        for name in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Geometry.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_config(cls, config: Any) -> "Geometry":
        """From a HF config (attributes) or a mapping; head_dim defaults to hidden/heads, kv heads to
        heads; a mixture of experts (``num_experts`` or ``num_local_experts``): its active FFN width."""
        if isinstance(config, Geometry):
            return config
        get = config.get if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
        experts, width = get("num_experts") or get("num_local_experts") or 0, get("intermediate_size")
        if experts:
            per_token, expert_width = get("num_experts_per_tok"), get("moe_intermediate_size") or width
            width = per_token * expert_width if per_token and expert_width else None
        return cls(hidden, heads, get("num_key_value_heads") or heads, head_dim,
                   width, get("vocab_size"), get("num_hidden_layers"), experts)

    def kv(self, tokens: int) -> int:
        """K and V projections of ``tokens`` tokens in one layer."""
        return 2 * tokens * self.hidden_size * 2 * self.num_key_value_heads * self.head_dim

    def layer(self, past: int, tokens: int) -> int:
        """One full layer on ``tokens`` new tokens after ``past`` cached rows (causal attention)."""
        q_o = 2 * tokens * self.hidden_size * 2 * self.num_attention_heads * self.head_dim
        mlp = 2 * tokens * self.hidden_size * (3 * self.intermediate_size + self.num_experts)
        attended = tokens * past + tokens * (tokens + 1) // 2  # sum_{t=1..T} (P + t)
        attn = 4 * self.num_attention_heads * self.head_dim * attended
        return q_o + self.kv(tokens) + mlp + attn

    @property
    def head(self) -> int:
        """LM head on one position."""
        return 2 * self.hidden_size * self.vocab_size


def _check(geometry: Geometry, n_tokens: int, cut: int | None) -> None:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
    layers = geometry.num_hidden_layers
    if cut is not None and (isinstance(cut, bool) or not isinstance(cut, int) or not 1 <= cut <= layers):
        raise ValueError(f"cut={cut!r} is out of range for {layers} layers: use 1..{layers}")


def prefill_flops(config: Any, n_tokens: int, cut: int | None = None) -> float:
    """FLOPs to prefill ``n_tokens`` and produce the first token's logits.

    ``cut=None``: the full model on all N tokens. ``cut``: POP = prefill graph on x_1..x_{N-1}
    (``cut`` full layers, ``L - cut`` K/V projections) plus x_N through the full model.
    """
    g = Geometry.from_config(config)
    _check(g, n_tokens, cut)
    layers = g.num_hidden_layers
    if cut is None:
        return float(layers * g.layer(0, n_tokens) + g.head)
    context = n_tokens - 1
    prefill = cut * g.layer(0, context) + (layers - cut) * g.kv(context)
    boundary = layers * g.layer(context, 1) + g.head
    return float(prefill + boundary)


def speedup_bound(config: Any, n_tokens: int, cut: int) -> float:
    """full / POP prefill FLOPs: the TTFT speedup POP can reach when time follows FLOPs. 1.0 at cut == L."""
    g = Geometry.from_config(config)
    _check(g, n_tokens, cut)
    if cut is None:
        raise ValueError("speedup_bound needs a cut")
    return prefill_flops(g, n_tokens) / prefill_flops(g, n_tokens, cut)


_VISION_FIELDS = ("hidden_size", "intermediate_size", "depth", "patch_size", "temporal_patch_size",
                  "in_channels", "spatial_merge_size", "out_hidden_size")


@dataclass(frozen=True)
class VisionGeometry:
    """The shape numbers of a vision tower that its FLOPs depend on (Qwen3-VL's ``vision_config``)."""

    hidden_size: int
    intermediate_size: int
    depth: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int
    out_hidden_size: int
    deepstack: int

    @classmethod
    def from_config(cls, config: Any) -> "VisionGeometry":
        """From a VLM's HF config (its ``vision_config``) or the vision config itself."""
        vision = getattr(config, "vision_config", config)
        values = {name: getattr(vision, name) for name in _VISION_FIELDS}
        return cls(**values, deepstack=len(getattr(vision, "deepstack_visual_indexes", ()) or ()))

    def image(self, patches: int) -> int:
        """FLOPs of one image of ``patches`` patches through the tower (module docstring)."""
        e, m2 = self.hidden_size, self.spatial_merge_size ** 2
        values = self.in_channels * self.temporal_patch_size * self.patch_size ** 2
        block = 2 * patches * e * 3 * e + 4 * e * patches * patches + 2 * patches * e * e \
            + 2 * 2 * patches * e * self.intermediate_size
        merged = patches // m2
        merger = 2 * merged * (e * m2) ** 2 + 2 * merged * e * m2 * self.out_hidden_size
        return 2 * patches * values * e + self.depth * block + (1 + self.deepstack) * merger


def vlm_prefill_flops(config: Any, n_tokens: int, image_patches: list[int], cut: int | None = None) -> float:
    """FLOPs to the first token of a vision-language prompt of ``n_tokens`` tokens (image tokens included)
    whose images have ``image_patches`` patches each: the vision tower on every image, then the text
    decoder's prefill (``prefill_flops``: full, or POP at ``cut``)."""
    vision = VisionGeometry.from_config(config)
    text = getattr(config, "text_config", config)
    return float(sum(vision.image(p) for p in image_patches)) + prefill_flops(text, n_tokens, cut)


def vlm_speedup_bound(config: Any, n_tokens: int, image_patches: list[int], cut: int) -> float:
    """full / POP FLOPs to the first token, the vision tower counted in both."""
    return vlm_prefill_flops(config, n_tokens, image_patches) / vlm_prefill_flops(config, n_tokens,
                                                                                   image_patches, cut)
