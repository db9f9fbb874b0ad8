"""The ``images`` task (a vision-language model): how often POP changes the model's answer about an image.

Synthetic image prompts (kvfit/images.py's drawings: colour gradients, rectangles and noise at several
sizes and aspect ratios; no download; POP+ calibration draws other ones), each with a question, run through
the eager reference (``reference.generate`` with the images) for every variant; ``compare_generations``
scores each against full (exact match, matched prefix), and ``first_token`` is the share whose first
generated token is full's. The numbers say how often POP's answer differs from the full model's, not whether
either is right: that needs a benchmark such as MMMU or ScreenSpot and real weights.
"""
from __future__ import annotations

from typing import Any

import torch

from ... import reference
from ...frontend.vision import ImageInputs, image_processing, image_turn
from ...kvfit.images import QUESTIONS, SIZES, synthetic_image  # the drawings, shared with calibration
from ...runtime.vision import ImageProcessing, image_tokens, preprocess
from .scoring import BASELINE, compare_generations


def image_prompt(model, tok, image, question: str,
                 processing: ImageProcessing) -> tuple[list[int], ImageInputs]:
    """Prompt ids (the chat template's user turn with the image first, placeholders expanded as the
    processor does: frontend.vision.image_turn) and the image, preprocessed as the engines' runtime does."""
    pixels, grid = preprocess(image, processing)
    ids = image_turn(model.config, tok, question, image_tokens(grid, processing.merge_size))
    return ids, ImageInputs(torch.tensor(pixels), torch.tensor([[1, *grid]]))


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
