"""The per-architecture table: the only place where architectures differ.

Everything else (capture, the POP pass, the reference) works from the HF config and from graph
metadata. An entry says what the model's forward accepts, not how it computes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    # The model's forward accepts {"full_attention": mask, "sliding_attention": mask} (models with
    # config.layer_types); otherwise it takes one 4D mask for every layer.
    mask_mapping: bool
    # Module names inside a decoder layer that the eager reference and POP+ calibration use. input_norm
    # None: a post-norm layer (OLMo 2) whose attention reads the residual stream itself.
    input_norm: str | None = "input_layernorm"
    k_proj: str = "self_attn.k_proj"
    v_proj: str = "self_attn.v_proj"
    # The one projection whose output rows are [q; k; v] (H*D, H_kv*D, H_kv*D rows: Phi-3's qkv_proj), None
    # where K and V have modules of their own. Eager code reads and writes the K/V rows through
    # kv_projections; the graph passes split it into nodes named k_proj and v_proj (passes/fused.py).
    fused_qkv: str | None = None
    # The RMS norm applied to K before RoPE, None where there is none; over each head's D values
    # (k_norm_width "head": Qwen3, Gemma 3) or over the whole projection, H_kv * D ("full": OLMo 2, OLMoE).
    k_norm: str | None = None
    k_norm_width: str = "head"
    # The config key of a clamp of q, k and v to [-clip, clip] right after their projections and norms
    # (OLMoE's clip_qkv; no clamp where the config's value is None), None where the family has none.
    clip_qkv: str | None = None
    # Norms on each branch's output before the residual add (Gemma 3's post-attention / post-feedforward
    # "sandwich" norms): the residual stream is then not rotation invariant (SliceGPT refuses it).
    branch_output_norms: bool = False
    # the vision-language model this decoder is the text part of (frontend/vision.py), None for a model
    # loaded on its own
    part_of: str | None = None

    def __post_init__(self) -> None:
        if self.k_norm_width not in ("head", "full"):
            raise ValueError(f"ArchSpec.k_norm_width must be 'head' or 'full', got {self.k_norm_width!r}")


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        ArchSpec("llama", mask_mapping=False),
        ArchSpec("mistral", mask_mapping=False),
        ArchSpec("qwen2", mask_mapping=True),
        ArchSpec("qwen3", mask_mapping=True, k_norm="self_attn.k_norm"),
        ArchSpec("qwen3_moe", mask_mapping=False, k_norm="self_attn.k_norm"),
        ArchSpec("mixtral", mask_mapping=False),
        # Phi-3, Phi-3.5, Phi-4-mini: fused qkv_proj (and gate_up_proj, which POP drops with the MLP); partial
        # rotary and LongRoPE are the model's own rotary module's (frontend/capture.settle_longrope)
        ArchSpec("phi3", mask_mapping=False, fused_qkv="self_attn.qkv_proj"),
        ArchSpec("gemma3_text", mask_mapping=True, k_norm="self_attn.k_norm", branch_output_norms=True),
        # Granite: Llama's layer with embedding, residual and attention multipliers inside transformers'
        # modules (captured as ops) and logits divided by logits_scaling (finish_logits)
        ArchSpec("granite", mask_mapping=False),
        # Gemma 2: Gemma 3's sandwich norms without a k-norm; attention scores soft-capped
        # (attention_implementation), final logits soft-capped (finish_logits)
        ArchSpec("gemma2", mask_mapping=True, branch_output_norms=True),
        # post-norm layers: no input norm, each branch's output normed before the residual add
        ArchSpec("olmo2", mask_mapping=False, input_norm=None, k_norm="self_attn.k_norm", k_norm_width="full",
                 branch_output_norms=True),
        ArchSpec("olmoe", mask_mapping=False, k_norm="self_attn.k_norm", k_norm_width="full",
                 clip_qkv="clip_qkv"),
        # Qwen3-VL's text decoder (frontend/vision.py: the model around it)
        ArchSpec("qwen3_vl_text", mask_mapping=False, k_norm="self_attn.k_norm", part_of="qwen3_vl"),
    )
}


#: the decoders loaded on their own (a vision-language model's text decoder is loaded with its model)
DECODER_TYPES: tuple[str, ...] = tuple(t for t, spec in ARCHITECTURES.items() if spec.part_of is None)


#: the transformers model folders (``transformers.models.<folder>``) whose decoders the table covers
TRANSFORMERS_FOLDERS: frozenset[str] = frozenset(
    {t.removesuffix("_text") for t in ARCHITECTURES}
    | {spec.part_of for spec in ARCHITECTURES.values() if spec.part_of})


def transformers_folder(cls: type) -> str | None:
    """``llama`` for ``transformers.models.llama.modeling_llama.LlamaDecoderLayer``; None for a class that is
    not one of transformers' models (a user's own module)."""
    parts = getattr(cls, "__module__", "").split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else None


def arch_spec(config) -> ArchSpec:
    """The table entry for a HF config (a vision-language model's: its text decoder's), or a ValueError
    naming the model type and what is supported."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {model_type!r}: popcompile handles decoder-only "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]


