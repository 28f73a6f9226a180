"""A rank imports only what its run uses: a one-process training without compile, on
tokenized data, loads no compile machinery of its own before its first step and no parquet,
tokenizer-library, float8 or TensorBoard code at all (checked by module sets, not memory)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import FAST, ROOT

# Runs ``yatrain pretrain ARGS`` in a fresh interpreter. It notes who first imports dynamo
# and inductor (the outermost torch frame of that import), the watched modules present when
# the first training step starts, and those present at exit.
PROBE = """
import atexit, json, sys, traceback
WATCHED = ("torch._dynamo", "torch._inductor", "pyarrow", "tokenizers", "tiktoken", "torchao",
           "tensorboard", "torch.utils.tensorboard")
seen = {"importer": {}}
class Importer:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch._dynamo", "torch._inductor") and name not in seen["importer"]:
            torch_frames = [f.filename for f in traceback.extract_stack()
                            if "/torch/" in f.filename]
            seen["importer"][name] = torch_frames[0] if torch_frames else "?"
        return None
sys.meta_path.insert(0, Importer())
from yatrain.cli import main  # first: it points inductor's cache away before torch loads
import yatrain.train.loop as loop
first_step = loop.train_step
def step(*args, **kwargs):
    seen.setdefault("before", sorted(m for m in WATCHED if m in sys.modules))
    return first_step(*args, **kwargs)
loop.train_step = step
def report():
    seen["after"] = sorted(m for m in WATCHED if m in sys.modules)
    print("PROBE", json.dumps(seen), file=sys.stderr)
atexit.register(report)
sys.argv = ["yatrain", *sys.argv[1:]]
main()
"""


def test_a_plain_run_imports_no_compile_parquet_tokenizer_float8_or_tensorboard(
    small_data, isolated_env, tmp_path
):
    sets = [f"--set={s}" for s in [*FAST, f"data.path={small_data}", "train.compile=false"]]
    args = ["pretrain", "recipes/tiny.yaml", *sets, "--steps=2", "--no-progress"]
    args += ["--run-dir", str(tmp_path / "run")]
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env=isolated_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stderr.splitlines() if x.startswith("PROBE "))
    seen = json.loads(line.removeprefix("PROBE "))
    # torch's own optimizer imports dynamo when it is built (add_param_group is wrapped in
    # torch._disable_dynamo): that import is torch's, never one of yatrain's modules.
    for module, importer in seen["importer"].items():
        assert "/torch/optim/" in importer, f"{module} imported first by {importer}"
    assert not set(seen["before"]) - {"torch._dynamo", "torch._inductor"}, seen
    assert seen["after"] == [m for m in seen["after"] if m.startswith("torch._")], seen
