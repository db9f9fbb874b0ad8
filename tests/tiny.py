"""Tiny random decoders of every supported architecture, and helpers to run captured graphs."""
from __future__ import annotations

import torch
import transformers

from popcompile.frontend.arch import attention_implementation

ATTN_CAP, LOGIT_CAP = 0.1, 1.0  # tiny Gemma 2's soft-caps

# model_type -> (config class, model class, extra config); every entry of arch.DECODER_TYPES needs one (a
# vision-language model's text decoder is tested inside tiny_vlm)
TINY = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 5}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, {
        "sliding_window": 4, "layer_types": None, "query_pre_attn_scalar": 16}),
    # multipliers away from 1 so that a dropped one shows (Granite 3: 12, 0.22, 1/128 and 8 or 16; here the
    # branches outweigh the embedding and the logits are sharpened, so that the deep layers matter)
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM, {
        "embedding_multiplier": 0.5, "residual_multiplier": 2.0, "attention_multiplier": 0.125,
        "logits_scaling": 0.5}),
    # caps small enough that tanh bends this tiny model's scores and logits (Gemma 2: 50 and 30)
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, {
        "sliding_window": 4, "query_pre_attn_scalar": 16, "attn_logit_softcapping": ATTN_CAP,
        "final_logit_softcapping": LOGIT_CAP}),
    # post-norm layers (each branch's output normed before the residual add), full-width q/k norms; no pad or
    # eos ids (OLMo's defaults, 1 and 50279, would mask a prompt's token 1, and sit off the vocabulary)
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {"eos_token_id": None,
                                                                      "pad_token_id": None}),
    # mixtures of experts: 8 experts of width 32, 2 per token (OLMoE: 4, routing not renormalised; its q/k
    # norms are full-width RMS norms, so |q|, |k| <= sqrt(64) * ~1.1 and clip_qkv 10 never clamps: finite
    # differences (test_analyze) fail at a clamp's kink; test_pass checks a clamp that does)
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, {
        "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "norm_topk_prob": False,
        "clip_qkv": 10.0, "eos_token_id": None, "pad_token_id": None}),
    # Phi-4-mini's layout: fused qkv_proj and gate_up_proj, RoPE on the first 3/4 of each head with LongRoPE
    # (tiny_model adds its short and long factors, rotary_dim / 2 of each; the long ones past 64 positions)
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {
        "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0}),
}


#: the families among TINY whose attention scores are soft-capped: their layers stay standard ONNX ops (no
#: fused attention, so no shared KV buffer)
CAPPED = frozenset({"gemma2"})

#: the mixtures of experts among TINY (their MLP is transformers' experts block: router + experts op)
MOE = frozenset({"qwen3_moe", "mixtral", "olmoe"})


def tiny_model(model_type: str, *, layers=4, heads=4, kv_heads=2, head_dim=16, seed=0, **overrides):
    config_cls, model_cls, extra = TINY[model_type]
    kwargs = dict(
        vocab_size=97, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=128, tie_word_embeddings=True,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    if model_type == "gemma3_text" and kwargs.get("layer_types") is None:
        # alternate local (sliding) and global layers, as Gemma 3 does (5:1 there)
        kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(layers)]
    if model_type == "phi3" and "rope_scaling" not in kwargs:
        kwargs["rope_scaling"] = longrope(int(head_dim * kwargs["partial_rotary_factor"]))
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    config._attn_implementation = attention_implementation(config)  # eager where attention is soft-capped
    model = model_cls(config).eval()
    # random init leaves norms at 1 and can make deep layers near no-ops: perturb every weight
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def longrope(rotary_dim: int) -> dict:
    """Phi-3.5 / Phi-4-mini's rope_scaling (LongRoPE): one short and one long factor per rotated pair."""
    pairs = range(rotary_dim // 2)
    return {"type": "longrope", "short_factor": [1.0 + 0.2 * i for i in pairs],
            "long_factor": [1.0 + 1.5 * i for i in pairs]}


#: Qwen3-VL's special ids inside the tiny vocabulary (the real model's sit above its text vocabulary too)
VL_IDS = {"image_token_id": 150, "video_token_id": 151, "vision_start_token_id": 152,
          "vision_end_token_id": 153}


def tiny_vlm(*, layers=6, deepstack=(0, 1), seed=0, **text_overrides):
    """A tiny random Qwen3-VL (DESIGN.md's shapes): text width 64, head_dim 16 with M-RoPE sections
    [4, 2, 2]; a 2-layer vision tower of width 32, patch 4, merge 2, ``deepstack`` vision layers feeding
    decoder layers 0..len-1. Weights drawn wide enough that greedy tokens vary (the default init's tiny
    model repeats one token)."""
    text = dict(vocab_size=160, num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True}, **text_overrides)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=list(deepstack))
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                        **VL_IDS)
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.15 if p.dim() > 1 else 1.0 + 0.3 * torch.randn_like(p))
    return model