#: the fused [q; k; v] projections' names inside a decoder layer (what the graph passes split)
FUSED_QKV: frozenset[str] = frozenset(spec.fused_qkv for spec in ARCHITECTURES.values() if spec.fused_qkv)


@dataclass(frozen=True)
class KVProjection:
    """A decoder layer's K or V projection: a Linear of its own, or rows ``rows`` of a fused one. ``weight``
    [out, in] and ``bias`` [out] (or None) are read from the module when asked (the module's parameters, or
    views of their rows), so an in-place write (``weight.copy_(...)``) changes the model, and a model whose
    parameters are swapped (frontend/lazy.py: streamed, materialised) is read as it is then. Calling it runs
    the module (a streamed module reads its weights for that forward) and keeps its rows."""

    module: torch.nn.Module  # the Linear that computes it (the fused one for a fused projection)
    rows: slice | None = None  # its rows of ``module``'s output; None: all of them

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight if self.rows is None else self.module.weight[self.rows]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.module.bias
        return bias if bias is None or self.rows is None else bias[self.rows]

    @property
    def out_features(self) -> int:
        return self.module.out_features if self.rows is None else self.rows.stop - self.rows.start

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        return out if self.rows is None else out[..., self.rows]


def split_fused_kv(rows: int, kv_width: int) -> tuple[slice, slice]:
    """The K and V rows of a fused [q; k; v] projection of ``rows`` output rows whose K and V have
    ``kv_width`` (H_kv * D) rows each: (slice(q, q + kv), slice(q + kv, rows)), q = rows - 2 * kv."""
    q = rows - 2 * kv_width
    if q <= 0:
        raise ValueError(f"a fused [q; k; v] projection of {rows} rows has no room for K and V of {kv_width}")
    return slice(q, q + kv_width), slice(q + kv_width, rows)


#: the names of a layer's K and V projections in a K/V fit (kvfit/), in kv_projections' order
KV_PARTS = ("k_proj", "v_proj")


def kv_projections(spec: ArchSpec, layer) -> dict[str, KVProjection]:
    """``{"k_proj": K, "v_proj": V}`` of a Hugging Face decoder layer, the one way POP+ and POP++ (kvfit/) and
    the reference read and write them: the modules ``spec.k_proj`` and ``spec.v_proj``, or the K/V rows of
    ``spec.fused_qkv``."""
    if spec.fused_qkv is None:
        modules = (layer.get_submodule(spec.k_proj), layer.get_submodule(spec.v_proj))
        return {part: KVProjection(m) for part, m in zip(KV_PARTS, modules)}
    fused = layer.get_submodule(spec.fused_qkv)
    attention = layer.get_submodule(spec.fused_qkv.rsplit(".", 1)[0])
    rows = split_fused_kv(fused.out_features, attention.num_key_value_heads * attention.head_dim)
    return {part: KVProjection(fused, r) for part, r in zip(KV_PARTS, rows)}


