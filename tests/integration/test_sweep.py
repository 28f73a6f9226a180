"""The sequence-length sweep: real short runs per configuration, failures kept as rows.

One sweep of the tiny model (sequence lengths 32 and 64, checkpoint settings 0 and 2) runs
once for the module. The two checkpoint-2 configurations are replaced, through the function
that launches a configuration, by processes that die the way real ones do: one raises
torch.OutOfMemoryError, one fails otherwise. The sweep must record both and carry on.
"""

from __future__ import annotations

import csv
import json
import sys

import pytest
from conftest import ROOT
from typer.testing import CliRunner

from yatrain.cli import app
from yatrain.errors import ConfigError
from yatrain.sweep import configs, report
from yatrain.sweep import run as sweep_run

TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=160",
    "model.vocab_size=512",
    "model.max_seq_len=128",
    "data.micro_batch_size=2",
    "data.global_batch_size=4",
    "logging.wandb.mode=disabled",
    "data.seq_len=32",  # the token budget kept across lengths: 4 x 32
]
OOM = "import torch; raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 9 GiB')"
FAIL = "import sys; print('step 1 ...'); sys.exit('simulated failure: disk full')"


def run_sweep_cli(out_dir, data, *extra: str):
    sets = [f"--set={s}" for s in [*TINY, f"data.path={data}"]]
    args = ["sweep", str(ROOT / "recipes/tiny.yaml"), "--seq-len", "32,64", "--steps", "3"]
    args += ["--activation-checkpoint-layers", "0,2", "--output", str(out_dir), *sets, *extra]
    return CliRunner().invoke(app, args)


@pytest.fixture(scope="module")
def swept(small_data, tmp_path_factory):
    """(sweep dir, CLI result, names of launched configs) of one sweep with two fakes."""
    out_dir = tmp_path_factory.mktemp("sweep") / "out"
    launched: list[str] = []
    real_launch = sweep_run.launch

    def launch(command, log_path):
        name = log_path.parent.name
        launched.append(name)
        fake = {"seq32-ckpt2": OOM, "seq64-ckpt2": FAIL}.get(name)
        return real_launch([sys.executable, "-c", fake] if fake else command, log_path)

    with pytest.MonkeyPatch.context() as mp:
        home = tmp_path_factory.mktemp("wandb")
        for key in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            mp.setenv(key, str(home))
        mp.delenv("WANDB_API_KEY", raising=False)
        mp.setenv("PYTHONPATH", str(ROOT))
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setattr(sweep_run, "launch", launch)
        result = run_sweep_cli(out_dir, small_data)
        rerun = run_sweep_cli(out_dir, small_data, "--set=logging.wandb.project=other")
    return out_dir, result, launched, rerun


