"""Checkpoints that cannot hurt: hostile metadata refused, manifests checked against their
schema, checksums at every size, keep-K counting good checkpoints only, no non-finite state
saved, a full disk handled."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import FAST, ROOT
from distributed import run_ranks

from yatrain.checkpoint import store as ckpt
from yatrain.checkpoint.checksums import HASH, HashingStream, hash_file
from yatrain.checkpoint.hf_export import export_hf
from yatrain.checkpoint.init_from import init_from_source
from yatrain.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    CorruptCheckpoint,
    open_checkpoint,
)
from yatrain.errors import ConfigError, TrainingError, YatrainError
from yatrain.inference.evaluate_checkpoint import evaluate_checkpoint
from yatrain.inference.generate_text import generate_text
from yatrain.models.llama import build_model
from yatrain.recipe.load import load_recipe
from yatrain.sharding import ShardedEngine
from yatrain.train.loop import pretrain
from yatrain.train.optim import build_optimizer
from yatrain.train.setup import Checks


def recipe(data: Path, *extra: str):
    return load_recipe(
        ROOT / "recipes/tiny.yaml",
        [
            *FAST,
            f"data.path={data}",
            "data.global_batch_size=8",
            "checkpoint.keep=10",
            "checkpoint.every=2",
            *extra,
        ],
    )


def train(data, run_dir, steps, *extra, resume="auto", checks=Checks()):
    cfg = recipe(data, *extra)
    return pretrain(cfg, run_dir=run_dir, steps=steps, resume=resume, progress=False, checks=checks)


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory) -> dict[int, float]:
    """The losses of 8 uninterrupted steps."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    train(small_data, run_dir, 8)
    return losses(run_dir)


@pytest.fixture()
def saved(small_data, tmp_path) -> Path:
    """A run directory with step-2 and step-4."""
    run_dir = tmp_path / "run"
    train(small_data, run_dir, 4)
    return run_dir


