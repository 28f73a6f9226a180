"""``yatrain pretrain --nproc-per-node N``: the ranks of a job, started through torch's public
elastic launch API (``torch.distributed.launcher.api``), the way torchrun starts them.

Each rank is ``python -m yatrain pretrain ...`` with the launcher's own flags removed, in the
environment torchrun gives (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, the rendezvous), so a
run behaves exactly as under ``torchrun -m yatrain``. Local rank 0 writes to this console;
the other ranks' output goes to files in a temporary directory (each rank's one error line
also reaches the launcher through torch elastic's error file, which ``cli.main`` writes).
When ranks fail the launcher prints one summary of two lines: the rank that failed first
(its error file is the oldest), its error line and exit code; then which ranks stopped after
it and where the other ranks' logs are. A job that
succeeds prints nothing of the launcher's and leaves no logs. SIGTERM and SIGINT are passed
to the ranks (torch's agent does it), which save a checkpoint and stop as under torchrun;
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (seconds, default 30) is how long they get before SIGKILL.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from yatrain.errors import ConfigError

LAUNCH_FLAGS = ("--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--rdzv-id", "--max-restarts")
_PREFIX = "yatrain: error"
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")


@dataclass(frozen=True)
class Launch:
    """How many ranks, on how many nodes, meeting where (torchrun's flags)."""

    nproc_per_node: int
    nnodes: str = "1"  # N or MIN:MAX
    rdzv_endpoint: str | None = None  # HOST:PORT of the rendezvous (several nodes)
    rdzv_id: str | None = None  # the job's id: the same on every node and restart
    max_restarts: int = 0

    def config(self, log_dir: Path) -> LaunchConfig:
        """The elastic launch of this job, checked (one line when a flag is wrong)."""
        low, _, high = self.nnodes.partition(":")
        if not (low.isdigit() and (high or low).isdigit() and 1 <= int(low) <= int(high or low)):
            raise ConfigError(f"--nnodes {self.nnodes}: pass a number of nodes, or MIN:MAX")
        if self.nproc_per_node < 1 or self.max_restarts < 0:
            raise ConfigError("--nproc-per-node must be at least 1 and --max-restarts at least 0")
        several = int(high or low) > 1
        if several and not self.rdzv_endpoint:
            raise ConfigError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (a node every node "
                "reaches) and --rdzv-id (the job's id, the same on every node)"
            )
        others = {r: Std.ALL for r in range(1, self.nproc_per_node)}  # rank 0: this console
        return LaunchConfig(
            min_nodes=int(low),
            max_nodes=int(high or low),
            nproc_per_node=self.nproc_per_node,
            run_id=self.rdzv_id or uuid.uuid4().hex[:12],
            rdzv_backend="c10d",
            rdzv_endpoint=self.rdzv_endpoint or "localhost:0",
            max_restarts=self.max_restarts,
            logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects={0: Std.NONE, **others}),
        )


def worker_args(argv: Sequence[str]) -> list[str]:
    """The command line each rank runs: ``argv`` (after ``yatrain``) without the launch
    flags (``--flag value`` and ``--flag=value`` forms)."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCH_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in LAUNCH_FLAGS)):
            args.append(arg)
    return args


def launch(job: Launch, argv: Sequence[str]) -> int:
    """Run ``yatrain`` with ``argv`` (launch flags removed) on every rank of ``job``; the
    exit code (0 when every rank succeeded). Failures are summarised on stderr."""
    if os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("LOCAL_RANK"):
        raise ConfigError(
            "--nproc-per-node starts the ranks itself: run `yatrain pretrain --nproc-per-node N` "
            "directly, or torchrun without --nproc-per-node on the yatrain command"
        )
    log_dir = Path(tempfile.mkdtemp(prefix="yatrain-ranks-"))
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.nproc_per_node))
    )
    levels = _silence_torch_elastic()  # its own reports: the summary says what matters
    try:
        elastic_launch(job.config(log_dir), sys.executable)("-m", "yatrain", *worker_args(argv))
    except ChildFailedError as failed:
        lines, code = summary(failed, job, log_dir)
        print("\n".join(lines), file=sys.stderr)
        return code
    except SignalException as stopped:
        shutil.rmtree(log_dir, ignore_errors=True)
        return 128 + int(stopped.sigval)
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _silence_torch_elastic() -> dict[logging.Logger, int]:
    """Torch elastic's loggers (each sets its own level) at CRITICAL; their old levels."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith(_TORCH_LOGGERS)]
    loggers = [logging.getLogger(name) for name in [*_TORCH_LOGGERS, *names]]
    levels = {logger: logger.level for logger in loggers}
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    return levels


def summary(failed: ChildFailedError, job: Launch, log_dir: Path) -> tuple[list[str], int]:
    """Two lines: the rank that failed first (the oldest error file), its error line and exit
    code; then the ranks that stopped after it and where the logs are. Also the exit code."""
    world = job.nproc_per_node * int(job.nnodes.partition(":")[0])
    failures = failed.failures
    rank = min(failures, key=lambda r: (_written_at(failures[r]), r))
    first = failures[rank]
    code = first.error_file_data.get("exitcode", first.exitcode)  # a rank stopped as it exited
    if not isinstance(code, int):
        code = first.exitcode
    if code < 0:
        how, code = f"killed by {signal.Signals(-code).name}", 128 - code
    else:
        how = f"exit code {code}"
    why = first.message if first.error_file_data.get("message") else None
    why = why or _last_line(log_dir, first.local_rank)
    after = ", ".join(str(r) for r in sorted(failures) if r != rank)
    logs = f"the other ranks' logs are in {log_dir}"
    return [
        f"{_PREFIX}: rank {rank} of {world} failed ({how}): {why}",
        f"{_PREFIX}: rank(s) {after} stopped after it; {logs}" if after else f"({logs})",
    ], code


def _written_at(failure) -> float:
    """When a rank wrote its error file (ns resolution); never, for a rank killed first."""
    try:
        return os.stat(failure.error_file).st_mtime_ns
    except OSError:
        return float("inf")


def _last_line(log_dir: Path, local_rank: int) -> str:
    """What a rank that wrote no error file printed last (its newest log file), if anything."""
    logs = sorted(log_dir.glob(f"*/attempt_*/{local_rank}/stderr.log"), key=os.path.getmtime)
    if not logs:
        return "no error line (see the output above)"
    lines = [line for line in logs[-1].read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"
