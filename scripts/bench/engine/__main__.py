"""``python -m bench.engine``: the engine benchmark (see ``cli``)."""

import sys

from bench.engine.cli import main

sys.exit(main())
