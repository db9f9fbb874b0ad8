#!/usr/bin/env bash
# Reference setup for benchmarks/optimum_reference.py: an optimum-onnx export of SmolLM2-135M-Instruct.
#
#   bash benchmarks/optimum_env.sh [VENV] [-- extra optimum-cli export options, e.g. --opset 18]
#
# optimum-onnx 0.1.0 needs optimum~=2.1.0 and transformers<4.58, so it lives in its own venv
# (default /tmp/optimum-venv), never in the project's .venv (transformers 5). torch is installed first
# (2.13.0, the CPU wheel on this machine's disk) and pinned, so nothing else can pull another torch.
#
# The model is popcompile's converted Hugging Face folder (written by transformers 5). A COPY in /tmp is
# adapted for transformers 4.57: rope_parameters -> rope_theta (4.57 would otherwise silently fall back
# to rope_theta 10000, i.e. a different model), tokenizer_class TokenizersBackend -> PreTrainedTokenizerFast.
# The original folder is never changed. The export goes to ~/.cache/popcompile/bench-engines/optimum-smollm2
# (skipped when model.onnx is already there).
set -euo pipefail

VENV=${1:-/tmp/optimum-venv}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
EXTRA=("$@")

MODEL=${MODEL:-$HOME/.cache/popcompile/models/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e}
COPY=${COPY:-/tmp/optimum-smollm2-hf}
OUT=${OUT:-$HOME/.cache/popcompile/bench-engines/optimum-smollm2}
TORCH=2.13.0

source "$(dirname "$0")/venv_torch.sh"   # $VENV with torch $TORCH pinned; sets PY and PIP
# torch pinned by constraint: optimum asks only torch>=1.11, which the installed one satisfies.
"${PIP[@]}" -c "$VENV/torch-pin.txt" "transformers>=4.57,<4.58" "optimum~=2.1.0" "optimum-onnx==0.1.0" \
    onnx onnxruntime onnxscript
"$PY" - <<'EOF'
import importlib.metadata as m
print("versions:", ", ".join(f"{p} {m.version(p)}" for p in
      ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime", "onnxscript")))
EOF

# A transformers-4.57-readable copy of the model folder.
rm -rf "$COPY"
mkdir -p "$COPY"
cp "$MODEL"/* "$COPY"/
"$PY" - "$COPY" <<'EOF'
import json, sys
from pathlib import Path
folder = Path(sys.argv[1])
cfg_path = folder / "config.json"
cfg = json.loads(cfg_path.read_text())
rope = cfg.pop("rope_parameters", None)
if rope:
    if rope.get("rope_type", "default") != "default":
        raise SystemExit(f"rope {rope} is not plain RoPE: adapt this script")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = None
cfg_path.write_text(json.dumps(cfg, indent=2))
tok_path = folder / "tokenizer_config.json"
tok = json.loads(tok_path.read_text())
if tok.get("tokenizer_class") == "TokenizersBackend":
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
tok.pop("backend", None)
tok_path.write_text(json.dumps(tok, indent=2))
from transformers import AutoConfig, AutoTokenizer
config = AutoConfig.from_pretrained(folder)
print("copy readable by transformers 4.57: rope_theta", config.rope_theta,
      "tokenizer", type(AutoTokenizer.from_pretrained(folder)).__name__)
EOF

if [ -f "$OUT/model.onnx" ]; then
    echo "$OUT/model.onnx exists: export skipped"
else
    mkdir -p "$(dirname "$OUT")"
    "$VENV/bin/optimum-cli" export onnx -m "$COPY" --task text-generation-with-past "${EXTRA[@]}" "$OUT"
fi
ls -la "$OUT"
