"""The ``images`` task (a vision-language model): how often POP changes the model's answer about an image.

Synthetic image prompts, drawn here (colour gradients, rectangles and noise at several sizes and aspect
ratios; no download), each with a question, run through the eager reference (``reference.generate`` with
the images) for every variant; ``compare_generations`` scores each against full (exact match, matched
prefix), and ``first_token`` is the share whose first generated token is full's. The numbers say how
often POP's answer differs from the full model's, not whether either is right: that needs a benchmark
such as MMMU or ScreenSpot and real weights.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ... import reference
from ...frontend.vision import ImageInputs, image_processing
from ...runtime.vision import ImageProcessing, image_tokens, preprocess
from .scoring import BASELINE, compare_generations

QUESTIONS = ("Describe this image.", "What colours are in this picture?", "How many shapes do you see?",
             "What is in the top left corner?", "Is this a photograph or a drawing?",
             "Which shape is the largest?", "Write one sentence about this image.", "What stands out here?")
#: (width, height) in pixels: square, landscape, portrait, large
SIZES = ((448, 448), (640, 360), (320, 640), (896, 672))


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


def image_prompt(model, tok, image, question: str,
                 processing: ImageProcessing) -> tuple[list[int], ImageInputs]:
    """Prompt ids (the chat template's user turn with the image first, placeholders expanded as the
    processor does) and the preprocessed image."""
    config = model.config
    start, pad, end = tok.convert_ids_to_tokens([config.vision_start_token_id, config.image_token_id,
                                                 config.vision_end_token_id])
    if tok.chat_template:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False).input_ids
    else:
        ids = tok(f"{start}{pad}{end}{question}").input_ids
    pixels, grid = preprocess(image, processing)
    count = image_tokens(grid, processing.merge_size)
    expanded = [t for token in ids for t in ([token] * count if token == config.image_token_id else [token])]
    return expanded, ImageInputs(torch.tensor(pixels), torch.tensor([[1, *grid]]))


def images_task(model, tok, variants: dict, limit: int | None, gen_tokens: int, folder: Any = None) -> dict:
    """Every variant's greedy answers to the synthetic image prompts, against full (module docstring)."""
    raw = image_processing(model.config, folder)
    processing = ImageProcessing.from_dict(raw)
    count = len(QUESTIONS) if limit is None else limit
    prompts = [image_prompt(model, tok, synthetic_image(i), QUESTIONS[i % len(QUESTIONS)], processing)
               for i in range(count)]
    images = {tuple(ids): inputs for ids, inputs in prompts}

    def generate(name: str, ids: list[int]) -> list[int]:
        return reference.generate(model, torch.tensor([ids]), gen_tokens, variants[name], tok.eos_token_id,
                                  images=images[tuple(ids)])

    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    results = compare_generations([ids for ids, _ in prompts], list(variants), generate, decode)
    full = results[BASELINE]["tokens"]
    for scores in results.values():
        scores["first_token"] = sum(g[:1] == f[:1] for g, f in zip(scores["tokens"], full)) / len(full)
    return {"prompts": count, "questions": [QUESTIONS[i % len(QUESTIONS)] for i in range(count)],
            "image_sizes": [list(SIZES[i % len(SIZES)]) for i in range(count)],
            "image_tokens": [sum(1 for t in ids if t == model.config.image_token_id) for ids, _ in prompts],
            "max_new_tokens": gen_tokens, "variants": results}
