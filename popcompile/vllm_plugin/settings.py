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
from ..errors import ConfigError, EnvironmentUnavailable, ModelError, PopcompileError, UnsupportedModelError
from ..threshold import is_token_count

VLLM_VERSION = "0.32.0"  # the one vLLM whose attention metadata and model classes this plugin was built on
KV_WEIGHTS_FILE = "pop_kv.safetensors"
KV_PREFIX = "pop_kv."  # tensor names in KV_WEIGHTS_FILE: pop_kv.layers.{l}.{k_proj|v_proj}.{weight|bias}

# POP class -> the stock vLLM/Hugging Face architecture it serves
POP_ARCHITECTURES = {"PopLlamaForCausalLM": "LlamaForCausalLM", "PopMistralForCausalLM": "MistralForCausalLM",
                     "PopQwen2ForCausalLM": "Qwen2ForCausalLM", "PopQwen3ForCausalLM": "Qwen3ForCausalLM",
                     "PopGemma3ForCausalLM": "Gemma3ForCausalLM",
                     # mixtures of experts: the deep layers' routers and experts run on the survivors only
                     "PopQwen3MoeForCausalLM": "Qwen3MoeForCausalLM",
                     "PopMixtralForCausalLM": "MixtralForCausalLM",
                     "PopOlmoeForCausalLM": "OlmoeForCausalLM",
                     "PopGraniteForCausalLM": "GraniteForCausalLM",
                     "PopGemma2ForCausalLM": "Gemma2ForCausalLM"}
BASE_TO_POP = {base: pop for pop, base in POP_ARCHITECTURES.items()}


@dataclass(frozen=True)
class StockStack:
    """How a stock vLLM decoder stack is driven where it differs from Llama's (model.py's units read it)."""
    # True: layer(positions, hidden, residual) -> (hidden, residual), the residual add fused into the next
    # norm, the stream being hidden + residual; False: layer(positions, hidden) -> hidden, the stream whole
    # (Granite: each branch is scaled by residual_multiplier before its add)
    carries_residual: bool = True
    # the config field the stock model's forward multiplies the embeddings by, outside embed_input_ids
    # (Granite's embedding_multiplier; Gemma's normalizer is inside embed_input_ids)
    embedding_multiplier: str | None = None


#: POP class -> its stack, where not Llama's
STOCK_STACKS = {"PopGraniteForCausalLM": StockStack(carries_residual=False,
                                                    embedding_multiplier="embedding_multiplier")}

# The mixtures of experts served: POP class -> (model_type, {config field: (the one value served, why)}).
# vLLM's classes read fewer fields than transformers' (popcompile.reference): a checkpoint with another value
# would be served with other experts than its own, so it is refused (``check_served``) rather than served
# wrong.
_SILU = ("silu", "vLLM's fused experts compute SiLU whatever hidden_act says")
MOE_FAMILIES = {
    "PopQwen3MoeForCausalLM": ("qwen3_moe", {
        "hidden_act": _SILU,
        "shared_expert_intermediate_size": (0, "vLLM's class adds a shared expert that transformers' "
                                               "Qwen3-MoE does not have")}),
    "PopMixtralForCausalLM": ("mixtral", {"hidden_act": _SILU}),
    # vLLM's OLMoE: no clamp of q/k/v, every RMS norm at eps 1e-5, the router's top-k weights as the softmax
    # gives them (renormalize=False), no attention bias, an LM head of its own (a tied checkpoint, which saves
    # no lm_head.weight, would leave it unloaded: measured, every token wrong)
    "PopOlmoeForCausalLM": ("olmoe", {
        "tie_word_embeddings": (False, "vLLM's class never ties lm_head to the embeddings"),
        "hidden_act": _SILU,
        "clip_qkv": (None, "vLLM's class does not clamp q, k and v"),
        "rms_norm_eps": (1e-5, "vLLM's class builds every RMS norm with eps 1e-5"),
        "norm_topk_prob": (False, "vLLM's class never renormalises the router's top-k weights"),
        "attention_bias": (False, "vLLM's class has no q/k/v/o bias")}),
}
# mixtures of experts the plugin does not serve (model_type -> the family and what it lacks), refused by name
# where a POP folder of one loads (vLLM serves them without POP)
UNSERVED_MOE = {"qwen2_moe": "Qwen2-MoE (shared experts)",
                "gpt_oss": "gpt-oss (attention sinks; biased MXFP4 experts with a clamped SwiGLU)"}

