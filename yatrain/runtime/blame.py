"""The launcher's two-line summary of failed ranks: the rank that failed first, then the rest.

Torch elastic hands the launcher every rank that ended badly, but a time of death only for
ranks that wrote an error file (``launcher_link.tell_launcher``): one killed by a signal
writes none. So the first to fail is chosen in tiers, then by when its error file was
written:

0. a rank that wrote its own error (bad data, out of memory, a non-finite loss);
1. a rank that wrote none and that the launcher did not stop: killed from outside (the
   out-of-memory killer sends SIGKILL) or crashed. It failed before the ranks that then
   report a lost peer;
2. a rank that failed only because another did: it lost a peer, or its watchdog ended a
   stuck collective (its line says what the hang report says);
3. a rank the launcher stopped itself once another had failed (torch's agent logs each
   signal it sends; ``StoppedRanks`` keeps their process ids).

The exit code is the first rank's: its own, or 128+N when signal N killed it.

A clean stop is no failure: when every rank saved and stopped on a signal (exit code 130,
said in its error file), ``clean_stop`` names the rank the signal reached (not one that
stopped only because another did).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

PREFIX = "yatrain: error"
_OUTSIDE = (
    "it wrote no error line: something outside it ended it (the kernel's out-of-memory "
    "killer, the job scheduler or a user; `dmesg` says if it was memory)"
)


class StoppedRanks(logging.Handler):
    """The process ids torch's agent signalled while stopping ranks (from its log records,
    which are not printed)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.pids: set[int] = set()

    def emit(self, record: logging.LogRecord) -> None:
        text = str(record.msg)
        if ("closing signal" in text or "forcefully exiting" in text) and record.args:
            pid = record.args[0] if isinstance(record.args, tuple) else None
            if isinstance(pid, int):
                self.pids.add(pid)


def first_failed(failures: Mapping[int, ProcessFailure], stopped: set[int]) -> int:
    """The global rank that failed first (see the module docstring)."""

    def order(rank: int) -> tuple[int, float, int]:
        failure = failures[rank]
        data = error_data(failure)
        if failure.pid in stopped:
            tier = 3
        elif data is None:
            tier = 1
        else:
            tier = 2 if data.get("follows_another") else 0
        return tier, _written_at(failure), rank

    return min(failures, key=order)


STOPPED = 130  # a rank that saved and stopped on SIGTERM/SIGINT (cli.main's Interrupted)


def clean_stop(failures: Mapping[int, ProcessFailure], world: int) -> str | None:
    """One line when every rank that ended stopped cleanly on a signal, naming the rank it
    reached and its own line; None otherwise (a failure to summarise)."""
    said = {rank: error_data(failure) or {} for rank, failure in failures.items()}
    if not said or any(data.get("exitcode") != STOPPED for data in said.values()):
        return None
    rank = min(said, key=lambda r: (bool(said[r].get("follows_another")), r))
    return f"rank {rank} of {world} {said[rank].get('message')}"


def summary(
    failures: Mapping[int, ProcessFailure], world: int, log_dir: Path, stopped: set[int]
) -> tuple[list[str], int]:
    """Two lines (the first rank to fail, its error line and exit code; the ranks that
    stopped after it and where their logs are) and the launcher's exit code."""
    rank = first_failed(failures, stopped)
    first = failures[rank]
    data = error_data(first) or {}
    code = data.get("exitcode", first.exitcode)  # a rank stopped as it exited
    if not isinstance(code, int):
        code = first.exitcode
    if code < 0:
        how, code = f"killed by {_signal_name(-code)}", 128 - code
    else:
        how = f"exit code {code}"
    why = data.get("message") if isinstance(data.get("message"), str) else None
    if why is None:
        outside = first.exitcode == -signal.SIGKILL and first.pid not in stopped
        why = _OUTSIDE if outside else _last_line(log_dir, first.local_rank)
    after = ", ".join(str(r) for r in sorted(failures) if r != rank)
    logs = f"the other ranks' logs are in {log_dir}"
    return [
        f"{PREFIX}: rank {rank} of {world} failed ({how}): {why}",
        f"{PREFIX}: rank(s) {after} stopped after it; {logs}" if after else f"({logs})",
    ], code


def error_data(failure: ProcessFailure) -> dict | None:
    """What the rank wrote to its error file, or None when it wrote none (torch then
    fills in a placeholder)."""
    if not os.path.isfile(failure.error_file):
        return None
    data = failure.error_file_data
    return data if isinstance(data, dict) else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _written_at(failure: ProcessFailure) -> float:
    """When a rank wrote its error file (ns resolution); never, for one that wrote none."""
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
