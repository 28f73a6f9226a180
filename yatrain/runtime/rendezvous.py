"""Where the nodes of a job meet (``--rdzv-endpoint HOST:PORT``), checked before torch waits.

Torch's c10d rendezvous waits in C++ for what it cannot reach, without a word: an
unresolvable host is retried for minutes (with C++ stack frames on stderr), and a port held
by a program that accepts connections but is not torch's store blocks it forever. So the
launcher first checks the endpoint: the host resolves (else one line); when the port is free
on this machine, torch hosts the store there; when something listens, it must answer as
torch's store within a few seconds (else the port is held by another program: one line);
when nothing listens yet (the first node is not up), it waits, bounded by the rendezvous
timeout. The launcher says what it waits for and how long (``waiting_line``) and a failed
rendezvous ends with one line (``failure_line``).
"""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
)

from yatrain.errors import ConfigError, TrainingError

DEFAULT_PORT = 29400  # torch's c10d default, when HOST comes without a port
STORE_ANSWER_S = 10.0  # what listens at the endpoint must answer as torch's store by then
_POLL_S = 0.5  # between looks at an endpoint where nothing listens yet
_ENDPOINT = re.compile(
    r"(?:\[(?P<v6>[0-9A-Fa-f:.]{2,45})\]|(?P<host>[A-Za-z0-9][A-Za-z0-9._-]{0,252}))"
    r"(?::(?P<port>[0-9]{1,5}))?"
)


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """``HOST:PORT`` (``[IPv6]:PORT``; HOST alone: torch's port 29400), or one line."""
    match = _ENDPOINT.fullmatch(text)
    port = int(match["port"]) if match and match["port"] else DEFAULT_PORT
    if match is None or not 1 <= port <= 65535:
        shown = text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"
        raise ConfigError(
            f"--rdzv-endpoint {shown!r}: pass HOST:PORT, a host name or IP address of the first "
            "node and a port from 1 to 65535 (e.g. node01:29500)"
        )
    return Endpoint(match["v6"] or match["host"], port)


def reach(endpoint: Endpoint, timeout_s: float, waiting: Callable[[], None]) -> None:
    """Return once torch can join (or host) the rendezvous at ``endpoint``; one line when
    it cannot: the host does not resolve, the port is held by another program, or nothing
    listens there within ``timeout_s``. ``waiting`` is called once if it has to wait."""
    deadline = time.monotonic() + timeout_s
    address = _resolve(endpoint)
    announced = False
    while True:
        left = deadline - time.monotonic()
        if _listening(address, min(2.0, max(left, 0.1))):
            return _answers_as_store(endpoint, min(STORE_ANSWER_S, max(left, 1.0)))
        if _local(address):
            if _free_here(endpoint.port):
                return  # torch's launcher hosts the store on this machine
            raise ConfigError(_held(endpoint, "it is bound but does not accept connections"))
        if left <= 0:
            raise TrainingError(
                f"nothing answered at --rdzv-endpoint {endpoint} within {timeout_s:.0f} s (the "
                "rendezvous timeout): start the job on the node at that address first, check "
                "the port is open between the nodes, or allow longer with --rdzv-timeout"
            )
        if not announced:
            waiting()
            announced = True
        time.sleep(_POLL_S)


def _resolve(endpoint: Endpoint) -> tuple:
    try:
        found = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        why = getattr(error, "strerror", None) or str(error)
        raise ConfigError(
            f"--rdzv-endpoint {endpoint}: cannot resolve the host {endpoint.host!r} ({why}): "
            "pass the first node's host name or IP address, as the other nodes reach it"
        ) from None
    family, _, _, _, sockaddr = found[0]
    return family, sockaddr


def _listening(address: tuple, seconds: float) -> bool:
    family, sockaddr = address
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(seconds)
        return probe.connect_ex(sockaddr) == 0


def _local(address: tuple) -> bool:
    """Is the address one of this machine's (can a socket be bound to it)?"""
    family, sockaddr = address
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((sockaddr[0], 0))
        except OSError:
            return False
    return True


def _free_here(port: int) -> bool:
    """Can torch's store listen on ``port`` here (on every address, as it does)?"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _answers_as_store(endpoint: Endpoint, seconds: float) -> None:
    """What listens at ``endpoint`` answers as torch's store within ``seconds``, or one
    line. Asked in a child process: torch's client waits forever on a program that accepts
    and never answers, and prints C++ stack frames on one that answers something else."""
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "FATAL"}
    args = [endpoint.host, str(endpoint.port), f"{seconds:g}"]
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _STORE_PROBE, *args],
            env=env,
            capture_output=True,
            timeout=seconds + _IMPORT_S,
        )
        answered = probe.returncode == 0
    except subprocess.TimeoutExpired:
        answered = False
    if not answered:
        why = f"it accepts connections but did not answer as torch's store within {seconds:.0f} s"
        raise ConfigError(_held(endpoint, why))


# The child: torch's store client in a thread, given ``seconds`` once torch is imported.
_STORE_PROBE = """
import datetime, os, sys, threading, time
import torch.distributed as dist
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
answered = threading.Event()
def connect():
    dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=seconds))
    answered.set()
threading.Thread(target=connect, daemon=True).start()
os._exit(0 if answered.wait(seconds + 1) else 1)
"""
_IMPORT_S = 120.0  # the child's own start (importing torch) on a busy machine


def _held(endpoint: Endpoint, why: str) -> str:
    return (
        f"--rdzv-endpoint {endpoint}: the port is held by another program ({why}): pick a "
        "free port, the same on every node"
    )


def waiting_line(endpoint: Endpoint, low: int, high: int, run_id: str, timeout_s: int) -> str:
    """What the launcher waits for, where, and how long (printed before it waits)."""
    if high == 1:
        return (
            f"yatrain: waiting for the rendezvous at {endpoint} to answer (job {run_id}), "
            f"rendezvous timeout {timeout_s} s"
        )
    if low == high:
        nodes = f"{low - 1} more of {low} nodes"
    else:
        nodes = f"{max(low - 1, 0)} to {high - 1} more of {low} to {high} nodes"
    return (
        f"yatrain: waiting for {nodes} at {endpoint} (job {run_id}), rendezvous timeout "
        f"{timeout_s} s"
    )


def failure_line(
    error: RendezvousError, endpoint: Endpoint, nnodes: str, run_id: str, timeout_s: int
) -> str:
    """The one line of a rendezvous that failed."""
    if isinstance(error, RendezvousTimeoutError):
        return (
            f"not all nodes joined the rendezvous at {endpoint} within {timeout_s} s (--nnodes "
            f"{nnodes}, job {run_id}): start the same command on every node (same "
            "--rdzv-endpoint and --rdzv-id), or allow longer with --rdzv-timeout"
        )
    if isinstance(error, RendezvousClosedError):
        return (
            f"the rendezvous of job {run_id} at {endpoint} is closed (a job with this "
            "--rdzv-id has ended): pass a new --rdzv-id"
        )
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return (
        f"lost the rendezvous at {endpoint} ({first}): the node hosting it stopped or cannot "
        "be reached; start the job again on every node"
    )
