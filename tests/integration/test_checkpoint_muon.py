"""Checkpoints of a Muon run: exact resume, resharding, and a resume with the other optimizer
(refused, or started afresh with ``--reset-optimizer``)."""

from __future__ import annotations

import json

import pytest
import torch
from distributed import run_ranks
from test_checkpoint import assert_same_trajectory, full_state, losses, recipe

from yatrain.checkpoint import store as ckpt
from yatrain.train.loop import pretrain
from yatrain.train.setup import Checks

# fp32 Newton-Schulz: a resharded run sums its gradients in another order, and bf16 would
# round those ulps into visible differences (the engine's own tests bound bf16).
MUON = ("optim.name=muon", "optim.muon_ns_dtype=fp32")


def train(data, run_dir, steps, *extra, reset=False):
    cfg = recipe(data, "checkpoint.every=2", *extra)
    checks = Checks(reset_optimizer=reset)
    return pretrain(cfg, run_dir=run_dir, steps=steps, progress=False, checks=checks)


def _train_on_ranks(rank, world, data, run_dir, steps):
    train(data, run_dir, steps, *MUON)
    return rank


@pytest.fixture(scope="module")
def muon_uninterrupted(small_data, tmp_path_factory) -> dict[int, tuple[float, float]]:
    run_dir = tmp_path_factory.mktemp("muon") / "run"
    train(small_data, run_dir, 8, *MUON)
    return losses(run_dir)


def test_a_muon_run_resumes_bitwise_and_names_its_state(small_data, muon_uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    train(small_data, run_dir, 4, *MUON)
    train(small_data, run_dir, 8, *MUON)
    assert losses(run_dir) == muon_uninterrupted  # bitwise: losses and gradient norms
    step = run_dir / "checkpoints/step-8"
    assert json.loads((step / ckpt.MANIFEST).read_text())["optimizer"] == "muon"
    state = full_state(step, tmp_path)
    momentum = {k.split(".", 1)[1] for k in state if k.startswith("momentum_buffer.")}
    moments = {k.split(".", 1)[1] for k in state if k.startswith("exp_avg.")}
    assert momentum == {"unit.1", "unit.2"}  # the two decoder layers: Muon
    assert moments == {"unit.0", "unit.3", "small"}  # embedding, head, norms: AdamW


def test_a_muon_checkpoint_of_world_4_resumes_at_world_2(small_data, muon_uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    run_ranks(4, _train_on_ranks, small_data, run_dir, 4)
    run_ranks(2, _train_on_ranks, small_data, run_dir, 8)
    manifest = json.loads((run_dir / "checkpoints/step-8" / ckpt.MANIFEST).read_text())
    assert manifest["world_size_at_save"] == 2
    assert_same_trajectory(losses(run_dir), muon_uninterrupted, loss_tolerance=1e-5)


def test_a_resume_with_the_other_optimizer_is_refused_unless_reset(small_data, tmp_path):
    run_dir = tmp_path / "run"
    train(small_data, run_dir, 2)  # AdamW
    with pytest.raises(ckpt.CheckpointError, match="--reset-optimizer") as refused:
        train(small_data, run_dir, 4, *MUON)
    assert "trained with optim.name adamw, this run uses muon" in str(refused.value)
    assert "\n" not in str(refused.value)
    train(small_data, run_dir, 4, *MUON, reset=True)
    got = losses(run_dir)
    assert list(got) == [1, 2, 3, 4]  # continued from step 2
    step = run_dir / "checkpoints/step-4"
    assert json.loads((step / ckpt.MANIFEST).read_text())["optimizer"] == "muon"
    assert any(k.startswith("momentum_buffer.") for k in full_state(step, tmp_path))
    train(small_data, run_dir, 6, *MUON, reset=True)  # same optimizer: the flag changes nothing
    with pytest.raises(ckpt.CheckpointError, match="trained with optim.name muon"):
        train(small_data, run_dir, 8)  # back to AdamW without the flag


def test_a_checkpoint_without_an_optimizer_name_is_adamw(small_data, tmp_path):
    """Checkpoints written before the manifest named the optimizer resume unchanged."""
    run_dir = tmp_path / "run"
    train(small_data, run_dir, 2)
    path = run_dir / "checkpoints/step-2" / ckpt.MANIFEST
    manifest = json.loads(path.read_text())
    del manifest["optimizer"]
    path.write_text(json.dumps(manifest))
    torch.manual_seed(0)
    train(small_data, run_dir, 4)
    assert list(losses(run_dir)) == [1, 2, 3, 4]
