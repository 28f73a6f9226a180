"""The training loop vs a bare PyTorch loop.

`python scripts/bench_loop.py ...` runs `bench.loop` (scripts/bench/; its docstring says
what it measures and how).
"""

import sys

from bench.loop import main

if __name__ == "__main__":
    sys.exit(main())
