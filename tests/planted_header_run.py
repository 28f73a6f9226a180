"""``python -m yatrain ARGS`` with an attacker who got to the shared temporary directory
first (tests/integration/test_compile_cache.py).

Inductor's precompiled header is named by a hash of its content, torch's compile command
and the compiler's version: the same on every machine with this torch and compiler, so an
attacker can name it in advance. Here the run's own hash names the planted file just before
torch looks for it, wherever torch looks under ``$PLANT_SHARED_TMP``. The planted header
includes what torch's would and adds a C++ constructor that creates ``$PLANT_MARKER`` when
a kernel built with it is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import yatrain.cli  # as `python -m yatrain`: the command line's set-up before torch

# isort: split
from torch._inductor import codecache  # noqa: E402

SHARED = Path(os.environ["PLANT_SHARED_TMP"])
CONSTRUCTOR = f"""
#include <cstdio>
__attribute__((constructor)) static void planted_by_someone_else() {{
    if (std::FILE* marker = std::fopen("{os.environ["PLANT_MARKER"]}", "w")) std::fclose(marker);
}}
"""
original_write = codecache.write


def planting_write(content, extension, extra="", hash_type="code", specified_dir="", key=None):
    if specified_dir and Path(specified_dir).is_relative_to(SHARED):
        key = key or codecache.get_hash(content.strip(), extra, hash_type)
        path = Path(codecache.get_path(key, extension, specified_dir)[2])
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content + CONSTRUCTOR)
    return original_write(content, extension, extra, hash_type, specified_dir, key)


codecache.write = planting_write
yatrain.cli.main()