def pruned_kv(spec: ArchSpec, layer, h_cut, project=None, head_dim: int | None = None):
    """POP's cache rows of a pruned layer, before RoPE: the one recipe (passes/pop.py rewires graphs to it;
    kvfit/distill.py trains through it; vllm_plugin/model.py serves with it).

        x = input_norm(h_cut), or h_cut itself      [..., d]  (post-norm layers have no input norm)
        k, v = project(x)                          [..., H_kv * D] each (the layer's k/v projections or a fit)
        k = k_norm(k), where spec has one          over D of [..., H_kv, D] ("head") or all H_kv * D ("full")
        k, v = clamp(k, v, -clip, clip)            where spec names a clip and the config sets it

    ``layer``: a decoder layer with the table's module names (Hugging Face's, and vLLM's for ``input_norm``
    and ``k_norm``). ``project`` None: the layer's own K/V projections (``kv_projections``: a fused qkv_proj's
    K/V rows, never its Q rows; Hugging Face layers only). ``head_dim``: needed where spec has a k_norm.
    Returns k, v [..., H_kv * D]; each caller applies RoPE in its own layout."""
    x = h_cut if spec.input_norm is None else layer.get_submodule(spec.input_norm)(h_cut)
    if project is None:
        own = kv_projections(spec, layer)
        project = lambda x: (own["k_proj"](x), own["v_proj"](x))  # noqa: E731
    k, v = project(x)
    if spec.k_norm is not None:
        norm = layer.get_submodule(spec.k_norm)
        heads = k.view(*k.shape[:-1], -1, head_dim)  # [..., H_kv, D]
        k = norm(k) if spec.k_norm_width == "full" else norm(heads).view(k.shape)
    clip = qkv_clip(spec, layer)
    if clip is not None:
        k, v = k.clamp(-clip, clip), v.clamp(-clip, clip)
    return k, v


def attention_implementation(config) -> str:
    """The attention transformers loads the model with: "sdpa", or "eager" where attention scores are
    soft-capped (Gemma 2's ``attn_logit_softcapping``: transformers refuses SDPA, which has no cap). Capture
    replaces either with its own function (capture.pop_attention), which writes the cap as plain ops."""
    return "eager" if attention_softcap(config) is not None else "sdpa"


def attention_softcap(config) -> float | None:
    """The cap on attention scores, ``tanh(s / cap) * cap`` (Gemma 2's attn_logit_softcapping), or None."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "attn_logit_softcapping", None)


def finish_logits(config, logits):
    """What the causal LM does to its LM head's output ``logits`` [..., V]: divide by ``logits_scaling``
    (Granite), then soft-cap as ``tanh(logits / cap) * cap`` (Gemma 2's and Gemma 3's
    ``final_logit_softcapping``), each where the (text) config sets it. The one copy of this recipe: capture,
    analyze's scorers and POP++'s student all run the head by hand, and must agree with ``model.generate``."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None:
        logits = logits / scaling
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = (logits / cap).tanh() * cap  # a tensor method: this table imports no torch
    return logits


def qkv_clip(spec: ArchSpec, layer) -> float | None:
    """The clamp bound of the layer's q/k/v (``spec.clip_qkv`` read from its attention module's config), None
    for no clamp."""
    if spec.clip_qkv is None:
        return None
    attention = layer.get_submodule(spec.k_proj.rsplit(".", 1)[0])
    return getattr(attention.config, spec.clip_qkv, None)


def layer_kinds(config) -> list[str]:
    """Attention kind of every layer: "full_attention" or "sliding_attention"."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return list(kinds)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return [kind] * config.num_hidden_layers


def attention_windows(config) -> dict[str, int | None]:
    """Window of each attention kind the model uses (None = full causal), in layer order of first use."""
    windows: dict[str, int | None] = {}
    for kind in layer_kinds(config):
        windows.setdefault(kind, config.sliding_window if kind == "sliding_attention" else None)
    return windows
