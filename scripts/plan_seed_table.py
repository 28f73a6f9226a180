"""The planner's answer for every row of YaFSDP's benchmark table.

`python scripts/plan_seed_table.py ...` is `python -m yatrain.bench.seed_table ...`; the benchmark
lives in yatrain/bench/ (its docstring says what it measures and how).
"""

import sys

from yatrain.bench.seed_table import main

if __name__ == "__main__":
    sys.exit(main())
