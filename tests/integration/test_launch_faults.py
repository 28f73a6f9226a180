"""The launcher (``yatrain pretrain --nproc-per-node``) is bounded, never silent, never
orphaned, and blames the right rank: a failed rank is a two-line summary, a launch that
works prints nothing of its own. Flag and rendezvous errors run the command in this process
(no rank starts); the faults run real ranks with a fault injected."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ROOT
from faults import at_step, inject
from test_failures import pretrain_args, yatrain

from yatrain.cli import main
from yatrain.errors import TrainingError
from yatrain.runtime import rendezvous
from yatrain.runtime.rendezvous import Endpoint
from yatrain.testing.ranks import free_port

RECIPE = str(ROOT / "recipes/tiny.yaml")  # its global batch: 16 sequences of 8 per rank


def run_cli(args: list[str], monkeypatch, capsys, tmp_path: Path) -> tuple[int, list[str]]:
    """``yatrain ARGS`` in this process, TMPDIR and the working directory in ``tmp_path``:
    its exit code and stderr lines."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    monkeypatch.setattr(sys, "argv", ["yatrain", *args])
    with pytest.raises(SystemExit) as ended:
        main()
    return ended.value.code, capsys.readouterr().err.splitlines()


def one_line(code: int, lines: list[str], tmp_path: Path, *needles: str) -> str:
    """The single ``yatrain: error`` line of a command refused before any rank started."""
    errors = [line for line in lines if line.startswith("yatrain: error")]
    assert code == 2 and len(errors) == 1, lines
    assert not any("Traceback" in line or "frame #" in line for line in lines), lines
    assert not list(tmp_path.rglob("yatrain-ranks-*")) and not (tmp_path / "runs").exists()
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node 0: start at least 1 rank"),
        (["--nproc-per-node", "99999999999999999999"], "at most 1024 ranks per node"),
        (["--nproc-per-node", "1000"], "--oversubscribe"),
        (["--rdzv-endpoint", "localhost:99999"], "--rdzv-endpoint 'localhost:99999'"),
        (["--rdzv-endpoint", "localhost:abc"], "--rdzv-endpoint 'localhost:abc'"),
        (["--rdzv-endpoint", ":"], "--rdzv-endpoint ':'"),
        (["--rdzv-id", "x" * 100_000], "(100000 characters)"),
        (["--rdzv-id", "../../escape"], "--rdzv-id '../../escape'"),
        (["--rdzv-endpoint", "nosuchhost.invalid:29500"], "cannot resolve the host"),
        # tiny's 16 sequences are 8 per rank: 3 ranks do not divide them (it was retried)
        (["--nproc-per-node", "3", "--max-restarts", "3"], "not divisible"),
    ],
)
def test_launch_flags_are_refused_in_one_line_before_anything_starts(
    flags, needle, monkeypatch, capsys, tmp_path
):
    args = ["pretrain", RECIPE, "--nproc-per-node", "2", *flags]
    one_line(*run_cli(args, monkeypatch, capsys, tmp_path), tmp_path, needle)


def test_waiting_for_nodes_says_what_and_how_long_and_ends_in_one_line(
    monkeypatch, capsys, tmp_path
):
    """``--nnodes 2`` with one node waited in silence (45 s and more)."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["pretrain", RECIPE, "--set=data.global_batch_size=32", "--nproc-per-node", "2"]
    rdzv = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", "j1", "--rdzv-timeout", "2"]
    code, lines = run_cli([*args, *rdzv], monkeypatch, capsys, tmp_path)
    wait = f"yatrain: waiting for 1 more of 2 nodes at {endpoint} (job j1), rendezvous timeout 2 s"
    assert lines[0] == wait, lines
    one_line(code, lines[1:], tmp_path, f"not all nodes joined the rendezvous at {endpoint}")


def test_a_port_held_by_another_program_is_one_line(monkeypatch, capsys, tmp_path):
    """A program that accepts connections and never answers held torch's client forever."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        endpoint = f"127.0.0.1:{holder.getsockname()[1]}"
        args = ["pretrain", RECIPE, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint]
        code, lines = run_cli([*args, "--rdzv-timeout", "2"], monkeypatch, capsys, tmp_path)
    one_line(code, lines, tmp_path, "the port is held by another program")


