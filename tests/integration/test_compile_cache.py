"""Inductor's cache is code: never read from a run directory, private by default,
shared only through ``train.compile_cache``, and in place before torch is imported."""

from __future__ import annotations

import getpass
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
from yatrain.recipe.load import load_recipe
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


def test_an_empty_compile_cache_or_a_default_inside_the_run_directory_is_refused(
    tmp_path, monkeypatch
):
    """``train.compile_cache: ''`` made the current directory the cache; a default that
    resolves into the run directory was taken where the same path named explicitly is not."""
    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match="train.compile_cache is empty") as refused:
            cache_for_run(empty, run_dir)
        assert "\n" not in str(refused.value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(run_dir / "cache"))
    with pytest.raises(ConfigError, match="default.* is inside the run directory"):
        cache_for_run(None, run_dir)
    assert not run_dir.exists()


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


def _tree(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every entry under ``root``: its content (None for a directory) and modification time."""
    return {
        str(path.relative_to(root)): (
            None if path.is_dir() else path.read_bytes(),
            path.stat().st_mtime_ns,
        )
        for path in sorted(root.rglob("*"))
    }


def test_a_compiled_run_uses_nothing_planted_in_the_shared_temporary_directory(
    small_data, tmp_path, isolated_env
):
    """Torch derives its precompiled header (included by every CPU kernel, kept if already
    there) and other caches from $TMPDIR whatever TORCHINDUCTOR_CACHE_DIR says. A header
    planted there with a constructor, and a file in each other such directory, before a
    compiled run: nothing planted runs, nothing there is read into the run or written."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp
    torch_default = shared / f"torchinductor_{getpass.getuser()}"
    planted = [
        torch_default / "precompiled_headers" / "locks" / "planted.lock",
        torch_default / "cache" / "planted",  # runtime/caching (memoizers)
        torch_default / "cache" / "inductor_on_disk_cache" / "planted",
        shared / "cache" / "on_disk_cache" / "planted",  # cache.py's OnDiskCache
        torch_default / "fxgraph" / "planted",
    ]
    for path in planted:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("planted")
    before = _tree(shared)
    marker = tmp_path / "planted-code-ran"
    env = dict(isolated_env, TMPDIR=str(shared), XDG_CACHE_HOME=str(tmp_path / "home-cache"))
    env.update(PLANT_SHARED_TMP=str(shared), PLANT_MARKER=str(marker))
    env.pop(CACHE_ENV, None)
    sets = [f"--set={s}" for s in [*FAST, f"data.path={small_data}", "train.compile=true"]]
    command = [sys.executable, str(ROOT / "tests/planted_header_run.py"), "pretrain"]
    command += ["recipes/tiny.yaml", *sets, "--set=checkpoint.enabled=false", "--steps=1"]
    command += ["--run-dir", str(tmp_path / "run"), "--no-progress"]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not marker.exists(), "a header planted in the shared temporary directory ran"
    assert _tree(shared) == before
    private = tmp_path / "home-cache" / "yatrain" / "inductor"
    assert list(private.glob("tmp/torchinductor_*/precompiled_headers/*.h"))  # its own
