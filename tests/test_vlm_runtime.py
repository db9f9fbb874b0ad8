"""The runtime's image path in numpy and Pillow (runtime/vision.py) against the transformers code it
follows: the Qwen-VL image processor, the vision tower's position-table taps and rotary grid, and
Qwen3-VL's M-RoPE index."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tiny import VL_IDS, tiny_images, tiny_vlm, vl_prompt
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

from popcompile.errors import InputError
from popcompile.runtime.vision import (
    ImageProcessing,
    load_image,
    mrope_positions,
    position_taps,
    preprocess,
    rotary_positions,
)

PROCESSING = ImageProcessing(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16,
                             max_pixels=48 * 48, image_mean=(0.48, 0.46, 0.41), image_std=(0.27, 0.26, 0.28))


def _image(size, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(array[..., 0] if mode == "L" else array, mode)


@pytest.mark.parametrize("size, mode", [((40, 24), "RGB"), ((13, 71), "RGB"), ((200, 150), "RGBA"),
                                        ((9, 9), "L")])
def test_preprocess_is_the_qwen_vl_image_processor(size, mode):
    """Every size class: within range, below min_pixels (upscaled), above max_pixels (downscaled); RGBA
    composited on white, greyscale to RGB."""
    p = PROCESSING
    hf = Qwen2VLImageProcessorPil(patch_size=p.patch_size, temporal_patch_size=p.temporal_patch_size,
                                  merge_size=p.merge_size, size={"shortest_edge": p.min_pixels,
                                                                 "longest_edge": p.max_pixels},
                                  image_mean=list(p.image_mean), image_std=list(p.image_std))
    expected = hf(images=[_image(size, mode)], return_tensors="np")
    pixels, grid = preprocess(_image(size, mode), p)
    assert [1, *grid] == expected["image_grid_thw"][0].tolist()
    np.testing.assert_allclose(pixels, expected["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("grid", [(4, 6), (2, 2), (8, 4), (6, 12)])
def test_position_taps_and_rotary_positions_are_the_vision_towers(grid):
    side, merge = 4, 2
    thw = torch.tensor([[1, *grid]])
    taps, weights = get_vision_interpolation_indices_and_weights(
        thw, side, mode="bilinear", align_corners=True, spatial_merge_size=merge)
    got_taps, got_weights = position_taps(*grid, side, merge)
    np.testing.assert_array_equal(got_taps, taps.numpy())
    np.testing.assert_array_equal(got_weights, weights.numpy())
    np.testing.assert_array_equal(rotary_positions(*grid, merge), get_vision_position_ids(thw, merge).numpy())


@pytest.mark.parametrize("sizes", [[(16, 24)], [(16, 24), (8, 16)], [(32, 8), (8, 8), (24, 24)], []])
def test_mrope_positions_are_qwen3_vls_rope_index(sizes):
    model = tiny_vlm(layers=2)
    _, grids = tiny_images(model, sizes) if sizes else (None, torch.zeros(0, 3, dtype=torch.long))
    ids = vl_prompt(model, grids)
    image = VL_IDS["image_token_id"]
    expected, delta = model.model.get_rope_index(ids, mm_token_type_ids=(ids == image).int(),
                                                 image_grid_thw=grids if sizes else None)
    positions, got_delta = mrope_positions(ids[0].tolist(), [tuple(g[1:]) for g in grids.tolist()], image, 2)
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert got_delta == int(delta)


def test_placeholders_that_disagree_with_the_images_are_refused():
    ids = [5, 150, 150, 150, 6]
    with pytest.raises(InputError, match="an image of 4 tokens has 3 placeholders"):
        mrope_positions(ids, [(4, 4)], 150, 2)
    with pytest.raises(InputError, match="more image placeholders than the 0 image"):
        mrope_positions(ids, [], 150, 2)
    with pytest.raises(InputError, match="2 image\\(s\\) given but the prompt has fewer"):
        mrope_positions([5, 150, 6], [(2, 2), (2, 2)], 150, 2)


def test_a_missing_or_broken_image_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_image(tmp_path / "nope.png")
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(InputError, match="is not an image Pillow can read"):
        load_image(tmp_path / "text.png")
    _image((10, 12)).save(tmp_path / "ok.png")
    assert load_image(tmp_path / "ok.png").size == (10, 12)
