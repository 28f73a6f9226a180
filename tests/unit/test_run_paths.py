"""What a run writes into its directory is its own: a folder it writes into (``hang/``,
``profile/``, ``tensorboard/``, ``wandb/``) that is a link or not a directory, and a file it
reads or writes (the lock, ``config.yaml``, ``metrics.jsonl``) that is not a regular file,
are refused in one line before anything is written, without hanging on a FIFO; and a
restart keeps an earlier hang's evidence (each attempt's stacks and report in
``hang/attempt-N/``)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from yatrain.errors import ConfigError
from yatrain.output.tensorboard_logger import writable_folder
from yatrain.runtime.hang import HangReporter, StackFile
from yatrain.runtime.process import Runtime
from yatrain.train.profile import StepProfiler
from yatrain.train.rundir import LOCK_FILE, claim_run_dir

FOLDERS = ("hang", "profile", "tensorboard", "wandb")
FILES = (LOCK_FILE, "config.yaml", "metrics.jsonl")


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (not followed through links): its kind and bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        kind = "link" if p.is_symlink() else "fifo" if p.is_fifo() else "dir" if p.is_dir() else ""
        out[str(p.relative_to(root))] = kind or p.read_text()
    return out


@contextlib.contextmanager
def _no_hang(seconds: int = 20):
    """Fail (not hang) when the block blocks, as opening a FIFO would."""

    def stuck(*_):
        raise TimeoutError("blocked: a FIFO was opened")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _claim(run_dir: Path):
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return claim_run_dir(runtime, "auto", run_dir, "tiny", "checkpoints")


def _old_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "config.yaml").write_text("model: {}\n")
    return run_dir


@pytest.mark.parametrize("name", FOLDERS)
def test_a_linked_run_folder_is_refused_and_what_it_points_to_is_untouched(tmp_path, name):
    users = tmp_path / "users"
    users.mkdir()
    for mine in ("stack-rank0.txt", "report.txt", "trace.json"):
        (users / mine).write_text(f"the user's {mine}")
    run_dir = _old_run(tmp_path)
    (run_dir / name).symlink_to(users)
    before, theirs = _tree(run_dir), _tree(users)
    with pytest.raises(ConfigError, match=rf"{name} is a symbolic link.*remove the link"):
        _claim(run_dir)
    assert _tree(run_dir) == before and _tree(users) == theirs


@pytest.mark.parametrize("name", FOLDERS)
def test_a_file_where_a_run_folder_goes_is_refused(tmp_path, name):
    run_dir = _old_run(tmp_path)
    (run_dir / name).write_text("mine")
    before = _tree(run_dir)
    with pytest.raises(ConfigError, match=rf"{name} is a file, not a directory"):
        _claim(run_dir)
    assert _tree(run_dir) == before


def test_each_writer_of_a_run_folder_refuses_a_link_itself(tmp_path):
    """The hang stacks (every rank), the profiler's traces and TensorBoard's events: a link
    at their folder is refused where it is made, not followed (mkdir(exist_ok=True) did)."""
    users = tmp_path / "users"
    users.mkdir()
    (users / "stack-rank0.txt").write_text("mine")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("hang", "profile", "tensorboard"):
        (run_dir / name).symlink_to(users)
    with pytest.raises(ConfigError, match="hang is a symbolic link"):
        StackFile(run_dir, 0)
    with pytest.raises(ConfigError, match="profile is a symbolic link"):
        StepProfiler(1, run_dir, 0, torch.device("cpu"), 0, print)
    with pytest.raises(ConfigError, match="tensorboard is a symbolic link"):
        writable_folder(run_dir / "tensorboard")
    assert _tree(users) == {"stack-rank0.txt": "mine"}


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_a_run_file_that_is_not_a_regular_file_is_refused_without_hanging(tmp_path, name, kind):
    run_dir = _old_run(tmp_path)
    (run_dir / name).unlink(missing_ok=True)
    os.mkfifo(run_dir / name) if kind == "fifo" else (run_dir / name).mkdir()
    before = _tree(run_dir)
    shown = "FIFO" if kind == "fifo" else "directory"
    with _no_hang(), pytest.raises(ConfigError, match=rf"{name} is a {shown}.*not a regular file"):
        _claim(run_dir)
    assert _tree(run_dir) == before


def _note() -> dict:
    return {"doing": "step 5", "phase": "forward", "micro_batch": 0, "collectives": 3}


def _attempt(run_dir: Path, world_size: int) -> HangReporter:
    """One attempt of a job, as rank 0 sees it: its run directory claimed, its stack file
    open and dumped (the watchdog fired), its hang report written; left as ``os._exit``
    leaves it (nothing closed)."""
    _, lock = _claim(run_dir)
    stacks = StackFile(run_dir, 0)
    stacks.dump()
    reporter = HangReporter(dist.HashStore(), 0, world_size, run_dir, "key", _note, 0.2)
    reporter.report("step 5 made no progress for 3 s")
    lock.release()
    return reporter


def test_a_restart_keeps_the_earlier_hangs_stacks_and_report(tmp_path):
    run_dir = tmp_path / "run"
    _attempt(run_dir, 1)
    first = (run_dir / "hang/attempt-1/stack-rank0.txt").read_text()
    _attempt(run_dir, 1)  # --resume auto, or the launcher's --max-restarts
    assert (run_dir / "hang/attempt-1/stack-rank0.txt").read_text() == first
    assert "test_run_paths" in first
    for attempt in (1, 2):
        report = (run_dir / f"hang/attempt-{attempt}/report.txt").read_text()
        assert f"{run_dir}/hang/attempt-{attempt}/stack-rank*.txt" in report
        assert (run_dir / f"hang/attempt-{attempt}/stack-rank0.txt").stat().st_size > 0
    latest = (run_dir / "hang/report.txt").read_text()
    assert latest == (run_dir / "hang/attempt-2/report.txt").read_text()


def test_a_dead_ranks_empty_stack_file_is_not_left_beside_the_report(tmp_path):
    """Rank 1 opened its stack file, then was killed (SIGKILL: it never closed the empty
    file) and sent no note; rank 0's watchdog fired and wrote the report."""
    run_dir = tmp_path / "run"
    _, lock = _claim(run_dir)
    StackFile(run_dir, 1)  # rank 1's, left open and empty
    stacks = StackFile(run_dir, 0)
    stacks.dump()
    reporter = HangReporter(dist.HashStore(), 0, 2, run_dir, "key", _note, 0.2)
    reporter.report("step 5 made no progress for 3 s")
    lock.release()
    folder = run_dir / "hang/attempt-1"
    assert sorted(p.name for p in folder.iterdir()) == ["report.txt", "stack-rank0.txt"]
    assert "rank 1 sent nothing" in (folder / "report.txt").read_text()
