"""The POP model classes vLLM loads by name (settings.POP_ARCHITECTURES; registered lazily by ``register``).

Each is the stock vLLM class with POP's forward (model.pop_forward) and the POP+ weights; the stock
layers, weights and weight loading are untouched. Built for vLLM settings.VLLM_VERSION.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import vllm
from vllm.model_executor.models.gemma2 import Gemma2ForCausalLM
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.granite import GraniteForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.mixtral import MixtralForCausalLM
from vllm.model_executor.models.olmoe import OlmoeForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from . import runner
from .model import PopDeep, PopKV, PopShallow, PopStack, pop_forward, use_survivor_backend
from .settings import KV_PREFIX, STOCK_STACKS, PopSettings, StockStack, check_vllm_version


class _PopMixin:
    """POP over a stock ``*ForCausalLM`` whose ``self.model`` is a vLLM decoder stack (Llama-like layers:
    ``input_layernorm``, ``self_attn.{qkv_proj, rotary_emb, attn}``). The per-head norm applied to K before
    RoPE comes from the architecture table (frontend/arch.py), as for popcompile's own graphs."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # the stock class: layers, weights, lm_head
        check_vllm_version(vllm.__version__)
        self.pop_settings = PopSettings.for_instance(vllm_config)
        self.pop_kv = self.pop_stack = None
        if self.pop_settings.prunes:
            runner.install()
            use_survivor_backend(self.model, self.pop_settings.cut)
            self.pop_stack = _units(self.model, vllm_config, prefix, self.pop_settings,
                                    STOCK_STACKS.get(type(self).__name__, StockStack()))
            # registered children (the stock layers they hold keep their stock parameter names)
            self.pop_shallow, self.pop_kv, self.pop_deep = (self.pop_stack.shallow, self.pop_stack.kv,
                                                            self.pop_stack.deep)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if self.pop_stack is None:  # cut = L: the stock model, compiled as vLLM compiles it
            return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        return pop_forward(self.pop_stack, input_ids, positions, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.pop_kv is None:
            return super().load_weights(w for w in weights if not w[0].startswith(KV_PREFIX))
        stock, loaded = self.pop_kv.load_weights(weights)
        return super().load_weights(stock) | loaded


def _units(model, vllm_config, prefix: str, settings: PopSettings, stack: StockStack) -> PopStack:
    """POP's three compiled units over the stock stack ``model``, each under its own compile tag."""
    from vllm.compilation.backends import set_model_tag  # vLLM's own models import it late too

    cut, layers = settings.cut, settings.num_layers
    with set_model_tag("pop_shallow"):
        shallow = PopShallow(vllm_config=vllm_config, prefix=f"{prefix}pop_shallow", model=model, first=0,
                             last=cut, stack=stack)
    with set_model_tag("pop_kv"):
        kv = PopKV(vllm_config=vllm_config, prefix=f"{prefix}pop_kv", model=model, cut=cut,
                   fitted=settings.kv_weights is not None)
    with set_model_tag("pop_deep"):
        deep = PopDeep(vllm_config=vllm_config, prefix=f"{prefix}pop_deep", model=model, first=cut,
                       last=layers, stack=stack)
    multiplier = (None if stack.embedding_multiplier is None
                  else float(getattr(vllm_config.model_config.hf_config, stack.embedding_multiplier)))
    return PopStack(model=model, shallow=shallow, kv=kv, deep=deep, cut=cut, embedding_multiplier=multiplier)


class PopLlamaForCausalLM(_PopMixin, LlamaForCausalLM):
    pass


class PopMistralForCausalLM(_PopMixin, MistralForCausalLM):
    pass


class PopQwen2ForCausalLM(_PopMixin, Qwen2ForCausalLM):
    pass


class PopQwen3ForCausalLM(_PopMixin, Qwen3ForCausalLM):
    pass


class PopGemma3ForCausalLM(_PopMixin, Gemma3ForCausalLM):
    pass


class PopQwen3MoeForCausalLM(_PopMixin, Qwen3MoeForCausalLM):
    pass


class PopMixtralForCausalLM(_PopMixin, MixtralForCausalLM):
    pass


class PopOlmoeForCausalLM(_PopMixin, OlmoeForCausalLM):
    pass


class PopGraniteForCausalLM(_PopMixin, GraniteForCausalLM):
    pass


class PopGemma2ForCausalLM(_PopMixin, Gemma2ForCausalLM):
    pass
