"""Checkpoints: exact resume, resharding across world sizes, crashes, corruption, restarts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT
from distributed import run_ranks
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from yatrain.checkpoint import store as ckpt
from yatrain.errors import TrainingError, YatrainError
from yatrain.recipe.load import load_recipe
from yatrain.sharding import ShardedEngine
from yatrain.train.loop import pretrain


def recipe(data: Path, *extra: str):
    return load_recipe(
        ROOT / "recipes/tiny.yaml",
        [*FAST, f"data.path={data}", "data.global_batch_size=8", "checkpoint.keep=10", *extra],
    )


def losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, gradient norm) from metrics.jsonl: the norm sees the gradient's scale."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, lines)}


# Gradient norms of the same gradients at different world sizes differ by up to 1.3e-5
# (measured): the engine sums 1.4M fp32 squares per shard with vector_norm, whose fp32
# accumulation is off by ~1e-5 at that length (the float64 sums agree to 1e-10). A wrongly
# scaled gradient is off by a factor of 2 or more.
NORM_TOLERANCE = 1e-4


def assert_same_trajectory(got: dict, want: dict, loss_tolerance: float = 1e-6) -> None:
    """Every step's loss and gradient norm, relative to ``want``."""
    assert sorted(got) == sorted(want)
    for step, (want_loss, want_norm) in want.items():
        loss, norm = got[step]
        assert abs(loss - want_loss) / want_loss < loss_tolerance, f"step {step} loss"
        assert abs(norm - want_norm) / want_norm < NORM_TOLERANCE, f"step {step} grad_norm"


def train(data, run_dir, steps, *extra, resume="auto"):
    cfg = recipe(data, "checkpoint.every=2", *extra)
    return pretrain(cfg, run_dir=run_dir, steps=steps, resume=resume, progress=False)


def _train_on_ranks(rank, world, data, run_dir, steps, extra):
    train(data, run_dir, steps, *extra)
    return rank


@pytest.fixture(scope="module")
def uninterrupted(small_data, tmp_path_factory) -> dict[int, tuple[float, float]]:
    run_dir = tmp_path_factory.mktemp("full") / "run"
    torch.manual_seed(3)
    train(small_data, run_dir, 8)
    return losses(run_dir)


def test_resume_is_bitwise_exact(small_data, uninterrupted, tmp_path):
    """Checkpoints hold no RNG state because training draws none: each half of the run (and
    the uninterrupted run) starts from a differently seeded global torch RNG, and still the
    resumed run is the uninterrupted one, float for float."""
    run_dir = tmp_path / "run"
    torch.manual_seed(1)
    train(small_data, run_dir, 4)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2", "step-4"]
    torch.manual_seed(2)
    train(small_data, run_dir, 8)  # --resume auto: continues from step-4
    resumed = losses(run_dir)
    assert list(resumed) == list(range(1, 9))  # one uninterrupted-looking log
    assert resumed == uninterrupted  # bitwise: same losses and gradient norms


@pytest.mark.parametrize("first,second", [(4, 2), (2, 1), (1, 2)])
def test_resharded_resume_continues_the_trajectory(
    small_data, uninterrupted, tmp_path, first, second
):
    run_dir = tmp_path / "run"
    for world, steps in ((first, 4), (second, 8)):
        if world == 1:
            train(small_data, run_dir, steps)
        else:
            run_ranks(world, _train_on_ranks, small_data, run_dir, steps, ())
    got = losses(run_dir)
    manifest = json.loads((run_dir / "checkpoints/step-8" / ckpt.MANIFEST).read_text())
    assert manifest["world_size_at_save"] == second
    assert_same_trajectory(got, uninterrupted)


