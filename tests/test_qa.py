"""The QA probe of issue 22, finding by finding: nothing a user types loses data or hangs.

One test per numbered finding (prepare-data's in test_qa_data.py, the three mutation-audit
bugs of finding 12 in test_qa_mutations.py). The next probe adds its reproductions here.
"""

from __future__ import annotations

from pathlib import Path

from test_failures import one_line_error, pretrain_args, yatrain


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("step-*"))


def test_1_a_checkpoint_dir_belongs_to_one_run(small_data, isolated_env, tmp_path):
    """An absolute checkpoint.dir is locked with its run and records its owner: another run
    naming it is refused (it neither resumes from it nor prunes it); --resume PATH reads it."""
    shared = tmp_path / "shared"
    first = pretrain_args(small_data, tmp_path / "a", "--steps", "6", "--set=checkpoint.every=2",
                          f"--set=checkpoint.dir={shared}")  # fmt: skip
    assert yatrain(*first, env=isolated_env).returncode == 0
    assert _steps(shared) == ["step-4", "step-6"]
    second = pretrain_args(small_data, tmp_path / "b", "--steps", "8", "--set=checkpoint.every=2",
                           f"--set=checkpoint.dir={shared}")  # fmt: skip
    one_line_error(yatrain(*second, env=isolated_env), f"checkpoint.dir {shared} belongs to",
                   "--resume")  # fmt: skip
    assert _steps(shared) == ["step-4", "step-6"] and not (tmp_path / "b").exists()
    # the owner continues as before
    again = pretrain_args(small_data, tmp_path / "a", "--steps", "8", "--set=checkpoint.every=2",
                          f"--set=checkpoint.dir={shared}")  # fmt: skip
    result = yatrain(*again, env=isolated_env)
    assert result.returncode == 0 and "resumed from" in result.stderr, result.stderr[-2000:]
    assert _steps(shared) == ["step-6", "step-8"]
    # another run reads one explicitly, and prunes only its own
    reader = pretrain_args(small_data, tmp_path / "c", "--steps", "12",
                           "--set=checkpoint.every=2", "--set=checkpoint.keep=1",
                           "--resume", str(shared / "step-8"))  # fmt: skip
    result = yatrain(*reader, env=isolated_env)
    assert result.returncode == 0 and "resumed from" in result.stderr, result.stderr[-2000:]
    assert _steps(shared) == ["step-6", "step-8"]
    assert _steps(tmp_path / "c" / "checkpoints") == ["step-12"]


def test_2_run_dir_that_is_not_a_run_is_refused_and_config_is_kept(
    small_data, isolated_env, tmp_path
):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own file\n")
    one_line_error(yatrain(*pretrain_args(small_data, mine, "--steps", "1"), env=isolated_env),
                   "is not a yatrain run directory")  # fmt: skip
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


def test_9_advice_that_works(small_data, isolated_env, tmp_path):
    """--resume of a run directory says how to continue it; a failed start leaves no run
    directory holding only its lock."""
    run = tmp_path / "run"
    assert (
        yatrain(*pretrain_args(small_data, run, "--steps", "2"), env=isolated_env).returncode == 0
    )
    line = one_line_error(
        yatrain(*pretrain_args(small_data, tmp_path / "new", "--resume", str(run)),
                env=isolated_env),
        "is a run directory, not a checkpoint", f"--run-dir {run} --resume auto",
    )  # fmt: skip
    assert str(run / "checkpoints" / "step-2") in line
    bad_init = pretrain_args(small_data, tmp_path / "failed", f"--set=train.init_from={tmp_path}")
    one_line_error(yatrain(*bad_init, env=isolated_env))
    assert not (tmp_path / "failed").exists()
