"""Shim: python scripts/bench_compile.py ... == python -m bench.compile ..."""

import sys

from bench.compile import main

if __name__ == "__main__":
    sys.exit(main())
