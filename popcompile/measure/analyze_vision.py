"""``popcompile analyze`` on a vision-language model (frontend/vision.py): image+text prompts.

Each sequence is one synthetic image prompt (eval/images.py: its drawings and its prompt builder, a chat turn
with the image before a question) followed by a window of the corpus's text, cut to the analysis's length::

    ids     [x_1 .. x_p]  image turn: chat tokens, vision_start, m image placeholders, vision_end, question
            [x_p+1 .. x_N y_1 .. y_G]  the corpus's text (N = --context-len, G = --gen-len; p < N)

so the image tokens are prefill positions like any other prompt token (POP prefills x_1..x_{N-1}) and the
loss is on text (y_1..y_G). Images are resized down to at most half the prompt (``max_image_tokens``).

The gated graph (``VisionScorer``) is analyze's Scorer over the text decoder, fed as the engines' graphs
are (frontend/capture.VisionDecoderWithKV, ``run_with_images``): ids, M-RoPE positions [3, B, S] and
``visual_embeds`` [1 + k, B, S, d] (the image features at the placeholders, then the deepstack features
added after decoder layers 0..k-1), all computed per sequence by the model's own vision tower and rope
index (``frontend.vision.encode_prompt``). The gates pass sees a decoder whose first k layers' outputs get
an input added (gates.py accepts that).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..frontend.arch import attention_windows, finish_logits
from ..frontend.capture import attention_for_capture, build_mask, functional_mrope, run_with_images
from ..frontend.vision import (
    ImageInputs,
    deepstack_layers,
    encode_prompt,
    image_processing,
    vision_spec,
    visual_embeds,
)
from ..kvfit.images import IMAGE_SHARE  # the share an image may fill, POP+ calibration's windows too
from ..runtime.vision import ImageProcessing
from .analyze_samples import ImagePrompts, Samples, special_prefix
from .eval.images import QUESTIONS, SIZES, image_prompt, synthetic_image
from .gates import GateResult, gate_pass


class VisionScorer(torch.nn.Module):
    """input_ids [B, S], position_ids [3, B, S] (M-RoPE), visual_embeds [1 + k, B, S, d] -> logits [B, G, V]
    of the last G positions: a full causal forward of the text decoder (analyze.Scorer's masks and
    attention), the image features fed as frontend/capture.VisionDecoderWithKV feeds them."""

    def __init__(self, model: torch.nn.Module, gen_len: int):
        super().__init__()
        spec = vision_spec(model.config)
        self.text = model.get_submodule(spec.text)
        self.lm_head = model.get_output_embeddings()
        self.config = model.config
        self.image_token_id = getattr(model.config, spec.image_token)
        self.window = next(iter(attention_windows(model.config.get_text_config()).values()))
        self.gen_len = gen_len

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                visual_embeds: torch.Tensor) -> torch.Tensor:
        mask = build_mask(torch.ones_like(input_ids), input_ids.shape[1], self.window)  # [B, 1, S, S]
        out = run_with_images(self.text, self.image_token_id, input_ids, visual_embeds,
                              position_ids=position_ids, attention_mask=mask, use_cache=False)
        return finish_logits(self.config, self.lm_head(out.last_hidden_state[:, -self.gen_len:]))  # [B, G, V]


def capture_vision_scorer(model: torch.nn.Module, batch: int, seq_len: int, gen_len: int) -> GateResult:
    """torch.export the VisionScorer at static [batch, seq_len] and run the gates pass on it; the graph's
    inputs are (input_ids, position_ids, visual_embeds, gates, stage)."""
    if not 1 <= gen_len <= seq_len:
        raise ValueError(f"gen_len={gen_len} must be in 1..seq_len={seq_len}")
    spec, hidden = vision_spec(model.config), model.config.get_text_config().hidden_size
    example = (torch.zeros(batch, seq_len, dtype=torch.long),                    # ids [B, S]
               torch.arange(seq_len).expand(3, batch, seq_len),                  # positions [3, B, S]
               torch.zeros(1 + deepstack_layers(model.config), batch, seq_len, hidden))  # [1 + k, B, S, d]
    with attention_for_capture(model), functional_mrope(model.get_submodule(spec.text)):
        program = torch.export.export(VisionScorer(model, gen_len).eval(), example, strict=False)
    return gate_pass(program.module())


def image_inputs(model: torch.nn.Module, windows: torch.Tensor,
                 images: Sequence[ImageInputs]) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """``Samples.inputs``: row indices [B] -> (ids [B, S], positions [3, B, S], visual_embeds
    [1 + k, B, S, d]) of windows[rows, :-1] with each row's image, encoded by the model's vision tower and
    rope index."""
    def inputs(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        encoded = [encode_prompt(model, windows[row:row + 1, :-1], images[row]) for row in rows.tolist()]
        return (torch.cat([e.input_ids for e in encoded]), torch.cat([e.positions for e in encoded], dim=1),
                torch.cat([visual_embeds(e) for e in encoded], dim=1))
    return inputs


def max_image_tokens(context_len: int) -> int:
    return max(1, int(context_len * IMAGE_SHARE))


def image_samples(model: torch.nn.Module, tokenizer: Any, windows: torch.Tensor, taken: Mapping[str, int],
                  context_len: int, folder: str | Path | None = None, image_seed: int = 0) -> Samples:
    """Each text window [W] behind synthetic image ``image_seed + i`` (eval/images.synthetic_image) in a
    chat turn with question i: the window's first W - p text tokens after the p-token image turn (module
    docstring). ConfigError when an image turn leaves no text in the prompt."""
    processing = fitted_processing(model.config, folder, max_image_tokens(context_len))
    prefix = len(special_prefix(tokenizer))
    image_id = getattr(model.config, vision_spec(model.config).image_token)
    rows, images, turns = [], [], []
    for i, window in enumerate(windows.tolist()):
        ids, inputs = image_prompt(model, tokenizer, synthetic_image(image_seed + i),
                                   QUESTIONS[i % len(QUESTIONS)], processing)
        if len(ids) >= context_len:
            raise ConfigError(f"--context-len {context_len} leaves no text after sequence {i}'s image turn "
                              f"of {len(ids)} tokens: use --context-len {len(ids) + 1} or more")
        rows.append(ids + window[prefix:][:len(window) - len(ids)])
        images.append(inputs)
        turns.append(ids)
    record = ImagePrompts(
        image_tokens=tuple(sum(t == image_id for t in ids) for ids in turns),
        prompt_tokens=tuple(len(ids) for ids in turns),
        image_sizes=tuple(SIZES[(image_seed + i) % len(SIZES)] for i in range(len(turns))),
        max_image_tokens=max_image_tokens(context_len), deepstack=deepstack_layers(model.config))
    ids = torch.tensor(rows, dtype=torch.long)  # [N, W]
    return Samples(ids, taken, capture_vision_scorer, image_inputs(model, ids, images), record)


def fitted_processing(config, folder: str | Path | None, max_tokens: int) -> ImageProcessing:
    """The model's image processing (its folder's preprocessor_config.json, else Qwen3-VL's defaults) with
    max_pixels lowered so that an image fills at most ``max_tokens`` placeholders."""
    processing = ImageProcessing.from_dict(image_processing(config, folder))
    return replace(processing, max_pixels=min(processing.max_pixels, max_tokens * processing.factor ** 2))
