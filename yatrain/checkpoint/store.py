"""Sharded, atomic, reshardable, checksummed checkpoints through ``torch.distributed.checkpoint``.

What is saved is the engine's own view of its state (``dcp_state``): the fp32 master
weights and AdamW moments as flat tensors under the engine's names, each rank contributing
its contiguous slice with its global offset. DCP records those offsets, so a checkpoint
loads at any world size, or in a single process (export, ``init_from``). No rank ever holds
the full model. Every DCP call goes through ``dcp_io``: each rank hashes its own files as
it writes them, and reading never unpickles anything but DCP's metadata.

A checkpoint is written to ``.tmp-step-N`` and renamed to ``step-N`` only after every rank
has finished and the manifest (sizes, checksums, model shape, loader position) is complete,
so a crash or a full disk mid-save leaves the previous checkpoints intact (a failed save
removes its ``.tmp-step-N``; one left by a killed run is removed at the next start).
``manifest.open_checkpoint`` is the one validation path. ``prune`` keeps the newest
``checkpoint.keep`` checkpoints that pass the cheap checks; a damaged one is moved aside as
``corrupt-step-N``, so it is never the newest and never the reason a good one is deleted.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.optim import Optimizer

from yatrain import __version__
from yatrain.checkpoint.checksums import copy_hashed
from yatrain.checkpoint.dcp_io import failure_message, load_alone, load_state, save_state
from yatrain.checkpoint.dcp_state import training_state, weights_state
from yatrain.checkpoint.files import fsync_dir, write_json_atomic
from yatrain.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    CorruptCheckpoint,
    SavedCheckpoint,
    check_files,
    complete_checkpoints,
    read_manifest,
)
from yatrain.checkpoint.optimizer_state import share_step_count
from yatrain.common import format_bytes
from yatrain.data import Tokenizer, load_tokenizer
from yatrain.runtime.process import Runtime
from yatrain.sharding import ShardedEngine, StateEntry

_T = TypeVar("_T")

# ---------------------------------------------------------------------- saving


def save_checkpoint(
    root: Path,
    step: int,
    engine: ShardedEngine,
    optimizer: Optimizer,
    mesh: DeviceMesh | None,
    meta: dict,
    *,
    is_main: bool,
    keep: int,
    tokenizer_files: Sequence[Path] = (),
) -> Path:
    """Collective: every rank calls it. Returns the final ``step-N`` directory.

    The tokenizer's files are copied in, so a checkpoint is self-contained for export. A
    failure (a full disk, a lost file system) is one CheckpointError on every rank, with
    ``.tmp-step-N`` removed and the earlier checkpoints untouched."""
    save = begin_save(
        root, step, engine, meta, is_main=is_main, keep=keep, tokenizer_files=tokenizer_files
    )
    records: dict[str, dict] | BaseException
    try:
        records = save_state(training_state(engine, optimizer, mesh), save.tmp)
    except (OSError, CheckpointException) as error:
        records = error
    return complete_save(save, records)


@dataclass(frozen=True)
class PendingSave:
    """A save whose shards are being written to ``tmp``: what completing it needs."""

    root: Path
    step: int
    tmp: Path
    manifest: dict
    keep: int
    tokenizer_files: tuple[Path, ...]
    is_main: bool

    @property
    def final(self) -> Path:
        return self.root / f"step-{self.step}"


def begin_save(
    root: Path,
    step: int,
    engine: ShardedEngine,
    meta: dict,
    *,
    is_main: bool,
    keep: int,
    tokenizer_files: Sequence[Path] = (),
) -> PendingSave:
    """Collective: an empty ``.tmp-step-N`` for every rank to write into, and what completing
    the save needs (synchronous and asynchronous saves alike)."""
    tmp = root / f".tmp-step-{step}"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    manifest = engine_manifest(engine, step, meta)
    return PendingSave(root, step, tmp, manifest, keep, tuple(tokenizer_files), is_main)


def engine_manifest(engine: ShardedEngine, step: int, meta: dict) -> dict:
    """The manifest of a checkpoint of ``engine`` at ``step`` (files added when complete)."""
    return {
        "format": FORMAT,
        "yatrain_version": __version__,
        "step": step,
        "world_size_at_save": engine.world_size,
        "unit_numels": [entry.numel for entry in engine.state_layout],
        **meta,
    }


def complete_save(
    save: PendingSave, records: dict | BaseException, group: dist.ProcessGroup | None = None
) -> Path:
    """Collective over ``group``, after every rank wrote its shards (``records``: the files
    it wrote, or why it could not): rank 0 writes the manifest, renames, prunes. Returns
    ``step-N``; raises the same CheckpointError on every rank when any part failed."""
    problem: str | None = None
    if isinstance(records, BaseException):  # DCP fails on every rank together
        if save.is_main:
            shutil.rmtree(save.tmp, ignore_errors=True)
        raise CheckpointError(save_failure(save, records))
    files = _gather_records(records, group)
    if save.is_main:
        try:
            _complete(save, files)
        except OSError as error:
            shutil.rmtree(save.tmp, ignore_errors=True)
            problem = save_failure(save, error)
    problem = _from_main(problem, group)
    if problem is not None:
        raise CheckpointError(problem)
    return save.final


def _complete(save: PendingSave, files: dict) -> None:
    """Rank 0, after every rank wrote its shards: tokenizer, manifest, rename, prune."""
    for file in save.tokenizer_files:
        files[file.name] = copy_hashed(file, save.tmp / file.name)
    manifest = {**save.manifest, "files": dict(sorted(files.items()))}
    write_json_atomic(save.tmp / MANIFEST, manifest)
    if save.final.exists():  # re-saving a step (e.g. after a restart): replace it only now
        shutil.rmtree(save.final)
    os.replace(save.tmp, save.final)
    fsync_dir(save.root)
    prune(save.root, save.keep, save.final)


def save_failure(save: PendingSave, error: BaseException) -> str:
    """The line a failed save ends the run with. A full disk is named as one, with what the
    checkpoint needs, even where torch reports it as a zip writer's position mismatch (the
    disk's error is then only the exception's context)."""
    disk = _os_error(error)
    if disk is not None and disk.errno in (errno.ENOSPC, errno.EDQUOT):
        need = 12 * sum(save.manifest["unit_numels"])  # fp32 masters and AdamW's two moments
        # The newest checkpoint stays until the next one is whole: at keep 1 no lower helps.
        fewer = " (or lower checkpoint.keep)" if save.keep > 1 else ""
        return (
            f"could not save checkpoint {save.final}: no space left on device at {save.root} "
            f"(needs about {format_bytes(need)}); nothing was kept of it: free space there"
            f"{fewer}, then resume with --resume auto"
        )
    return (
        f"could not save checkpoint {save.final}: {failure_message(error)}; nothing was kept "
        "of it: fix the file system, then resume with --resume auto"
    )


def _os_error(error: BaseException | None) -> OSError | None:
    """The first OSError in ``error``, its rank failures (DCP) or what it was raised during."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        if isinstance(current, CheckpointException):
            for _, failure in sorted(current.failures.items()):
                pending.append(failure[0] if isinstance(failure, tuple) else failure)
        pending += [current.__cause__, current.__context__]
    return None


