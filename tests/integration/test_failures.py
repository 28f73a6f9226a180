"""Every failure is one line and a non-zero exit, run as a user runs it (real subprocesses,
torchrun for the multi-rank ones): absurd shapes and recipes too big for the machine, recipes
that are not UTF-8 or nested too deep, names too long, a run directory that is a file, in use
or not a run (a restart keeps the old config), an export onto a file, token ids outside the
vocabulary, a full disk, a lost or hung peer."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FAST, ROOT
from faults import DIE, DISK_FULL, HANG, at_step, inject

from yatrain.data.shards import TokenShards
from yatrain.errors import DataError
from yatrain.runtime.failures import explain
from yatrain.train.rundir import default_run_dir


def yatrain(*args: str, env: dict, timeout: float = 240, **options) -> subprocess.CompletedProcess:
    """``python -m yatrain ARGS`` from the repository root; ``options`` go to ``subprocess.run``
    (``preexec_fn``: a resource limit)."""
    return subprocess.run(
        [sys.executable, "-m", "yatrain", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        **options,
    )


def pretrain_args(data: Path, run_dir: Path, *extra: str) -> list[str]:
    sets = [f"--set={s}" for s in [*FAST, f"data.path={data}"]]
    return [
        "pretrain",
        "recipes/tiny.yaml",
        *sets,
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *extra,
    ]


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """The single ``yatrain: error`` line of a failed command (and no traceback)."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("yatrain: error")]
    assert len(errors) == 1, result.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.dim=1000000000", "'model.dim' must be at most"),
        ("model.n_layers=1000000", "'model.n_layers' must be at most"),
        ("model.dim=65536", "does not fit"),  # a real shape, not for this machine
    ],
)
def test_absurd_shapes_fail_before_anything_is_allocated(
    small_data, isolated_env, tmp_path, override, needle
):
    start = time.monotonic()
    args = pretrain_args(small_data, tmp_path / "run", f"--set={override}")
    one_line_error(yatrain(*args, env=isolated_env), needle)
    assert time.monotonic() - start < 60  # never minutes of a growing process
    assert not (tmp_path / "run").exists()


def test_a_recipe_too_big_for_the_machine_is_refused_by_the_fit_check(isolated_env):
    """recipes/llama3_70b.yaml on this CPU: the planner's answer, not the allocator's."""
    line = one_line_error(
        yatrain("pretrain", "recipes/llama3_70b.yaml", env=isolated_env),
        "does not fit",
        "predicts a peak of",
        "is available (available RAM)",
        "--no-fit-check",
    )
    fixes = ("at least", "activation_checkpoint_layers=", "lower data.micro_batch_size")
    assert any(fix in line for fix in fixes)  # what the planner says would fit
    skipped = yatrain("pretrain", "recipes/llama3_70b.yaml", "--no-fit-check", env=isolated_env)
    one_line_error(skipped, "prepare-data")  # got past the check (to the missing data)


def test_run_dir_that_is_a_file_is_refused_before_the_model_is_built(
    small_data, isolated_env, tmp_path
):
    run_dir = tmp_path / "file"
    run_dir.write_text("not a directory")
    one_line_error(yatrain(*pretrain_args(small_data, run_dir), env=isolated_env), "is a file")


