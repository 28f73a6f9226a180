"""Checkpoint save and load time and size.

`python scripts/bench_checkpoint.py ...` is `python -m yatrain.bench.checkpoint ...`; the benchmark
lives in yatrain/bench/ (its docstring says what it measures and how).
"""

import sys

from yatrain.bench.checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
