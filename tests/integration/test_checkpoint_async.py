"""Asynchronous checkpoints (checkpoint.async): the write overlaps the next steps, what is
written is the state of the saved step, resume stays exact, and a kill or a full disk during
the background write never leaves a half-written checkpoint as the newest."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import torch
from conftest import FAST, ROOT
from distributed import run_ranks
from faults import inject
from test_checkpoint import (  # noqa: F401 (uninterrupted: a fixture)
    _step_reached,
    _wait_for,
    full_state,
    losses,
    recipe,
    train,
    uninterrupted,
)

import yatrain.checkpoint.checksums as checksum
import yatrain.data.loader as loader_module
from yatrain.checkpoint import store as ckpt
from yatrain.train.loop import pretrain
from yatrain.train.setup import Checks

ASYNC = "checkpoint.async=true"


def test_async_resume_is_bitwise_exact(small_data, uninterrupted, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    torch.manual_seed(1)
    train(small_data, run_dir, 4, ASYNC)
    assert [p.name for p in ckpt.complete_checkpoints(run_dir / "checkpoints")] == [
        "step-4",
        "step-2",
    ]
    torch.manual_seed(2)
    train(small_data, run_dir, 8, ASYNC)
    assert losses(run_dir) == uninterrupted


def test_the_write_overlaps_the_next_steps_and_holds_the_saved_step(
    small_data, tmp_path, monkeypatch
):
    """Step 2's files are written only once the loop is about to run step 4 (so step 3
    changed every weight meanwhile): a synchronous save would wait forever here (the test
    would fail on the timeout), and a save that read the live weights would differ from a
    synchronous checkpoint of step 2."""
    reached_step_4 = threading.Event()
    real_write, real_next = checksum.HashingStream.write, loader_module.GlobalBatchLoader.next_batch

    def write(self, data):
        if ".tmp-step-2" in self.raw.name:
            assert reached_step_4.wait(timeout=60), "the save blocked the loop"
        return real_write(self, data)

    def next_batch(self):
        if self.step == 3:  # about to run step 4
            reached_step_4.set()
        return real_next(self)

    monkeypatch.setattr(checksum.HashingStream, "write", write)
    monkeypatch.setattr(loader_module.GlobalBatchLoader, "next_batch", next_batch)
    train(small_data, tmp_path / "async", 4, ASYNC)
    monkeypatch.undo()
    train(small_data, tmp_path / "sync", 2)
    written = full_state(tmp_path / "async/checkpoints/step-2", tmp_path)
    expected = full_state(tmp_path / "sync/checkpoints/step-2", tmp_path / "sync")
    assert written.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(written[key], value), key


def test_a_tensor_peak_step_after_an_async_save_counts_and_the_run_goes_on(small_data, tmp_path):
    """``--tensor-peak-step 3`` with step 2's save in flight: counting every live tensor
    met the staged state's DTensors (no storage of their own) and killed the run."""
    cfg = recipe(small_data, "checkpoint.every=2", ASYNC)
    pretrain(cfg, run_dir=tmp_path / "run", steps=4, progress=False, checks=Checks(tensor_step=3))
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").open()]
    assert [r["peak_tensor_bytes"] is not None for r in records] == [False, False, True, False]
    assert records[2]["peak_tensor_bytes"] > 0
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "run/checkpoints")] == [
        "step-4",
        "step-2",
    ]


def _train_on_ranks(rank, world, data, run_dir, steps, *extra):
    train(data, run_dir, steps, *extra)
    return rank


def test_async_resume_of_two_ranks_is_bitwise_exact(small_data, tmp_path):
    """Both ranks write in the background and rank 0 completes the manifest from both
    ranks' checksums; the resumed run at world 2 is the uninterrupted one, float for float."""
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    run_ranks(2, _train_on_ranks, small_data, reference, 8)
    run_ranks(2, _train_on_ranks, small_data, run_dir, 4, ASYNC)
    manifest = json.loads((run_dir / "checkpoints/step-4" / ckpt.MANIFEST).read_text())
    assert manifest["world_size_at_save"] == 2
    assert len([f for f in manifest["files"] if f.endswith(".distcp")]) == 2
    run_ranks(2, _train_on_ranks, small_data, run_dir, 8, ASYNC)
    assert losses(run_dir) == losses(reference)


KILL_DURING_WRITE = """
import os, signal
import yatrain.checkpoint.checksums as _checksum
_real = _checksum.HashingStream.write

def _write(self, data):
    if ".tmp-step-{step}" in self.raw.name:
        os.kill(os.getpid(), signal.SIGKILL)
    return _real(self, data)

_checksum.HashingStream.write = _write
"""


SLOW_WRITES = """
import time
import yatrain.checkpoint.checksums as _checksum
_real = _checksum.HashingStream.write

def _write(self, data):
    if self.size == 0:  # each checkpoint file: a slow start (a busy file system)
        time.sleep(0.5)
    return _real(self, data)

_checksum.HashingStream.write = _write
"""


def _cli(data, run_dir, steps: int) -> list[str]:
    sets = [
        *FAST,
        f"data.path={data}",
        "data.global_batch_size=8",
        "checkpoint.keep=10",
        "checkpoint.every=2",
        ASYNC,
    ]
    return [
        sys.executable,
        "-m",
        "yatrain",
        "pretrain",
        "recipes/tiny.yaml",
        *[f"--set={s}" for s in sets],
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--no-progress",
    ]


def _no_warnings(stderr: str) -> None:
    assert "warn" not in stderr.lower(), stderr[-3000:]


def test_the_last_save_on_sigterm_is_complete_before_exit(small_data, isolated_env, tmp_path):
    """Every checkpoint file starts slowly, so the stop lands while a save is in flight and
    the save of the stopped step takes longer than the rest of the exit."""
    run_dir = tmp_path / "run"
    env = inject(isolated_env, tmp_path / "inject", SLOW_WRITES)
    proc = subprocess.Popen(
        _cli(small_data, run_dir, 400),
        env=env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _wait_for(_step_reached(run_dir, 3), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    stopped_at = int(err.split("stopped by SIGTERM at step ")[1].split(";")[0])
    root = run_dir / "checkpoints"
    assert ckpt.complete_checkpoints(root)[0] == root / f"step-{stopped_at}"
    assert not list(root.glob(".tmp-*"))
    _no_warnings(err)


def test_a_kill_during_the_write_leaves_the_previous_checkpoint_the_newest(
    small_data,
    uninterrupted,  # noqa: F811
    isolated_env,
    tmp_path,
):
    run_dir, root = tmp_path / "run", tmp_path / "run/checkpoints"
    env = inject(isolated_env, tmp_path / "inject", KILL_DURING_WRITE.format(step=4))
    killed = subprocess.run(
        _cli(small_data, run_dir, 8), env=env, cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert ckpt.complete_checkpoints(root) == [root / "step-2"]
    assert (root / ".tmp-step-4").is_dir()
    resumed = subprocess.run(
        _cli(small_data, run_dir, 8),
        env=isolated_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "removed 1 unfinished save(s) of an earlier run: .tmp-step-4" in resumed.stderr
    assert "resumed from" in resumed.stderr and "(step 2)" in resumed.stderr
    assert losses(run_dir) == uninterrupted
    _no_warnings(resumed.stderr)
