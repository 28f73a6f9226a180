"""A symbolic link planted at a file yatrain writes in a run directory is never
written through (the file it points to is left as it was), while a run directory reached
through a linked path works; a compile cache that a link puts inside the run directory is
refused, and a run gives inductor's cache variable back as it found it. A run directory from
before the lock file is still a run; a ``checkpoint.dir`` leaving the run directory is locked
and owned by it, and one that is refused is left exactly as it was."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from yatrain.errors import ConfigError
from yatrain.files import RecordFile, cut_torn_tail, write_whole
from yatrain.runtime.compile_cache import (
    CACHE_ENV,
    cache_for_run,
    restore_inductor_cache,
    use_inductor_cache,
)
from yatrain.runtime.hang import StackFile, use_attempt
from yatrain.train.rundir import LOCK_FILE, OWNER_FILE, RunDirLock

USERS = "a user's own file, not a line to cut"  # no newline: a torn tail to yatrain


@pytest.fixture()
def victim(tmp_path):
    path = tmp_path / "users-file.txt"
    path.write_text(USERS)
    return path


def test_a_link_at_a_file_yatrain_writes_is_never_written_through(tmp_path, victim):
    run_dir = tmp_path / "run"
    (run_dir / "hang/attempt-1").mkdir(parents=True)
    (run_dir / "metrics.jsonl").touch()  # a yatrain run (from before the lock)
    use_attempt(run_dir, 1)
    for name in (LOCK_FILE, "hang/attempt-1/stack-rank0.txt", "results.jsonl", "report.html"):
        (run_dir / name).symlink_to(victim)
    with pytest.raises(ConfigError, match=rf"{LOCK_FILE} is a symbolic link"):
        RunDirLock(run_dir)  # a resume: it wrote its JSON into the user's file
    with pytest.raises(ConfigError, match="stack-rank0.txt is a symbolic link"):
        StackFile(run_dir, 0)  # a multi-rank run: it truncated the user's file
    with pytest.raises(ConfigError, match="results.jsonl is a symbolic link"):
        RecordFile(run_dir / "results.jsonl")  # cut the user's "torn tail", then appended
    with pytest.raises(ConfigError, match="results.jsonl is a symbolic link"):
        cut_torn_tail(run_dir / "results.jsonl")
    write_whole(run_dir / "report.html", "<html></html>")  # the link is replaced
    assert (run_dir / "report.html").read_text() == "<html></html>"
    assert not (run_dir / "report.html").is_symlink()
    assert victim.read_text() == USERS


def test_a_run_directory_reached_through_a_linked_path_works(tmp_path):
    (tmp_path / "scratch/runs").mkdir(parents=True)
    (tmp_path / "runs").symlink_to(tmp_path / "scratch/runs")  # as on a cluster
    lock = RunDirLock(tmp_path / "runs/run")
    file = RecordFile(tmp_path / "runs/run/metrics.jsonl")
    file.append('{"step": 1}')
    file.close()
    StackFile(tmp_path / "runs/run", 0).close()
    lock.release()
    held = json.loads((tmp_path / "scratch/runs/run" / LOCK_FILE).read_text())
    assert held["host"] and (tmp_path / "scratch/runs/run/metrics.jsonl").read_text()


def test_a_refused_checkpoint_dir_is_left_exactly_as_it_was(tmp_path):
    """It kept a ``.yatrain.lock``; a later ``--run-dir`` on it then passed it for a run
    and renamed the user's config.yaml and metrics.jsonl."""
    users = tmp_path / "mine"
    users.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):
        (users / name).write_text(name)
    with pytest.raises(ConfigError, match="holds files but no .yatrain-owner"):
        RunDirLock(tmp_path / "run", checkpoint_dir=users)
    assert sorted(p.name for p in users.iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert not (tmp_path / "run").exists()
    (users / "metrics.jsonl").unlink()  # no longer looks like an old yatrain run
    with pytest.raises(ConfigError, match="is not a yatrain run directory"):
        RunDirLock(users)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root``: its bytes (None for a directory)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def test_a_compile_cache_a_link_puts_inside_the_run_directory_is_refused(tmp_path, monkeypatch):
    """Named through a link outside the run directory, named by its real path while the run
    directory is reached through a link, or the default under an XDG_CACHE_HOME that is such
    a link: each is inside the run directory, refused, and nothing is made there."""
    run_dir = tmp_path / "scratch" / "run"
    (run_dir / "cache").mkdir(parents=True)
    link = tmp_path / "team-cache"
    link.symlink_to(run_dir / "cache")
    (tmp_path / "runs").symlink_to(tmp_path / "scratch")  # as on a cluster
    inside = rf"is inside the run directory {re.escape(str(run_dir))}\b"
    with pytest.raises(ConfigError, match=rf"train.compile_cache: {re.escape(str(link))} {inside}"):
        cache_for_run(str(link), run_dir)
    linked_run = tmp_path / "runs" / "run"
    with pytest.raises(
        ConfigError, match=rf"inside the run directory {re.escape(str(linked_run))}"
    ):
        cache_for_run(str(run_dir / "cache"), linked_run)
    monkeypatch.setenv("XDG_CACHE_HOME", str(link))
    with pytest.raises(ConfigError, match=rf"\(the default, .*\) {inside}"):
        cache_for_run(None, run_dir)
    assert _tree(run_dir) == {"cache": None}


def test_a_run_gives_the_inductor_cache_variable_back_as_it_found_it(tmp_path, monkeypatch):
    """What a compiled run does to TORCHINDUCTOR_CACHE_DIR (CompileWatch at its start and
    close): set to the run's cache while it lasts, then unset again if it was unset."""
    monkeypatch.delenv(CACHE_ENV, raising=False)
    previous = use_inductor_cache(tmp_path / "cache")
    assert os.environ[CACHE_ENV] == str(tmp_path / "cache")
    restore_inductor_cache(previous)
    assert CACHE_ENV not in os.environ
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "before"))
    previous = use_inductor_cache(tmp_path / "cache")
    assert os.environ[CACHE_ENV] == str(tmp_path / "cache")
    restore_inductor_cache(previous)
    assert os.environ[CACHE_ENV] == str(tmp_path / "before")


