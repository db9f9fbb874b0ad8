"""The eager reference for vision-language models (Qwen3-VL): unpruned, it is transformers' ``generate``
token for token; pruned, its cache holds POP's K/V of h_cut at the M-RoPE positions; cuts that would prune a
deepstack layer and prompts whose placeholders disagree with the images are refused."""
from __future__ import annotations

import pytest
import torch
from tiny import VL_IDS, tiny_images, tiny_model, tiny_vlm, vl_prompt
from transformers import DynamicCache

from popcompile import reference
from popcompile.errors import ConfigError, InputError
from popcompile.frontend.arch import arch_spec, pruned_kv
from popcompile.frontend.vision import ImageInputs, check_cut, deepstack_layers, encode_prompt

NEW = 10
LAYERS = 6


@pytest.fixture(scope="module")
def model():
    return tiny_vlm(layers=LAYERS)


def _hf_generate(model, ids, images):
    kwargs = {} if images is None else {"pixel_values": images.pixel_values,
                                        "image_grid_thw": images.image_grid_thw}
    out = model.generate(input_ids=ids, mm_token_type_ids=(ids == VL_IDS["image_token_id"]).int(),
                         max_new_tokens=NEW, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("sizes", [[(16, 24)], [(16, 24), (8, 16)], []], ids=["one image", "two images",
                                                                              "text only"])
def test_unpruned_reference_is_transformers_generate(model, sizes):
    images = ImageInputs(*tiny_images(model, sizes)) if sizes else None
    ids = vl_prompt(model, images.image_grid_thw if images else torch.zeros(0, 3, dtype=torch.long))
    expected = _hf_generate(model, ids, images)
    assert len(set(expected)) > 1  # the tiny model's tokens vary: the comparison can fail
    got = reference.generate(model, ids, NEW, reference.Variant(cut=LAYERS), images=images)
    assert got == expected


def test_pruned_cache_is_pops_kv_of_h_cut_at_mrope_positions(model):
    """Every deep layer's cache rows for x_1..x_{N-1} are its own k/v projection of h_cut (the cut layer's
    input), K rotated at the prompt's M-RoPE positions: POP's cache, images included."""
    cut = 4
    images = ImageInputs(*tiny_images(model, [(16, 24), (8, 8)]))
    ids = vl_prompt(model, images.image_grid_thw)
    encoded = encode_prompt(model, ids, images)
    run = reference.PopRun(model, reference.Variant(cut=cut), ids.shape[1],
                           reference.VisionFeed(model, encoded))
    pop_logits = run.prefill(ids)
    rows = ids.shape[1] - 1
    text = model.model.language_model
    h = {}

    def keep_input(module, args, kwargs):
        h["cut"] = args[0] if args else kwargs["hidden_states"]  # [1, rows, d]: h_cut

    hook = text.layers[cut].register_forward_pre_hook(keep_input, with_kwargs=True)
    with torch.no_grad():
        reference.VisionFeed(model, encoded).prompt(ids, 0, rows, DynamicCache())
    hook.remove()
    spec, config = arch_spec(model.config), model.config.text_config
    cos, sin = text.rotary_emb(h["cut"], encoded.positions[:, :, :rows])
    for index in range(cut, LAYERS):
        layer = text.layers[index]
        attention = layer.self_attn

        def project(x, attention=attention):
            return attention.k_proj(x), attention.v_proj(x)

        with torch.no_grad():
            k, v = pruned_kv(spec, layer, h["cut"], project, config.head_dim)
        k = k.view(1, rows, -1, config.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        v = v.view(1, rows, -1, config.head_dim).transpose(1, 2)
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        cached_k, cached_v = run.cache.layers[index].keys, run.cache.layers[index].values
        torch.testing.assert_close(cached_k[:, :, :rows], k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cached_v[:, :, :rows], v, atol=1e-5, rtol=1e-5)
    full = reference.PopRun(model, reference.Variant(cut=LAYERS), ids.shape[1],
                            reference.VisionFeed(model, encoded)).prefill(ids)
    assert (pop_logits - full).abs().max() > 1e-3  # the cut changed something: the check above has teeth


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def test_cut_below_the_deepstack_layers_is_refused(model):
    assert deepstack_layers(model.config) == 2 and deepstack_layers(tiny_model("qwen3").config) == 0
    check_cut(model.config, 2)
    with pytest.raises(ConfigError, match=r"cut 1 is below qwen3_vl's deepstack layers.*--cut 2"):
        reference.generate(model, vl_prompt(model, torch.zeros(0, 3, dtype=torch.long)), 2,
                           reference.Variant(cut=1))


def test_placeholders_that_disagree_with_the_images_are_refused(model):
    images = ImageInputs(*tiny_images(model, [(16, 24)]))
    ids = vl_prompt(model, torch.tensor([[1, 2, 4]]))  # 2 placeholders for an image of 6 tokens
    with pytest.raises(InputError, match="2 image placeholder tokens but the images fill 6"):
        encode_prompt(model, ids, images)
    with pytest.raises(ValueError, match="text model: it takes no images"):
        reference.generate(tiny_model("qwen3"), torch.tensor([[1, 2, 3]]), 2, reference.Variant(cut=2),
                           images=images)
