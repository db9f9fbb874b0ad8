"""Prompts with images for a vision-language engine (a manifest with a ``vision`` section), in numpy.

    images -> Images.encode        each image: load, preprocess (vision.py), the vision graph -> features
                                   [V_i, d] and deepstack features [k, V_i, d]
    prompt -> image_prompt_ids     the prompt's ids with one image token per image (the chat template's,
                                   the prompt text's, or put before the text), then each expanded to the
                                   image's V_i tokens (the processor's rule)
    ids    -> VisionFeeds          what the text graphs take beside input_ids: M-RoPE position_ids
                                   [3, B, T] and visual_embeds [1 + k, B, T, d] (zeros at text tokens and
                                   in decode steps); decode tokens sit at row + rope delta

Text-only prompts to such an engine take the same inputs (text positions on all three rows, zero
features).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..engine.vision import VisionSection
from ..errors import InputError
from .vision import (
    ImageProcessing,
    image_tokens,
    load_image,
    mrope_positions,
    position_taps,
    preprocess,
    rotary_positions,
)

#: what a user may give as an image: a file path or a PIL image
ImageLike = object
RunVision = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


@dataclass(frozen=True)
class PreparedImage:
    pixels: np.ndarray         # [P, C*T*p*p]
    grid: tuple[int, int]      # (gh, gw) in patches
    key: str                   # the pixels' digest: a chat's cached rows are reused for the same image only


@dataclass(frozen=True)
class EncodedImage:
    grid: tuple[int, int]      # (gh, gw) in patches
    features: np.ndarray       # [V, d]: replace the image's placeholders
    deepstack: np.ndarray      # [k, V, d]: added after decoder layers 0..k-1


class Images:
    """A vision-language engine's image path: its vision section and a runner of its vision graph."""

    def __init__(self, section: VisionSection, run_vision: RunVision, dtype: np.dtype):
        self.section, self.run_vision, self.dtype = section, run_vision, dtype
        self.processing = ImageProcessing.from_dict(section.processing)

    def prepare(self, image: ImageLike) -> PreparedImage:
        """One image (a path or a PIL image) preprocessed (no graph runs)."""
        pixels, grid = preprocess(_as_image(image), self.processing)
        return PreparedImage(pixels, grid, hashlib.sha256(pixels.tobytes()).hexdigest())

    def encode(self, image: PreparedImage) -> EncodedImage:
        """One prepared image through the vision graph."""
        merge, side, grid = self.processing.merge_size, self.section.position_side, image.grid
        taps, weights = position_taps(*grid, side, merge)
        features, deepstack = self.run_vision({
            "pixel_values": image.pixels.astype(self.dtype), "pos_indices": taps,
            "pos_weights": weights.astype(self.dtype), "rotary_positions": rotary_positions(*grid, merge)})
        return EncodedImage(grid, features, deepstack)

    def row(self, ids: list[int], cached: int, images: Sequence[PreparedImage]) -> VisionRow:
        """A prompt's row: ``ids`` expanded, ``cached`` of them in the cache; only the images whose tokens
        lie after the cached rows run through the vision graph."""
        starts = self.image_starts(ids, [image.grid for image in images])
        encoded = [self.encode(image) for image, start in zip(images, starts) if start >= cached]
        k, d = self.section.deepstack, self.section.hidden_size
        features, deepstack = np.zeros((0, d), self.dtype), np.zeros((k, 0, d), self.dtype)
        if encoded:
            features = np.concatenate([e.features for e in encoded])
            deepstack = np.concatenate([e.deepstack for e in encoded], axis=1)
        return VisionRow(ids, cached, [image.grid for image in images], features, deepstack)

    def image_starts(self, ids: list[int], grids: Sequence[tuple[int, int]]) -> list[int]:
        """Where each image's run of tokens begins in expanded ``ids`` (runs of the grids' lengths)."""
        starts, index, runs = [], 0, iter(grids)
        while index < len(ids):
            if ids[index] == self.section.image_token_id:
                starts.append(index)
                index += image_tokens(next(runs), self.processing.merge_size)
            else:
                index += 1
        return starts

    def expand(self, ids: list[int], grids: Sequence[tuple[int, int]]) -> list[int]:
        """Each image token of ``ids`` (one per image, in order) repeated to its image's token count.
        InputError when the prompt holds another number of image tokens than images."""
        image_id = self.section.image_token_id
        found = sum(1 for token in ids if token == image_id)
        if found != len(grids):
            raise InputError(f"the prompt has {found} image placeholder(s) ({self.section.image_token}) for "
                             f"{len(grids)} image(s): give one per image, or none to put the images first")
        expanded, images = [], iter(grids)
        for token in ids:
            count = image_tokens(next(images), self.processing.merge_size) if token == image_id else 1
            expanded += [token] * count
        return expanded

    def placeholder_text(self, count: int) -> str:
        """The text of ``count`` images as the prompt takes them: vision start, image token, vision end."""
        s = self.section
        return "".join(f"{s.vision_start}{s.image_token}{s.vision_end}" for _ in range(count))

    def text_feeds(self) -> TextVisionFeeds:
        """Feeds for token ids without images (Session.prefill and step)."""
        return TextVisionFeeds(self.section.deepstack, self.section.hidden_size, self.dtype)

    def feeds(self, rows: Sequence[VisionRow], width: int) -> VisionFeeds:
        """The graphs' extra inputs for left-padded rows of ``width`` new tokens (module docstring)."""
        k, d = self.section.deepstack, self.section.hidden_size
        batch = len(rows)
        positions = np.zeros((3, batch, width), np.int64)
        visual = np.zeros((1 + k, batch, width, d), self.dtype)
        deltas = np.zeros(batch, np.int64)
        for r, row in enumerate(rows):
            new = len(row.ids) - row.cached
            columns = slice(width - new, width)
            mrope, deltas[r] = mrope_positions(row.ids, row.grids, self.section.image_token_id,
                                               self.processing.merge_size)
            positions[:, r, columns] = mrope[:, row.cached:]
            image = np.asarray(row.ids[row.cached:]) == self.section.image_token_id
            if image.any():
                visual[0, r, width - new + np.flatnonzero(image)] = row.features
                visual[1:, r, width - new + np.flatnonzero(image)] = row.deepstack
        return VisionFeeds(positions, visual, deltas)