def rewrite(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace a file and its manifest entry, as an attacker (or a bad copy tool) would."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][name] = {"bytes": len(data), HASH: hash_file(checkpoint / name)}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


class RunsACommand:
    """Unpickling this runs ``touch MARKER``: what a crafted ``.metadata`` can do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_crafted_metadata_is_refused_by_every_command_that_loads(saved, small_data, tmp_path):
    checkpoint, marker = saved / "checkpoints/step-4", tmp_path / "PWNED"
    exploit = pickle.dumps(RunsACommand(marker))
    rewrite(checkpoint, ".metadata", exploit)  # sizes and checksum consistent
    cfg = recipe(small_data)
    engine = ShardedEngine.from_model(build_model(cfg.model), device="cpu")
    optimizer = build_optimizer(engine.param_groups(0.1), cfg.optim)
    attempts = {
        "open": lambda: open_checkpoint(checkpoint),
        "resume": lambda: train(small_data, saved, 6, resume=str(checkpoint)),
        "export": lambda: export_hf(checkpoint, tmp_path / "hf"),
        "init_from": lambda: init_from_source(checkpoint, cfg.model, build_model(cfg.model)),
        "load without open_checkpoint": lambda: ckpt.load_checkpoint(
            checkpoint, engine, optimizer, None
        ),
        "eval": lambda: evaluate_checkpoint(checkpoint, data=small_data),
        "generate": lambda: generate_text(checkpoint, "def ", max_new_tokens=2),
    }
    for name, attempt in attempts.items():
        with pytest.raises(CheckpointError, match="could run code") as error:
            attempt()
        assert "\n" not in str(error.value), name
        assert not marker.exists(), f"{name} ran the command"
    pickle.loads(exploit)  # the same bytes, unpickled plainly: the command does run
    assert marker.exists()


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda m: m.update(step="4"), "'step' is '4'"),
        (lambda m: m.pop("files"), "'files' is missing"),
        (lambda m: m["files"][".metadata"].update(bytes="12"), "whole number of 'bytes'"),
        (lambda m: m["model"].update(dim="64"), "model is invalid"),
        (lambda m: m.update(loader=[]), r"'loader' is \[\]"),
        (lambda m: m["files"].update({"../x": {"bytes": 1}}), "not a file name"),
    ],
)
def test_manifest_with_wrong_types_is_refused_and_the_older_one_used(
    saved, small_data, reference, damage, message, capfd
):
    newest = saved / "checkpoints/step-4"
    manifest = json.loads((newest / MANIFEST).read_text())
    damage(manifest)
    (newest / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpoint, match=message):
        train(small_data, saved, 8, resume=str(newest))
    train(small_data, saved, 8)  # auto: falls back to step-2 and sets step-4 aside
    assert "skipping step-4" in capfd.readouterr().err
    assert (saved / "checkpoints/corrupt-step-4").is_dir()
    assert losses(saved) == reference


NESTED = "[" * 100_000 + "]" * 100_000  # valid JSON, deeper than Python's recursion limit


def test_a_manifest_nested_too_deep_is_corrupt_for_every_command_and_auto_resume_falls_back(
    saved, small_data, reference, tmp_path, capfd
):
    newest = saved / "checkpoints/step-4"
    (newest / MANIFEST).write_text(NESTED)
    cfg = recipe(small_data)
    attempts = {
        "open": lambda: open_checkpoint(newest),
        "resume": lambda: train(small_data, saved, 6, resume=str(newest)),
        "export": lambda: export_hf(newest, tmp_path / "hf"),
        "init_from": lambda: init_from_source(newest, cfg.model, build_model(cfg.model)),
        "eval": lambda: evaluate_checkpoint(newest, data=small_data),
        "generate": lambda: generate_text(newest, "def ", max_new_tokens=2),
    }
    for name, attempt in attempts.items():
        with pytest.raises(CheckpointError, match="nested too deeply") as error:
            attempt()
        assert "\n" not in str(error.value), name
    train(small_data, saved, 8)  # auto: falls back to step-2 and sets step-4 aside
    assert "skipping step-4" in capfd.readouterr().err
    assert (saved / "checkpoints/corrupt-step-4").is_dir()
    assert losses(saved) == reference


def test_export_to_a_dangling_symlink_is_one_line_naming_it(saved, isolated_env, tmp_path):
    """A traceback, each line prefixed "[rank0]: " five times (once per one-rank process
    group the export made): now one line naming the path, and the link left as it was."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere" / "x")
    command = [sys.executable, "-m", "yatrain", "export", str(saved / "checkpoints/step-4")]
    command += ["--output", str(link)]
    result = subprocess.run(
        command, env=isolated_env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("yatrain: error: --output ") and str(link) in line
    assert "symbolic link" in line
    assert os.readlink(link) == str(tmp_path / "nowhere" / "x")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")) == []


def test_a_one_process_command_leaves_tracebacks_without_rank_prefixes(saved, tmp_path):
    """The one-rank process groups a command makes for DCP leave the excepthook as it was
    (torch wraps it at each one, prefixing every line of a traceback with "[rank0]: ")."""
    hook = sys.excepthook
    open_checkpoint(saved / "checkpoints/step-4")
    export_hf(saved / "checkpoints/step-4", tmp_path / "hf")
    assert sys.excepthook is hook


def _save_on_ranks(rank, world, data, run_dir):
    train(data, run_dir, 2)
    return rank


def test_each_rank_hashes_its_own_files_and_every_file_is_checked(small_data, tmp_path):
    run_dir = tmp_path / "run"
    run_ranks(2, _save_on_ranks, small_data, run_dir)
    checkpoint = run_dir / "checkpoints/step-2"
    files = json.loads((checkpoint / MANIFEST).read_text())["files"]
    on_disk = {p.name for p in checkpoint.iterdir()} - {MANIFEST}
    assert set(files) == on_disk and {"__0_0.distcp", "__1_0.distcp"} <= on_disk
    for name, entry in files.items():  # hashed while written, equal to a fresh read
        assert entry[HASH] == hash_file(checkpoint / name), name
    shard = checkpoint / "__1_0.distcp"  # rank 1's file, far from its start
    data = bytearray(shard.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="__1_0.distcp is corrupt"):
        open_checkpoint(checkpoint)
    assert open_checkpoint(checkpoint, verify=False).step == 2  # --no-verify


def test_keep_counts_good_checkpoints_only(small_data, tmp_path, reference, capfd):
    """Truncate the newest shard and resume: the run falls back to step-4; the truncated
    step-6 is moved aside, never kept as the newest nor a reason to delete."""
    run_dir = tmp_path / "run"
    train(small_data, run_dir, 6, "checkpoint.keep=2")
    root = run_dir / "checkpoints"
    shard = max((root / "step-6").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])
    train(small_data, run_dir, 8, "checkpoint.keep=2")
    assert "moved it to corrupt-step-6" in capfd.readouterr().err
    names = sorted(p.name for p in root.iterdir())
    assert names == ["corrupt-step-6", "step-6", "step-8"]
    assert losses(run_dir) == reference


