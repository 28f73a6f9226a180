"""Tokenization throughput of prepare-data, 1 vs 2 workers.

`python scripts/bench_tokenize.py ...` runs `bench.tokenization` (scripts/bench/; its docstring says
what it measures and how).
"""

import sys

from bench.tokenization import main

if __name__ == "__main__":
    sys.exit(main())
