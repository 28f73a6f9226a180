"""Host work per step, counted: yatrain vs FSDP2 (collectives, engine ops, CUDA events).

`python scripts/bench_host_cost.py ...` runs `bench.host_cost` (scripts/bench/; its docstring says
what it counts and how).
"""

import sys

from bench.host_cost import main

if __name__ == "__main__":
    sys.exit(main())
