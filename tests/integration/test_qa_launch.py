"""Finding 7 of issue 22: under torchrun a rank's one error line was buried in the launcher's
traceback and report. ``yatrain pretrain --nproc-per-node N`` starts the ranks itself
(torch's elastic launch API) and reports a failure in two lines of its own."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from conftest import ROOT
from faults import at_step, inject
from test_failures import pretrain_args, yatrain

from yatrain.runtime.launch import worker_args

BAD_SHARD = (
    'from yatrain.errors import DataError; raise DataError("tokens-00003.bin is unreadable")'
)
LAUNCHER_NOISE = ("Traceback", "ChildFailedError", "torch.distributed", "elastic", "[default")


def test_worker_args_drop_the_launch_flags():
    argv = [
        "--debug",
        "pretrain",
        "r.yaml",
        "--nproc-per-node",
        "4",
        "--nnodes=2",
        "--rdzv-endpoint",
        "h:1",
        "--rdzv-id=j",
        "--max-restarts",
        "3",
        "--steps",
        "5",
    ]
    assert worker_args(argv) == ["--debug", "pretrain", "r.yaml", "--steps", "5"]


def test_7_a_failed_rank_is_a_two_line_summary(small_data, isolated_env, tmp_path):
    """Rank 2 of 4 fails at its first step: the run's two start-up lines, rank 0's line (it
    lost contact), the launcher's two: five lines in all."""
    env = inject(isolated_env, tmp_path / "inject", at_step(rank=2, step=1, action=BAD_SHARD))
    env["TMPDIR"] = str(tmp_path)
    args = pretrain_args(
        small_data,
        tmp_path / "run",
        "--steps",
        "20",
        "--nproc-per-node",
        "4",
        "--set=data.global_batch_size=8",
    )
    result = yatrain(*args, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = (result.stdout + result.stderr).splitlines()
    assert len(lines) <= 5, "\n".join(lines)
    assert not any(noise in line for line in lines for noise in LAUNCHER_NOISE), lines
    summary = [line for line in lines if line.startswith("yatrain: error: ")]
    assert (
        summary[0]
        == "yatrain: error: rank 2 of 4 failed (exit code 2): tokens-00003.bin is unreadable"
    )
    assert "stopped after it" in summary[1] and "logs are in" in summary[1]


def test_7_a_successful_launch_prints_nothing_of_its_own(small_data, isolated_env, tmp_path):
    env = {**isolated_env, "TMPDIR": str(tmp_path)}
    args = pretrain_args(small_data, tmp_path / "run", "--steps", "3", "--nproc-per-node", "2")
    result = yatrain(*args, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (result.stdout + result.stderr).splitlines()
    assert not any(noise in line for line in lines for noise in LAUNCHER_NOISE), lines
    assert "world size 2" in result.stderr and not list(tmp_path.glob("yatrain-ranks-*"))


def test_7_sigterm_reaches_the_ranks_which_save(small_data, isolated_env, tmp_path):
    run = tmp_path / "run"
    args = pretrain_args(small_data, run, "--steps", "5000", "--nproc-per-node", "2")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "yatrain", *args],
        cwd=ROOT,
        env=isolated_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics, deadline = run / "metrics.jsonl", time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "yatrain: stopped by SIGTERM at step" in err and "checkpoint saved" in err, err[-3000:]
    assert not any(noise in err for noise in LAUNCHER_NOISE), err[-3000:]
    assert list((run / "checkpoints").glob("step-*"))