def test_crash_during_save_keeps_previous_checkpoint(
    small_data, uninterrupted, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    real_save = ckpt.save_state

    def dies_after_writing(state, path):
        records = real_save(state, path)
        if path.name.endswith("step-4"):
            raise KeyboardInterrupt("killed while saving")  # before manifest and rename
        return records

    monkeypatch.setattr(ckpt, "save_state", dies_after_writing)
    with pytest.raises(KeyboardInterrupt):
        train(small_data, run_dir, 8)
    monkeypatch.setattr(ckpt, "save_state", real_save)
    root = run_dir / "checkpoints"
    assert (root / ".tmp-step-4").exists() and not (root / "step-4").exists()
    assert ckpt.complete_checkpoints(root) == [root / "step-2"]
    train(small_data, run_dir, 8)
    assert losses(run_dir) == uninterrupted
    assert not (root / ".tmp-step-4").exists()  # removed when the next run started


@pytest.mark.parametrize("damage", ["truncated", "checksum mismatch"])
def test_corrupt_checkpoint_is_refused_and_auto_falls_back(
    small_data, uninterrupted, tmp_path, capfd, damage
):
    run_dir = tmp_path / "run"
    train(small_data, run_dir, 4)
    newest = run_dir / "checkpoints/step-4"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    if damage == "truncated":
        data = data[:100]
    else:  # one bit in the middle of the tensor data, same size: only the CRC32 can tell
        data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=damage):
        train(small_data, run_dir, 8, resume=str(newest))
    train(small_data, run_dir, 8)  # auto: falls back to step-2, and says so
    assert "skipping step-4" in capfd.readouterr().err
    assert losses(run_dir) == uninterrupted


def test_keep_leaves_exactly_the_newest_checkpoints(small_data, tmp_path):
    run_dir = tmp_path / "run"
    train(small_data, run_dir, 5, "checkpoint.every=1", "checkpoint.keep=2")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-4", "step-5"]


def test_missing_shard_and_other_model_are_refused(small_data, tmp_path):
    run_dir = tmp_path / "run"
    train(small_data, run_dir, 2)
    path = run_dir / "checkpoints/step-2"
    with pytest.raises(ckpt.CheckpointError, match=r"model\.dim 64 -> 96"):
        train(small_data, run_dir, 4, "model.dim=96", resume=str(path))
    next(path.glob("*.distcp")).unlink()
    with pytest.raises(ckpt.CheckpointError, match="missing"):
        train(small_data, run_dir, 4, resume=str(path))
    with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint"):
        train(small_data, run_dir, 4)  # auto never silently restarts over a broken run


