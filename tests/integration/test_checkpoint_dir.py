"""Checkpoint folders: an absolute ``checkpoint.dir`` belongs to one run (locked with it, its
owner recorded: another run naming it is refused, neither resumes from it nor prunes it,
and reads it only through ``--resume PATH``), and links in a checkpoints folder are never
followed (a shard that is a link refused by export, a step directory that is a link pruned
as a link); an export's files share one mode."""

from __future__ import annotations

from pathlib import Path

from test_failures import one_line_error, pretrain_args, yatrain


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("step-*"))


def test_a_checkpoint_dir_belongs_to_one_run(small_data, isolated_env, tmp_path):
    """An absolute checkpoint.dir is locked with its run and records its owner: another run
    naming it is refused (it neither resumes from it nor prunes it); --resume PATH reads it."""
    shared = tmp_path / "shared"
    first = pretrain_args(
        small_data,
        tmp_path / "a",
        "--steps",
        "6",
        "--set=checkpoint.every=2",
        f"--set=checkpoint.dir={shared}",
    )
    assert yatrain(*first, env=isolated_env).returncode == 0
    assert _steps(shared) == ["step-4", "step-6"]
    second = pretrain_args(
        small_data,
        tmp_path / "b",
        "--steps",
        "8",
        "--set=checkpoint.every=2",
        f"--set=checkpoint.dir={shared}",
    )
    one_line_error(
        yatrain(*second, env=isolated_env), f"checkpoint.dir {shared} belongs to", "--resume"
    )
    assert _steps(shared) == ["step-4", "step-6"] and not (tmp_path / "b").exists()
    # the owner continues as before
    again = pretrain_args(
        small_data,
        tmp_path / "a",
        "--steps",
        "8",
        "--set=checkpoint.every=2",
        f"--set=checkpoint.dir={shared}",
    )
    result = yatrain(*again, env=isolated_env)
    assert result.returncode == 0 and "resumed from" in result.stderr, result.stderr[-2000:]
    assert _steps(shared) == ["step-6", "step-8"]
    # another run reads one explicitly, and prunes only its own
    reader = pretrain_args(
        small_data,
        tmp_path / "c",
        "--steps",
        "12",
        "--set=checkpoint.every=2",
        "--set=checkpoint.keep=1",
        "--resume",
        str(shared / "step-8"),
    )
    result = yatrain(*reader, env=isolated_env)
    assert result.returncode == 0 and "resumed from" in result.stderr, result.stderr[-2000:]
    assert _steps(shared) == ["step-6", "step-8"]
    assert _steps(tmp_path / "c" / "checkpoints") == ["step-12"]


def test_links_in_checkpoints_are_never_followed_and_export_files_share_one_mode(
    small_data, isolated_env, tmp_path
):
    run = tmp_path / "run"
    args = pretrain_args(small_data, run, "--steps", "4", "--set=checkpoint.every=2")
    assert yatrain(*args, env=isolated_env).returncode == 0
    step = run / "checkpoints" / "step-4"
    hf = tmp_path / "hf"
    assert yatrain("export", str(step), "--output", str(hf), env=isolated_env).returncode == 0
    assert len({f.stat().st_mode for f in hf.iterdir()}) == 1  # safetensors included
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 12345)
    victim = next(step.glob("*.distcp"))
    victim.unlink()
    victim.symlink_to(secret)
    line = one_line_error(
        yatrain("export", str(step), "--output", str(tmp_path / "hf2"), env=isolated_env),
        "is a symbolic link",
    )
    assert "12345" not in line
    # a step directory that is a link is pruned as a link; what it points to stays
    elsewhere = tmp_path / "elsewhere"
    (run / "checkpoints" / "step-2").rename(elsewhere)
    (run / "checkpoints" / "step-1").symlink_to(elsewhere)
    victim.unlink()
    more = pretrain_args(
        small_data,
        run,
        "--steps",
        "8",
        "--set=checkpoint.every=2",
        "--resume",
        str(run / "checkpoints" / "step-1"),
    )
    result = yatrain(*more, env=isolated_env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert _steps(run / "checkpoints") == ["step-6", "step-8"] and elsewhere.is_dir()
