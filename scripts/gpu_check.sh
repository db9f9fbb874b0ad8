#!/usr/bin/env bash
# The prepared GPU check: POP vs full prefill on CUDA through PyTorch (bf16, Llama-3.1-8B geometry, random
# weights), eager graphs from capture + pass and torch.compile(backend=PopBackend) with inner inductor.
# Needs only what the GPU machine has: python3 with torch (CUDA), triton and transformers, and this source
# tree (run from it, PYTHONPATH=.; no venv, no install, no download). TensorRT and onnxruntime's CUDA
# provider are used only where they import (scripts/gpu_check_trt.py, with --engine DIR).
# Ends within GPU_CHECK_LIMIT seconds (default 470, under 8 minutes); writes docs/gpu_results.md/.json, and
# copies them into $OUT when that is set (the device runner brings back what is there).
#
# Usage: bash scripts/gpu_check.sh [gpu_check.py options]
#   bash scripts/gpu_check.sh --dry-run --out /tmp/gpu_results    # CPU, tiny geometry: what CI runs
#   GPU_CHECK_PYTHON=PATH   the interpreter (default: python3)
set -uo pipefail
cd "$(dirname "$0")/.."
LIMIT=${GPU_CHECK_LIMIT:-470}
py=${GPU_CHECK_PYTHON:-python3}
start=$SECONDS
echo "[gpu_check.sh] $("$py" --version 2>&1), limit ${LIMIT}s"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "$((LIMIT - 5))" "$py" scripts/gpu_check.py --budget "$((LIMIT - 20))" "$@"
status=$?
[ $status -eq 124 ] && echo "[gpu_check.sh] the check hit the time limit: the results hold the phases that finished"
echo "[gpu_check.sh] done in $((SECONDS - start)) s (exit $status)"
exit $status
