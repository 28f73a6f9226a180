"""Tokenization throughput of prepare-data, 1 vs 2 workers.

`python scripts/bench_tokenize.py ...` is `python -m yatrain.bench.tokenization ...`; the
benchmark lives in yatrain/bench/ (its docstring says what it measures and how).
"""

import sys

from yatrain.bench.tokenization import main

if __name__ == "__main__":
    sys.exit(main())
