"""A VLM's vision tower as one exportable graph, run once per image.

transformers' Qwen3-VL vision forward derives three index tensors from ``grid_thw`` with data-dependent
loops and splits attention by ``cu_seqlens.tolist()``: neither exports. The graph takes them as inputs
instead (the runtime computes them from the image's grid, runtime/vision.py) and attends over one image's
patches at a time, which is what the block-diagonal attention of a batch of images computes per image::

    pixel_values      [P, C*T*p*p]  the image's patches (processor order: merge blocks, row-major)
    pos_indices       [P, 4]        int64, the 4 bilinear taps into the learned position table per patch
    pos_weights       [P, 4]        their weights
    rotary_positions  [P, 2]        int64, the patch's (row, column) in the image's grid
      -> image_embeds     [P / m^2, d_text]       the merged features (they replace the placeholders)
      -> deepstack_embeds [k, P / m^2, d_text]    the deepstack mergers' features (added after layers 0..k-1)

The blocks run as transformers' blocks do (norm1, qkv, 2D rotary, attention, proj, residual; norm2, MLP,
residual); the modules are the model's own.
"""
from __future__ import annotations

import torch
import torch.fx.experimental._config as fx_config
from torch.export import Dim, ExportedProgram

from .vision import vision_spec


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionEncoder(torch.nn.Module):
    """One image through the vision tower ``visual`` (module docstring)."""

    def __init__(self, visual: torch.nn.Module):
        super().__init__()
        self.visual = visual

    def forward(self, pixel_values, pos_indices, pos_weights, rotary_positions):
        v = self.visual
        hidden = v.patch_embed(pixel_values)  # [P, e]
        hidden = hidden + (v.pos_embed(pos_indices) * pos_weights[..., None]).sum(1).to(hidden.dtype)
        cos, sin = v.rotary_pos_emb(hidden, rotary_positions)  # [P, head_dim]
        deepstack = []
        for index, block in enumerate(v.blocks):
            hidden = hidden + self._attention(block.attn, block.norm1(hidden), cos, sin)
            hidden = hidden + block.mlp(block.norm2(hidden))
            if index in v.deepstack_visual_indexes:
                deepstack.append(v.deepstack_merger_list[v.deepstack_visual_indexes.index(index)](hidden))
        return v.merger(hidden), torch.stack(deepstack)

    @staticmethod
    def _attention(attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        """transformers' vision attention over every patch of one image (no split by cu_seqlens)."""
        patches = x.shape[0]
        # q, k, v: [P, H, D]
        q, k, v = attn.qkv(x).reshape(patches, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(  # [1, H, P, D]
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=attn.scaling)
        return attn.proj(out[0].transpose(0, 1).reshape(patches, -1))


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_submodule(vision_spec(model.config).vision)


def vision_example_inputs(model: torch.nn.Module, patches: int = 32) -> tuple[torch.Tensor, ...]:
    """Samples of one image of ``patches`` patches (a multiple of merge^2, >= 2 merged tokens)."""
    vc = model.config.vision_config
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    dtype = next(vision_tower(model).parameters()).dtype
    return (torch.randn(patches, width, dtype=dtype),
            torch.randint(0, vc.num_position_embeddings, (patches, 4)),
            torch.rand(patches, 4, dtype=dtype), torch.randint(0, 8, (patches, 2)))


def capture_vision_encoder(model: torch.nn.Module) -> ExportedProgram:
    """torch.export of VisionEncoder; the number of patches is dynamic (a multiple of merge^2)."""
    merge = model.config.vision_config.spatial_merge_size
    tokens = Dim("image_tokens", min=1, max=1 << 20)
    patches = merge * merge * tokens
    dims = ({0: patches}, {0: patches}, {0: patches}, {0: patches})
    with fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(VisionEncoder(vision_tower(model)).eval(), vision_example_inputs(model),
                                   dynamic_shapes=dims, strict=False)
