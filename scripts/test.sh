#!/usr/bin/env bash
# The whole test suite (and lint), on a fresh machine too: sets up .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${YATRAIN_VENV:-.venv}
"$VENV/bin/ruff" check yatrain tests scripts
"$VENV/bin/ruff" format --check yatrain tests scripts
"$VENV/bin/lint-imports"  # the package layering in pyproject.toml
exec "$VENV/bin/python" -m pytest "$@"
