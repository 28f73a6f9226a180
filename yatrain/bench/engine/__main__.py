"""``python -m yatrain.bench.engine``: the engine benchmark (see ``cli``)."""

import sys

from yatrain.bench.engine.cli import main

sys.exit(main())
