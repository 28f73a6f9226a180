"""Where the step time goes at world size 2, and what measuring it costs.

`python scripts/bench_breakdown.py ...` runs `bench.breakdown` (scripts/bench/; its docstring says
what it measures and how).
"""

import sys

from bench.breakdown import main

if __name__ == "__main__":
    sys.exit(main())