@dataclass(frozen=True)
class VisionRow:
    """One prompt: ``ids`` the whole sequence (expanded; a chat: every turn), ``cached`` of them already in
    the cache, ``grids`` every image of ``ids`` in order, ``features``/``deepstack`` those of the images in
    ``ids[cached:]`` ([V, d], [k, V, d])."""

    ids: list[int]
    cached: int
    grids: list[tuple[int, int]]
    features: np.ndarray
    deepstack: np.ndarray


@dataclass(frozen=True)
class VisionFeeds:
    """A vision-language engine's inputs beside input_ids (loop.Feeds): prompt columns take their M-RoPE
    positions and image features; later tokens sit at row + delta on all three rows with zero features."""

    positions: np.ndarray   # [3, B, W]: the prompt's new columns (left-padded)
    visual: np.ndarray      # [1 + k, B, W, d]
    deltas: np.ndarray      # [B]

    def prompt(self, columns: slice, positions: np.ndarray) -> dict[str, np.ndarray]:
        return {"position_ids": np.ascontiguousarray(self.positions[:, :, columns]),
                "visual_embeds": np.ascontiguousarray(self.visual[:, :, columns])}

    def step(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """positions [B, T]: the tokens' cache rows."""
        rope = np.broadcast_to((positions + self.deltas[:, None])[None], (3, *positions.shape))
        visual = np.zeros((self.visual.shape[0], *positions.shape, self.visual.shape[-1]), self.visual.dtype)
        return {"position_ids": np.ascontiguousarray(rope), "visual_embeds": visual}


@dataclass(frozen=True)
class TextVisionFeeds:
    """A vision-language engine's inputs for text alone: its text positions on all three M-RoPE rows (what
    the M-RoPE rule gives text), zero image features."""

    deepstack: int
    hidden: int
    dtype: np.dtype

    def prompt(self, columns: slice, positions: np.ndarray) -> dict[str, np.ndarray]:
        return self.step(positions)

    def step(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        return {"position_ids": np.ascontiguousarray(np.broadcast_to(positions[None], (3, *positions.shape))),
                "visual_embeds": np.zeros((1 + self.deepstack, *positions.shape, self.hidden), self.dtype)}


def _as_image(image: ImageLike):
    if isinstance(image, (str, Path)):
        return load_image(image)
    if hasattr(image, "convert") and hasattr(image, "size"):
        return image
    raise InputError(f"an image is a file path or a PIL image, got {type(image).__name__}")


def encoded_rows(images: Images, prompts: list[list[int]],
                 per_prompt: list[list[ImageLike]]) -> list[VisionRow]:
    """Rows for prompts (ids with one image token per image) and their images: prepared, expanded, encoded."""
    rows = []
    for ids, row_images in zip(prompts, per_prompt):
        prepared = [images.prepare(image) for image in row_images]
        rows.append(images.row(images.expand(ids, [p.grid for p in prepared]), 0, prepared))
    return rows


def per_prompt_images(prompts: object, images: object) -> list[list[ImageLike]]:
    """``images`` as one list per prompt: for one text prompt, a list of images; for a batch (a list of
    prompts), a list of such lists, one per prompt. InputError for anything else."""
    batch = len(prompts) if isinstance(prompts, (list, tuple)) else 1
    if images is None:
        return [[] for _ in range(batch)]
    if not isinstance(images, (list, tuple)):
        raise InputError(f"images must be a list of images (a list of such lists for a batch of prompts), "
                         f"got {type(images).__name__}")
    if isinstance(prompts, str):
        return [list(images)]
    if len(images) != batch or not all(isinstance(row, (list, tuple)) for row in images):
        raise InputError(f"a batch of {batch} prompt(s) takes a list of {batch} image lists, one per prompt")
    return [list(row) for row in images]


def with_placeholders(images: Images, prompt: object, count: int) -> object:
    """A text prompt with one image token per image: as written where it has them, else the images' tokens
    put before the text (as a chat message's images come first). Id lists are used as they are."""
    if not isinstance(prompt, str) or not count or images.section.image_token in prompt:
        return prompt
    return images.placeholder_text(count) + prompt


def chat_text(images: Images | None, messages: list[dict]) -> tuple[list[dict], list[ImageLike]]:
    """Messages whose content is a list of parts ({"type": "text", "text": ...}, {"type": "image", "image":
    path or PIL image}) as text messages, each image as its tokens' text, and the images in order."""
    found: list[ImageLike] = []
    plain = []
    if not isinstance(messages, (list, tuple)):
        return messages, found  # chat_prompt_ids names what a conversation must be
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, (list, tuple)):
            plain.append(message)
            continue
        if images is None:
            raise InputError("this engine is a text model: a message's content is text, not a list of parts")
        text = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image" and "image" in part:
                found.append(part["image"])
                text.append(images.placeholder_text(1))
            elif kind == "text" and isinstance(part.get("text"), str):
                text.append(part["text"])
            else:
                raise InputError(f"a message part is {part!r}: give {{'type': 'text', 'text': ...}} or "
                                 "{'type': 'image', 'image': path or PIL image}")
        plain.append({**message, "content": "".join(text)})
    return plain, found