def test_sweep_writes_table_csv_json_and_plots(swept):
    out_dir, result, _, _ = swept
    assert result.exit_code == 0, result.output
    rows = json.loads((out_dir / "sweep.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["seq32-ckpt0", "seq32-ckpt2", "seq64-ckpt0", "seq64-ckpt2"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert [r["seq_len"] for r in ok] == [32, 64]
    # tokens per global batch kept at 4 x 32: fewer sequences when they are longer
    assert [r["global_batch_size"] for r in ok] == [4, 2]
    for r in ok:
        assert r["tokens_per_s_per_device"] > 0 and r["mfu"] > 0 and r["step_time_s"] > 0
        assert r["measured_steps"] == 1  # 3 steps, 2 warm-up steps left out
        assert r["peak_memory_bytes"] > 0 and r["predicted_peak_bytes"] > 0
    with (out_dir / "sweep.csv").open() as f:
        assert [r["name"] for r in csv.DictReader(f)] == [r["name"] for r in rows]
    for png in ("throughput.png", "memory.png", "sweep.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = result.stdout
    assert "tok/s/dev" in table and "plan MiB" in table and "OOM" in table
    assert not (out_dir / "configs/seq32-ckpt0/checkpoints").exists()  # measurement runs only
    # tiny.yaml evaluates (eval.every, eval.at_end), a measurement run never does
    assert "val_loss" not in (out_dir / "configs/seq32-ckpt0/metrics.jsonl").read_text()


def test_oom_is_a_row_and_the_sweep_goes_on(swept):
    out_dir, result, launched, _ = swept
    rows = {r["name"]: r for r in json.loads((out_dir / "sweep.json").read_text())["rows"]}
    oom = rows["seq32-ckpt2"]
    assert oom["status"] == "oom" and "out of memory" in oom["error"].lower()
    assert oom["predicted_peak_bytes"] > 0  # the planner's figure is still shown
    assert rows["seq64-ckpt0"]["status"] == "ok"  # ran after the OOM
    failed = rows["seq64-ckpt2"]
    assert failed["status"] == "failed" and failed["error"] == "simulated failure: disk full"
    assert "seq32-ckpt2: OOM" in result.output
    assert launched[:4] == ["seq32-ckpt0", "seq32-ckpt2", "seq64-ckpt0", "seq64-ckpt2"]


def test_restart_skips_finished_configurations(swept):
    out_dir, _, launched, rerun = swept
    assert rerun.exit_code == 0, rerun.output
    assert launched[4:] == ["seq64-ckpt2"]  # only the failed one runs again
    for name, status in [("seq32-ckpt0", "ok"), ("seq32-ckpt2", "oom"), ("seq64-ckpt0", "ok")]:
        assert f"{name}: already {status} in {out_dir}, skipped" in rerun.output
    rows = json.loads((out_dir / "sweep.json").read_text())["rows"]
    assert len(rows) == 4  # logging settings do not make a configuration new


def test_table_and_plots_go_to_wandb(swept, small_data, isolated_env):
    out_dir = swept[0]
    rows = json.loads((out_dir / "sweep.json").read_text())["rows"]
    plots = [out_dir / "throughput.png", out_dir / "memory.png"]
    sets = [*TINY, f"data.path={small_data}", "logging.wandb.mode=offline"]
    wandb_cfg = configs.base_recipe(ROOT / "recipes/tiny.yaml", sets)[0].logging.wandb
    mode = report.log_to_wandb(wandb_cfg, out_dir, rows, plots, {"x": 1})
    assert mode == "offline"
    assert list((out_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_batch_sizes_keep_tokens_or_sequences():
    assert configs.batch_for(2048, 4096, 512, 1, 8, keep_seqs=False) == (1024, 1)
    assert configs.batch_for(8192, 4096, 512, 2, 8, keep_seqs=False) == (256, 2)
    assert configs.batch_for(64, 32, 4, 2, 2, keep_seqs=False) == (2, 1)  # micro-batch shrinks
    assert configs.batch_for(8192, 4096, 512, 1, 8, keep_seqs=True) == (512, 1)
    with pytest.raises(ConfigError, match="keep-batch-sequences"):
        configs.batch_for(3000, 4096, 512, 1, 8, keep_seqs=False)
    with pytest.raises(ConfigError, match="do not split"):
        configs.batch_for(64, 32, 4, 1, 8, keep_seqs=False)


def test_commands_and_failure_classes():
    config = configs.SweepConfig("seq8-ckpt0", 8, "0", 0, 4, 2, ["data.seq_len=8"], 1)
    one = sweep_run.config_command(ROOT / "r.yaml", config, ROOT / "d", 1)
    assert one[1:3] == ["-m", "yatrain"] and "--set=data.seq_len=8" in one
    two = sweep_run.config_command(ROOT / "r.yaml", config, ROOT / "d", 2)
    assert two[1:7] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
    ]
    assert two[7:9] == ["yatrain", "pretrain"] and two[-1] == "--no-progress"
    text = "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate\n"
    assert sweep_run.classify_failure(1, text)[0] == "oom"
    assert sweep_run.classify_failure(-9, "")[0] == "oom"
    assert sweep_run.classify_failure(2, "a\nyatrain: error: bad key\n") == (
        "failed",
        "yatrain: error: bad key",
    )


def test_auto_and_bad_settings_are_resolved_before_running(small_data):
    recipe = ROOT / "recipes/tiny.yaml"
    sets = [*TINY, f"data.path={small_data}"]
    expanded = configs.expand_configs(recipe, sets, [32, 256], ["auto", "1"], 3, 1, True)
    assert [c.name for c in expanded] == [
        "seq32-ckptauto",
        "seq32-ckpt1",
        "seq256-ckptauto",
        "seq256-ckpt1",
    ]
    assert expanded[0].layers == 0  # a CPU without sharding.gpu_memory_gib: nothing to plan for
    assert "model.max_seq_len=256" in expanded[2].overrides  # beyond the recipe's context
    with pytest.raises(ConfigError, match="'7' is not 'auto' or a layer count"):
        configs.expand_configs(recipe, sets, [32], ["7"], 3, 1, False)


def test_plan_only_sweep_tabulates_the_planner_without_training(tmp_path):
    """--plan-only: one row per (length, CP size) from the planner, its table, CSV, JSON
    and plot; no configuration runs (no configs/ directory), no data needed."""
    args = ["sweep", str(ROOT / "recipes/llama3_1_8b.yaml"), "--plan-only", "--gpus", "8"]
    args += ["--seq-len", "65536,131072", "--context-parallel", "1,8"]
    result = CliRunner().invoke(app, [*args, "--gpu-memory", "80", "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert [(r["seq_len"], r["context_parallel"]) for r in rows] == [
        (65536, 1),
        (65536, 8),
        (131072, 1),
        (131072, 8),
    ]
    whole, cut = rows[2], rows[3]
    assert whole["fits"] is False and whole["min_context_parallel"]["context_parallel"] == 2
    assert cut["fits"] is True and cut["context_bytes_per_step"] > 0
    assert rows[1]["activation_checkpoint_layers"] < rows[0]["activation_checkpoint_layers"]
    assert "| 131,072 | 8 | 18 |" in result.stdout and "no: CP 2 fits" in result.stdout
    written = {p.name for p in tmp_path.iterdir()}
    assert written == {"plan.csv", "plan.json", "plan.png", sweep_run.SWEEP_MARK}
    with (tmp_path / "plan.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4


def test_context_parallel_axis_of_a_measured_sweep():
    """--context-parallel 1,2 on 2 processes: each length at each CP size, named by it, its
    batch split over world / CP data ranks, the planner's peak for that CP."""
    out = configs.expand_configs(
        ROOT / "recipes/tiny.yaml", TINY, [32, 64], ["0"], 3, 2, False, [1, 2]
    )
    assert [c.name for c in out] == [
        "seq32-cp1-ckpt0",
        "seq32-cp2-ckpt0",
        "seq64-cp1-ckpt0",
        "seq64-cp2-ckpt0",
    ]
    assert [c.context_parallel for c in out] == [1, 2, 1, 2]
    assert "sharding.context_parallel=2" in out[1].overrides
    assert out[1].predicted_peak_bytes < out[0].predicted_peak_bytes
    plain = configs.expand_configs(ROOT / "recipes/tiny.yaml", TINY, [32], ["0"], 3, 2, False)
    assert plain[0].name == "seq32-ckpt0" and plain[0].context_parallel == 1
    assert not any("context_parallel" in s for s in plain[0].overrides)


def test_plan_only_flags_need_plan_only():
    args = ["sweep", str(ROOT / "recipes/tiny.yaml"), "--seq-len", "64", "--gpus", "8"]
    with pytest.raises(ConfigError, match="pass --plan-only with them"):
        CliRunner().invoke(app, args, catch_exceptions=False)
    bad = ["sweep", str(ROOT / "recipes/tiny.yaml"), "--seq-len", "64", "--plan-only"]
    with pytest.raises(ConfigError, match="--context-parallel: 'x' is not a positive"):
        CliRunner().invoke(app, [*bad, "--context-parallel", "1,x"], catch_exceptions=False)
