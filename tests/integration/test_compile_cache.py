"""Inductor's cache is code (issue 32): never read from a run directory, private by default,
shared only through ``train.compile_cache``, and in place before torch is imported."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT
from torch._inductor.runtime.cache_dir_utils import cache_dir

from yatrain.errors import ConfigError
from yatrain.recipe_load import load_recipe
from yatrain.runtime import compile_cache
from yatrain.runtime.compile_cache import CACHE_ENV, cache_for_run, private_dir
from yatrain.train import loop
from yatrain.train.loop import pretrain
from yatrain.train.setup import compile_watch


@pytest.fixture(autouse=True)
def own_cache_home(tmp_path, monkeypatch) -> Path:
    """The user's cache home (XDG_CACHE_HOME) under tmp_path; inductor's variable as
    importing dynamo leaves it (torch's default under /tmp)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache-home"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "torch-default"))
    torch.compiler.reset()
    yield tmp_path / "cache-home"
    torch.compiler.reset()


def recipe(data: Path, *extra: str):
    sets = [*FAST, f"data.path={data}", "train.compile=true", *extra]
    return load_recipe(ROOT / "recipes/tiny.yaml", sets)


def test_no_compile_cache_is_read_from_the_run_directory(own_cache_home, tmp_path):
    """Inductor's caches (fxgraph, aotautograd: pickles) live in the private per-user
    cache while a run lasts, not in RUN_DIR/compile-cache where anyone who can write to
    the run directory (or hands on a copy of it) could plant code."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    watch = compile_watch(recipe(Path("unused")), run_dir)
    try:
        where = Path(cache_dir())  # what inductor itself reads and writes
        assert where == own_cache_home / "yatrain" / "inductor" == watch.cache_dir
        assert not where.is_relative_to(run_dir)
        assert stat.S_IMODE(where.stat().st_mode) == 0o700
        assert f"cache {where}" in watch.describe()
    finally:
        watch.close()
    assert not (run_dir / "compile-cache").exists()


def test_a_cache_others_could_write_or_that_another_user_owns_is_refused(tmp_path, monkeypatch):
    cache = private_dir(tmp_path / "mine" / "inductor")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(cache.parent.stat().st_mode) == 0o700  # created parents too
    for mode in (0o770, 0o707, 0o777):
        cache.chmod(mode)
        with pytest.raises(ConfigError, match=f"{cache} is writable by other users") as refused:
            private_dir(cache)
        assert "\n" not in str(refused.value)
    cache.chmod(0o700)
    monkeypatch.setattr(compile_cache.os, "getuid", lambda: os.stat(cache).st_uid + 1)
    with pytest.raises(ConfigError, match="belongs to user id .* not to you"):
        private_dir(cache)


def test_a_shared_cache_is_only_what_train_compile_cache_names(tmp_path):
    """Group-writable and named on purpose: taken. Inside the run directory or writable by
    every user: refused in one line quoting the rule."""
    run_dir = tmp_path / "run"
    shared = tmp_path / "team-cache"
    shared.mkdir(mode=0o770)
    shared.chmod(0o770)
    assert cache_for_run(str(shared), run_dir) == shared
    with pytest.raises(ConfigError, match="inside the run directory") as refused:
        cache_for_run(str(run_dir / "compile-cache"), run_dir)
    assert compile_cache.SHARE_RULE in str(refused.value)
    for mode in (0o777, 0o1777):  # a sticky bit still lets anyone add entries
        shared.chmod(mode)
        with pytest.raises(ConfigError, match="writable by every user"):
            cache_for_run(str(shared), run_dir)


def test_a_read_only_cache_location_is_one_line(tmp_path, monkeypatch):
    """/proc/sys refuses writes even to root: one line at start, not an InductorError at the
    first step."""
    with pytest.raises(ConfigError, match="/proc/sys is not writable"):
        cache_for_run("/proc/sys", tmp_path / "run")
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/sys")
    with pytest.raises(ConfigError, match="cannot be created"):
        compile_watch(recipe(Path("unused")), tmp_path / "run")


def test_no_command_lets_torch_create_its_shared_temporary_cache(tmp_path, isolated_env):
    """torch makes $TMPDIR/torchinductor_$USER (0755) the moment inductor is imported, as
    ``yatrain plan`` does: the command line has pointed inductor elsewhere by then."""
    env = dict(isolated_env, TMPDIR=str(tmp_path / "tmp"), XDG_CACHE_HOME=str(tmp_path / "c"))
    env.pop(CACHE_ENV, None)
    (tmp_path / "tmp").mkdir()
    command = [sys.executable, "-m", "yatrain", "plan", "recipes/tiny.yaml", "--gpus=2"]
    command += ["--set=train.compile=true", *(f"--set={s}" for s in FAST)]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower()
    assert list((tmp_path / "tmp").iterdir()) == []
    private = tmp_path / "c" / "yatrain" / "inductor"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


def test_the_cache_is_where_the_run_says_during_and_after_the_run(
    small_data, tmp_path, monkeypatch
):
    """Importing dynamo sets the variable before any run starts: the run's cache must
    replace it (not ``setdefault``) while the run lasts, and give it back after."""
    seen = []
    step = loop.train_step

    def watching(*args, **kwargs):
        seen.append(cache_dir())
        return step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", watching)
    shared = tmp_path / "team-cache"
    cfg = recipe(small_data, "train.compile_backend=aot_eager", f"train.compile_cache={shared}")
    pretrain(cfg, run_dir=tmp_path / "run", steps=2, progress=False)
    assert seen == [str(shared)] * 2
    assert os.environ[CACHE_ENV] == str(tmp_path / "torch-default")
