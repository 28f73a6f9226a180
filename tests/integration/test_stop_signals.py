"""Issue 43: a stop does what it says. A signal during a save stops the run at that save
(not one step later); a sweep's configurations end with the sweep; a rank stopped alone is
named."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import FAST, ROOT

from yatrain.errors import Interrupted
from yatrain.output.record import read_metrics
from yatrain.recipe_load import load_recipe
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
