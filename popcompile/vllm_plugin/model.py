"""POP's prefill schedule over a stock vLLM decoder stack (``model.embed_tokens``, ``.layers``, ``.norm``).

One step, T tokens (prompt chunks and decode tokens of several requests), S survivors (attention.py):

    layers 0..cut-1      stock, on all T tokens                         h_cut: [T, hidden]
    POP K/V, l >= cut    k, v = RoPE(W_K^l norm_l(h_cut)), W_V^l norm_l(h_cut)
                         -> layer l's cache, all T slots
    layers cut..L-1      stock, on the S survivors; their own K/V overwrite their slots
    returns              [T, hidden]: the survivors' final hidden states in their rows (logits are read there)

A step in which every token survives (decode only, or vLLM's warm-up) runs the stock layers unchanged.
POP+ (``PopKV``): the deep layers' K/V projections of h_cut use fitted weights instead of W_K, W_V.

Under vLLM's torch.compile (its default; not with ``enforce_eager``) three units are compiled, each traced
once with a dynamic token count: ``PopShallow`` (layers 0..cut-1), ``PopKV`` (POP's K/V of h_cut) and
``PopDeep`` (layers cut..L-1 and the norm, on all tokens or on the survivors). The stock model's own
compiled forward is not used by a pruning model: its one graph cannot stop at the cut. Selecting the
survivors and writing POP's K/V into the paged cache stay eager (they read the step's forward context).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile

from ..frontend.arch import arch_spec, pruned_kv
from .attention import survivor_backend, survivor_slots, survivors, warming_up, write_kv
from .settings import KV_PREFIX, StockStack


def deep_attention(model: nn.Module, cut: int) -> list[nn.Module]:
    """The vLLM ``Attention`` modules of layers cut..L-1."""
    return [layer.self_attn.attn for layer in model.layers[cut:]]


def use_survivor_backend(model: nn.Module, cut: int) -> None:
    """Point the deep layers at the survivor backend; vLLM builds each step's metadata from it."""
    for attn in deep_attention(model, cut):
        attn.attn_backend = survivor_backend(attn.attn_backend)


