"""POP's prefill schedule over a stock vLLM decoder stack (``model.embed_tokens``, ``.layers``, ``.norm``).

One step, T tokens (prompt chunks and decode tokens of several requests), S survivors (attention.py):

    layers 0..cut-1      stock, on all T tokens                         h_cut: [T, hidden]
    POP K/V, l >= cut    k, v = RoPE(W_K^l norm_l(h_cut)), W_V^l norm_l(h_cut)  -> layer l's cache, all T slots
    layers cut..L-1      stock, on the S survivors; their own K/V overwrite their slots
    returns              [T, hidden]: the survivors' final hidden states in their rows (logits are read there)

A step in which every token survives (decode only, or vLLM's warm-up) runs the stock stack unchanged.
POP+ (``PopKV``): the deep layers' K/V projections of h_cut use fitted weights instead of W_K, W_V.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from .attention import survivor_backend, survivor_slots, survivors, write_kv
from .settings import KV_PREFIX, PopSettings


def deep_attention(model: nn.Module, cut: int) -> list[nn.Module]:
    """The vLLM ``Attention`` modules of layers cut..L-1."""
    return [layer.self_attn.attn for layer in model.layers[cut:]]


def use_survivor_backend(model: nn.Module, cut: int) -> None:
    """Point the deep layers at the survivor backend; vLLM builds each step's metadata from it."""
    for attn in deep_attention(model, cut):
        attn.attn_backend = survivor_backend(attn.attn_backend)


class PopKV(nn.Module):
    """The deep layers' K/V projections of h_cut: copies of the model's own ``k_proj``/``v_proj`` (POP),
    replaced by the fitted ones of settings.KV_WEIGHTS_FILE where it has them (POP+: layers cut+1..L-1;
    layer ``cut`` sees its true input h_cut and keeps its own). Own copies: vLLM's CPU linear layers
    repack their weights after loading, so ``qkv_proj.weight`` cannot be sliced."""

    def __init__(self, model: nn.Module, cut: int, k_norm: Callable[[nn.Module], nn.Module | None]):
        super().__init__()
        self.cut = cut
        self.layers = nn.ModuleList(_kv_pair(layer.self_attn) for layer in model.layers[cut:])
        self.k_norms = [k_norm(layer.self_attn) for layer in model.layers[cut:]]  # the layers' own modules

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[list, set[str]]:
        """Copies ``model.layers.{l}.self_attn.{k|v}_proj.*`` of the deep layers, then lets
        ``pop_kv.layers.{l}.{k|v}_proj.*`` (POP+) override them, in whatever order the files come;
        returns the weights for the stock loader and the names loaded here."""
        params, stock, fitted = dict(self.named_parameters()), [], set()
        for name, tensor in weights:
            fit = name.startswith(KV_PREFIX)
            local = self._local_name(name)
            if local is not None and (fit or local not in fitted):
                params[local].data.copy_(tensor)
                if fit:
                    fitted.add(local)
            if not fit:
                stock.append((name, tensor))
        return stock, {f"{KV_PREFIX}{name}" for name in params}

    def _local_name(self, name: str) -> str | None:
        parts = name.split(".")  # pop_kv.layers.20.k_proj.weight | model.layers.20.self_attn.k_proj.weight
        if len(parts) < 5 or parts[1] != "layers" or parts[-2] not in ("k_proj", "v_proj"):
            return None
        layer = int(parts[2])
        return f"layers.{layer - self.cut}.{parts[-2]}.{parts[-1]}" if layer >= self.cut else None


def _kv_pair(self_attn: nn.Module) -> nn.Module:
    hidden, bias = self_attn.qkv_proj.input_size, self_attn.qkv_proj.bias is not None
    pair = nn.Module()
    pair.k_proj = nn.Linear(hidden, self_attn.kv_size, bias=bias)
    pair.v_proj = nn.Linear(hidden, self_attn.kv_size, bias=bias)
    return pair


def kv_of(layer: nn.Module, index: int, h_cut: torch.Tensor, positions: torch.Tensor,
          pop_kv: PopKV) -> tuple[torch.Tensor, torch.Tensor]:
    """POP's K/V of one deep layer for every token: k, v [T, H_kv * D] (RoPE'd k)."""
    x = layer.input_layernorm(h_cut)  # without a residual: out of place
    pair, k_norm = pop_kv.layers[index - pop_kv.cut], pop_kv.k_norms[index - pop_kv.cut]
    k = pair.k_proj(x)  # [T, H_kv * D]
    if k_norm is not None:
        head_dim = layer.self_attn.head_dim
        k = k_norm(k.view(k.shape[0], -1, head_dim)).view(k.shape)
    k, _ = layer.self_attn.rotary_emb(positions, k)
    return k, pair.v_proj(x)


def pop_forward(model: nn.Module, settings: PopSettings, pop_kv: PopKV, input_ids: torch.Tensor | None,
                positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """The stack's final hidden states [T, hidden] under POP (module docstring)."""
    hidden = inputs_embeds if inputs_embeds is not None else model.embed_input_ids(input_ids)
    residual = None
    for layer in model.layers[:settings.cut]:
        hidden, residual = layer(positions, hidden, residual)
    deep = list(model.layers[settings.cut:])
    index = survivors(deep[0].self_attn.attn.layer_name) if deep else None
    if index is None:
        for layer in deep:
            hidden, residual = layer(positions, hidden, residual)
        return model.norm(hidden, residual)[0]
    h_cut = hidden + residual  # [T, hidden]: the residual stream after layer cut-1
    for offset, layer in enumerate(deep):
        k, v = kv_of(layer, settings.cut + offset, h_cut, positions, pop_kv)
        write_kv(layer.self_attn.attn.layer_name, k, v)
    if index.numel():  # the other rows keep h_cut: tokens that stop at the cut have no logits read
        h_cut[index] = _run_survivors(model, deep, hidden[index], residual[index], positions[index], index)
    return h_cut


def _run_survivors(model, deep, hidden, residual, positions, index) -> torch.Tensor:
    with survivor_slots([layer.self_attn.attn.layer_name for layer in deep], index):
        for layer in deep:
            hidden, residual = layer(positions, hidden, residual)
    return model.norm(hidden, residual)[0]