def test_non_finite_loss_stops_without_checkpointing_the_bad_state(small_data, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(TrainingError, match=r"non-finite .* at step \d+") as error:
        train(
            small_data, run_dir, 12, "optim.lr=1.0e+6", "optim.warmup_steps=0", "optim.grad_clip=0"
        )
    bad_step = int(str(error.value).split("at step ")[1].split(";")[0])
    saved = [int(p.name.split("-")[1]) for p in ckpt.complete_checkpoints(run_dir / "checkpoints")]
    assert saved and max(saved) < bad_step


def test_non_finite_steps_can_be_skipped_and_counted(small_data, tmp_path):
    run_dir = tmp_path / "run"
    summary = train(
        small_data,
        run_dir,
        6,
        "optim.lr=1.0e+6",
        "optim.warmup_steps=0",
        "optim.grad_clip=0",
        "train.skip_nonfinite_steps=true",
    )
    assert summary["steps"] == 6 and summary["skipped_steps"] > 0


def inject_inf_gradient(monkeypatch, at_step: int) -> None:
    """Make one gradient element +inf at step ``at_step`` (after the reduction, before the
    norm), as an overflow would: the loss stays finite, the gradient norm becomes inf."""
    real = ShardedEngine.reduce_gradients
    calls = []

    def reduce_gradients(self):
        real(self)
        calls.append(None)
        if len(calls) == at_step:
            grad = self.param_groups(0.0)[0]["params"][0].grad  # what the optimizer reads
            grad.view(-1)[0] = float("inf")

    monkeypatch.setattr(ShardedEngine, "reduce_gradients", reduce_gradients)


def test_infinite_gradient_norm_with_a_finite_loss_stops_the_run(small_data, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    inject_inf_gradient(monkeypatch, at_step=3)
    with pytest.raises(TrainingError, match=r"non-finite loss or gradient norm at step 3;"):
        train(small_data, run_dir, 6)
    assert list(losses(run_dir)) == [1, 2]  # nothing logged for the bad step
    saved = ckpt.complete_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in saved] == ["step-2"]


def full_state(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint's shards hold (weights, AdamW moments and step), by name."""
    out = tmp_path / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    flat = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            flat[prefix] = value

    walk("", torch.load(out, weights_only=True))
    return flat


def test_a_skipped_step_leaves_weights_and_optimizer_state_unchanged(
    small_data, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    inject_inf_gradient(monkeypatch, at_step=3)
    summary = train(small_data, run_dir, 4, "checkpoint.every=1", "train.skip_nonfinite_steps=true")
    assert summary["skipped_steps"] == 1
    root = run_dir / "checkpoints"
    before, after, later = (full_state(root / f"step-{n}", tmp_path) for n in (2, 3, 4))
    assert before.keys() == after.keys() == later.keys()
    assert len(before) > 4  # weights and both AdamW moments of every unit, the AdamW step
    for key in before:
        assert torch.equal(after[key], before[key]), key  # the skipped step changed nothing
        assert not torch.equal(later[key], before[key]), key  # step 4 trained again


def test_checkpoints_can_be_disabled(small_data, tmp_path):
    run_dir = tmp_path / "run"
    train(small_data, run_dir, 3, "checkpoint.enabled=false")
    assert not (run_dir / "checkpoints").exists()
    assert list(losses(run_dir)) == [1, 2, 3]


def test_user_errors_are_yatrain_errors():
    assert issubclass(ckpt.CheckpointError, YatrainError)


def _cli(*args: str) -> list[str]:
    sets = [f"--set={s}" for s in [*FAST, "data.global_batch_size=8", "checkpoint.every=5"]]
    return ["-m", "yatrain", "pretrain", "recipes/tiny.yaml", *sets, *args, "--no-progress"]


def _wait_for(predicate, proc, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _step_reached(run_dir: Path, step: int):
    def reached() -> bool:
        path = run_dir / "metrics.jsonl"
        return path.exists() and len(path.read_text().splitlines()) >= step

    return reached


def test_sigterm_saves_a_checkpoint_of_the_current_step(small_data, isolated_env, tmp_path):
    run_dir, steps = tmp_path / "run", "400"
    args = _cli(f"--set=data.path={small_data}", "--run-dir", str(run_dir), "--steps", steps)
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=isolated_env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _wait_for(_step_reached(run_dir, 3), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "stopped by SIGTERM at step" in err
    stopped_at = int(err.split("at step ")[1].split(";")[0])
    assert ckpt.complete_checkpoints(run_dir / "checkpoints")[0].name == f"step-{stopped_at}"
    assert stopped_at < 400


def test_elastic_restart_after_a_killed_rank_matches_uninterrupted(
    small_data, isolated_env, tmp_path
):
    steps = "60"
    reference = tmp_path / "reference"
    common = [f"--set=data.path={small_data}", "--steps", steps]
    done = subprocess.run(
        [sys.executable, *_cli(*common, "--run-dir", str(reference))],
        cwd=ROOT,
        env=isolated_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "elastic"
    torchrun = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
    ]
    cmd = [sys.executable, *torchrun, *_cli(*common, "--run-dir", str(run_dir))[1:]]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=isolated_env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _wait_for(lambda: (run_dir / "checkpoints/step-10").exists(), proc, timeout=240)
        workers = subprocess.run(
            ["pgrep", "-f", "-P", str(proc.pid), "yatrain"], capture_output=True, text=True
        ).stdout.split()
        assert workers, "no worker processes found"
        os.kill(int(workers[-1]), signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in err  # the restarted workers continued from a checkpoint
    assert_same_trajectory(losses(run_dir), losses(reference), loss_tolerance=1e-5)
    shutil.rmtree(run_dir, ignore_errors=True)
