#!/usr/bin/env bash
# The whole test suite (and lint), on a fresh machine too: sets up .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
# hf: transformers, so the Hugging Face export test runs instead of being skipped.
YATRAIN_EXTRAS=dev,hf bash scripts/setup.sh
export YATRAIN_TEST_REQUIRE_HF=1  # a missing transformers is then a failure, not a skip
VENV=${YATRAIN_VENV:-.venv}
"$VENV/bin/ruff" check yatrain tests scripts
"$VENV/bin/ruff" format --check yatrain tests scripts
"$VENV/bin/lint-imports"  # the package layering in pyproject.toml
exec "$VENV/bin/python" -m pytest "$@"
