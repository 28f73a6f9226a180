"""A symbolic link planted at a file yatrain writes in a run directory is never
written through (the file it points to is left as it was), while a run directory reached
through a linked path works; a refused ``checkpoint.dir`` is left exactly as it was."""

from __future__ import annotations

import json

import pytest

from yatrain.errors import ConfigError
from yatrain.files import RecordFile, cut_torn_tail, write_whole
from yatrain.runtime.hang import StackFile
from yatrain.train.rundir import LOCK_FILE, RunDirLock

USERS = "a user's own file, not a line to cut"  # no newline: a torn tail to yatrain


@pytest.fixture()
def victim(tmp_path):
    path = tmp_path / "users-file.txt"
    path.write_text(USERS)
    return path


def test_a_link_at_a_file_yatrain_writes_is_never_written_through(tmp_path, victim):
    run_dir = tmp_path / "run"
    (run_dir / "hang").mkdir(parents=True)
    (run_dir / "metrics.jsonl").touch()  # a yatrain run (from before the lock)
    for name in (LOCK_FILE, "hang/stack-rank0.txt", "results.jsonl", "report.html"):
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