class _Stack(nn.Module):
    """Decoder layers ``first..last-1`` of the stock stack, compiled as one unit under vLLM's torch.compile
    (``support_torch_compile``; plain modules under ``enforce_eager``). The layers are the stock modules,
    registered here a second time (named_parameters keeps the stock names, as for Gemma 3n's decoders).
    ``stack``: how the stock layers are called (settings.StockStack): with a residual, or on the whole
    stream (residual None throughout)."""

    def __init__(self, *, vllm_config, prefix: str = "", model: nn.Module, first: int, last: int,
                 stack: StockStack):
        super().__init__()
        self.layers = model.layers[first:last]
        self.carries_residual = stack.carries_residual

    def run(self, positions: torch.Tensor, hidden: torch.Tensor,
            residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        for layer in self.layers:
            if self.carries_residual:
                hidden, residual = layer(positions, hidden, residual)
            else:
                hidden = layer(positions, hidden)
        return hidden, residual


@support_torch_compile(dynamic_arg_dims={"positions": 0, "hidden": 0})  # [T], [T, hidden]
class PopShallow(_Stack):
    """Layers 0..cut-1 on every token: hidden [T, hidden] -> (hidden, residual), each [T, hidden] (residual
    None where the layers carry the stream whole)."""

    def forward(self, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.run(positions, hidden, None)


@support_torch_compile(dynamic_arg_dims={"positions": 0, "hidden": 0, "residual": 0})  # S tokens
class PopDeep(_Stack):
    """Layers cut..L-1 and the final norm on the tokens given (all of a decode step, or the survivors):
    (hidden, residual) [S, hidden] -> the final hidden states [S, hidden]."""

    def __init__(self, *, vllm_config, prefix: str = "", model: nn.Module, first: int, last: int,
                 stack: StockStack):
        super().__init__(vllm_config=vllm_config, prefix=prefix, model=model, first=first, last=last,
                         stack=stack)
        self.norm = model.norm

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> torch.Tensor:
        hidden, residual = self.run(positions, hidden, residual)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


@support_torch_compile(dynamic_arg_dims={"positions": 0, "h_cut": 0})  # T tokens
class PopKV(nn.Module):
    """The deep layers' K/V of h_cut for every token (compiled as one unit): [T, hidden] -> k, v
    [L - cut, T, H_kv * D], k RoPE'd. The projections are copies of the model's own ``k_proj``/``v_proj``
    (POP), replaced by the fitted ones of settings.KV_WEIGHTS_FILE where it has them (POP+: layers
    cut+1..L-1; layer ``cut`` sees its true input h_cut and keeps its own). Own copies: vLLM's CPU linear
    layers repack their weights after loading, so ``qkv_proj.weight`` cannot be sliced. ``fitted``: POP+
    weights will be loaded; a fit may carry a bias where the model's projections have none
    (kvfit/calibrate.py, ``bias=True``), so every pair then has one, zero until a fitted or stock bias is
    loaded over it."""

    def __init__(self, *, vllm_config, prefix: str = "", model: nn.Module, cut: int, fitted: bool = False):
        super().__init__()
        self.cut = cut
        # input_norm and k_norm, as the pass reads them; no clamp: vLLM's classes apply none (OLMoE's), and
        # settings.check_served refuses a config that sets one
        self.spec = dataclasses.replace(arch_spec(vllm_config.model_config.hf_config), clip_qkv=None)
        self.layers = nn.ModuleList(_kv_pair(layer.self_attn, fitted) for layer in model.layers[cut:])
        self.deep = model.layers[cut:]  # the stock layers: input_layernorm, rotary_emb, k_norm

    def forward(self, positions: torch.Tensor, h_cut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = [], []
        for layer, pair in zip(self.deep, self.layers):
            # input_layernorm without a residual: out of place; k, v [T, H_kv * D]
            k, v = pruned_kv(self.spec, layer, h_cut, lambda x, pair=pair: (pair.k_proj(x), pair.v_proj(x)),
                             layer.self_attn.head_dim)
            keys.append(layer.self_attn.rotary_emb(positions, k)[0])
            values.append(v)
        return torch.stack(keys), torch.stack(values)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[list, set[str]]:
        """Copies ``model.layers.{l}.self_attn.{k|v}_proj.*`` of the deep layers, then lets
        ``pop_kv.layers.{l}.{k|v}_proj.*`` (POP+) override them, in whatever order the files come;
        returns the weights for the stock loader and the names loaded here."""
        params, stock, fitted = dict(self.layers.named_parameters(prefix="layers")), [], set()
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


def _kv_pair(self_attn: nn.Module, fitted: bool) -> nn.Module:
    """k_proj, v_proj [kv_size, hidden]: with a bias where the model has one or POP+ weights may bring one
    (zero-initialised: a layer the fit leaves alone, e.g. layer ``cut``, must add nothing)."""
    hidden, bias = self_attn.qkv_proj.input_size, fitted or self_attn.qkv_proj.bias is not None
    pair = nn.Module()
    pair.k_proj = nn.Linear(hidden, self_attn.kv_size, bias=bias)
    pair.v_proj = nn.Linear(hidden, self_attn.kv_size, bias=bias)
    if bias:
        for linear in (pair.k_proj, pair.v_proj):
            nn.init.zeros_(linear.bias)
    return pair


@dataclasses.dataclass(frozen=True)
class PopStack:
    """The compiled units of one POP model (module docstring); built once by the POP model class."""
    model: nn.Module  # the stock stack: embed_input_ids, layers
    shallow: PopShallow
    kv: PopKV
    deep: PopDeep
    cut: int
    embedding_multiplier: float | None = None  # StockStack.embedding_multiplier's value, where it has one


def pop_forward(stack: PopStack, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """The stack's final hidden states [T, hidden] under POP (module docstring)."""
    hidden = inputs_embeds if inputs_embeds is not None else stack.model.embed_input_ids(input_ids)
    if stack.embedding_multiplier is not None:  # as the stock forward scales them (Granite)
        hidden = hidden * stack.embedding_multiplier
    hidden, residual = stack.shallow(positions, hidden)
    names = [layer.self_attn.attn.layer_name for layer in stack.deep.layers]
    index = survivors(names[0])
    if index is None:
        if warming_up():  # vLLM's warm-up: compile the K/V unit too (it writes nothing without a cache)
            stack.kv(positions, hidden if residual is None else hidden + residual)
        return stack.deep(positions, hidden, residual)
    # [T, hidden]: the residual stream after layer cut-1 (a copy: the survivors' rows are written into it)
    h_cut = hidden.clone() if residual is None else hidden + residual
    keys, values = stack.kv(positions, h_cut)  # [L - cut, T, H_kv * D]
    for name, k, v in zip(names, keys, values):
        write_kv(name, k, v)
    if index.numel():  # the other rows keep h_cut: tokens that stop at the cut have no logits read
        with survivor_slots(names, index):
            h_cut[index] = stack.deep(positions[index], hidden[index],
                                      None if residual is None else residual[index])
    return h_cut
