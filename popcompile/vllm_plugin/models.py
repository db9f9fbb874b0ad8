"""The POP model classes vLLM loads by name (settings.POP_ARCHITECTURES; registered lazily by ``register``).

Each is the stock vLLM class with POP's forward (model.pop_forward) and the POP+ weights; the stock
layers, weights and weight loading are untouched. Built for vLLM settings.VLLM_VERSION.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import vllm
from vllm.model_executor.models.llama import LlamaForCausalLM

from . import runner
from .model import PopKV, pop_forward, use_survivor_backend
from .settings import KV_PREFIX, PopSettings, check_vllm_version


class _PopMixin:
    """POP over a stock ``*ForCausalLM`` whose ``self.model`` is a vLLM decoder stack."""

    def _init_pop(self, vllm_config) -> None:
        check_vllm_version(vllm.__version__)
        self.pop_settings = PopSettings.of(vllm_config.model_config.hf_config)
        self.pop_kv = None
        if self.pop_settings.prunes:
            runner.install()
            use_survivor_backend(self.model, self.pop_settings.cut)
            bias = bool(getattr(self.config, "attention_bias", False))
            self.pop_kv = PopKV(self.model, self.pop_settings.cut, bias)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return pop_forward(self.model, self.pop_settings, self.pop_kv, input_ids, positions, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.pop_kv is None:
            return super().load_weights(w for w in weights if not w[0].startswith(KV_PREFIX))
        stock, loaded = self.pop_kv.load_weights(weights)
        return super().load_weights(stock) | loaded


class PopLlamaForCausalLM(_PopMixin, LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._init_pop(vllm_config)
