"""scripts/slurm.sbatch builds the `yatrain pretrain --nproc-per-node` command (yatrain's
own launcher) from the allocation: run under bash with
stand-ins for SLURM's ``scontrol`` and ``srun`` (which prints what it would start)."""

from __future__ import annotations

import os
import subprocess

from conftest import ROOT

SCRIPT = ROOT / "scripts/slurm.sbatch"


def fake_slurm(tmp_path, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a17\\ngpu-a18\\ngpu-b02\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\necho "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    slurm = {
        "SLURM_JOB_NODELIST": "gpu-a[17-18],gpu-b02",
        "SLURM_NNODES": "3",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "llama70b",
        "SLURM_GPUS_ON_NODE": "8",
    }
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **slurm, **env}
    args = ["bash", str(SCRIPT), "recipes/llama3_70b.yaml", "--set", "data.path=/shared/web"]
    return subprocess.run(args, env=full_env, cwd=ROOT, capture_output=True, text=True)


def test_sbatch_script_rendezvous_comes_from_the_allocation(tmp_path):
    result = fake_slurm(tmp_path)
    assert result.returncode == 0, result.stderr
    command = result.stdout.split()
    want = [
        "--nnodes",
        "3",
        "--nproc-per-node",
        "8",
        "--rdzv-endpoint",
        "gpu-a17:29500",
        "--rdzv-id",
        "4242",
        "--run-dir",
        "runs/llama70b",
        "--resume",
        "auto",
    ]
    for flag, value in zip(want[::2], want[1::2], strict=True):
        assert command[command.index(flag) + 1] == value, flag
    assert "torch.distributed.run" not in result.stdout
    assert " -m yatrain pretrain recipes/llama3_70b.yaml " in result.stdout
    assert command[-2:] == ["--set", "data.path=/shared/web"]
    assert "sharding.shard_group_size=auto" not in command


def test_sbatch_script_passes_the_shard_group_and_run_dir(tmp_path):
    result = fake_slurm(tmp_path, SHARD_GROUP_SIZE="auto", RUN_DIR="/shared/runs/a")
    assert result.returncode == 0, result.stderr
    assert "--run-dir /shared/runs/a" in result.stdout
    assert "--set sharding.shard_group_size=auto" in result.stdout
