"""The ONNX writer's steps as data, in order: onnx.py runs them, the targets count them for a progress bar
(targets.py); here so that neither of those imports the other (onnx.py imports torch and onnx).

    export decode graph             the captured program -> ONNX
    export prefill graph            the POP prefill program -> ONNX
    export vision graph             vision-language models only: the vision tower, one image a call -> ONNX
    fuse attention for onnxruntime  attention lowered "fused" only: ort_passes.ORT_PASSES over both graphs
    quantize weights                int8/int4 weights only: after fusing, so packed projections quantise whole
    write engine folder             both graphs over one weights file, tokenizer and configs (the driver
                                    writes the manifest, once)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WriteStep:
    """A step of the ONNX writer; ``needs``: "fused" (attention lowered to onnxruntime's ops), "quantized"
    (int8/int4 weights), "vision" (a vision-language model) or None (always)."""

    name: str
    needs: str | None = None


ONNX_WRITE_STEPS = (
    WriteStep("export decode graph"),
    WriteStep("export prefill graph"),
    WriteStep("export vision graph", needs="vision"),
    WriteStep("fuse attention for onnxruntime", needs="fused"),
    WriteStep("quantize weights", needs="quantized"),
    WriteStep("write engine folder"),
)
VISION_STEP, FUSE_STEP, QUANTIZE_STEP = (step.name for step in ONNX_WRITE_STEPS if step.needs)
#: the steps every ONNX folder goes through (the TensorRT target writes standard, float weights)
ONNX_STEPS = tuple(step.name for step in ONNX_WRITE_STEPS if step.needs is None)
#: the record written last: the export driver's final step, and build-trt's after its plans
WRITE_MANIFEST = "write manifest"


def onnx_write_steps(attention: str, quantized: bool, vision: bool = False) -> tuple[WriteStep, ...]:
    """The steps that run for an attention lowering ("fused" | "standard"), weights (quantized or not) and a
    model (vision-language or not)."""
    have = {None, *(["fused"] if attention == "fused" else []), *(["quantized"] if quantized else []),
            *(["vision"] if vision else [])}
    return tuple(step for step in ONNX_WRITE_STEPS if step.needs in have)
