"""What a POP folder tells vLLM (config.json's ``popcompile`` entry), validated once; the config hook.

    config.json
      "architectures": ["PopLlamaForCausalLM"]
      "popcompile": {"cut": 20, "kv_weights": "pop_kv.safetensors" | null, "min_prompt_tokens": 64,
                     "format": 1}

``min_prompt_tokens``: a request whose prompt is shorter runs every prompt token through the full model
(runner.py); absent (folders written before it existed): 0, POP for every prompt, as those folders served.

``cut == num_hidden_layers`` serves the unpruned model through the same class. Everything here is
importable without vLLM (the exporter and the tests use it); the hook runs inside vLLM's config build.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..engine.vllm_folder import CONFIG_KEY, FORMAT, is_readable_entry
from ..errors import ConfigError, EnvironmentUnavailable, ModelError
from ..threshold import is_token_count

VLLM_VERSION = "0.32.0"  # the one vLLM whose attention metadata and model classes this plugin was built on
KV_WEIGHTS_FILE = "pop_kv.safetensors"
KV_PREFIX = "pop_kv."  # tensor names in KV_WEIGHTS_FILE: pop_kv.layers.{l}.{k_proj|v_proj}.{weight|bias}

# POP class -> the stock vLLM/Hugging Face architecture it serves
POP_ARCHITECTURES = {"PopLlamaForCausalLM": "LlamaForCausalLM", "PopMistralForCausalLM": "MistralForCausalLM",
                     "PopQwen2ForCausalLM": "Qwen2ForCausalLM", "PopQwen3ForCausalLM": "Qwen3ForCausalLM",
                     "PopGemma3ForCausalLM": "Gemma3ForCausalLM"}
BASE_TO_POP = {base: pop for pop, base in POP_ARCHITECTURES.items()}


@dataclass(frozen=True)
class PopSettings:
    cut: int
    num_layers: int
    kv_weights: str | None = None
    min_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.cut, bool) or not isinstance(self.cut, int) \
                or not 1 <= self.cut <= self.num_layers:
            raise ModelError(f"config.json popcompile.cut={self.cut!r} is not a layer count in "
                             f"1..{self.num_layers}: "
                             "export the folder again with `popcompile export MODEL --target vllm`")
        if self.kv_weights not in (None, KV_WEIGHTS_FILE):
            raise ModelError(f"config.json popcompile.kv_weights={self.kv_weights!r}: "
                             f"expected {KV_WEIGHTS_FILE!r} or null; export the folder again")
        threshold = self.min_prompt_tokens
        if not is_token_count(threshold):
            raise ModelError(f"config.json popcompile.min_prompt_tokens={threshold!r} is not a token count "
                             ">= 0: export the folder again with `popcompile export MODEL --target vllm`")

    @property
    def prunes(self) -> bool:
        return self.cut < self.num_layers

    @classmethod
    def of(cls, hf_config: Any) -> PopSettings:
        entry = getattr(hf_config, CONFIG_KEY, None)
        if not is_readable_entry(entry):
            raise ModelError(f"config.json has no readable {CONFIG_KEY!r} entry of format {FORMAT} "
                             f"({entry!r}): make the folder with `popcompile export MODEL --target vllm`")
        return cls(cut=entry.get("cut"), num_layers=hf_config.num_hidden_layers,
                   kv_weights=entry.get("kv_weights"), min_prompt_tokens=entry.get("min_prompt_tokens", 0))

    @classmethod
    def for_instance(cls, vllm_config: Any) -> PopSettings:
        """The folder's settings as this vLLM instance serves them: a decode instance of a prefill/decode
        pair (``kv_role`` "kv_consumer", connector.py) runs the full model, whatever the folder's cut."""
        settings = cls.of(vllm_config.model_config.hf_config)
        transfer = vllm_config.kv_transfer_config
        if transfer is not None and transfer.kv_role == "kv_consumer":
            return replace(settings, cut=settings.num_layers)
        return settings

    def to_json(self) -> dict:
        return {"format": FORMAT, "cut": self.cut, "kv_weights": self.kv_weights,
                "min_prompt_tokens": self.min_prompt_tokens}


def check_vllm_version(version: str) -> None:
    if version != VLLM_VERSION:
        raise EnvironmentUnavailable(
            f"vLLM {version} is installed; popcompile's POP plugin is built for vLLM {VLLM_VERSION} "
            f"(pip install \"popcompile[vllm]\", or `pip install vllm=={VLLM_VERSION}`), or serve the "
            "folder's model without POP")


class PopConfigHook:
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``): checks the folder and the deployment, and
    turns on ``kv_sharing_fast_prefill`` so that the model runner hands the model the logits indices
    (the tokens that survive into the deep layers) and refuses ``prompt_logprobs``."""

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        import vllm

        check_vllm_version(vllm.__version__)
        settings = PopSettings.for_instance(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ConfigError(f"tensor_parallel_size={parallel.tensor_parallel_size}, pipeline_parallel_size="
                              f"{parallel.pipeline_parallel_size}: the POP plugin serves one device per "
                              "model for now; set both to 1")
        if vllm_config.speculative_config is not None:
            raise ConfigError("speculative decoding with a POP folder: drafts need the full model's logits "
                              "for every token; serve without speculative_config")
        if settings.prunes:
            vllm_config.cache_config.kv_sharing_fast_prefill = True

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        return
