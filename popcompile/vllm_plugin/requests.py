"""Refuse ``prompt_logprobs`` where the request enters vLLM, also offline (``LLM.generate``).

Prompt tokens never reach the deep layers under POP, so their logprobs cannot be computed. vLLM's
server already refuses them under ``kv_sharing_fast_prefill`` (AsyncLLM); the offline path reaches an
``assert`` in the model runner instead, which kills the engine and every request in flight. This wraps
``InputProcessor._validate_params`` (front end, before scheduling) with the same refusal, for POP
folders only. Installed by ``register()``, once per process.
"""
from __future__ import annotations

from .patching import wrap_once
from .settings import POP_ARCHITECTURES


def install() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    wrap_once(InputProcessor, "_validate_params", _refusing_prompt_logprobs)


def _refusing_prompt_logprobs(original):
    from vllm.exceptions import VLLMValidationError

    def validate(self, params, supported_tasks):
        pop = self.vllm_config.model_config.architecture in POP_ARCHITECTURES
        if pop and getattr(params, "prompt_logprobs", None):
            raise VLLMValidationError(
                "prompt_logprobs: this model is served with POP (popcompile), whose prompt tokens skip the "
                "deep layers, so their logprobs cannot be computed; drop prompt_logprobs, or serve the model "
                "without POP", parameter="prompt_logprobs")
        return original(self, params, supported_tasks)

    return validate