# families popcompile compiles (ONNX engines, torch.compile) but its vLLM plugin does not serve (model_type ->
# the family and why), refused by name: by the exporter, and where a folder whose config.json names a POP
# class loads. OLMo 2: vLLM 0.32 has no class of its own for it and runs Olmo2ForCausalLM through its
# Transformers backend (transformers' modules, fused and compiled as one graph), not a vLLM decoder stack
# that POP's units drive
UNSERVED_FAMILIES = {"olmo2": "OLMo 2 (vLLM 0.32 runs it through its Transformers backend, not a vLLM "
                              "decoder stack of its own)"}


def check_served(architecture: str | None, hf_config: Any) -> None:
    """UnsupportedModelError, one line, unless the POP class ``architecture`` serves ``hf_config`` as
    transformers computes it: a mixture of experts the plugin does not serve (``UNSERVED_MOE``), a POP
    mixture of experts class over another family's config, or a config field its vLLM class does not read
    (``MOE_FAMILIES``). Called by the exporter and, where a POP folder loads, by ``PopConfigHook``."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in UNSERVED_FAMILIES:
        raise UnsupportedModelError(
            f"{UNSERVED_FAMILIES[model_type]}, model_type {model_type!r}: popcompile's vLLM plugin does not "
            "serve it; export it with --target onnx, or serve it with vLLM without POP")
    if model_type in UNSERVED_MOE:
        raise UnsupportedModelError(
            f"{UNSERVED_MOE[model_type]}, model_type {model_type!r}: a mixture of experts popcompile's vLLM "
            f"plugin does not serve (it serves {', '.join(family for family, _ in MOE_FAMILIES.values())}); "
            "serve the model with vLLM without POP")
    if architecture not in MOE_FAMILIES:
        return
    family, fields = MOE_FAMILIES[architecture]
    if model_type != family:
        raise UnsupportedModelError(f"{architecture} serves model_type {family!r}, and this config.json has "
                                    f"{model_type!r}: export the model again with `popcompile export MODEL "
                                    "--target vllm`")
    for field, (served, why) in fields.items():
        value = getattr(hf_config, field, None)
        if value is not None and value != served:
            raise UnsupportedModelError(
                f"{POP_ARCHITECTURES[architecture]} with {field}={value!r}: {why}, so popcompile's vLLM "
                f"plugin serves {field}={served!r} only; this checkpoint is not supported")


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


class FolderRefused(PopcompileError, RuntimeError):
    """A POP folder or deployment the plugin will not serve, raised where vLLM builds its config: the
    refusal's own type and message in one line. Not a ValueError, which vLLM's config validation (pydantic)
    would wrap into a multi-line ValidationError."""


class PopConfigHook:
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``): checks the folder and the deployment, and
    turns on ``kv_sharing_fast_prefill`` so that the model runner hands the model the logits indices
    (the tokens that survive into the deep layers) and refuses ``prompt_logprobs``."""

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        try:
            PopConfigHook._verify_and_update_config(vllm_config)
        except PopcompileError as err:  # one line, as popcompile's own refusals (not pydantic's wrapping)
            raise FolderRefused(f"{type(err).__name__}: {err}") from None

    @staticmethod
    def _verify_and_update_config(vllm_config: Any) -> None:
        import vllm

        check_vllm_version(vllm.__version__)
        check_served(vllm_config.model_config.architecture, vllm_config.model_config.hf_config)
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
