"""Memory and K/V traffic of context parallelism (sharding.context_parallel).

`python scripts/bench_context.py ...` is `python -m yatrain.bench.context ...`; the benchmark
lives in yatrain/bench/ (its docstring says what it measures and how).
"""

import sys

from yatrain.bench.context import main

if __name__ == "__main__":
    sys.exit(main())
