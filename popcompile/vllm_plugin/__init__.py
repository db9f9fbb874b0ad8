"""POP inside vLLM: a ``vllm.general_plugins`` entry point (pyproject.toml) that vLLM calls in every process.

``register()`` names the POP model classes to vLLM's ``ModelRegistry`` as strings (nothing is imported
until a POP folder is loaded, after vLLM has forked its workers) and adds the config hook that turns on
the logits indices POP needs (``settings.PopConfigHook``), and refuses ``prompt_logprobs`` of POP models
where requests enter (``requests.py``). A folder from ``popcompile export MODEL
--target vllm`` names a POP class in ``architectures``; any other model is untouched. It also names
``PopConnector`` (connector.py), the KV connector of a POP prefill instance and its full-model decode
instance.

    config.json  "architectures": ["PopLlamaForCausalLM"], "popcompile": {"cut": 20, ...}
    vllm serve DIR  /  vllm.LLM(DIR)      -> models.PopLlamaForCausalLM (model.pop_forward per step)

Design and measurements: docs/vllm.md.
"""
from __future__ import annotations

from .settings import POP_ARCHITECTURES

__all__ = ["register"]
CONNECTOR = "PopConnector"


def register() -> None:
    """vLLM's plugin hook: register the POP architectures and their config hook (idempotent)."""
    from vllm import ModelRegistry
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from . import requests
    from .settings import PopConfigHook

    requests.install()
    if CONNECTOR not in KVConnectorFactory._registry:  # "kv_connector": "PopConnector" (connector.py)
        KVConnectorFactory.register_connector(CONNECTOR, f"{__name__}.connector", CONNECTOR)
    for pop_name in POP_ARCHITECTURES:
        if pop_name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(pop_name, f"popcompile.vllm_plugin.models:{pop_name}")
        MODELS_CONFIG_MAP[pop_name] = PopConfigHook
