"""The step-time cost of data.document_mask.

`python scripts/bench_document_mask.py ...` runs `bench.document_mask` (scripts/bench/; its
docstring says what it measures and how).
"""

import sys

from bench.document_mask import main

if __name__ == "__main__":
    sys.exit(main())
