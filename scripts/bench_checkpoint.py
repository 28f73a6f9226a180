"""Checkpoint save and load time and size.

`python scripts/bench_checkpoint.py ...` runs `bench.checkpoint` (scripts/bench/; its docstring says
what it measures and how).
"""

import sys

from bench.checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
