"""A stop does what it says. A signal during a save stops the run at that save (not one
step later); a SIGTERM to the launcher reaches the ranks, which save; a sweep's
configurations end with the sweep; a rank stopped alone is named; a signal to prepare-data
ends its workers and leaves no temporary directory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, ROOT
from faults import at_step, inject
from test_failures import pretrain_args, yatrain
from test_inputs import _prepare
from test_launch_faults import LAUNCHER_NOISE, _alive, _wait_for

from yatrain.data.parallel import default_workers
from yatrain.errors import Interrupted
from yatrain.output.record import read_metrics
from yatrain.recipe.load import load_recipe
from yatrain.train import checkpointer
from yatrain.train.loop import pretrain


def test_a_signal_during_a_save_stops_at_that_step(small_data, tmp_path, monkeypatch, capfd):
    """It announced "saving the checkpoint of step 2, then stopping", then trained and
    saved step 3."""
    real_save = checkpointer.Checkpointer.save

    def save(self, step, *args, **kwargs):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the save is under way
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpointer.Checkpointer, "save", save)
    recipe = load_recipe(
        ROOT / "recipes/tiny.yaml", [*FAST, f"data.path={small_data}", "checkpoint.every=2"]
    )
    run_dir = tmp_path / "run"
    with pytest.raises(Interrupted, match="stopped by SIGTERM at step 2; checkpoint saved in"):
        pretrain(recipe, run_dir=run_dir, steps=6, progress=False)
    assert "SIGTERM: saving the checkpoint of step 2, then stopping" in capfd.readouterr().err
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-2"]
    assert [r.step for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_sweeps_configuration_ends_with_the_sweep(small_data, isolated_env, tmp_path, signum):
    """The configuration being measured kept training 15-25 s after the sweep was killed;
    a SIGTERM is passed on to it (it stops as a run does) and the sweep stops with one line."""
    out = tmp_path / "sweep"
    sets = [f"--set={s}" for s in [*FAST, f"data.path={small_data}", "model.max_seq_len=128"]]
    command = [sys.executable, "-m", "yatrain", "sweep", "recipes/tiny.yaml", "--seq-len", "32"]
    command += ["--steps", "100000", "--output", str(out), *sets]
    sweep = subprocess.Popen(command, cwd=ROOT, env=isolated_env, stderr=subprocess.PIPE)
    config: list[int] = []
    try:
        _wait_for(lambda: any(p.read_text() for p in out.glob("configs/*/metrics.jsonl")), sweep)
        config = _children(sweep.pid)
        assert len(config) == 1
        sweep.send_signal(signum)
        _, err = sweep.communicate(timeout=120)
        deadline = time.monotonic() + 30
        while _alive(config[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(config[0]), "the configuration outlived its sweep"
        if signum == signal.SIGTERM:
            assert sweep.returncode == 130, err.decode()[-3000:]
            assert "yatrain: sweep stopped by SIGTERM during seq32-" in err.decode()
            log = next(out.glob("configs/*/output.log")).read_text()
            assert "stopped by SIGTERM at step" in log, log[-3000:]
    finally:
        for pid in config:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        sweep.kill()
        sweep.communicate()


def test_a_sigterm_to_one_rank_is_a_clean_stop_that_names_it(small_data, isolated_env, tmp_path):
    """SIGTERM to rank 1 alone: the launcher blamed rank 0 and printed "interrupted"."""
    term = at_step(rank=1, step=3, action="os.kill(os.getpid(), signal.SIGTERM)")
    env = inject(isolated_env, tmp_path / "inject", term)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # the rank logs would go to its private tmp
    sets = ["--set=data.global_batch_size=8", "--set=checkpoint.every=100"]
    args = pretrain_args(small_data, tmp_path / "run", "--steps", "50", *sets)
    result = yatrain(*args, "--nproc-per-node", "2", env=env)
    lines = [line for line in result.stderr.splitlines() if line.startswith("yatrain: ")]
    assert result.returncode == 130, result.stderr[-3000:]
    assert lines[-1].startswith("yatrain: rank 1 of 2 stopped by SIGTERM at step 3;"), lines
    assert not [line for line in lines if "error" in line or "interrupted" in line], lines
    assert not list(tmp_path.rglob("yatrain-ranks-*"))  # nothing failed: no logs kept


def test_a_sigterm_to_the_launcher_reaches_the_ranks_which_save(small_data, isolated_env, tmp_path):
    run = tmp_path / "run"
    args = pretrain_args(small_data, run, "--steps", "5000", "--nproc-per-node", "2")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "yatrain", *args],
        cwd=ROOT,
        env=isolated_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics, deadline = run / "metrics.jsonl", time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "yatrain: stopped by SIGTERM at step" in err and "checkpoint saved" in err, err[-3000:]
    assert not any(noise in err for noise in LAUNCHER_NOISE), err[-3000:]
    assert list((run / "checkpoints").glob("step-*"))


def _default_sigint() -> None:
    """A job started in the background by a non-interactive shell (nohup, ``cmd &``) has
    SIGINT ignored, and its children inherit that: give prepare-data a real Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(default_workers() < 2, reason="needs two CPUs for two workers")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_prepare_data_ends_its_workers_and_removes_its_temporary_directory(
    small_data, isolated_env, tmp_path, signum
):
    work = tmp_path / "work"
    out = work / "out"
    (work / ".tmp-out-stale").mkdir(parents=True)  # a killed run's: its lock is free
    (work / ".tmp-out-stale" / ".prepare.lock").touch()
    (work / ".tmp-out-old").mkdir()  # no lock: named, not removed
    args = _prepare(out, "--tokenizer", str(small_data / "tokenizer.model"), "--workers", "2")
    process = subprocess.Popen(
        [sys.executable, "-m", "yatrain", *args],
        cwd=ROOT,
        env=isolated_env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 120
        while len(workers := _children(process.pid)) < 2:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # tokenizing
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("yatrain:")]
    assert len(lines) == 1 and "prepare-data stopped; nothing was written" in lines[0], err
    assert "removed " in err and ".tmp-out-stale" in err and ".tmp-out-old" in err
    assert sorted(p.name for p in work.iterdir()) == [".tmp-out-old"]
    for _ in range(100):  # terminated and reaped by the parent before it exited
        if not any(_alive(pid) for pid in workers):
            break
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in workers)
