"""Vision-language models: what differs from a text decoder; a multimodal prompt as the text decoder sees it.

A VLM here is a vision tower in front of a text decoder that POP prunes like any other (image tokens are
prompt tokens). Its prompt reaches the decoder as four things, computed once by ``encode_prompt``:

    input_ids       [B, N]     text ids; each image is a run of ``image_token_id`` placeholders
    embeds          [B, N, d]  token embeddings, the vision tower's merged features scattered over the runs
    positions       [3, B, N]  M-RoPE rows (time, height, width): text advances all three by one, an image's
                               tokens take their grid coordinates, and text after it resumes at max(h', w')
    rope_delta      [B, 1]     positions[:, :, -1] + 1 - N: decode token t (cache row t) sits at t + delta
    visual_mask     [B, N]     where the image features went
    deepstack       k x [V, d] features of k vision layers, added to the hidden state at the image tokens
                               after decoder layers 0..k-1 (DeepStack): a POP cut must be >= k

The table ``VISION_LANGUAGE`` names, per model type, where the parts live and what the config calls them;
everything else reads the Hugging Face model's own modules (its vision tower, its ``get_rope_index``, its
image processor). ``image_turn`` (a chat turn with an image) and ``preprocess_image`` build image prompts on
the compiler's side: eval's images task, analyze, POP+ calibration (kvfit/images.py).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, InputError


@dataclass(frozen=True)
class VisionLanguageSpec:
    """Where a VLM's parts live (module paths from the ForConditionalGeneration class) and the config keys
    that describe its image tokens and its deepstack layers."""

    model_type: str
    vision: str = "model.visual"
    text: str = "model.language_model"
    inner: str = "model"                     # holds get_rope_index
    image_token: str = "image_token_id"      # config key of the placeholder id
    deepstack: str = "deepstack_visual_indexes"  # vision_config key: one decoder layer fed per entry
    auto_class: str = "AutoModelForImageTextToText"  # transformers' class that loads it from a folder
    #: transformers' image processor (numpy and Pillow: no torchvision) that ``preprocess_image`` runs; the
    #: runtime's numpy copy (runtime/vision.py) is tested equal to it
    image_processor: str = "Qwen2VLImageProcessorPil"


VISION_LANGUAGE: dict[str, VisionLanguageSpec] = {
    spec.model_type: spec for spec in (VisionLanguageSpec("qwen3_vl"),)
}


def vision_spec(config) -> VisionLanguageSpec | None:
    """The table entry of a VLM's config; None for a text-only model."""
    return VISION_LANGUAGE.get(getattr(config, "model_type", None))


def is_vision_language(model: torch.nn.Module) -> bool:
    return vision_spec(model.config) is not None


def deepstack_layers(config) -> int:
    """k: decoder layers 0..k-1 receive deepstack features (0 for a text model)."""
    spec = vision_spec(config)
    return 0 if spec is None else len(getattr(config.vision_config, spec.deepstack, None) or ())


def check_cut(config, cut: int) -> None:
    """A cut below the deepstack layers would prune a layer the image features still enter: refused."""
    k = deepstack_layers(config)
    if cut < k:
        raise ConfigError(f"cut {cut} is below {config.model_type}'s deepstack layers: image features are "
                          f"added after decoder layers 0..{k - 1}, so a POP cut must keep them: give --cut "
                          f"{k} or more (or a smaller --prune-ratio)")


@dataclass(frozen=True)
class ImageInputs:
    """Preprocessed images, as the Hugging Face processor returns them: ``pixel_values`` [P, C*T*p*p] (the
    patches of every image, in order) and ``image_grid_thw`` [I, 3] (each image's grid in patches)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


@dataclass(frozen=True)
class VisionPrompt:
    """One multimodal prompt as the text decoder takes it (module docstring)."""

    input_ids: torch.Tensor
    embeds: torch.Tensor
    positions: torch.Tensor
    rope_delta: torch.Tensor
    visual_mask: torch.Tensor
    deepstack: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


def image_token_count(config, images: ImageInputs) -> int:
    """The placeholders the images fill: each image's grid in patches over merge x merge."""
    merge = config.vision_config.spatial_merge_size
    return int(images.image_grid_thw.prod(-1).sum()) // (merge * merge)


@torch.no_grad()
def encode_prompt(model: torch.nn.Module, input_ids: torch.Tensor,
                  images: ImageInputs | None) -> VisionPrompt:
    """``input_ids`` [B, N] with ``images`` (their placeholders already expanded, as the processor does) as
    the text decoder's inputs, computed by the model's own vision tower and M-RoPE rule. InputError when
    the placeholders and the images disagree."""
    spec, config = vision_spec(model.config), model.config
    image_id = getattr(config, spec.image_token)
    placeholders = input_ids == image_id
    wanted = 0 if images is None else image_token_count(config, images)
    if int(placeholders.sum()) != wanted:
        raise InputError(f"the prompt has {int(placeholders.sum())} image placeholder tokens but the images "
                         f"fill {wanted}: expand each image's placeholder with the processor's rule")
    text = model.get_submodule(spec.text)
    embeds = text.get_input_embeddings()(input_ids)
    # no images: k empty feature lists, so that every prompt has k deepstack rows
    deepstack = tuple(embeds.new_zeros(0, embeds.shape[-1]) for _ in range(deepstack_layers(config)))
    if images is not None:
        vision = model.get_submodule(spec.vision)
        out = vision(images.pixel_values.to(vision.dtype), grid_thw=images.image_grid_thw, return_dict=True)
        # features [V, d] in placeholder order over every image
        embeds = embeds.masked_scatter(placeholders[..., None].expand_as(embeds),
                                       out.pooler_output.to(embeds.dtype))
        deepstack = tuple(f.to(embeds.dtype) for f in out.deepstack_features)
    inner = model.get_submodule(spec.inner)
    grid = None if images is None else images.image_grid_thw
    positions, delta = inner.get_rope_index(input_ids, mm_token_type_ids=placeholders.int(),
                                            image_grid_thw=grid)  # [3, B, N], [B, 1]
    return VisionPrompt(input_ids, embeds, positions, delta, placeholders, deepstack)


