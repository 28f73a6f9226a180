"""The training loop vs a bare PyTorch loop.

`python scripts/bench_loop.py ...` is `python -m yatrain.bench.loop ...`; the benchmark
lives in yatrain/bench/ (its docstring says what it measures and how).
"""

import sys

from yatrain.bench.loop import main

if __name__ == "__main__":
    sys.exit(main())