def test_a_run_dir_that_is_not_a_run_is_refused_and_a_restart_keeps_the_old_config(
    small_data, isolated_env, tmp_path
):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own file\n")
    one_line_error(
        yatrain(*pretrain_args(small_data, mine, "--steps", "1"), env=isolated_env),
        "is not a yatrain run directory",
    )
    assert [p.name for p in mine.iterdir()] == ["config.yaml"]
    assert (mine / "config.yaml").read_text() == "my own file\n"
    run = tmp_path / "run"
    assert (
        yatrain(*pretrain_args(small_data, run, "--steps", "2"), env=isolated_env).returncode == 0
    )
    before = (run / "config.yaml").read_text()
    restart = pretrain_args(small_data, run, "--steps", "4", "--set=train.log_every=2")
    result = yatrain(*restart, env=isolated_env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (run / "config-before-restart-1.yaml").read_text() == before
    assert "log_every: 2" in (run / "config.yaml").read_text()


def _long(tmp_path: Path) -> str:
    return str(tmp_path / ("x" * 300))


def test_recipes_not_utf8_or_nested_too_deep_and_names_too_long_are_one_line(
    small_data, isolated_env, tmp_path
):
    latin1 = tmp_path / "recipe.yaml"
    latin1.write_bytes("model:\n  dim: 64  # d\xe9faut\n".encode("latin-1"))
    deep = tmp_path / "deep.yaml"
    deep.write_text("model:\n  dim: " + "[" * 5000 + "]" * 5000 + "\n")
    nested = "model.dim=" + "[" * 5000 + "]" * 5000
    for args, needle in [
        (["pretrain", str(latin1)], "is not UTF-8 text"),
        (["plan", str(latin1), "--gpus", "1"], "is not UTF-8 text"),
        (["sweep", str(latin1), "--seq-len", "64"], "is not UTF-8 text"),
        (["plan", str(deep), "--gpus", "1"], "nested too deeply"),
        (["plan", "recipes/tiny.yaml", "--gpus", "1", "--set", nested], "nested too deeply"),
        (
            pretrain_args(small_data, tmp_path / "r", f"--set=data.path={_long(tmp_path)}"),
            "File name too long",
        ),
        (pretrain_args(small_data, Path(_long(tmp_path))), "File name too long"),
        (["prepare-data", "--output", _long(tmp_path), "--vocab-size", "64"], "File name too long"),
    ]:
        one_line_error(yatrain(*args, env=isolated_env), needle)


def test_export_to_a_file_and_init_from_without_safetensors(small_data, isolated_env, tmp_path):
    run_dir = tmp_path / "run"
    done = yatrain(*pretrain_args(small_data, run_dir, "--steps", "2"), env=isolated_env)
    assert done.returncode == 0, done.stderr
    target = tmp_path / "taken"
    target.write_text("x")
    checkpoint = str(run_dir / "checkpoints/step-2")
    one_line_error(
        yatrain("export", checkpoint, "--output", str(target), env=isolated_env), "is a file"
    )
    hf = tmp_path / "hf"
    assert yatrain("export", checkpoint, "--output", str(hf), env=isolated_env).returncode == 0
    for weights in hf.glob("model*.safetensors*"):
        weights.unlink()
    args = pretrain_args(small_data, tmp_path / "run2", f"--set=train.init_from={hf}")
    one_line_error(yatrain(*args, env=isolated_env), "no model.safetensors")


def test_token_ids_outside_the_vocabulary_are_refused_when_data_is_opened(
    small_data, isolated_env, tmp_path
):
    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    manifest = json.loads((data / "manifest.json").read_text())
    tokens = data / manifest["files"][0]["name"]
    ids = np.fromfile(tokens, dtype=np.uint16)
    ids[1000] = 60000  # a uint16 id far outside the 512-token vocabulary
    ids.tofile(tokens)
    manifest["files"][0]["sha256"] = hashlib.sha256(tokens.read_bytes()).hexdigest()
    (data / "manifest.json").write_text(json.dumps(manifest))
    args = pretrain_args(data, tmp_path / "run", "--steps", "1")
    one_line_error(yatrain(*args, env=isolated_env), "token id 60000", "vocabulary of 512")
    unchecked = TokenShards.open(data, verify_checksums=False)  # large data: checked per read
    with pytest.raises(DataError, match="token id 60000"):
        unchecked.read(990, 33)


def test_one_run_per_directory(small_data, isolated_env, tmp_path):
    run_dir = tmp_path / "run"
    args = pretrain_args(small_data, run_dir, "--steps", "2000", "--set=checkpoint.every=5")
    first = subprocess.Popen(
        [sys.executable, "-m", "yatrain", *args],
        cwd=ROOT,
        env=isolated_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 6):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        second = yatrain(*args, env=isolated_env)
        one_line_error(second, "is in use by another run", f"PID {first.pid} on ")
        lines = len(metrics.read_text().splitlines())
        time.sleep(1.0)
        assert len(metrics.read_text().splitlines()) > lines >= 6  # untouched, still growing
    finally:
        first.send_signal(signal.SIGKILL)  # no clean exit: the lock must not outlive it
        first.communicate()
    third = yatrain(*pretrain_args(small_data, run_dir, "--steps", "12"), env=isolated_env)
    assert third.returncode == 0 and "resumed from" in third.stderr, third.stderr[-2000:]


def test_default_run_dirs_are_unique_within_a_second(tmp_path):
    made = {default_run_dir("tiny", tmp_path) for _ in range(5)}
    assert len(made) == 5 and all(p.is_dir() for p in made)


@pytest.mark.parametrize("background", ["false", "true"])
def test_disk_full_during_a_save_is_one_line(small_data, isolated_env, tmp_path, background):
    """Also when the save is written in the background (checkpoint.async): its failure is
    raised at the next save, and nothing of that one is started."""
    env = inject(isolated_env, tmp_path / "inject", DISK_FULL.format(step=4))
    run_dir = tmp_path / "run"
    args = pretrain_args(
        small_data,
        run_dir,
        "--steps",
        "6",
        "--set=checkpoint.every=2",
        f"--set=checkpoint.async={background}",
    )
    one_line_error(
        yatrain(*args, env=env),
        "could not save checkpoint",
        "no space left on device at",
        "needs about",
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2"]


def torchrun(args: list[str], env: dict, logs: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """An ``nproc``-rank torchrun job whose ranks' output goes to files under ``logs``."""
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
    ]
    return subprocess.run(
        [*launcher, "-m", "yatrain", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


def rank_stderr(logs: Path, rank: int) -> str:
    (path,) = logs.glob(f"**/attempt_0/{rank}/stderr.log")
    return path.read_text()


@pytest.mark.parametrize(
    "fault,needle",
    [(DIE, "lost contact with another rank at step 3"), (HANG, "step 3 has made no progress")],
)
def test_a_lost_or_hung_peer_ends_rank_0_with_one_line(
    small_data, isolated_env, tmp_path, fault, needle
):
    env = inject(isolated_env, tmp_path / "inject", at_step(rank=1, step=3, action=fault))
    args = pretrain_args(
        small_data, tmp_path / "run", "--steps", "50", "--set=train.collective_timeout_s=3"
    )
    start = time.monotonic()
    result = torchrun(args, env, tmp_path / "logs")
    assert result.returncode != 0 and time.monotonic() - start < 120
    err = rank_stderr(tmp_path / "logs", 0)
    seen = f"{err[-3000:]}\n--- torchrun's own output:\n{result.stderr[-2000:]}"
    assert "Traceback" not in err, seen
    errors = [line for line in err.splitlines() if line.startswith("yatrain: error (rank 0)")]
    assert len(errors) == 1 and needle in errors[0], seen


def test_machine_failures_are_explained_and_bugs_are_not():
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 68719476736 bytes."
    )
    for error in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB"), cpu):
        explained = explain(error, "at step 3")
        assert explained is not None and str(explained).startswith("out of memory at step 3")
        assert "\n" not in str(explained)
    assert explain(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "at step 3") is None
    # without a process group nothing is a lost peer
    assert explain(RuntimeError("Connection reset by peer"), "at step 3") is None