def _gather_records(records: dict[str, dict], group: dist.ProcessGroup | None) -> dict[str, dict]:
    """Every rank's file entries, merged on rank 0 (collective over ``group``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return dict(records)
    main = dist.get_rank() == 0
    gathered: list = [None] * dist.get_world_size(group) if main else []
    dist.gather_object(records, gathered if main else None, dst=0, group=group)
    merged: dict[str, dict] = {}
    for table in gathered:
        merged.update(table or {})
    return merged


def _from_main(value: _T, group: dist.ProcessGroup | None) -> _T:
    """Rank 0's value on every rank (a collective that also serves as the save's barrier)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def prune(root: Path, keep: int, current: Path | None = None) -> None:
    """Keep the newest ``keep`` checkpoints that pass the cheap checks (manifest, sizes,
    safe metadata; ``current`` was just written and is trusted); move damaged ones aside
    as ``corrupt-step-N`` and delete the older good ones."""
    kept = 0
    for path in complete_checkpoints(root):
        if kept >= keep:
            if path.is_symlink():  # a link put there: removed, what it points to is not
                path.unlink()
            else:
                shutil.rmtree(path, ignore_errors=True)
            continue
        if path != current:
            try:
                check_files(path, read_manifest(path))
            except CorruptCheckpoint:
                move_aside(path)
                continue
        kept += 1


