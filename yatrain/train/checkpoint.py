"""Sharded, atomic, reshardable checkpoints through ``torch.distributed.checkpoint``.

Each unit's flat weights (and its AdamW moments) are saved as one 1-D tensor of the unit's
real length, each rank contributing its contiguous slice. The engine's shards follow
``torch.chunk`` boundaries, so every slice is exactly the local piece of a DTensor sharded
on dim 0: DCP records global offsets and can load the checkpoint at any world size, or in a
single process with no process group at all (export). No rank ever holds the full model.

A checkpoint is written to ``.tmp-step-N`` and renamed to ``step-N`` only after every rank
has finished and the manifest (sizes, checksums, model shape, loader position) is complete,
so a crash mid-save leaves the previous checkpoint intact. Discovery ignores anything that
is not a complete ``step-N`` directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from yatrain import __version__
from yatrain.config import ModelConfig
from yatrain.errors import YatrainError

MANIFEST = "yatrain-checkpoint.json"
FORMAT = "yatrain-checkpoint-v1"
_CHECKSUM_MAX_BYTES = 2 * 2**30  # above this, sizes only: hashing would dominate save time


class CheckpointError(YatrainError):
    """A checkpoint is missing, incomplete, corrupt or belongs to another model."""


# ---------------------------------------------------------------------- state <-> tensors


def _distributed_tensor(local: torch.Tensor, numel: int, mesh):
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,)
    )


def training_state(engine, optimizer, mesh) -> dict:
    """Views of the engine's shards and AdamW moments, wrapped for DCP (no copies)."""
    ensure_optimizer_state(engine, optimizer)
    state: dict = {}
    tensors = {"model": (engine.flat_param, engine.small_param)}
    for moment in ("exp_avg", "exp_avg_sq"):
        tensors[moment] = (
            optimizer.state[engine.flat_param][moment],
            optimizer.state[engine.small_param][moment],
        )
    for group, (flat, small) in tensors.items():
        state[group] = {
            name: _distributed_tensor(local, numel, mesh)
            for name, (local, numel) in engine.local_pieces(flat, small).items()
        }
    state["adam_step"] = optimizer.state[engine.flat_param]["step"]
    # No RNG state: nothing in training draws from a global generator (init uses per-unit
    # generators, the data order its own seeded permutation, and there is no dropout), so
    # there is nothing to restore. tests/test_checkpoint.py reseeds the global RNG between
    # the halves of a resumed run to keep it that way.
    return state


def ensure_optimizer_state(engine, optimizer) -> None:
    """Create AdamW's state the way its first step would, so a load has tensors to fill."""
    for param in (engine.flat_param, engine.small_param):
        if not optimizer.state[param]:
            optimizer.state[param] = {
                "step": torch.zeros((), dtype=torch.float32, device=param.device),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }


def _sync_adam_step(engine, optimizer) -> None:
    """Both groups share one step count; DCP restored the flat group's."""
    step = optimizer.state[engine.flat_param]["step"]
    optimizer.state[engine.small_param]["step"].copy_(step)


# ---------------------------------------------------------------------- saving


def save_checkpoint(
    root: Path,
    step: int,
    engine,
    optimizer,
    mesh,
    meta: dict,
    *,
    is_main: bool,
    keep: int,
    tokenizer_files: Sequence[Path] = (),
) -> Path:
    """Collective: every rank calls it. Returns the final ``step-N`` directory.

    The tokenizer's files are copied in, so a checkpoint is self-contained for export."""
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # re-saving a step (e.g. after a restart)
    _barrier()
    dcp.save(training_state(engine, optimizer, mesh), checkpoint_id=str(tmp))
    _barrier()
    if is_main:
        for file in tokenizer_files:
            shutil.copyfile(file, tmp / file.name)
        files = {}
        for path in sorted(tmp.iterdir()):
            files[path.name] = {"bytes": path.stat().st_size}
        total = sum(f["bytes"] for f in files.values())
        if total <= _CHECKSUM_MAX_BYTES:
            for name in files:
                files[name]["crc32"] = _crc32(tmp / name)
        manifest = {
            "format": FORMAT,
            "yatrain_version": __version__,
            "step": step,
            "world_size_at_save": engine.world_size,
            "unit_numels": engine.unit_numels,
            "files": files,
            **meta,
        }
        _write_json_atomic(tmp / MANIFEST, manifest)
        os.replace(tmp, final)
        _fsync_dir(root)
        _prune(root, keep)
    _barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    for old in complete_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)


