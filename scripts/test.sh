#!/usr/bin/env bash
# The whole test suite (and lint), on a fresh machine too: sets up .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
# hf: transformers, so the Hugging Face export test runs instead of being skipped;
# tensorboard: the TensorBoard logger's test; browser: playwright for the HTML report's test;
# float8: torchao, for train.float8's tests.
YATRAIN_EXTRAS=dev,hf,tensorboard,browser,float8 bash scripts/setup.sh
# That test drives Debian's chromium (no browser download): installed when root with apt,
# else the test skips itself with one line.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
  && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
    >/dev/null 2>&1 || echo "test.sh: chromium not installed; the browser test will skip" >&2
fi
export YATRAIN_TEST_REQUIRE_HF=1  # a missing transformers is then a failure, not a skip
VENV=${YATRAIN_VENV:-.venv}
"$VENV/bin/ruff" check yatrain tests scripts
"$VENV/bin/ruff" format --check yatrain tests scripts
"$VENV/bin/lint-imports"  # the package layering in pyproject.toml
exec "$VENV/bin/python" -m pytest "$@"
