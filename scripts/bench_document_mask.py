"""The step-time cost of data.document_mask.

`python scripts/bench_document_mask.py ...` is `python -m yatrain.bench.document_mask ...`;
the benchmark lives in yatrain/bench/ (its docstring says what it measures and how).
"""

import sys

from yatrain.bench.document_mask import main

if __name__ == "__main__":
    sys.exit(main())
