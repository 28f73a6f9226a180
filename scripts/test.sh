#!/usr/bin/env bash
# The whole test suite (and lint), on a fresh machine too: sets up .venv first.
#   bash scripts/test.sh            lint, types, every test (what CI runs)
#   bash scripts/test.sh --quick    lint, types, tests/unit only: the inner loop (< 2 minutes)
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=false
if [ "${1:-}" = "--quick" ]; then
  QUICK=true
  shift
fi
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
# The packages typed so far: the sharding engine, context parallelism, checkpoint storage,
# the recipe and the optimizers over the shards, where a wrong shape or a None slipping
# through corrupts state silently (the rest follows, a package at a time).
"$VENV/bin/mypy" yatrain/sharding yatrain/context_parallel yatrain/checkpoint yatrain/recipe yatrain/optim
if $QUICK; then
  exec "$VENV/bin/python" -m pytest tests/unit "$@"
fi
exec "$VENV/bin/python" -m pytest "$@"