def move_aside(path: Path) -> Path:
    """Rename a damaged ``step-N`` to ``corrupt-step-N`` (kept for inspection, never
    loaded, never counted by ``checkpoint.keep``)."""
    target, number = path.with_name(f"corrupt-{path.name}"), 1
    while target.exists():
        number += 1
        target = path.with_name(f"corrupt-{path.name}-{number}")
    os.replace(path, target)
    return target


def remove_stale_saves(root: Path) -> list[Path]:
    """Delete the ``.tmp-step-N`` directories of saves that never finished (a killed run, a
    full disk); only while this run holds the run directory's lock."""
    stale = sorted(root.glob(".tmp-step-*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


# ---------------------------------------------------------------------- loading


def load_checkpoint(
    path: Path, engine: ShardedEngine, optimizer: Optimizer, mesh: DeviceMesh | None
) -> None:
    """Collective: fill the engine's shards and AdamW state from ``path`` at any world size."""
    _load(training_state(engine, optimizer, mesh), path)
    share_step_count(optimizer)
    engine.after_step()  # refresh gather inputs (bf16 copies) from the loaded masters


def load_weights(path: Path, engine: ShardedEngine, mesh: DeviceMesh | None) -> None:
    """Collective: fill only the engine's weight shards from ``path`` (evaluation: no
    optimizer), at any world size."""
    _load(weights_state(engine, mesh), path)
    engine.after_step()


def _load(state: dict, path: Path) -> None:
    try:
        load_state(state, path)
    except (Exception, CheckpointException) as error:  # DCP raises many types
        raise CheckpointError(
            f"could not load checkpoint {path}: {failure_message(error)}"
        ) from None


def read_weights(checkpoint: SavedCheckpoint, entry: StateEntry) -> dict[str, torch.Tensor]:
    """The fp32 parameters of one saved flat tensor, in this process alone, by name."""
    flat = torch.empty(entry.numel, dtype=torch.float32)
    try:
        load_alone({"model": {entry.key: flat}}, checkpoint.path)
    except (Exception, CheckpointException) as error:
        raise CheckpointError(
            f"could not read checkpoint {checkpoint.path}: {failure_message(error)}"
        ) from None
    return entry.split(flat)


def checkpoint_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer a checkpoint's run trained with (saved with it)."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if (path / name).is_file():
            return load_tokenizer(path / name)
    raise CheckpointError(
        f"checkpoint {path} holds no tokenizer (tokenizer.model or tokenizer.json): it was "
        "saved by an older yatrain; use a newer checkpoint"
    )


def iter_full_weights(checkpoint: SavedCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter in fp32, one saved flat tensor (a unit) in memory at a time."""
    for entry in checkpoint.layout:
        yield from read_weights(checkpoint, entry).items()


def dcp_mesh(runtime: Runtime, engine: ShardedEngine | None = None) -> DeviceMesh | None:
    """The mesh DCP shards over: the engine's (hybrid sharding), else one dimension over
    the world; None in a single process."""
    if not runtime.distributed:
        return None
    if engine is not None and engine.mesh is not None:
        return engine.mesh
    return init_device_mesh(runtime.device.type, (runtime.world_size,))


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