# ---------------------------------------------------------------------- finding and checking


def complete_checkpoints(root: Path) -> list[Path]:
    """``step-N`` directories with a manifest, newest first."""
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        suffix = path.name.removeprefix("step-")
        if suffix.isdigit() and (path / MANIFEST).is_file():
            found.append((int(suffix), path))
    return [p for _, p in sorted(found, reverse=True)]


def validate_checkpoint(path: Path, model: ModelConfig, unit_numels: list[int]) -> dict:
    """The manifest if the checkpoint is complete and fits this model; else CheckpointError."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} is not a complete yatrain checkpoint (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{manifest_path} is unreadable ({error})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: unknown format {manifest.get('format')!r}")
    for name, expect in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        if file.stat().st_size != expect["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} has {file.stat().st_size} bytes, "
                f"the manifest says {expect['bytes']} (truncated or replaced)"
            )
        if "crc32" in expect and _crc32(file) != expect["crc32"]:
            raise CheckpointError(f"checkpoint {path}: {name} is corrupt (checksum mismatch)")
    saved_model = manifest.get("model", {})
    current = dataclasses.asdict(model)
    differs = [k for k in current if saved_model.get(k) != current[k]]
    if differs or manifest.get("unit_numels") != unit_numels:
        detail = ", ".join(f"model.{k} {saved_model.get(k)} -> {current[k]}" for k in differs)
        raise CheckpointError(
            f"checkpoint {path} was saved for a different model ({detail or 'layout differs'}): "
            "resume it with its own recipe, or start a new --run-dir"
        )
    return manifest


def find_resume_checkpoint(
    root: Path, model: ModelConfig, unit_numels: list[int], say
) -> tuple[Path, dict] | None:
    """``--resume auto``: the newest good checkpoint, skipping (and reporting) bad ones."""
    candidates = complete_checkpoints(root)
    first_error = None
    for path in candidates:
        try:
            return path, validate_checkpoint(path, model, unit_numels)
        except CheckpointError as error:
            first_error = first_error or error
            say(f"warning: skipping {path.name}: {error}; falling back to an older checkpoint")
    if first_error is not None:
        raise CheckpointError(f"no usable checkpoint in {root}: {first_error}")
    return None


# ---------------------------------------------------------------------- loading


def load_checkpoint(path: Path, engine, optimizer, mesh) -> None:
    """Collective: fill the engine's shards and AdamW state from ``path`` at any world size."""
    state = training_state(engine, optimizer, mesh)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as error:  # DCP raises many types for unreadable files
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"could not load checkpoint {path}: {first[:300]}") from None
    _sync_adam_step(engine, optimizer)
    engine.after_step()  # refresh gather inputs (bf16 copies) from the loaded masters


def iter_full_weights(path: Path, layouts, small) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter in fp32 from a checkpoint, in one process, one unit at a time."""
    names = [f"unit.{i}" for i in range(len(layouts))] + ["small"]
    for name, layout in zip(names, [*layouts, small], strict=True):
        flat = torch.empty(layout.numel, dtype=torch.float32)
        dcp.load({"model": {name: flat}}, checkpoint_id=str(path), no_dist=True)
        for slot, view in zip(layout.slots, layout.views(flat), strict=True):
            yield slot.name, view


# ---------------------------------------------------------------------- small helpers


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _crc32(path: Path) -> int:
    value = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            value = zlib.crc32(chunk, value)
    return value


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
