"""``yatrain pretrain --nproc-per-node N``: the ranks of a job, started through torch's public
elastic launch API (``torch.distributed.launcher.api``), the way torchrun starts them.

Each rank is ``python -m yatrain pretrain ...`` with the launcher's own flags removed, in the
environment torchrun gives (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, the rendezvous), so a
run behaves exactly as under ``torchrun -m yatrain``. Local rank 0 writes to this console;
the other ranks' output goes to files in a temporary directory (each rank's one error line
also reaches the launcher through torch elastic's error file, which ``cli.main`` writes).

Bounded: the flags are checked before anything starts (at most one rank per visible GPU, on
CPU at most max(8, 2 x cores) unless ``--oversubscribe``), and so is the endpoint of a
job on several nodes (``rendezvous.py``); the launcher says what it waits for and for how
long (``--rdzv-timeout``), and a failed wait is one line. Never orphaned: each rank dies
with its launcher (``launcher_link.py``). When ranks fail it prints two lines, naming the
rank that failed first (``blame.py``); ranks that all saved and stopped on a signal are no
failure: one line names the rank the signal reached. A job that succeeds prints nothing of
the launcher's and leaves no logs; nor does a job refused before its ranks start. SIGTERM
and SIGINT are passed to the ranks (torch's agent does it), which save a checkpoint and
stop as under torchrun; ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (seconds, default 30) is how long
they get before SIGKILL.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from yatrain.errors import ConfigError, Interrupted, TrainingError
from yatrain.runtime.blame import StoppedRanks, clean_stop, summary
from yatrain.runtime.launcher_link import LAUNCHER_PID, launched
from yatrain.runtime.rendezvous import Endpoint, failure_line, parse_endpoint, reach, waiting_line

LAUNCH_FLAGS = (
    "--nproc-per-node",
    "--nnodes",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-timeout",
    "--max-restarts",
)
LAUNCH_SWITCHES = ("--oversubscribe",)  # launch flags without a value
MAX_RANKS_PER_NODE = 1024  # even with --oversubscribe
MAX_RDZV_TIMEOUT_S = 86_400
MAX_NODES = 999_999
_NODES = re.compile(r"([0-9]+)(?::([0-9]+))?")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")
_AGENT_SIGNALS = "torch.distributed.elastic.multiprocessing.api"  # logs the signals it sends


@dataclass(frozen=True)
class Launch:
    """How many ranks, on how many nodes, meeting where (torchrun's flags)."""

    nproc_per_node: int
    nnodes: str = "1"  # N or MIN:MAX
    rdzv_endpoint: str | None = None  # HOST:PORT of the rendezvous (several nodes)
    rdzv_id: str | None = None  # the job's id: the same on every node and restart
    max_restarts: int = 0
    rdzv_timeout_s: int = 600  # how long the nodes wait for each other (torch's join timeout)
    oversubscribe: bool = False  # more CPU ranks than max(8, 2 x cores)

    @property
    def nodes(self) -> tuple[int, int]:
        """(min, max) nodes; one line when ``--nnodes`` is not N or MIN:MAX."""
        match = _NODES.fullmatch(self.nnodes)
        if not match:
            raise ConfigError(f"--nnodes {self.nnodes[:80]}: pass a number of nodes, or MIN:MAX")
        flag = f"--nnodes {self.nnodes[:80]}"
        if any(len(part.lstrip("0")) > len(str(MAX_NODES)) for part in match.groups("")):
            raise ConfigError(f"{flag}: at most {MAX_NODES:,} nodes")
        low, high = int(match[1]), int(match[2] or match[1])
        if high > MAX_NODES:
            raise ConfigError(f"{flag}: at most {MAX_NODES:,} nodes")
        if low < 1:
            raise ConfigError(f"{flag}: a job has at least 1 node")
        if low > high:
            raise ConfigError(f"{flag}: MIN ({low}) exceeds MAX ({high}); pass MIN:MAX")
        return low, high

    def world_sizes(self) -> tuple[int, int]:
        """The fewest and the most ranks of the job."""
        low, high = self.nodes
        return low * self.nproc_per_node, high * self.nproc_per_node

    def check(self, gpus: int | None = None, cores: int | None = None) -> None:
        """Every flag, before anything starts; ``gpus``/``cores``: this node's (default)."""
        gpus = visible_gpus() if gpus is None else gpus
        check_ranks(self.nproc_per_node, gpus, cores or os.cpu_count() or 1, self.oversubscribe)
        _, high = self.nodes
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: pass 0 or more")
        if not 1 <= self.rdzv_timeout_s <= MAX_RDZV_TIMEOUT_S:
            raise ConfigError(
                f"--rdzv-timeout {self.rdzv_timeout_s}: pass seconds from 1 to {MAX_RDZV_TIMEOUT_S}"
            )
        if high > 1 and not (self.rdzv_endpoint and self.rdzv_id):
            raise ConfigError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (a node every node "
                "reaches) and --rdzv-id (the job's id, the same on every node)"
            )
        if self.rdzv_endpoint is not None:
            parse_endpoint(self.rdzv_endpoint)
        if self.rdzv_id is not None:
            check_run_id(self.rdzv_id, "--rdzv-id")

    @property
    def endpoint(self) -> Endpoint | None:
        return parse_endpoint(self.rdzv_endpoint) if self.rdzv_endpoint else None

    def config(self, log_dir: Path, run_id: str, timeout_s: float) -> LaunchConfig:
        """The elastic launch of this (checked) job; ``timeout_s``: what is left of the
        rendezvous timeout."""
        low, high = self.nodes
        others = {r: Std.ALL for r in range(1, self.nproc_per_node)}  # rank 0: this console
        seconds = max(1, round(timeout_s))
        return LaunchConfig(
            min_nodes=low,
            max_nodes=high,
            nproc_per_node=self.nproc_per_node,
            run_id=run_id,
            rdzv_backend="c10d",
            rdzv_endpoint=str(self.endpoint) if self.endpoint else "localhost:0",
            rdzv_configs={"join_timeout": seconds, "read_timeout": min(60, seconds)},
            max_restarts=self.max_restarts,
            logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects={0: Std.NONE, **others}),
        )


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_ranks(ranks: int, gpus: int, cores: int, oversubscribe: bool) -> None:
    """At most one rank per visible GPU; on CPU at most max(8, 2 x cores) unless
    ``oversubscribe``, and never more than ``MAX_RANKS_PER_NODE``."""
    digits = str(ranks)
    flag = f"--nproc-per-node {digits if len(digits) <= 24 else digits[:20] + '...'}"
    if ranks < 1:
        raise ConfigError(f"{flag}: start at least 1 rank")
    if gpus and ranks > gpus:
        raise ConfigError(
            f"{flag}: this node sees {gpus} GPU(s) and each rank needs one of its own; pass "
            f"at most {gpus} (CUDA_VISIBLE_DEVICES chooses which)"
        )
    limit = max(8, 2 * cores)
    if ranks > MAX_RANKS_PER_NODE:
        raise ConfigError(f"{flag}: at most {MAX_RANKS_PER_NODE} ranks per node")
    if not gpus and ranks > limit and not oversubscribe:
        raise ConfigError(
            f"{flag}: more ranks than this node's {cores} CPU core(s) run well (at most "
            f"max(8, 2 x cores) = {limit}); pass fewer, or --oversubscribe to start them anyway"
        )


