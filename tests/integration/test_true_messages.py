"""Messages that say what happened: Ctrl-C named as Ctrl-C, a signal announced at once,
TensorBoard trimmed on resume like ``metrics.jsonl``, lines never glued to the progress
bar, a contradictory ``config.json`` refused, a deleted run directory one error line, and
the advice an error gives works as given (a failed start leaves no run directory behind)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import sys

import pytest
import torch
from conftest import FAST, ROOT
from test_failures import one_line_error, pretrain_args, yatrain

from yatrain.data.loader import GlobalBatchLoader
from yatrain.errors import ConfigError, TrainingError
from yatrain.models import hf
from yatrain.output.loggers import Console
from yatrain.recipe.load import load_recipe
from yatrain.train.guard import StepGuard
from yatrain.train.loop import pretrain


def test_ctrl_c_then_the_launchers_sigterm_is_reported_as_ctrl_c(capfd):
    """Ctrl-C reaches a launched rank twice: as SIGINT from the terminal, then as the
    launcher's SIGTERM; the first is what the user did."""
    guard = StepGuard(torch.device("cpu"))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        with guard.during_save(4):
            pass
    finally:
        guard.restore()
    assert guard.signal_name == "SIGINT (Ctrl-C)"
    said = capfd.readouterr().err
    assert said == "yatrain: SIGINT (Ctrl-C): saving the checkpoint of step 4, then stopping\n"


def test_a_signal_during_a_save_is_said_at_once(capfd):
    """A rank killed before its save ends (a launcher's short grace period) has already said
    why it was stopping; a signal outside a save adds nothing until the run stops (a rank
    stopped because another failed prints only its error)."""
    guard = StepGuard(torch.device("cpu"))
    try:
        with guard.during_save(6):
            os.kill(os.getpid(), signal.SIGTERM)
            said = capfd.readouterr().err
    finally:
        guard.restore()
    assert said == "yatrain: SIGTERM: saving the checkpoint of step 6, then stopping\n"
    quiet = StepGuard(torch.device("cpu"))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        quiet.restore()
    assert capfd.readouterr().err == "" and quiet.signal_name == "SIGTERM"


def test_tensorboard_is_trimmed_on_resume_like_metrics(small_data, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = [*FAST, f"data.path={small_data}", "logging.tensorboard=true", "checkpoint.every=4"]
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", overrides)
    run_dir = tmp_path / "run"
    pretrain(recipe, run_dir=run_dir, steps=6, progress=False)
    shutil.rmtree(run_dir / "checkpoints/step-6")  # lost: the resume starts after step 4
    pretrain(recipe, run_dir=run_dir, steps=6, progress=False)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5, 6]


def test_a_line_printed_while_the_bar_is_drawn_starts_its_own_line(monkeypatch):
    """A hang report's headline (written straight to stderr by another part) is printed
    above the bar, not glued to its line."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    console = Console(progress=True)
    console.start(10, 0)
    console.step_done()
    sys.stderr.write("yatrain: hang report: rank 1 ")
    print("is behind", file=sys.stderr)
    console.close()
    assert sys.stderr is stream
    assert re.search(r"(^|[\r\n])yatrain: hang report: rank 1 is behind\n", stream.getvalue())


def test_contradicting_rope_spellings_in_config_json_are_refused():
    config = {
        "rope_scaling": {"rope_type": "default"},
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    }
    with pytest.raises(
        ConfigError, match=r"rope_scaling \(default\) and rope_parameters \(linear\)"
    ):
        hf.unsupported(config)
    agreeing = {"rope_scaling": None, "rope_parameters": {"rope_type": "default"}}
    assert hf.unsupported(agreeing) is None and hf.rope_scaling_from_hf(agreeing) is None


def test_deleting_the_run_directory_mid_run_stops_with_one_line(small_data, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    real = GlobalBatchLoader.next_batch

    def next_batch(self):
        if self.step == 2:  # about to run step 3
            shutil.rmtree(run_dir)
        return real(self)

    monkeypatch.setattr(GlobalBatchLoader, "next_batch", next_batch)
    overrides = [*FAST, f"data.path={small_data}", "checkpoint.every=2"]
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", overrides)
    with pytest.raises(TrainingError, match=f"the run directory {run_dir} was deleted"):
        pretrain(recipe, run_dir=run_dir, steps=5, progress=False)
    assert not run_dir.exists()  # no directory made again that no run owns


def test_advice_in_an_error_works_and_a_failed_start_leaves_no_run_directory(
    small_data, isolated_env, tmp_path
):
    """--resume of a run directory says how to continue it; a failed start leaves no run
    directory holding only its lock."""
    run = tmp_path / "run"
    assert (
        yatrain(*pretrain_args(small_data, run, "--steps", "2"), env=isolated_env).returncode == 0
    )
    line = one_line_error(
        yatrain(
            *pretrain_args(small_data, tmp_path / "new", "--resume", str(run)), env=isolated_env
        ),
        "is a run directory, not a checkpoint",
        f"--run-dir {run} --resume auto",
    )
    assert str(run / "checkpoints" / "step-2") in line
    hf = tmp_path / "hf"
    step = str(run / "checkpoints" / "step-2")
    assert yatrain("export", step, "--output", str(hf), env=isolated_env).returncode == 0
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    (hf / "model.safetensors").rename(tmp_path / "outside.safetensors")
    index["weight_map"] = dict.fromkeys(index["weight_map"], "../outside.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    bad_init = pretrain_args(small_data, tmp_path / "failed", f"--set=train.init_from={hf}")
    one_line_error(yatrain(*bad_init, env=isolated_env), "not a file name inside")
    assert not (tmp_path / "failed").exists()  # no run directory holding only its lock
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "docs.jsonl").write_text('{"text": "hello"}\n')
    args = pretrain_args(
        small_data, tmp_path / "v", f"--set=data.val_path={raw}", "--set=eval.every=1"
    )
    line = one_line_error(yatrain(*args, env=isolated_env), "is not tokenized data")
    assert f"--input {raw} --output {tmp_path / 'raw-tokenized'}" in line
