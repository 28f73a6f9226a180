"""Shim: python scripts/bench_compile.py ... == python -m yatrain.bench.compile ..."""

import sys

from yatrain.bench.compile import main

if __name__ == "__main__":
    sys.exit(main())