def test_waiting_for_a_first_node_that_never_listens_is_said_and_bounded(monkeypatch):
    """A node whose rendezvous host never comes up waited for minutes, printing C++ stack
    frames: it says what it waits for, once, and ends with one line at the timeout."""
    monkeypatch.setattr(rendezvous, "_local", lambda address: False)  # as if another host
    said: list[str] = []
    with pytest.raises(TrainingError, match=r"^nothing answered at --rdzv-endpoint 127\.0\.0\.1"):
        rendezvous.reach(Endpoint("127.0.0.1", free_port()), 1, lambda: said.append("waiting"))
    assert said == ["waiting"]


PID_FILE = """
import contextlib, os, pathlib
if "RANK" in os.environ:  # a rank (not a process it starts): its pid, once
    with contextlib.suppress(FileExistsError):
        with pathlib.Path("{folder}", "rank" + os.environ["RANK"]).open("x") as file:
            file.write(f"{{os.getpid()}} {{os.getppid()}}")
"""


def _parents(folder: Path) -> dict[int, int]:
    """Each rank's pid and its launcher's."""
    pairs = [p.read_text().split() for p in folder.iterdir()]
    return {int(pid): int(parent) for pid, parent in pairs if parent}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_ranks_die_with_their_launcher_and_a_lost_node_ends_the_run_non_zero(
    small_data, isolated_env, tmp_path
):
    """Two one-rank nodes; node B's launcher is SIGKILLed mid-run. Its rank was left
    training to the end and node A exited 0: B's rank dies, A's launcher ends non-zero."""
    pids = tmp_path / "pids"
    pids.mkdir()
    env = inject(isolated_env, tmp_path / "inject", PID_FILE.format(folder=pids))
    port = free_port()
    sets = ["--set=data.global_batch_size=8", "--set=train.collective_timeout_s=2"]
    args = pretrain_args(small_data, tmp_path / "run", "--steps", "5000", *sets)
    rdzv = ["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    command = [sys.executable, "-m", "yatrain", *args, *rdzv, "--rdzv-id", "lost-node"]
    nodes: list[subprocess.Popen] = []
    try:
        for _ in ("A", "B"):  # A hosts the rendezvous: B starts once A listens
            nodes.append(subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE))
            _wait_for(lambda: _listens(port), nodes[0])
        metrics = tmp_path / "run/metrics.jsonl"
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, nodes[0])
        _wait_for(lambda: len(list(pids.iterdir())) == 2, nodes[0])
        ranks = _parents(pids)
        (b_rank,) = [pid for pid, parent in ranks.items() if parent == nodes[1].pid]
        nodes[1].kill()
        deadline = time.monotonic() + 30
        while _alive(b_rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(b_rank), "node B's rank outlived its launcher"
        _, err = nodes[0].communicate(timeout=120)
        assert nodes[0].returncode not in (0, None), err.decode()[-3000:]
        summary = [line for line in err.decode().splitlines() if "failed (" in line]
        assert summary and " of 2 failed (exit code 2): lost contact" in summary[0], err
    finally:  # the ranks first: an orphan holds its launcher's stderr open
        for pid in _parents(pids):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for node in nodes:
            node.kill()
            node.communicate()


def _listens(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(ready, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert process.poll() is None, process.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)


BAD_SHARD = (
    'from yatrain.errors import DataError; raise DataError("tokens-00003.bin is unreadable")'
)
LAUNCHER_NOISE = ("Traceback", "ChildFailedError", "torch.distributed", "elastic", "[default")


def test_a_failed_rank_is_a_two_line_summary(small_data, isolated_env, tmp_path):
    """Rank 2 of 4 fails at its first step: the run's two start-up lines, rank 0's line (it
    lost contact), the launcher's two: five lines in all."""
    env = inject(isolated_env, tmp_path / "inject", at_step(rank=2, step=1, action=BAD_SHARD))
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # the rank logs go to its private tmp
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
    kept = list(tmp_path.rglob("yatrain-ranks-*"))  # where the checks below look
    assert len(kept) == 1 and str(kept[0]) in summary[1]


def test_a_successful_launch_prints_nothing_of_its_own(small_data, isolated_env, tmp_path):
    env = {**isolated_env, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    args = pretrain_args(small_data, tmp_path / "run", "--steps", "3", "--nproc-per-node", "2")
    result = yatrain(*args, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (result.stdout + result.stderr).splitlines()
    assert not any(noise in line for line in lines for noise in LAUNCHER_NOISE), lines
    assert "world size 2" in result.stderr and not list(tmp_path.rglob("yatrain-ranks-*"))


FAULT_SETS = ["--set=data.global_batch_size=8", "--set=train.collective_timeout_s=2"]


def test_a_rank_killed_by_a_signal_is_named_first(small_data, isolated_env, tmp_path):
    """Rank 1 SIGKILLed at step 2 was reported as "rank 0 of 2 failed (exit code 2)" (rank
    0 lost contact with it), and the launcher exited 2, not 137."""
    kill = at_step(rank=1, step=2, action="os.kill(os.getpid(), signal.SIGKILL)")
    env = {**inject(isolated_env, tmp_path / "inject", kill), "TMPDIR": str(tmp_path)}
    args = pretrain_args(small_data, tmp_path / "run", "--steps", "50", *FAULT_SETS)
    result = yatrain(*args, "--nproc-per-node", "2", env=env)
    summary = [line for line in result.stderr.splitlines() if line.startswith("yatrain: error: ")]
    assert result.returncode == 128 + signal.SIGKILL and summary, result.stderr[-3000:]
    assert summary[0].startswith(
        "yatrain: error: rank 1 of 2 failed (killed by SIGKILL): it wrote no error line"
    ), result.stderr[-3000:]
    assert summary[1].startswith("yatrain: error: rank(s) 0 stopped after it")


STOP_RANK_1 = """
import os, pathlib, signal
if os.environ.get("RANK") == "1":
    pathlib.Path("{pid_file}").write_text(str(os.getpid()))
"""


def test_a_stopped_ranks_watchdog_exit_says_what_the_hang_report_says(
    small_data, isolated_env, tmp_path
):
    """Rank 1 SIGSTOPped at step 2: rank 0's watchdog ends it, and the summary showed
    torch's "To enable traceback see" rather than what the hang report says. Torch's agent
    then sends the stopped rank SIGTERM and, 30 s later, SIGKILL: this test sends the
    SIGKILL once the SIGTERM is pending."""
    pid_file = tmp_path / "rank1.pid"
    stop = at_step(rank=1, step=2, action="os.kill(os.getpid(), signal.SIGSTOP)")
    env = inject(isolated_env, tmp_path / "inject", STOP_RANK_1.format(pid_file=pid_file) + stop)
    env["TMPDIR"] = str(tmp_path)
    args = pretrain_args(small_data, tmp_path / "run", "--steps", "50", *FAULT_SETS)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "yatrain", *args, "--nproc-per-node", "2"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(
            lambda: pid_file.exists() and _pending(int(pid_file.read_text()), "SIGTERM"), launcher
        )
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    summary = [line for line in err.splitlines() if line.startswith("yatrain: error: ")]
    assert launcher.returncode == 3 and summary, err[-3000:]
    assert summary[0].startswith(
        "yatrain: error: rank 0 of 2 failed (exit code 3): step 2 has made no progress"
    ), err[-3000:]
    assert summary[0].endswith(
        "says: rank 1 sent nothing (dead, or cannot run Python)); stopping this rank, "
        "continue with --resume auto"
    )
    assert "To enable traceback" not in err


def _pending(pid: int, name: str) -> bool:
    """Is signal ``name`` pending for process ``pid`` (Linux's /proc status)?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    bit = 1 << (int(getattr(signal, name)) - 1)
    masks = [
        line.split()[1] for line in status.splitlines() if line.startswith(("ShdPnd", "SigPnd"))
    ]
    return any(int(mask, 16) & bit for mask in masks)