def tiny_images(model, sizes, seed=0):
    """Random preprocessed images of ``sizes`` [(h, w) in pixels, multiples of patch x merge]:
    (pixel_values [P, C*T*p*p], image_grid_thw [I, 3]) as the Qwen-VL processor lays them out."""
    vc = model.config.vision_config
    grids = torch.tensor([[1, h // vc.patch_size, w // vc.patch_size] for h, w in sizes])
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(int(grids.prod(-1).sum()), width, generator=generator), grids


def vl_prompt(model, grids, text=(5, 6, 7), question=(8, 9, 10, 11)):
    """Prompt ids [1, N]: ``text``, then each image as vision_start, its placeholders, vision_end, then
    ``question``."""
    merge = model.config.vision_config.spatial_merge_size
    ids = list(text)
    for grid in grids.tolist():
        ids += [VL_IDS["vision_start_token_id"], *[VL_IDS["image_token_id"]] * (grid[0] * grid[1] * grid[2]
                                                                                // merge ** 2),
                VL_IDS["vision_end_token_id"]]
    return torch.tensor([ids + list(question)])


def empty_past(layout, batch=1):
    return [torch.zeros(batch, layout.num_kv_heads, 0, layout.head_dim) for _ in range(2 * layout.num_layers)]


def run_graph(module, ids, past, start=0):
    """Run a captured/prefill graph on ids [B, T] after `past` rows; returns the flat outputs."""
    batch, seq = ids.shape
    pos = torch.arange(start, start + seq).repeat(batch, 1)
    mask = torch.ones(batch, start + seq, dtype=torch.int64)
    return module(ids, pos, mask, *past)


def greedy_with_graphs(pair, prompt, max_new_tokens):
    """POP generation with the two graphs. Folded boundary: the prefill graph on x_1..x_N gives the first
    token's logits; separate: prefill x_1..x_{N-1}, then x_N with the decode graph. Then decode steps."""
    prefill, decode = pair.prefill.module(), pair.decode.module()
    n = prompt.shape[1]
    if pair.boundary == "folded":
        logits, *past = run_graph(prefill, prompt, empty_past(pair.layout))
        tokens = [int(logits[0].argmax())]
        ids, start = torch.tensor([[tokens[-1]]]), n
    else:
        past = list(run_graph(prefill, prompt[:, : n - 1], empty_past(pair.layout)))
        ids, start, tokens = prompt[:, n - 1:], n - 1, []
    while len(tokens) < max_new_tokens:
        logits, *new = run_graph(decode, ids, past, start)
        past = [torch.cat([p, q], dim=2) for p, q in zip(past, new)]
        start += ids.shape[1]
        tokens.append(int(logits[0].argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens


def vl_greedy_with_graphs(pair, model, prompt, images, max_new_tokens):
    """POP generation of a vision-language prompt with the two graphs (folded boundary): the prefill graph
    on x_1..x_N with the image features and M-RoPE positions, then decode steps at row + rope_delta with
    zero visual rows."""
    from popcompile.frontend.vision import encode_prompt, visual_embeds

    encoded = encode_prompt(model, prompt, images)
    visual = visual_embeds(encoded)
    prefill, decode = pair.prefill.module(), pair.decode.module()
    n = prompt.shape[1]
    mask = torch.ones(1, n, dtype=torch.int64)
    logits, *past = prefill(prompt, encoded.positions, mask, visual, *empty_past(pair.layout))
    tokens = [int(logits[0].argmax())]
    while len(tokens) < max_new_tokens:
        row = n + len(tokens) - 1
        positions = (torch.tensor([[row]]) + encoded.rope_delta).expand(3, 1, 1)
        mask = torch.ones(1, row + 1, dtype=torch.int64)
        logits, *new = decode(torch.tensor([[tokens[-1]]]), positions, mask,
                              visual.new_zeros(visual.shape[0], 1, 1, visual.shape[-1]), *past)
        past = [torch.cat([p, q], dim=2) for p, q in zip(past, new)]
        tokens.append(int(logits[0].argmax()))
    return tokens


class CharTokenizer:
    """Character-level stand-in for a HF tokenizer (ids fit the tiny models' vocabulary of 97)."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 97 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i % 95) for i in ids)
