"""Multi-node launch, tested on one machine: two torchrun "nodes" of two ranks each, joined by
a c10d rendezvous on 127.0.0.1 (as scripts/slurm.sbatch joins real nodes), train with hybrid
sharding (``shard_group_size: auto`` = the two ranks of each node) and match the losses of a
one-node four-rank run with full sharding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT
from test_cli import pretrain_args, read_metrics

from yatrain.testing.ranks import free_port

STEPS = 4
# Both runs see the same global batches; only the order of the gradient sums differs (a
# reduce-scatter over 4 vs over 2 then an all-reduce over 2): fp32 rounding. Measured: the
# four losses equal bit for bit, gradient norms within 2.1e-7 relative. A wrong layout (data
# seen twice, a gradient not averaged over the world) is off by 1e-3 or more.
LOSS_TOLERANCE, NORM_TOLERANCE = 1e-5, 1e-4


def launcher(ranks: int, *options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), *options]


def run_args(data: Path, run_dir: Path, *extra: str) -> list[str]:
    sets = ["--set=data.global_batch_size=8", *(f"--set={s}" for s in extra)]
    return [
        "-m",
        "yatrain",
        *pretrain_args(data, run_dir, "--steps", str(STEPS), *sets),
        "--no-progress",
    ]


def two_nodes(data: Path, run_dir: Path, env: dict, logs: Path) -> list[subprocess.Popen]:
    """Node 0 hosts the rendezvous store; both join one job of 4 ranks (2 per node). No
    ``--node-rank``: c10d numbers the nodes as they join (torchrun warns that it ignores
    one); each node's ranks are still contiguous, so each node is one shard group."""
    port = free_port()
    procs = []
    for node in (0, 1):
        rdzv = [
            "--nnodes",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "yatrain-test",
            "--rdzv-conf",
            f"is_host={int(node == 0)}",
        ]
        args = run_args(data, run_dir, "sharding.shard_group_size=auto")
        out = (logs / f"node{node}.log").open("w")
        procs.append(
            subprocess.Popen(
                [*launcher(2, *rdzv), *args],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def test_two_torchrun_nodes_with_hybrid_sharding_match_one_node(small_data, isolated_env, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    nodes = two_nodes(small_data, tmp_path / "hybrid", isolated_env, logs)
    single = subprocess.run(
        [*launcher(4, "--standalone"), *run_args(small_data, tmp_path / "full")],
        env=isolated_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    codes = [proc.wait(timeout=240) for proc in nodes]
    output = "".join((logs / f"node{n}.log").read_text() for n in (0, 1))
    assert codes == [0, 0], output[-4000:]
    assert single.returncode == 0, single.stderr[-4000:]
    assert "world size 4 (2 replicas of shard groups of 2)" in output
    hybrid, full = read_metrics(tmp_path / "hybrid"), read_metrics(tmp_path / "full")
    assert [r["step"] for r in hybrid] == [r["step"] for r in full] == list(range(1, STEPS + 1))
    for a, b in zip(full, hybrid, strict=True):
        assert abs(a["loss"] - b["loss"]) / a["loss"] < LOSS_TOLERANCE
        assert abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] < NORM_TOLERANCE
        assert b["comm_bytes_sent_cross"] > 0 == a["comm_bytes_sent_cross"]
