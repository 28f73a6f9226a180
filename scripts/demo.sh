#!/usr/bin/env bash
# The main job: set up, tokenize the built-in corpus once, pretrain the tiny recipe.
# Extra arguments go to `yatrain pretrain`, e.g. `bash scripts/demo.sh --steps 20`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${YATRAIN_VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
if [ ! -f data/stdlib/manifest.json ]; then
  yatrain prepare-data --output data/stdlib --vocab-size 4096
fi
exec yatrain pretrain recipes/tiny.yaml "$@"
