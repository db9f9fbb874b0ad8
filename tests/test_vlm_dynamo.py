"""torch.compile(backend="pop") on Qwen3-VL: with dynamo capturing the data-dependent shapes of the image
placement (two config flags, docs/torch_compile.md), ``generate(input_ids, pixel_values=...,
image_grid_thw=...)`` prefills with POP and equals the eager reference token for token; without them it
runs unpruned and says which flags to set."""
from __future__ import annotations

import warnings

import pytest
import torch
from tiny import VL_IDS, tiny_images, tiny_vlm, vl_prompt

from popcompile import reference
from popcompile.dynamo import PopBackend, PopFallbackWarning, PopOptions
from popcompile.frontend.vision import ImageInputs

CUT, NEW = 4, 8
FLAGS = {"capture_dynamic_output_shape_ops": True, "capture_scalar_outputs": True}


def _generate(model, backend, sizes, eager_tower=False):
    if eager_tower:  # docs/torch_compile.md: the vision tower left to eager PyTorch, the text model compiled
        model.model.visual.forward = torch.compiler.disable(model.model.visual.forward)
    pixels, grids = tiny_images(model, sizes)
    ids = vl_prompt(model, grids)
    compiled = torch.compile(model.forward, backend=backend, dynamic=True)
    original, model.forward = model.forward, compiled
    try:
        out = model.generate(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                             mm_token_type_ids=(ids == VL_IDS["image_token_id"]).int(), max_new_tokens=NEW,
                             do_sample=False)
    finally:
        model.forward = original
        torch._dynamo.reset()
    return out[0, ids.shape[1]:].tolist(), ids, ImageInputs(pixels, grids)


@pytest.mark.parametrize("sizes,eager_tower", [([(16, 24)], False), ([(16, 24), (8, 16)], False),
                                               ([(16, 24), (8, 16)], True)],
                         ids=["one image", "two images", "two images, eager vision tower"])
def test_compiled_generate_is_the_pop_reference(sizes, eager_tower):
    model = tiny_vlm()
    backend = PopBackend(PopOptions(cut=CUT, inner="eager", min_prompt_tokens=0))
    with torch._dynamo.config.patch(**FLAGS):
        tokens, ids, images = _generate(model, backend, sizes, eager_tower)
    assert [r.kind for r in backend.records].count("prefill-pop") == 1
    expected = reference.generate(model, ids, NEW, reference.Variant(cut=CUT), images=images)
    assert tokens == expected
    assert expected != reference.generate(model, ids, NEW, reference.Variant(cut=6), images=images)


def test_without_the_flags_it_runs_unpruned_and_names_them():
    model = tiny_vlm()
    backend = PopBackend(PopOptions(cut=CUT, inner="eager", min_prompt_tokens=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, ids, images = _generate(model, backend, [(16, 24)])
    assert "prefill-pop" not in [r.kind for r in backend.records]
    assert any(issubclass(w.category, PopFallbackWarning)
               and "capture_dynamic_output_shape_ops" in str(w.message) for w in caught)
    assert tokens == reference.generate(model, ids, NEW, reference.Variant(cut=6), images=images)
