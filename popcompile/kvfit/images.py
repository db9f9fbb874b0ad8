"""POP+ on a vision-language model: image+text calibration windows, and the built-in images they hold.

An image is most of a VLM's prefill, so the pruned layers' K/V projections are fitted on what the text decoder
sees there. Each window is one synthetic image (``synthetic_image``, drawn here: no download) in a chat turn
with a question, then calibration text, ``seq_len`` tokens in all::

    ids  [x_1 .. x_p]      image turn: chat tokens, vision_start, m image placeholders, vision_end, question
         [x_p+1 .. x_T]    text: the built-in calibration corpus (corpus.CALIBRATION_MODULES) or the user's

An image fills at most ``IMAGE_SHARE`` of a window (larger ones are resized down to it). ``layer_inputs`` runs
one batch of windows as the engines' graphs run a prompt: the model's own image processor, vision tower and
M-RoPE index (frontend/vision.py: ``preprocess_image``, ``encode_prompt``), the text decoder fed through
frontend/capture.run_with_images (image features at the placeholders, deepstack features added after decoder
layers 0..k-1); the fit reads each decoder layer's input there (calibrate.py).

The drawings are shared: eval's images task and analyze draw images 0, 1, ..., calibration draws from
``CALIBRATION_SEED`` on, so the images measured stay held out from the fit (as corpus.py's text does).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, InputError
from ..frontend.capture import run_with_images
from ..frontend.vision import (
    ImageInputs,
    encode_prompt,
    image_processing,
    image_token_count,
    image_turn,
    preprocess_image,
    vision_spec,
    visual_embeds,
)

QUESTIONS = ("Describe this image.", "What colours are in this picture?", "How many shapes do you see?",
             "What is in the top left corner?", "Is this a photograph or a drawing?",
             "Which shape is the largest?", "Write one sentence about this image.", "What stands out here?")
#: (width, height) in pixels: square, landscape, portrait, large
SIZES = ((448, 448), (640, 360), (320, 640), (896, 672))
#: the first image calibration draws (eval and analyze draw from 0: a few dozen images at most)
CALIBRATION_SEED = 10_000
#: the share of a calibration window an image may fill (analyze's share of its prompts too)
IMAGE_SHARE = 0.5


def synthetic_image(index: int):
    """A gradient with rectangles of random colours and a little noise, at SIZES[index % 4]."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(index)
    width, height = SIZES[index % len(SIZES)]
    ramp = np.linspace(0, 1, width)[None, :, None] * rng.integers(0, 256, 3)
    pixels = (ramp + rng.normal(0, 8, (height, width, 3))).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(np.broadcast_to(pixels, (height, width, 3)).copy())
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(1, 5))):
        x, y = int(rng.integers(0, width - 16)), int(rng.integers(0, height - 16))
        draw.rectangle([x, y, x + int(rng.integers(16, width // 2)), y + int(rng.integers(16, height // 2))],
                       fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return image


@dataclass(frozen=True)
class ImageWindow:
    """A batch of image+text calibration windows (module docstring): ``ids`` [B, T], row b image turn b then
    text; ``images`` the B images in row order (pixel_values [P, C*T*p*p], image_grid_thw [B, 3])."""

    ids: torch.Tensor
    images: ImageInputs

    def numel(self) -> int:
        """The batch's tokens (what a progress bar counts, as for a [B, T] batch of ids)."""
        return self.ids.numel()

    def to(self, device: torch.device) -> ImageWindow:
        """This batch on ``device`` (the K/V fit's, kvfit/budget.py)."""
        images = ImageInputs(self.images.pixel_values.to(device), self.images.image_grid_thw.to(device))
        return ImageWindow(self.ids.to(device), images)


def capped_processing(config, folder: str | Path | None, max_tokens: int) -> dict:
    """The model's image processing (its folder's preprocessor_config.json, else Qwen3-VL's defaults) with
    max_pixels lowered so that an image fills at most ``max_tokens`` placeholders (never below min_pixels)."""
    processing = image_processing(config, folder)
    factor = processing["patch_size"] * processing["merge_size"]
    cap = min(processing["max_pixels"], max_tokens * factor ** 2)
    return {**processing, "max_pixels": max(processing["min_pixels"], cap)}


def image_windows(model: torch.nn.Module, tokenizer: Any, docs: Iterable[list[int]], *, seq_len: int,
                  max_tokens: int, batch: int = 4, folder: str | Path | None = None,
                  seed: int = CALIBRATION_SEED) -> list[ImageWindow]:
    """``max_tokens // (seq_len * batch)`` batches (at least one) of ``batch`` windows [seq_len]: image
    ``seed + i`` with question i, then the next tokens of ``docs`` (token id lists, read as one stream and
    only as far as needed). ConfigError when an image turn leaves no text in a window; InputError when the
    text runs out before one window is complete."""
    config, text = model.config, _stream(docs)
    processing = capped_processing(config, folder, max(1, int(seq_len * IMAGE_SHARE)))
    rows: list[list[int]] = []
    images: list[ImageInputs] = []
    for i in range(max(1, max_tokens // (seq_len * batch)) * batch):
        image = preprocess_image(config, processing, synthetic_image(seed + i))
        turn = image_turn(config, tokenizer, QUESTIONS[i % len(QUESTIONS)], image_token_count(config, image))
        if len(turn) >= seq_len:
            raise ConfigError(f"--seq-len {seq_len} leaves no text after window {i}'s image turn of "
                              f"{len(turn)} tokens: give --seq-len {2 * len(turn)} or more")
        rest = list(islice(text, seq_len - len(turn)))
        if len(rest) < seq_len - len(turn):
            break
        rows.append(turn + rest)
        images.append(image)
    if not rows:
        raise InputError(f"the calibration text has too few tokens for one image+text window of --seq-len "
                         f"{seq_len}: give more text")
    return [_window(rows[i:i + batch], images[i:i + batch]) for i in range(0, len(rows), batch)]


def _stream(docs: Iterable[list[int]]) -> Iterator[int]:
    for doc in docs:
        yield from doc


def _window(rows: list[list[int]], images: list[ImageInputs]) -> ImageWindow:
    return ImageWindow(torch.tensor(rows, dtype=torch.long),
                       ImageInputs(torch.cat([i.pixel_values for i in images]),
                                   torch.cat([i.image_grid_thw for i in images])))


@torch.no_grad()
def layer_inputs(model: torch.nn.Module, window: ImageWindow) -> list[torch.Tensor]:
    """[l]: the input of text decoder layer l [B, T, d] over ``window`` (module docstring), read by forward
    pre-hooks: a layer's recorded hidden_states output would miss the deepstack features added after it."""
    spec = vision_spec(model.config)
    text = model.get_submodule(spec.text)
    encoded = encode_prompt(model, window.ids, window.images)  # positions [3, B, T], features, deepstack
    inputs: dict[int, torch.Tensor] = {}

    def record(index: int):
        def hook(module, args, kwargs):
            inputs[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    hooks = [layer.register_forward_pre_hook(record(i), with_kwargs=True)
             for i, layer in enumerate(text.layers)]
    try:
        run_with_images(text, getattr(model.config, spec.image_token), window.ids, visual_embeds(encoded),
                        position_ids=encoded.positions, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [inputs[i] for i in range(len(text.layers))]
