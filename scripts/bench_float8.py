"""Shim: python scripts/bench_float8.py ... == python -m bench.float8 ..."""

import sys

from bench.float8 import main

if __name__ == "__main__":
    sys.exit(main())
