#!/usr/bin/env bash
# The main job: set up, tokenize the built-in corpus once, pretrain the tiny recipe.
# Extra arguments go to `yatrain pretrain`, e.g. `bash scripts/demo.sh --steps 20`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${YATRAIN_VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
# 2% of the documents held out: the tiny recipe evaluates on them every 30 steps.
PREPARE=(yatrain prepare-data --output data/stdlib --vocab-size 4096 --val-fraction 0.02)
if [ ! -f data/stdlib/manifest.json ]; then
  "${PREPARE[@]}"
elif ! grep -q '"validation": {' data/stdlib/manifest.json; then
  kept="data/stdlib-without-split-$(date +%Y%m%d-%H%M%S)"
  echo "demo: data/stdlib has no held-out split (made by an older yatrain): kept as $kept" >&2
  mv data/stdlib "$kept"
  "${PREPARE[@]}"
fi
exec yatrain pretrain recipes/tiny.yaml "$@"