def check_run_id(run_id: str, flag: str) -> None:
    """A job id is part of file names (its logs, ``runs/RECIPE-ID``): a plain name."""
    if not _RUN_ID.fullmatch(run_id):
        shown = run_id if len(run_id) <= 80 else f"{run_id[:80]}... ({len(run_id)} characters)"
        raise ConfigError(
            f"{flag} {shown!r}: pass a name of at most 128 letters, digits, '.', '_' or '-' "
            "(not starting with '.' or '-'), e.g. the scheduler's job id"
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
        elif arg not in LAUNCH_SWITCHES and not arg.startswith(
            tuple(f"{flag}=" for flag in LAUNCH_FLAGS)
        ):
            args.append(arg)
    return args


def launch(job: Launch, argv: Sequence[str]) -> int:
    """Run ``yatrain`` with ``argv`` (launch flags removed) on every rank of ``job``; the
    exit code (0 when every rank succeeded). Failures are summarised on stderr."""
    if os.environ.get("TORCHELASTIC_RUN_ID") or (os.environ.get("LOCAL_RANK") and launched()):
        raise ConfigError(
            "--nproc-per-node starts the ranks itself: run `yatrain pretrain --nproc-per-node N` "
            "directly, or torchrun without --nproc-per-node on the yatrain command"
        )
    job.check()
    run_id = job.rdzv_id or uuid.uuid4().hex[:12]
    deadline = time.monotonic() + job.rdzv_timeout_s
    endpoint = job.endpoint
    if endpoint is not None:  # several nodes: say so now; one: only if it has to wait
        low, high = job.nodes
        line = waiting_line(endpoint, low, high, run_id, job.rdzv_timeout_s)
        say = functools.partial(print, line, file=sys.stderr)
        if high > 1:
            say()
        reach(endpoint, job.rdzv_timeout_s, waiting=say if high == 1 else lambda: None)
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.nproc_per_node))
    )
    os.environ[LAUNCHER_PID] = str(os.getpid())  # each rank dies with this process
    log_dir = Path(tempfile.mkdtemp(prefix="yatrain-ranks-"))
    keep_logs, stopped = False, StoppedRanks()
    try:
        with _quiet_torch_elastic(stopped):
            left = deadline - time.monotonic()
            config = job.config(log_dir, run_id, left)
            elastic_launch(config, sys.executable)("-m", "yatrain", *worker_args(argv))
    except ChildFailedError as failed:
        stop = clean_stop(failed.failures, job.world_sizes()[0])
        if stop is not None:
            raise Interrupted(stop) from None
        lines, code = summary(failed.failures, job.world_sizes()[0], log_dir, stopped.pids)
        print("\n".join(lines), file=sys.stderr)
        keep_logs = True
        return code
    except SignalException as signalled:
        return 128 + int(signalled.sigval)
    except RendezvousError as error:
        shown = endpoint or Endpoint("localhost", 0)
        line = failure_line(error, shown, job.nnodes, run_id, job.rdzv_timeout_s)
        raise TrainingError(line) from None
    finally:
        os.environ.pop(LAUNCHER_PID, None)
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0


@contextlib.contextmanager
def _quiet_torch_elastic(stopped: StoppedRanks) -> Iterator[None]:
    """Torch elastic's loggers (each sets its own level) at CRITICAL, its own reports
    unprinted (the summary says what matters), but the signals its agent sends recorded."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith(_TORCH_LOGGERS)]
    loggers = [logging.getLogger(name) for name in [*_TORCH_LOGGERS, *names]]
    levels = {logger: logger.level for logger in loggers}
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    agent = logging.getLogger(_AGENT_SIGNALS)
    propagate = agent.propagate
    agent.setLevel(logging.WARNING)
    agent.propagate = False
    agent.addHandler(stopped)
    try:
        yield
    finally:
        agent.removeHandler(stopped)
        agent.propagate = propagate
        for logger, level in levels.items():
            logger.setLevel(level)
