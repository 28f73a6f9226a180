"""The engine vs FSDP2, DDP and a bare step.

`python scripts/bench_engine.py ...` is `python -m yatrain.bench.engine ...`; the benchmark
lives in yatrain/bench/ (its docstring says what it measures and how).
"""

import sys

from yatrain.bench.engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
