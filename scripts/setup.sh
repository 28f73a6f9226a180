#!/usr/bin/env bash
# Create .venv with yatrain and its dependencies (idempotent; re-run after pulling).
# YATRAIN_EXTRAS picks the pyproject extras to install (default: dev).
#
# On a machine without a GPU this pins the CPU build of torch 2.13.0 (an open range could
# pull a multi-GB CUDA build). On a GPU machine set YATRAIN_TORCH to the torch requirement
# you want (e.g. YATRAIN_TORCH="torch==2.13.0" with your CUDA index configured in pip).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${YATRAIN_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
EXTRAS=${YATRAIN_EXTRAS:-dev}  # pyproject extras; scripts/test.sh adds hf (transformers)
stamp="$VENV/.yatrain-installed-${EXTRAS//,/-}"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && "$PY" -c "import yatrain, torch" 2>/dev/null; then
  exit 0
fi
"$PY" -m pip install -q --upgrade pip >/dev/null
if [ -z "${YATRAIN_TORCH:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then YATRAIN_TORCH="torch>=2.5"; else YATRAIN_TORCH="torch==2.13.0"; fi
fi
"$PY" -m pip install -q "$YATRAIN_TORCH"
"$PY" -m pip install -q -e ".[$EXTRAS]"
touch "$stamp"
echo "setup: $("$PY" -c 'import torch, yatrain; print("yatrain", yatrain.__version__, "torch", torch.__version__)')" >&2
