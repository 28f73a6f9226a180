"""The engine vs FSDP2, DDP and a bare step.

`python scripts/bench_engine.py ...` runs `bench.engine` (scripts/bench/; its docstring says
what it measures and how).
"""

import sys

from bench.engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
