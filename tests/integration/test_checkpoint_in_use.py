"""Reading the checkpoints of a job that is still running: an export is kept out of reach of
its rotation (``checkpoint.keep`` deletes old checkpoints with all they hold), and a
checkpoint the rotation deletes while ``eval``, ``generate`` or ``export`` reads it is named
as such, with the checkpoint to read instead."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import FAST, ROOT
from test_failures import one_line_error, yatrain

import yatrain.checkpoint.manifest as manifest_module
import yatrain.checkpoint.store as store_module
from yatrain.checkpoint.hf_export import export_hf
from yatrain.checkpoint.manifest import CheckpointError
from yatrain.errors import ConfigError
from yatrain.inference.evaluate_checkpoint import evaluate_checkpoint
from yatrain.inference.generate_text import generate_text
from yatrain.models.generate import Sampling
from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain


@pytest.fixture(scope="module")
def run_dir(small_data, tmp_path_factory) -> Path:
    """A run with step-2 and step-4 kept (the state a running job leaves between saves)."""
    run = tmp_path_factory.mktemp("run") / "run"
    sets = [*FAST, f"data.path={small_data}", "checkpoint.every=2", "checkpoint.keep=2"]
    pretrain(load_recipe(ROOT / "recipes/tiny.yaml", sets), run_dir=run, steps=4, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-4"]
    return run


@pytest.fixture()
def run_copy(run_dir, tmp_path) -> Path:
    """A copy of the run that a test may delete from."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("inside", ["checkpoints/step-2/hf", "checkpoints/hf", "checkpoints"])
def test_an_export_where_the_rotation_deletes_is_refused_before_any_work(
    run_copy, inside, monkeypatch
):
    before = _listing(run_copy)
    monkeypatch.setattr(  # refused before the checkpoint is even opened
        "yatrain.checkpoint.hf_export.open_checkpoint", lambda *a, **k: pytest.fail("opened")
    )
    with pytest.raises(ConfigError) as refused:
        export_hf(run_copy / "checkpoints/step-2", run_copy / inside)
    line = str(refused.value)
    assert "\n" not in line and f"--output {run_copy / inside}" in line
    assert "checkpoint.keep" in line and "outside" in line
    assert str(run_copy / "hf-step-2") in line  # a place outside: in the run directory
    assert _listing(run_copy) == before


def test_an_export_into_a_linked_path_to_the_checkpoints_is_refused(run_copy, tmp_path):
    """The rotation's directory reached through a link is still the rotation's."""
    (tmp_path / "link").symlink_to(run_copy / "checkpoints")
    before = _listing(run_copy)
    with pytest.raises(ConfigError, match="checkpoint.keep"):
        export_hf(run_copy / "checkpoints/step-4", tmp_path / "link/hf")
    assert _listing(run_copy) == before


def test_the_export_command_refuses_the_checkpoint_directory_in_one_line(
    run_copy, isolated_env, tmp_path
):
    before = _listing(run_copy)
    checkpoint = run_copy / "checkpoints/step-4"
    result = yatrain(
        "export", str(checkpoint), "--output", str(checkpoint / "hf"), env=isolated_env
    )
    one_line_error(result, f"--output {checkpoint / 'hf'}", "checkpoint.keep")
    assert _listing(run_copy) == before


def test_an_export_beside_the_checkpoints_in_the_run_directory_is_written(run_copy):
    out = export_hf(run_copy / "checkpoints/step-4", run_copy / "hf")
    assert (out / "config.json").is_file()


def _deleted_during(monkeypatch, module, name: str, checkpoint: Path) -> None:
    """Delete ``checkpoint`` (as ``shutil.rmtree`` in the rotation does) the moment the
    reader calls ``module.name``, then let the call go on."""
    original = getattr(module, name)

    def delete_then_call(*args, **kwargs):
        shutil.rmtree(checkpoint, ignore_errors=True)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, delete_then_call)


READERS = {
    "eval": lambda path, out: evaluate_checkpoint(path),
    "generate": lambda path, out: generate_text(
        path, "def ", max_new_tokens=2, sampling=Sampling(0.0)
    ),
    "export": lambda path, out: export_hf(path, out),
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize(
    "when", [(manifest_module, "check_files"), (store_module, "checkpoint_tokenizer")]
)
def test_a_checkpoint_removed_while_it_is_read_is_named_as_removed(
    run_copy, reader, when, monkeypatch, tmp_path
):
    checkpoint = run_copy / "checkpoints/step-2"
    module, name = when
    if name == "checkpoint_tokenizer":  # imported by name: patch where each reader looks
        module = {
            "eval": "yatrain.inference.evaluate_checkpoint",
            "generate": "yatrain.inference.generate_text",
            "export": "yatrain.checkpoint.hf_export",
        }[reader]
        if reader == "export":
            name = "export_tokenizer"
        module = __import__(module, fromlist=[name])
    _deleted_during(monkeypatch, module, name, checkpoint)
    with pytest.raises(CheckpointError) as removed:
        READERS[reader](checkpoint, tmp_path / "hf")
    line = str(removed.value)
    assert "\n" not in line and f"checkpoint {checkpoint} was removed while" in line, line
    assert "not a complete" not in line and "missing" not in line
    assert str(run_copy / "checkpoints/step-4") in line  # the newest one left, to read instead
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".tmp-hf-*"))


def test_weights_removed_mid_read_are_named_as_a_removed_checkpoint(run_copy, monkeypatch):
    """Deleted between the checks and the weights: DCP's own error is not what is shown."""
    checkpoint = run_copy / "checkpoints/step-2"
    _deleted_during(monkeypatch, store_module, "read_weights", checkpoint)
    with pytest.raises(CheckpointError, match="was removed while"):
        generate_text(checkpoint, "def ", max_new_tokens=2, sampling=Sampling(0.0))


def test_a_damaged_checkpoint_that_is_still_there_keeps_its_own_message(run_copy):
    checkpoint = run_copy / "checkpoints/step-2"
    (checkpoint / "tokenizer.model").unlink()  # missing before the read began: damage
    with pytest.raises(CheckpointError) as damaged:
        generate_text(checkpoint, "def ", max_new_tokens=2)
    assert "removed while" not in str(damaged.value)
