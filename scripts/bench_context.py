"""Memory and K/V traffic of context parallelism (sharding.context_parallel).

`python scripts/bench_context.py ...` runs `bench.context` (scripts/bench/; its docstring says
what it measures and how).
"""

import sys

from bench.context import main

if __name__ == "__main__":
    sys.exit(main())
