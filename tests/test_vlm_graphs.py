"""A vision-language model's graphs (Qwen3-VL): the captured decode graph and the POP prefill graph take
M-RoPE positions [3, B, T] and the image features as ``visual_embeds``; prefilling with the prefill graph
and decoding with the decode graph generates the eager reference's tokens, with one image, two and none."""
from __future__ import annotations

import pytest
import torch
from tiny import tiny_images, tiny_vlm, vl_greedy_with_graphs, vl_prompt

from popcompile import reference
from popcompile.frontend.capture import FunctionalMRope, capture
from popcompile.frontend.vision import ImageInputs
from popcompile.frontend.vision_encoder import capture_vision_encoder
from popcompile.passes.prefill import pop_graphs

# one worker runs this file: the tiny VLM's graphs, built once per module (conftest.py)
pytestmark = pytest.mark.xdist_group("test_vlm_graphs")

LAYERS, CUT, NEW = 6, 4, 8


@pytest.fixture(scope="module")
def model():
    return tiny_vlm(layers=LAYERS)


@pytest.fixture(scope="module")
def captured(model):
    return capture(model, max_seq=128)


@pytest.fixture(scope="module")
def pair(captured):
    return pop_graphs(captured, CUT)


def test_the_graphs_take_mrope_positions_and_image_features(model, captured, pair):
    assert captured.input_names[:4] == ["input_ids", "position_ids", "attention_mask", "visual_embeds"]
    for program in (pair.decode, pair.prefill):
        assert program.graph_signature.user_inputs[:4] == tuple(captured.input_names[:4])
        weights = program.graph_signature.inputs_to_parameters.values()
        assert weights and not [w for w in weights if "visual" in w]  # no vision weights in the text graphs
    visual = [n for n in pair.prefill.graph.nodes if n.name == "visual_embeds"][0]
    assert visual.meta["val"].shape[0] == 3 and visual.meta["val"].shape[-1] == 64  # 1 + k rows of width d


def test_functional_mrope_is_transformers_mrope_bit_for_bit(model):
    rope = model.model.language_model.rotary_emb
    positions = torch.randint(0, 300, (3, 2, 9))
    x = torch.zeros(1, dtype=torch.float32)
    for got, want in zip(FunctionalMRope(rope)(x, positions), rope(x, positions)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("sizes", [[(16, 24)], [(16, 24), (8, 16)], []],
                         ids=["one image", "two images", "text only"])
@pytest.mark.parametrize("cut", [CUT, LAYERS], ids=["pop", "full"])
def test_graphs_generate_the_references_tokens(model, captured, pair, sizes, cut):
    images = ImageInputs(*tiny_images(model, sizes)) if sizes else None
    ids = vl_prompt(model, images.image_grid_thw if images else torch.zeros(0, 3, dtype=torch.long))
    graphs = pair if cut == CUT else pop_graphs(captured, LAYERS)
    expected = reference.generate(model, ids, NEW, reference.Variant(cut=cut), images=images)
    assert len(set(expected)) > 1
    assert vl_greedy_with_graphs(graphs, model, ids, images, NEW) == expected


@pytest.mark.parametrize("sizes", [[(16, 24), (8, 16)], [(32, 8)]], ids=["two images", "tall image"])
def test_vision_encoder_graph_is_the_vision_tower_one_image_at_a_time(model, sizes):
    """The exported vision graph on each image, with the index tensors transformers derives from its grid,
    gives the tower's features and deepstack features for that image (within float rounding: one SDPA
    over the image instead of transformers' split)."""
    from transformers.vision_utils import (
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    visual = model.model.visual
    pixels, grids = tiny_images(model, sizes)
    program = capture_vision_encoder(model).module()
    with torch.no_grad():
        whole = visual(pixels, grid_thw=grids, return_dict=True)
        deepstack = torch.stack(whole.deepstack_features)
        patch, token = 0, 0
        for grid in grids:
            patches, merge = int(grid.prod()), visual.spatial_merge_size
            taps, weights = get_vision_interpolation_indices_and_weights(
                grid[None], visual.num_grid_per_side, mode="bilinear", align_corners=True,
                spatial_merge_size=merge)
            rotary = get_vision_position_ids(grid[None], merge)
            features, deep = program(pixels[patch:patch + patches], taps, weights, rotary)
            tokens = patches // merge ** 2
            torch.testing.assert_close(features, whole.pooler_output[token:token + tokens], atol=1e-5,
                                       rtol=1e-5)
            torch.testing.assert_close(deep, deepstack[:, token:token + tokens], atol=1e-5, rtol=1e-5)
            patch, token = patch + patches, token + tokens


@pytest.mark.parametrize("grid", [(4, 6), (8, 8)])
def test_vision_flops_are_the_towers_counted_flops(model, grid):
    """cost.VisionGeometry.image equals torch's FLOP counter on the vision graph plus attention's 4*e*P^2 per
    block (CPU attention runs a path the counter does not see)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.vision_utils import (
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    from popcompile.cost import VisionGeometry, vlm_prefill_flops, vlm_speedup_bound
    from popcompile.frontend.vision_encoder import VisionEncoder

    visual, patches = model.model.visual, grid[0] * grid[1]
    thw = torch.tensor([[1, *grid]])
    taps, weights = get_vision_interpolation_indices_and_weights(
        thw, visual.num_grid_per_side, mode="bilinear", align_corners=True, spatial_merge_size=2)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        VisionEncoder(visual)(torch.randn(patches, 96), taps, weights, get_vision_position_ids(thw, 2))
    attention = 4 * visual.config.hidden_size * patches ** 2 * visual.config.depth
    geometry = VisionGeometry.from_config(model.config)
    assert geometry.image(patches) == counter.get_total_flops() + attention
    tokens = 20 + patches // 4
    full = vlm_prefill_flops(model.config, tokens, [patches])
    assert full > vlm_prefill_flops(model.config, tokens, [patches], cut=CUT) > geometry.image(patches)
    assert vlm_speedup_bound(model.config, tokens, [patches], LAYERS) == 1.0
