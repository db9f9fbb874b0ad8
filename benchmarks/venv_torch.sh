# Sourced by the anchors' setup scripts (optimum_env.sh, genai_env.sh): a venv at $VENV with torch $TORCH
# (the CPU wheel on this machine's disk) installed first and pinned in $VENV/torch-pin.txt, so that no
# later install can pull another torch. Sets PY (the venv's python) and PIP (pip install, quiet).
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
    "${PIP[@]}" "torch==$TORCH"
fi
echo "torch==$("$PY" -c 'import torch; print(torch.__version__)')" > "$VENV/torch-pin.txt"
