"""The manifest's ``vision`` section: what a vision-language engine adds to the folder (no torch).

    "vision": {                              written by exporters/onnx.py for a VLM; empty for a text engine
      "graph": {file, inputs, outputs, bytes, sha256}   vision.onnx (frontend/vision_encoder.py)
      "processing": {patch_size, temporal_patch_size, merge_size, min_pixels, max_pixels, image_mean,
                     image_std, rescale_factor}         how an image becomes patches (runtime/vision.py)
      "image_token_id", "vision_start_token_id", "vision_end_token_id"   the prompt's image tokens
      "image_token", "vision_start", "vision_end"       their text (a prompt or chat template writes them)
      "position_side": int                    the learned position table is side x side
      "deepstack": int                        k: visual_embeds has 1 + k rows
      "hidden_size": int                      d: visual_embeds' last dimension
    }

With a vision section, both text graphs take ``position_ids`` [3, B, T] (M-RoPE) and ``visual_embeds``
[1 + k, B, T, d] after ``attention_mask`` (frontend/capture.VisionDecoderWithKV).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import EngineError

VISION_INPUTS = ("pixel_values", "pos_indices", "pos_weights", "rotary_positions")
VISION_OUTPUTS = ("image_embeds", "deepstack_embeds")
VISUAL_EMBEDS = "visual_embeds"
PROCESSING_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels",
                   "image_mean", "image_std", "rescale_factor")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class VisionSection:
    """The vision section, checked (``from_manifest``)."""

    graph: dict
    processing: dict
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    image_token: str
    vision_start: str
    vision_end: str
    position_side: int
    deepstack: int
    hidden_size: int

    def __post_init__(self) -> None:
        counts = ("image_token_id", "vision_start_token_id", "vision_end_token_id", "position_side",
                  "deepstack", "hidden_size")
        bad = [name for name in counts if not _is_count(getattr(self, name))]
        bad += [name for name in ("image_token", "vision_start", "vision_end")
                if not isinstance(getattr(self, name), str) or not getattr(self, name)]
        if not isinstance(self.processing, dict) or set(self.processing) != set(PROCESSING_KEYS):
            bad.append("processing")
        if not isinstance(self.graph, dict) or tuple(self.graph.get("inputs", ())) != VISION_INPUTS \
                or tuple(self.graph.get("outputs", ())) != VISION_OUTPUTS:
            bad.append("graph")
        if bad:
            raise EngineError(f"the manifest's vision section has bad {', '.join(bad)}")

    @classmethod
    def from_manifest(cls, vision: dict, folder: object = "?") -> VisionSection:
        try:
            return cls(**vision)
        except TypeError as err:
            raise EngineError(f"{folder}: the manifest's vision section is malformed ({err}): re-export the "
                              "engine") from None

    @property
    def merge_size(self) -> int:
        return int(self.processing["merge_size"])
