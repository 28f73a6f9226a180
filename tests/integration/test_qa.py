"""The QA probe of issue 22, finding by finding: nothing a user types loses data or hangs.

One test per numbered finding (prepare-data's in test_qa_data.py, the three mutation-audit
bugs of finding 12 in test_qa_mutations.py). The next probe adds its reproductions here.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from test_failures import one_line_error, pretrain_args, yatrain

from yatrain.errors import YatrainError
from yatrain.models.generate import Sampling, choose
from yatrain.output import wandb_logger
from yatrain.recipe.config import WandbConfig


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("step-*"))


def test_1_a_checkpoint_dir_belongs_to_one_run(small_data, isolated_env, tmp_path):
    """An absolute checkpoint.dir is locked with its run and records its owner: another run
    naming it is refused (it neither resumes from it nor prunes it); --resume PATH reads it."""
    shared = tmp_path / "shared"
    first = pretrain_args(
        small_data,
        tmp_path / "a",
        "--steps",
        "6",
        "--set=checkpoint.every=2",
        f"--set=checkpoint.dir={shared}",
    )
    assert yatrain(*first, env=isolated_env).returncode == 0
    assert _steps(shared) == ["step-4", "step-6"]
    second = pretrain_args(
        small_data,
        tmp_path / "b",
        "--steps",
        "8",
        "--set=checkpoint.every=2",
        f"--set=checkpoint.dir={shared}",
    )
    one_line_error(
        yatrain(*second, env=isolated_env), f"checkpoint.dir {shared} belongs to", "--resume"
    )
    assert _steps(shared) == ["step-4", "step-6"] and not (tmp_path / "b").exists()
    # the owner continues as before
    again = pretrain_args(
        small_data,
        tmp_path / "a",
        "--steps",
        "8",
        "--set=checkpoint.every=2",
        f"--set=checkpoint.dir={shared}",
    )
    result = yatrain(*again, env=isolated_env)
    assert result.returncode == 0 and "resumed from" in result.stderr, result.stderr[-2000:]
    assert _steps(shared) == ["step-6", "step-8"]
    # another run reads one explicitly, and prunes only its own
    reader = pretrain_args(
        small_data,
        tmp_path / "c",
        "--steps",
        "12",
        "--set=checkpoint.every=2",
        "--set=checkpoint.keep=1",
        "--resume",
        str(shared / "step-8"),
    )
    result = yatrain(*reader, env=isolated_env)
    assert result.returncode == 0 and "resumed from" in result.stderr, result.stderr[-2000:]
    assert _steps(shared) == ["step-6", "step-8"]
    assert _steps(tmp_path / "c" / "checkpoints") == ["step-12"]


def test_2_run_dir_that_is_not_a_run_is_refused_and_config_is_kept(
    small_data, isolated_env, tmp_path
):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own file\n")
    one_line_error(
        yatrain(*pretrain_args(small_data, mine, "--steps", "1"), env=isolated_env),
        "is not a yatrain run directory",
    )
    assert [p.name for p in mine.iterdir()] == ["config.yaml"]
    assert (mine / "config.yaml").read_text() == "my own file\n"
    run = tmp_path / "run"
    assert (
        yatrain(*pretrain_args(small_data, run, "--steps", "2"), env=isolated_env).returncode == 0
    )
    before = (run / "config.yaml").read_text()
    restart = pretrain_args(small_data, run, "--steps", "4", "--set=train.log_every=2")
    result = yatrain(*restart, env=isolated_env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (run / "config-before-restart-1.yaml").read_text() == before
    assert "log_every: 2" in (run / "config.yaml").read_text()


def test_9_advice_that_works(small_data, isolated_env, tmp_path):
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


def _long(tmp_path: Path) -> str:
    return str(tmp_path / ("x" * 300))


def test_5_what_used_to_end_in_a_traceback_is_one_line(small_data, isolated_env, tmp_path):
    latin1 = tmp_path / "recipe.yaml"
    latin1.write_bytes("model:\n  dim: 64  # d\xe9faut\n".encode("latin-1"))
    deep = tmp_path / "deep.yaml"
    deep.write_text("model:\n  dim: " + "[" * 5000 + "]" * 5000 + "\n")
    nested = "model.dim=" + "[" * 5000 + "]" * 5000
    for args, needle in [
        (["pretrain", str(latin1)], "is not UTF-8 text"),
        (["plan", str(latin1), "--gpus", "1"], "is not UTF-8 text"),
        (["sweep", str(latin1), "--seq-len", "64"], "is not UTF-8 text"),
        (["plan", str(deep), "--gpus", "1"], "nested too deeply"),
        (["plan", "recipes/tiny.yaml", "--gpus", "1", "--set", nested], "nested too deeply"),
        (
            pretrain_args(small_data, tmp_path / "r", f"--set=data.path={_long(tmp_path)}"),
            "File name too long",
        ),
        (pretrain_args(small_data, Path(_long(tmp_path))), "File name too long"),
        (["prepare-data", "--output", _long(tmp_path), "--vocab-size", "64"], "File name too long"),
    ]:
        one_line_error(yatrain(*args, env=isolated_env), needle)


class ServerResponseError(Exception):
    """What wandb raises when its server answers but refuses."""


class _RefusingWandb(types.ModuleType):
    """A wandb whose server answers and refuses every run; ``refuse_log``: starts, then
    refuses the first record."""

    def __init__(self, refuse_log: bool) -> None:
        super().__init__("wandb")
        self.refuse_log, self.Settings = refuse_log, lambda **_: None

    def init(self, **_):
        if not self.refuse_log:
            raise ServerResponseError("run ID abc is in use")
        return types.SimpleNamespace(log=self.init_failed, finish=lambda: None)

    def init_failed(self, *_, **__):
        raise ServerResponseError("run ID abc is in use")


def test_5_wandb_that_refuses_is_one_line_or_one_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(wandb_logger, "resolve_mode", lambda mode: ("online", None))
    monkeypatch.setitem(sys.modules, "wandb", _RefusingWandb(refuse_log=False))
    with pytest.raises(YatrainError, match="W&B could not start an? offline run .*in use"):
        wandb_logger.WandbLogger(WandbConfig(mode="auto"), tmp_path, {}, "run", say=print)
    said: list[str] = []
    monkeypatch.setitem(sys.modules, "wandb", _RefusingWandb(refuse_log=True))
    logger = wandb_logger.WandbLogger(WandbConfig(mode="auto"), tmp_path, {}, "r", said.append)
    logger.log({"loss": 1.0}, step=1)
    logger.log({"loss": 1.0}, step=2)
    logger.finish()
    assert len(said) == 1 and "W&B logging stopped" in said[0], said


def test_5_a_tiny_temperature_is_greedy_not_an_error():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    for temperature in (1e-45, 1e-30, 5e-324):
        generator = torch.Generator().manual_seed(0)
        assert choose(logits, Sampling(temperature=temperature), generator) == 1


def _strict(text: str) -> object:
    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_8_quiet_runs_and_range_errors_as_one_line(small_data, isolated_env, tmp_path):
    env = {k: v for k, v in isolated_env.items() if k not in ("HOME", "XDG_CACHE_HOME")}
    run = pretrain_args(
        small_data,
        tmp_path / "run",
        "--steps",
        "4",
        "--set=train.profile=1",
        "--set=logging.wandb.mode=offline",
    )
    result = yatrain(*run, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    noise = [line for line in lines if line.startswith(("USDT", "[W", "20")) or " INFO " in line]
    assert noise == [], noise
    ckpt = str(tmp_path / "nowhere")
    for args, needle in [
        (["generate", ckpt, "--prompt", "a", "--top-k", "0"], "--top-k"),
        (["generate", ckpt, "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["generate", ckpt, "--prompt", "a", "--temperature", "-1"], "--temperature"),
        (["generate", ckpt, "--prompt", "a", "--temperature", "inf"], "finite"),
        (["eval", ckpt, "--batches", "0"], "--batches"),
        (
            ["plan", "recipes/tiny.yaml", "--gpus", "1", "--shard-group-size", "auto"],
            "pass --shard-group-size N",
        ),
    ]:
        one_line_error(yatrain(*args, env=isolated_env), needle)
    planned = yatrain("plan", "recipes/tiny.yaml", "--gpus", "2", "--json", env=isolated_env)
    assert planned.returncode == 0 and isinstance(_strict(planned.stdout), dict)


def test_10_checkpoint_symlinks_and_export_permissions(small_data, isolated_env, tmp_path):
    run = tmp_path / "run"
    args = pretrain_args(small_data, run, "--steps", "4", "--set=checkpoint.every=2")
    assert yatrain(*args, env=isolated_env).returncode == 0
    step = run / "checkpoints" / "step-4"
    hf = tmp_path / "hf"
    assert yatrain("export", str(step), "--output", str(hf), env=isolated_env).returncode == 0
    assert len({f.stat().st_mode for f in hf.iterdir()}) == 1  # safetensors included
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 12345)
    victim = next(step.glob("*.distcp"))
    victim.unlink()
    victim.symlink_to(secret)
    line = one_line_error(
        yatrain("export", str(step), "--output", str(tmp_path / "hf2"), env=isolated_env),
        "is a symbolic link",
    )
    assert "12345" not in line
    # a step directory that is a link is pruned as a link; what it points to stays
    elsewhere = tmp_path / "elsewhere"
    (run / "checkpoints" / "step-2").rename(elsewhere)
    (run / "checkpoints" / "step-1").symlink_to(elsewhere)
    victim.unlink()
    more = pretrain_args(
        small_data,
        run,
        "--steps",
        "8",
        "--set=checkpoint.every=2",
        "--resume",
        str(run / "checkpoints" / "step-1"),
    )
    result = yatrain(*more, env=isolated_env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert _steps(run / "checkpoints") == ["step-6", "step-8"] and elsewhere.is_dir()
