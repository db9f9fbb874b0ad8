#!/usr/bin/env bash
# Reference setup for benchmarks/anchors.py: onnxruntime-genai model builder exports of SmolLM2-135M-Instruct.
#
#   bash benchmarks/genai_env.sh [VENV] [-- extra builder options, e.g. --extra_options block_size=128]
#
# onnxruntime-genai lives in its own venv (default /tmp/genai-venv), never in the project's .venv. torch is
# installed first (2.13.0, the CPU wheel on this machine's disk) and pinned, so nothing else can pull
# another torch (the builder imports torch; onnxruntime-genai itself asks only numpy and onnxruntime).
#
# The model is popcompile's converted Hugging Face folder (written by transformers 5.19). The builder of
# onnxruntime-genai 0.18 runs with transformers 5 and reads rope_parameters itself (it collapses them to
# rope_theta 100000), so it reads the ORIGINAL folder as written: no adapted copy is needed (unlike
# optimum_env.sh, whose transformers 4.57 needs one). The builder only reads it (-i); its scratch files go
# to a temporary -c folder. HF_HUB_OFFLINE=1 and --extra_options hf_token=false: no hub access at all.
#
# Exports (each skipped when its genai_config.json is already there; built in a temporary folder and
# moved into place, so a failed build leaves nothing behind):
#   ~/.cache/popcompile/bench-engines/genai-smollm2-fp32    -p fp32 -e cpu
#   ~/.cache/popcompile/bench-engines/genai-smollm2-int4    -p int4 -e cpu  (CPU defaults: MatMulNBits,
#                                                           4 bits, block 32, symmetric, accuracy_level 4)
# Then a check: 8 greedy tokens of each export on a short prompt against transformers' own model.
# (`python -m onnxruntime_genai.models.builder --help` crashes in 0.18 (argparse formats its help text);
# the options are in its source: onnxruntime_genai/models/builder.py, get_args.)
set -euo pipefail

VENV=${1:-/tmp/genai-venv}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
EXTRA=("$@")

MODEL=${MODEL:-$HOME/.cache/popcompile/models/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e}
OUT=${OUT:-$HOME/.cache/popcompile/bench-engines/genai-smollm2}
TORCH=2.13.0
GENAI=${GENAI:-0.18.0}

source "$(dirname "$0")/venv_torch.sh"   # $VENV with torch $TORCH pinned; sets PY and PIP
# torch pinned by constraint. transformers 5 reads the folder as written; onnx_ir and tqdm are the
# builder's imports that onnxruntime-genai does not declare.
"${PIP[@]}" -c "$VENV/torch-pin.txt" "onnxruntime-genai==$GENAI" "transformers>=5.19,<6" onnx onnx-ir tqdm numpy
"$PY" - <<'EOF'
import importlib.metadata as m
print("versions:", ", ".join(f"{p} {m.version(p)}" for p in
      ("torch", "transformers", "onnxruntime-genai", "onnxruntime", "onnx", "onnx-ir", "numpy")))
EOF

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
for PRECISION in fp32 int4; do
    DEST="$OUT-$PRECISION"
    if [ -f "$DEST/genai_config.json" ] && [ -f "$DEST/model.onnx" ]; then
        echo "$DEST exists: export skipped"
        continue
    fi
    mkdir -p "$(dirname "$DEST")"
    WORK=$(mktemp -d "$DEST.building.XXXXXX")
    LOG="$WORK.log"
    echo "building $DEST (log: $LOG)"
    if ! "$PY" -m onnxruntime_genai.models.builder -i "$MODEL" -o "$WORK/model" -p "$PRECISION" -e cpu \
            -c "$WORK/cache" --extra_options hf_token=false "${EXTRA[@]}" > "$LOG" 2>&1; then
        tail -n 20 "$LOG"
        rm -rf "$WORK"
        echo "the $PRECISION export failed: see $LOG" >&2
        exit 1
    fi
    grep -E "^(Extra options|GroupQueryAttention|Saving (ONNX|GenAI))" "$LOG" || true
    rm -rf "$DEST"
    mv "$WORK/model" "$DEST"
    rm -rf "$WORK"
    rm -f "$LOG"
done

# Same model? 8 greedy tokens of each export against transformers' (float32, eager) on a fixed prompt.
"$PY" - "$MODEL" "$OUT-fp32" "$OUT-int4" <<'EOF'
import sys
import numpy as np
import onnxruntime_genai as og
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, exports = sys.argv[1], sys.argv[2:]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
ids = tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
new = 8
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
with torch.no_grad():
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, len(ids):].tolist()
for folder in exports:
    model = og.Model(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + new, min_length=len(ids) + new)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(ids, dtype=np.int32))
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    same = next((i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b), new)
    print(f"check {folder}: greedy tokens equal to transformers' for the first {same}/{new}: "
          f"{tokenizer.decode(tokens)!r}")
EOF
ls -la "$OUT-fp32" "$OUT-int4"
