"""Context parallelism through ``yatrain pretrain``: a CP 2 run, with documents masked and
evaluation during training, resumes at CP 1 and at CP 4 on the same windows in the same
order (losses within 1e-5 of the uninterrupted run), and a launch it cannot run is refused
in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST, ROOT
from distributed import run_ranks

from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain

TOL = 1e-5


def _recipe(data: Path, cp: int):
    overrides = [
        *FAST,
        f"data.path={data}",
        f"sharding.context_parallel={cp}",
        "train.dtype=fp32",
        "data.document_mask=true",
        "data.restart_positions=true",
        "sharding.activation_checkpoint_layers=1",
        "checkpoint.every=2",
        "eval.every=2",
        "eval.batches=1",
    ]
    return load_recipe(ROOT / "recipes/tiny.yaml", overrides)


def _pretrain(rank, world, data, cp, run_dir, steps):
    pretrain(_recipe(data, cp), run_dir=run_dir, steps=steps, progress=False)
    return rank


def _run(world: int, data: Path, cp: int, run_dir: Path, steps: int) -> dict[int, dict]:
    if world == 1:
        pretrain(_recipe(data, cp), run_dir=run_dir, steps=steps, progress=False)
    else:
        run_ranks(world, _pretrain, data, cp, run_dir, steps)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= TOL * abs(want)


def test_cp2_run_resumes_at_cp1_and_cp4(small_data, tmp_path):
    straight = _run(2, small_data, 2, tmp_path / "straight", 4)
    one = _run(1, small_data, 1, tmp_path / "one", 2)  # CP 1, one process: the reference
    for step in (1, 2):
        assert _close(straight[step]["loss"], one[step]["loss"])
    assert _close(straight[2]["val_loss"], one[2]["val_loss"])  # evaluated under CP 2
    stopped = tmp_path / "stopped"
    _run(2, small_data, 2, stopped, 2)
    for world, cp in [(1, 1), (4, 4)]:
        resumed_dir = tmp_path / f"cp{cp}"
        shutil.copytree(stopped, resumed_dir)
        resumed = _run(world, small_data, cp, resumed_dir, 4)
        for step in (3, 4):
            assert _close(resumed[step]["loss"], straight[step]["loss"]), (cp, step)
        assert _close(resumed[4]["val_loss"], straight[4]["val_loss"]), cp


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["sharding.context_parallel=2"], "'sharding.context_parallel' 2 cuts each window"),
        (["sharding.context_parallel=3"], "is not a multiple of 2 x 'sharding.context_parallel'"),
    ],
)
def test_refused_in_one_line(small_data, tmp_path, isolated_env, extra, expected):
    sets = [arg for item in [*FAST, f"data.path={small_data}", *extra] for arg in ("--set", item)]
    command = [sys.executable, "-m", "yatrain", "pretrain", str(ROOT / "recipes/tiny.yaml")]
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [*command, *sets, "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        env=isolated_env,
        timeout=120,
    )
    assert done.returncode != 0
    assert expected in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not run_dir.exists()
