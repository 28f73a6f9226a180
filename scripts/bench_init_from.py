"""Start-up of init_from: bytes read and peak memory per rank.

`python scripts/bench_init_from.py ...` runs `bench.init_from` (scripts/bench/; its docstring says
what it measures and how).
"""

import sys

from bench.init_from import main

if __name__ == "__main__":
    sys.exit(main())
