"""Quiet and honest output: no warnings in a normal run and no library noise in a profiled
one, out-of-range flags as one line, strict JSON, W&B that never blocks, and a sweep whose
measured memory is the planner's kind of memory."""

from __future__ import annotations

import json
import time

import pytest
from conftest import FAST, ROOT
from test_failures import one_line_error, pretrain_args, yatrain

from yatrain.output import wandb_logger
from yatrain.output.record import read_metrics
from yatrain.recipe.load import load_recipe
from yatrain.sweep import run_sweep
from yatrain.train.loop import pretrain


def test_a_normal_run_resume_and_export_print_no_warning(small_data, isolated_env, tmp_path):
    run_dir = tmp_path / "run"
    commands = [
        pretrain_args(
            small_data,
            run_dir,
            "--steps",
            "4",
            "--set=checkpoint.every=2",
            "--set=logging.wandb.mode=offline",
        ),
        pretrain_args(
            small_data,
            run_dir,
            "--steps",
            "6",
            "--set=checkpoint.every=2",
            "--set=logging.wandb.mode=offline",
        ),  # resumes from step-4
        ["export", str(run_dir / "checkpoints/step-6"), "--output", str(tmp_path / "hf")],
    ]
    for args in commands:
        result = yatrain(*args, env=isolated_env)
        assert result.returncode == 0, result.stderr[-3000:]
        noisy = [line for line in result.stderr.splitlines() if "warn" in line.lower()]
        assert noisy == [], noisy


def _refuse_constant(name: str):
    raise ValueError(f"not JSON: {name}")


def test_metrics_file_is_strict_json(small_data, tmp_path, monkeypatch):
    """A skipped step's infinite gradient norm is written as null, never a bare Infinity."""
    from test_checkpoint import inject_inf_gradient

    inject_inf_gradient(monkeypatch, at_step=2)
    sets = [*FAST, f"data.path={small_data}", "train.skip_nonfinite_steps=true"]
    cfg = load_recipe(ROOT / "recipes/tiny.yaml", sets)
    pretrain(cfg, run_dir=tmp_path / "run", steps=3, progress=False)
    lines = (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=_refuse_constant) for line in lines]
    assert records[1]["step"] == 2 and records[1]["grad_norm"] is None
    assert records[1]["skipped_steps"] == 1
    back = read_metrics(tmp_path / "run/metrics.jsonl")
    assert back[1].grad_norm != back[1].grad_norm  # null reads back as NaN


def _strict(text: str) -> object:
    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_quiet_runs_out_of_range_flags_as_one_line_and_strict_plan_json(
    small_data, isolated_env, tmp_path
):
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


def test_wandb_auto_with_a_key_and_no_network_goes_offline_in_seconds(
    small_data, isolated_env, tmp_path
):
    env = {**isolated_env, "WANDB_API_KEY": "0" * 40}  # this machine has no network
    args = pretrain_args(
        small_data, tmp_path / "run", "--steps", "2", "--set=logging.wandb.mode=auto"
    )
    start = time.monotonic()
    result = yatrain(*args, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - start < 90  # was 96 s of blocking, then a traceback
    assert "is unreachable" in result.stderr and "logging offline instead" in result.stderr
    assert list((tmp_path / "run/wandb").glob("offline-run-*"))
    env["WANDB_MODE"] = "offline"  # respected: no network attempt at all
    result = yatrain(
        *pretrain_args(
            small_data, tmp_path / "run2", "--steps", "1", "--set=logging.wandb.mode=auto"
        ),
        env=env,
    )
    assert result.returncode == 0 and "unreachable" not in result.stderr, result.stderr
    assert "wandb offline" in result.stderr and list((tmp_path / "run2/wandb").glob("offline-*"))


@pytest.mark.parametrize(
    "recipe_mode,env_mode,want",
    [
        ("online", "offline", "offline"),  # the stricter of the two wins
        ("offline", "online", "offline"),
        ("online", "disabled", "disabled"),
        ("disabled", None, "disabled"),
        ("auto", "dryrun", "offline"),
        ("auto", None, "offline"),  # no key
    ],
)
def test_wandb_mode_and_the_environment(monkeypatch, tmp_path, recipe_mode, env_mode, want):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    if env_mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env_mode)
    assert wandb_logger.resolve_mode(recipe_mode)[0] == want


def test_sweep_measures_tensors_and_agrees_with_the_planner(small_data, tmp_path, monkeypatch):
    """The tiny recipe as it is (dim 256, 4 layers, seq 128, 1 layer checkpointed): the
    live-tensor peak of a warm-up step within 15% of the planner's tensor peak."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = run_sweep(
        ROOT / "recipes/tiny.yaml",
        [128],
        steps=3,
        warmup=2,
        output=tmp_path / "sweep",
        overrides=[f"data.path={small_data}", "logging.wandb.mode=disabled"],
        echo=lambda _: None,
    )
    (row,) = result.rows
    assert row["status"] == "ok", row
    measured, planned = row["peak_tensor_bytes"], row["predicted_peak_bytes"]
    assert measured > 0 and abs(measured - planned) / measured < 0.15, (measured, planned)
    assert row["peak_memory_bytes"] > measured  # the process's resident peak, shown apart