def visual_embeds(encoded: VisionPrompt) -> torch.Tensor:
    """The graphs' ``visual_embeds`` [1 + k, B, N, d] (frontend/capture.VisionDecoderWithKV): row 0 the
    image features at the image placeholders, rows 1..k the deepstack features there; zeros at text
    tokens."""
    mask = encoded.visual_mask[..., None]  # [B, N, 1]
    rows = [torch.where(mask, encoded.embeds, 0.0)]
    for features in encoded.deepstack:
        placed = encoded.embeds.new_zeros(encoded.embeds.shape)
        placed[encoded.visual_mask] = features
        rows.append(placed)
    return torch.stack(rows)


def image_turn(config, tokenizer, question: str, image_tokens: int) -> list[int]:
    """A user turn with one image before ``question`` (the chat template's, with the generation prompt; a
    tokenizer without one: vision_start, the image, vision_end, the question), its image placeholder
    expanded to ``image_tokens`` as the processor does. eval's images task, analyze and POP+ calibration
    build their image prompts with it."""
    spec = vision_spec(config)
    image_id = getattr(config, spec.image_token)
    start, pad, end = tokenizer.convert_ids_to_tokens([config.vision_start_token_id, image_id,
                                                       config.vision_end_token_id])
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(f"{start}{pad}{end}{question}").input_ids
    return [t for token in ids for t in ([token] * image_tokens if token == image_id else [token])]


def preprocess_image(config, processing: dict, image) -> ImageInputs:
    """One PIL image as the model's own image processor (the table's ``image_processor``, transformers')
    makes it with ``processing`` (``image_processing``'s record): pixel_values [P, C*T*p*p] and
    image_grid_thw [1, 3]."""
    import transformers

    processor = getattr(transformers, vision_spec(config).image_processor)(
        patch_size=processing["patch_size"], temporal_patch_size=processing["temporal_patch_size"],
        merge_size=processing["merge_size"], image_mean=list(processing["image_mean"]),
        image_std=list(processing["image_std"]), rescale_factor=processing["rescale_factor"],
        size={"shortest_edge": processing["min_pixels"], "longest_edge": processing["max_pixels"]})
    out = processor(images=[image], return_tensors="pt")
    return ImageInputs(out["pixel_values"].float(), out["image_grid_thw"])


#: transformers' Qwen-VL image processor settings where the model folder has no preprocessor_config.json
#: (Qwen3-VL's released values for pixels, mean and std; patch and merge sizes come from the vision config)
DEFAULT_PIXELS = {"min_pixels": 65536, "max_pixels": 16777216}
DEFAULT_NORMALIZE = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255}


def image_processing(config, folder: str | Path | None) -> dict:
    """How images become patches (engine/vision.py's ``processing``): the folder's preprocessor_config.json
    where it has one, else the vision config's patch sizes with Qwen3-VL's defaults."""
    vc = config.vision_config
    found = {}
    path = Path(folder) / "preprocessor_config.json" if folder else None
    if path is not None and path.is_file():
        found = json.loads(path.read_text(encoding="utf-8"))
    size = found.get("size") or {}
    return {
        "patch_size": int(found.get("patch_size", vc.patch_size)),
        "temporal_patch_size": int(found.get("temporal_patch_size", vc.temporal_patch_size)),
        "merge_size": int(found.get("merge_size", vc.spatial_merge_size)),
        "min_pixels": int(size.get("shortest_edge", found.get("min_pixels", DEFAULT_PIXELS["min_pixels"]))),
        "max_pixels": int(size.get("longest_edge", found.get("max_pixels", DEFAULT_PIXELS["max_pixels"]))),
        **{key: found.get(key, default) for key, default in DEFAULT_NORMALIZE.items()},
    }


def vision_record(model: torch.nn.Module, tokenizer, folder: str | Path | None) -> dict:
    """The manifest's vision section but its graph entry (engine/vision.py): processing, image tokens (ids
    and text), the position table's side, k and d."""
    spec, config = vision_spec(model.config), model.config
    ids = {key: int(getattr(config, key)) for key in ("image_token_id", "vision_start_token_id",
                                                       "vision_end_token_id")}
    texts = dict(zip(("image_token", "vision_start", "vision_end"),
                     tokenizer.convert_ids_to_tokens(list(ids.values()))))
    side = math.isqrt(config.vision_config.num_position_embeddings)
    return {"processing": image_processing(config, folder), **ids, **texts, "position_side": side,
            "deepstack": len(getattr(config.vision_config, spec.deepstack)),
            "hidden_size": config.get_text_config().hidden_size}
