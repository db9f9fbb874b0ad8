"""The progress-step names the ONNX writer reports, shared by the writer (onnx.py) and the targets that
count them for a progress bar (targets.py), so that neither imports the other."""

ONNX_STEPS = ("export decode graph", "export prefill graph", "write engine folder")
# after the exports, with attention="fused" (the onnx target's default)
FUSE_STEP = "fuse attention for onnxruntime"
QUANTIZE_STEP = "quantize weights"   # then, with --weights int8/int4
