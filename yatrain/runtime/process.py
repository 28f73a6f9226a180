"""Process-level setup: which rank am I, on which device, and a clean shutdown.

One process needs no process group at all. Under ``torchrun`` the environment names the
rank and world size; NCCL is used on GPUs and gloo on CPUs. The group is always destroyed
on the way out, also after an error, so no rank hangs at exit.

Those variables are checked before torch reads them (``launch_environment``): a number that
is not one, or ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` left in the shell of a command that no
launcher started (no torchrun, no ``MASTER_ADDR``/``MASTER_PORT``), is one line saying
what to unset, not torch's rendezvous traceback (or a wait for ranks that never come).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from yatrain.errors import ConfigError
from yatrain.runtime.launcher_link import launched

LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_MAX_DIGITS = 9  # a world of fewer than a billion ranks
FIX = "fix the launcher's command, or unset them if no launcher started yatrain"


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool = False  # created here, so destroyed here (not when a caller made it)
    timeout_s: float = 600.0  # collectives' timeout (groups made later, such as the saves')
    # The job's key-value store (torchrun's agent store, else the one rank 0 hosts for the
    # rendezvous), under a prefix of ours: hang reports go through it, not a collective.
    store: dist.Store | None = None

    @classmethod
    def of_caller_group(cls, device: torch.device) -> Runtime:
        """This process's place in the process group its caller made (the ranks of a
        benchmark), or alone without one: no rendezvous, no store, the group not ours."""
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank, world_size = 0, 1
        return cls(rank=rank, world_size=world_size, local_rank=rank, device=device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def local_world_size(self) -> int:
        """Ranks on this node (torchrun's LOCAL_WORLD_SIZE); all of them without torchrun."""
        return launch_environment().get("LOCAL_WORLD_SIZE", self.world_size)

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def broadcast_object(self, obj):
        """Rank 0's value everywhere (e.g. a run directory chosen by the clock)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def shutdown(self) -> None:
        if self.owns_group and self.distributed:
            dist.destroy_process_group()


def launched_world_size() -> int:
    """The world size torchrun launched this process into (1 outside torchrun), read
    before any process group exists; one line when the variables are stale or malformed
    (``launch_environment``)."""
    return launch_environment().get("WORLD_SIZE", 1)


def launch_environment() -> dict[str, int]:
    """The launcher's variables that are set (``LAUNCH_VARIABLES``), as numbers; one line
    when one is not a whole number, when the world is empty or the rank outside it, or when
    they place this process in a world of several ranks that no launcher started."""
    found = {}
    for name in LAUNCH_VARIABLES:
        text = os.environ.get(name)
        if text is None:
            continue
        if not (text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS):
            shown = repr(text if len(text) <= 20 else text[:20] + "...")
            raise ConfigError(
                f"{name}={shown} in the environment is not a whole number: unset {name} if no "
                "launcher started yatrain, or fix the launcher's command"
            )
        found[name] = int(text)
    shown = ", ".join(f"{name}={value}" for name, value in found.items())
    if found.get("WORLD_SIZE", 1) < 1:
        raise ConfigError(f"WORLD_SIZE=0 in the environment: a world has at least 1 rank; {FIX}")
    world, rank = found.get("WORLD_SIZE", 1), found.get("RANK", 0)
    if (world > 1 or rank > 0 or found.get("LOCAL_RANK", 0) > 0) and not launched():
        raise ConfigError(
            f"{shown} is set in the environment, but no launcher started this process (no "
            f"torchrun, no MASTER_ADDR/MASTER_PORT): unset {' '.join(found)} (left over from "
            "another job), or start the ranks with `yatrain pretrain --nproc-per-node N` or "
            "torchrun"
        )
    if rank >= world:
        raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={world} in the environment; {FIX}")
    return found


def elastic_run_id() -> str | None:
    """torchrun's job id (``--rdzv-id``), the same for every rank and restart of a job;
    None outside torchrun (or its placeholder ``none``)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id in (None, "", "none") else run_id


def init_runtime(timeout_s: float = 600.0, *, single_rank_group: bool = False) -> Runtime:
    """Join the torchrun job if there is one (or use the caller's process group); pick
    cuda:LOCAL_RANK when a GPU is present. ``single_rank_group``: one process gets a
    process group of its own too (``sharding.force_process_group``; asynchronous checkpoints
    write over one)."""
    if dist.is_available() and dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    else:
        named = launch_environment()
        world_size, rank = named.get("WORLD_SIZE", 1), named.get("RANK", 0)
        local_rank = named.get("LOCAL_RANK", 0)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    owns = False
    if (world_size > 1 or single_rank_group) and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        store = _elastic_store(world_size, timeout)
        if store is None and world_size == 1 and "MASTER_ADDR" not in os.environ:
            store = dist.HashStore()  # one rank, no rendezvous to join
        if store is not None:
            kwargs.update(store=store, rank=rank, world_size=world_size)
        if device.type == "cuda":
            nccl_flight_recorder()
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        owns = True
        if world_size > 1 and store is not None:  # the agent's
            return Runtime(rank, world_size, local_rank, device, owns, timeout_s, store)
    kv = _rendezvous_store() if world_size > 1 and dist.is_initialized() else None
    return Runtime(rank, world_size, local_rank, device, owns, timeout_s, kv)


# NCCL's flight recorder (the last collectives of every rank, dumped when NCCL times out or
# fails): on unless the job sets these itself; where the dumps go (a prefix + the rank).
FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
FLIGHT_RECORDER_FILES = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
FLIGHT_RECORDER_DEFAULT = "/tmp/nccl_trace_rank_"  # NCCL's own default prefix


def nccl_flight_recorder() -> str:
    """Turn on NCCL's flight recorder (before the process group exists); returns the prefix
    of its dump files."""
    for key, value in FLIGHT_RECORDER.items():
        os.environ.setdefault(key, value)
    return os.environ.get(FLIGHT_RECORDER_FILES, FLIGHT_RECORDER_DEFAULT)


def _rendezvous_store() -> dist.Store | None:
    """Without torchrun's agent: a client of the store rank 0 hosts for the rendezvous
    (``MASTER_ADDR``:``MASTER_PORT``), the one the process group was built on."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    return dist.PrefixStore("yatrain", client)


def _elastic_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """Under torchrun's agent store, a key space of our own for each restart attempt.

    The agent's store can outlive a failed attempt; the process group's rendezvous keys
    (each rank's address) would then still hold the dead workers' addresses, and a
    restarted rank can read one before it is overwritten and wait on a dead peer. A prefix
    with the restart count makes every attempt start from empty keys."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"yatrain/attempt_{attempt}", agent)