def test_a_run_directory_from_before_the_lock_file_is_still_a_run(tmp_path):
    """An older yatrain wrote metrics.jsonl and no lock file: its directory is resumed (and
    locked), its files left as they were; without metrics.jsonl it is not a run."""
    run_dir = tmp_path / "old-run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("model: {}\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 8.3}\n')
    before = _tree(run_dir)
    lock = RunDirLock(run_dir)
    try:
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert {k: v for k, v in _tree(run_dir).items() if k != LOCK_FILE} == before
    (run_dir / LOCK_FILE).unlink()
    (run_dir / "metrics.jsonl").unlink()
    with pytest.raises(ConfigError, match="is not empty and is not a yatrain run directory"):
        RunDirLock(run_dir)
    assert _tree(run_dir) == {"config.yaml": b"model: {}\n"}


def test_a_checkpoint_dir_leaving_the_run_directory_is_locked_and_owned(tmp_path):
    """``checkpoint.dir: ../shared`` is outside the run directory as much as an absolute
    path: locked while the run holds it, its owner recorded, so another run naming it is
    refused (it could resume from or prune the first run's checkpoints)."""
    run_dir, other, ckpt_dir = tmp_path / "run", tmp_path / "other", Path("../shared")
    lock = RunDirLock(run_dir, checkpoint_dir=ckpt_dir)
    try:
        owner = json.loads((tmp_path / "shared" / OWNER_FILE).read_text())
        assert owner == {"run_dir": str(run_dir.resolve())}
        with pytest.raises(ConfigError, match=r"checkpoint directory .*shared is in use by"):
            RunDirLock(other, checkpoint_dir=ckpt_dir)
    finally:
        lock.release()
    mine = rf"belongs to {re.escape(str(run_dir.resolve()))}, not to this run"
    with pytest.raises(ConfigError, match=rf"checkpoint.dir .*shared {mine}"):
        RunDirLock(other, checkpoint_dir=ckpt_dir)
    assert not other.exists()


def test_a_refused_checkpoint_dir_keeps_the_lock_file_its_owner_made(tmp_path):
    """The refused run removed the lock file it found (as if it had made it): the owner's
    checkpoint directory lost its lock while the owner was stopped."""
    shared = tmp_path / "shared"
    RunDirLock(tmp_path / "a", checkpoint_dir=shared).release()
    (shared / "step-2").mkdir()
    (shared / "step-2" / "__0_0.distcp").write_bytes(b"weights")
    before, lock_file = _tree(shared), os.stat(shared / LOCK_FILE)
    with pytest.raises(ConfigError, match=rf"checkpoint.dir {re.escape(str(shared))} belongs to"):
        RunDirLock(tmp_path / "b", checkpoint_dir=shared)
    after = _tree(shared)
    assert after.keys() == before.keys()
    assert {k: v for k, v in after.items() if k != LOCK_FILE} == {
        k: v for k, v in before.items() if k != LOCK_FILE
    }
    assert os.stat(shared / LOCK_FILE).st_ino == lock_file.st_ino
    assert not (tmp_path / "b").exists()
