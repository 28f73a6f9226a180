"""The planner's answer for every row of YaFSDP's benchmark table.

`python scripts/plan_seed_table.py ...` runs `bench.seed_table` (scripts/bench/; its docstring says
what it measures and how).
"""

import sys

from bench.seed_table import main

if __name__ == "__main__":
    sys.exit(main())
