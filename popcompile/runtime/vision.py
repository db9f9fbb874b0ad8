"""Images for a vision-language engine, in numpy and Pillow (no torch): what the runtime feeds its graphs.

    load_image(path)                   PIL image, or InputError naming the file and what is wrong
    preprocess(image, processing)      pixel_values [P, C*T*p*p] float32 and the grid (gh, gw) in patches:
                                       transformers' Qwen-VL image processor (smart resize to multiples of
                                       patch * merge within [min_pixels, max_pixels], bicubic, rescale,
                                       normalise, patches in merge-block order, the frame repeated T times)
    position_taps(gh, gw, side, merge) [P, 4] int64 taps into the vision tower's learned position table and
                                       their bilinear weights (align_corners), per patch
    rotary_positions(gh, gw, merge)    [P, 2] int64 (row, column) of each patch, merge-block order
    mrope_positions(ids, grids, ...)   [3, N] M-RoPE positions of a prompt and its rope delta

Each follows the transformers function it is tested against (tests/test_vlm_runtime.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError


@dataclass(frozen=True)
class ImageProcessing:
    """How images become patches (the manifest's ``vision.processing``; transformers' processor config)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, values: dict) -> ImageProcessing:
        """From the manifest's ``vision.processing`` (or frontend.vision.image_processing): JSON lists to
        tuples."""
        return cls(**{**values, "image_mean": tuple(values["image_mean"]),
                      "image_std": tuple(values["image_std"])})

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def load_image(path: str | Path):
    """The image file at ``path`` as a PIL image (decoded now: a broken file fails here, not later)."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise InputError(f"image {path} does not exist: give the path of an image file (PNG, JPEG, ...)")
    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise InputError(f"{path} is not an image Pillow can read ({error}): give a PNG, JPEG, WebP or "
                         "another common image file") from None


def smart_resize(height: int, width: int, p: ImageProcessing) -> tuple[int, int]:
    """The processor's target size: multiples of ``p.factor``, pixels within [min_pixels, max_pixels],
    the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise InputError(f"an image of {width}x{height} pixels has an aspect ratio over 200: crop it")
    factor = p.factor
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > p.max_pixels:
        beta = math.sqrt(height * width / p.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < p.min_pixels:
        beta = math.sqrt(p.min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image):
    """RGB, transparency composited onto white (as transformers' processors do)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image, p: ImageProcessing) -> tuple[np.ndarray, tuple[int, int]]:
    """One image -> pixel_values [gh * gw, 3 * T * patch * patch] float32 and its grid (gh, gw)."""
    from PIL import Image

    rgb = to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, p)
    pixels = np.asarray(rgb.resize((width, height), resample=Image.Resampling.BICUBIC), dtype=np.float32)
    pixels = (pixels * np.float32(p.rescale_factor) - np.asarray(p.image_mean, np.float32)) \
        / np.asarray(p.image_std, np.float32)  # [H, W, 3]
    gh, gw, m, s = height // p.patch_size, width // p.patch_size, p.merge_size, p.patch_size
    patches = pixels.transpose(2, 0, 1).reshape(3, gh // m, m, s, gw // m, m, s)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, s, s]
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], p.temporal_patch_size, s, s))
    return np.ascontiguousarray(patches.reshape(gh * gw, -1)), (gh, gw)


def _block_order(gh: int, gw: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch [P] in merge-block order: blocks row-major, then m x m inside each."""
    index = np.arange(gh * gw)
    in_col, in_row = index % merge, (index // merge) % merge
    blocks = index // (merge * merge)
    block_col, block_row = blocks % (gw // merge), blocks // (gw // merge)
    return block_row * merge + in_row, block_col * merge + in_col


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (align_corners) into a ``side``-long axis for positions ``index`` of ``size``; float32
    arithmetic as torch does it."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32)), 0, None)
    return taps, weights.astype(np.float32)


def position_taps(gh: int, gw: int, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """pos_indices [P, 4] int64 and pos_weights [P, 4] float32: the learned ``side`` x ``side`` position
    table resampled (bilinear, align_corners) to the gh x gw grid, per patch in merge-block order."""
    row, col = _block_order(gh, gw, merge)
    h_taps, h_weights = _axis_taps(row, gh, side)
    w_taps, w_weights = _axis_taps(col, gw, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


def rotary_positions(gh: int, gw: int, merge: int) -> np.ndarray:
    """[P, 2] int64: each patch's (row, column), merge-block order (the vision tower's 2D rotary)."""
    row, col = _block_order(gh, gw, merge)
    return np.stack([row, col], axis=1).astype(np.int64)


def image_tokens(grid: tuple[int, int], merge: int) -> int:
    """Placeholder tokens an image of ``grid`` patches fills (one per merge x merge block)."""
    return grid[0] * grid[1] // (merge * merge)


def mrope_positions(ids: list[int], grids: list[tuple[int, int]], image_token_id: int,
                    merge: int) -> tuple[np.ndarray, int]:
    """[3, N] int64 M-RoPE positions of a prompt and its rope delta (max position + 1 - N). Text advances all
    three rows by one; each image's run of placeholders takes (start, start + row, start + column) over its
    merged grid, and the text after it resumes at start + max(rows, columns). ``grids``: the images in
    order. InputError when the placeholders and the grids disagree."""
    positions = np.zeros((3, len(ids)), dtype=np.int64)
    images, index, current = iter(grids), 0, 0
    while index < len(ids):
        if ids[index] != image_token_id:
            positions[:, index] = current
            index, current = index + 1, current + 1
            continue
        grid = next(images, None)
        if grid is None:
            raise InputError(f"the prompt has more image placeholders than the {len(grids)} image(s) given")
        rows, cols = grid[0] // merge, grid[1] // merge
        span = ids[index:index + rows * cols]
        if len(span) != rows * cols or any(token != image_token_id for token in span):
            found = sum(1 for token in span if token == image_token_id)
            raise InputError(f"an image of {rows * cols} tokens has {found} placeholders in the prompt: "
                             "expand each image's placeholder with the engine's rule")
        r, c = np.divmod(np.arange(rows * cols), cols)
        positions[:, index:index + rows * cols] = np.stack([np.zeros_like(r), r, c]) + current
        index, current = index + rows * cols, current + max(rows, cols)
    if next(images, None) is not None:
        raise InputError(f"{len(grids)} image(s) given but the prompt has fewer image placeholders")
    return positions, int(positions.max(initial=-1)) + 1 - len(ids)