def test_prune_moves_a_damaged_checkpoint_aside_instead_of_deleting_a_good_one(saved, small_data):
    root = saved / "checkpoints"
    train(small_data, saved, 6)  # step-2, step-4, step-6
    shard = next((root / "step-6").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    ckpt.prune(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["corrupt-step-6", "step-2", "step-4"]


@pytest.mark.parametrize("skip", ["false", "true"])
def test_a_non_finite_update_is_never_saved(small_data, tmp_path, skip):
    """lr 1e39: the loss and gradient norm of step 1 are finite, its update is not."""
    run_dir = tmp_path / "run"
    with pytest.raises(TrainingError, match="update at step 1 made weights non-finite") as error:
        train(
            small_data,
            run_dir,
            4,
            "optim.lr=1.0e+39",
            "optim.warmup_steps=0",
            "checkpoint.every=1",
            f"train.skip_nonfinite_steps={skip}",
        )
    assert "last good checkpoint is none" in str(error.value)
    assert ckpt.complete_checkpoints(run_dir / "checkpoints") == []


def test_full_disk_during_a_save_is_one_line_and_cleaned_up(
    saved, small_data, reference, monkeypatch, capfd
):
    real_write = HashingStream.write

    def write(self, data):
        if ".tmp-step-6" in self.raw.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    monkeypatch.setattr(HashingStream, "write", write)
    with pytest.raises(
        CheckpointError, match=r"no space left on device at .* \(needs about"
    ) as error:
        train(small_data, saved, 8)
    assert "\n" not in str(error.value) and "free space" in str(error.value)
    root = saved / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4"]
    monkeypatch.setattr(HashingStream, "write", real_write)
    (root / ".tmp-step-9").mkdir()  # as a killed save leaves it
    (root / ".tmp-step-9/__0_0.distcp").write_bytes(b"x" * 1000)
    train(small_data, saved, 8)
    assert "removed 1 unfinished save(s) of an earlier run: .tmp-step-9" in capfd.readouterr().err
    assert not (root / ".tmp-step-9").exists()
    assert losses(saved) == reference


def test_dcp_checkpoint_exception_becomes_a_checkpoint_error(saved, small_data):
    """DCP raises CheckpointException, a BaseException: it must not escape as a traceback."""
    checkpoint = saved / "checkpoints/step-4"
    shard = max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)
    rewrite(checkpoint, shard.name, bytes(shard.stat().st_size))  # valid checksum, no tensors
    with pytest.raises(CheckpointError, match="could not load checkpoint") as error:
        train(small_data, saved, 6, resume=str(checkpoint))
    assert isinstance(error.value, YatrainError) and "\n" not in str(error.value)


def test_saving_loading_and_exporting_in_one_process_warn_nothing(small_data, tmp_path):
    run_dir = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(small_data, run_dir, 2)
        train(small_data, run_dir, 4)  # resumes from step-2
        export_hf(run_dir / "checkpoints/step-4", tmp_path / "hf")
        cfg = recipe(small_data)
        init = init_from_source(run_dir / "checkpoints/step-4", cfg.model, build_model(cfg.model))
        ShardedEngine.from_model(build_model(cfg.model), device="cpu", init=init)
    assert [str(w.message) for w in caught] == []


def test_a_checkpoint_of_another_model_is_not_set_aside(saved, small_data):
    with pytest.raises(ConfigError, match=r"model\.dim 64 -> 96"):
        train(small_data, saved, 6, "model.dim=96")
    assert sorted(p.name for p in (saved / "checkpoints").iterdir()) == ["step-2", "step-4"]


def test_a_killed_export_leaves_nothing_the_next_export_keeps(saved, tmp_path):
    """A SIGKILLed export leaves ``.tmp-OUT-PID-XXXX``; the next export there removes it (and
    leaves alone one whose process still runs)."""
    dead = tmp_path / ".tmp-hf-999999999-0a1b"
    alive = tmp_path / f".tmp-hf-{os.getpid()}-0a1b"
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "part-00001.safetensors").write_bytes(b"half")
    export_hf(saved / "checkpoints/step-4", tmp_path / "hf")
    assert not dead.exists() and alive.exists()
    assert (tmp_path / "hf/config.json").is_file()
