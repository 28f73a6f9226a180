"""Sharded, atomic, reshardable checkpoints through ``torch.distributed.checkpoint``.

What is saved is the engine's own view of its state (``ShardedEngine.sharded_state``): the
fp32 master weights and AdamW moments as flat tensors under the engine's names, each rank
contributing its contiguous slice with its global offset. DCP records those offsets, so a
checkpoint loads at any world size, or in a single process with no process group at all
(export, ``init_from``). No rank ever holds the full model.

A checkpoint is written to ``.tmp-step-N`` and renamed to ``step-N`` only after every rank
has finished and the manifest (sizes, checksums, model shape, loader position) is complete,
so a crash mid-save leaves the previous checkpoint intact. Discovery ignores anything that
is not a complete ``step-N`` directory; ``manifest.open_checkpoint`` is the one validation
path for resume, export and ``init_from``. ``Checkpointer`` is a run's view of all this:
when to save (``due``), what goes in, where to resume from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from yatrain import __version__
from yatrain.config import ModelConfig, Recipe, recipe_to_dict, recipe_to_yaml
from yatrain.data import BatchLoader, Tokenizer, load_tokenizer
from yatrain.sharding import ShardedEngine, ShardView, StateEntry
from yatrain.train.files import fsync_dir, write_json_atomic
from yatrain.train.manifest import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    SavedCheckpoint,
    complete_checkpoints,
    file_table,
    open_checkpoint,
)
from yatrain.train.optim import ensure_state, share_step_count, step_count
from yatrain.train.runtime import Runtime

# ---------------------------------------------------------------------- state <-> tensors


def _for_dcp(view: ShardView, mesh: DeviceMesh | None) -> torch.Tensor:
    """A rank's piece as DCP sees it: a dim-0 sharded DTensor, or the whole tensor alone."""
    if mesh is None:
        return view.local
    shape = torch.Size([view.numel])
    return DTensor.from_local(view.local, mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=(1,))  # fmt: skip


def training_state(engine: ShardedEngine, optimizer: Optimizer, mesh: DeviceMesh | None) -> dict:
    """Views of the engine's shards and AdamW moments, wrapped for DCP (no copies)."""
    ensure_state(optimizer)
    state: dict = {
        group: {key: _for_dcp(view, mesh) for key, view in views.items()}
        for group, views in engine.sharded_state(optimizer).items()
    }
    state["adam_step"] = step_count(optimizer)
    # No RNG state: nothing in training draws from a global generator (init uses per-unit
    # generators, the data order its own seeded permutation, and there is no dropout), so
    # there is nothing to restore. tests/test_checkpoint.py reseeds the global RNG between
    # the halves of a resumed run to keep it that way.
    return state


# ---------------------------------------------------------------------- saving


def save_checkpoint(
    root: Path, step: int, engine: ShardedEngine, optimizer: Optimizer,
    mesh: DeviceMesh | None, meta: dict, *,
    is_main: bool, keep: int, tokenizer_files: Sequence[Path] = (),
) -> Path:  # fmt: skip
    """Collective: every rank calls it. Returns the final ``step-N`` directory.

    The tokenizer's files are copied in, so a checkpoint is self-contained for export."""
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # re-saving a step (e.g. after a restart)
    _barrier()
    with _single_process_is_intended():
        dcp.save(training_state(engine, optimizer, mesh), checkpoint_id=str(tmp))
    _barrier()
    if is_main:
        for file in tokenizer_files:
            shutil.copyfile(file, tmp / file.name)
        manifest = {
            "format": FORMAT,
            "yatrain_version": __version__,
            "step": step,
            "world_size_at_save": engine.world_size,
            "unit_numels": [entry.numel for entry in engine.state_layout],
            "files": file_table(tmp),
            **meta,
        }
        write_json_atomic(tmp / MANIFEST, manifest)
        os.replace(tmp, final)
        fsync_dir(root)
        _prune(root, keep)
    _barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    for old in complete_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)


# ---------------------------------------------------------------------- finding and checking


def find_resume_checkpoint(
    root: Path, model: ModelConfig, say: Callable[[str], None]
) -> SavedCheckpoint | None:
    """``--resume auto``: the newest good checkpoint, skipping (and reporting) bad ones."""
    first_error = None
    for path in complete_checkpoints(root):
        try:
            return open_checkpoint(path, model)
        except CheckpointError as error:
            first_error = first_error or error
            say(f"warning: skipping {path.name}: {error}; falling back to an older checkpoint")
    if first_error is not None:
        raise CheckpointError(f"no usable checkpoint in {root}: {first_error}")
    return None


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
    views = engine.sharded_state()["model"]
    _load({"model": {key: _for_dcp(view, mesh) for key, view in views.items()}}, path)
    engine.after_step()


def _load(state: dict, path: Path) -> None:
    try:
        with _single_process_is_intended():
            dcp.load(state, checkpoint_id=str(path))
    except Exception as error:  # DCP raises many types for unreadable files
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"could not load checkpoint {path}: {first[:300]}") from None


def read_weights(checkpoint: SavedCheckpoint, entry: StateEntry) -> dict[str, torch.Tensor]:
    """The fp32 parameters of one saved flat tensor, in one process, by name."""
    flat = torch.empty(entry.numel, dtype=torch.float32)
    with _single_process_is_intended():
        dcp.load({"model": {entry.key: flat}}, checkpoint_id=str(checkpoint.path), no_dist=True)
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


# ---------------------------------------------------------------------- the run's checkpoints


class Checkpointer:
    """A run's checkpoints: when to save (``due``), what goes in, and where a run resumes.

    Collective like the saves themselves: every rank holds one and calls it at the same
    steps."""

    def __init__(
        self, recipe: Recipe, root: Path, engine: ShardedEngine, optimizer: Optimizer,
        loader: BatchLoader,
        runtime: Runtime,
    ) -> None:  # fmt: skip
        self.cfg, self.total_steps, self.model = recipe.checkpoint, recipe.train.steps, recipe.model
        self.root, self.engine, self.optimizer, self.loader = root, engine, optimizer, loader
        self.runtime = runtime
        self.meta = {
            "model": dataclasses.asdict(recipe.model),
            "recipe_sha256": hashlib.sha256(recipe_to_yaml(recipe).encode()).hexdigest(),
            "recipe": recipe_to_dict(recipe),  # for `yatrain eval`: its data, batches, dtype
            "dtype": recipe.train.dtype,
        }
        self.mesh = dcp_mesh(runtime)
        self.last: Path | None = None  # the newest checkpoint this run saved or resumed from

    def due(self, step: int, stop: bool = False) -> bool:
        """Save after this step? Every ``checkpoint.every`` steps, at the end, and when the
        run is stopping; never when checkpoints are off."""
        every = self.cfg.every
        periodic = bool(every) and step % every == 0
        return self.cfg.enabled and (periodic or step == self.total_steps or stop)

    def save(self, step: int, skipped_steps: int) -> Path:
        meta = {
            **self.meta,
            "loader": self.loader.state_dict(),
            "tokens_seen": step * self.loader.tokens_per_step,
            "skipped_steps": skipped_steps,
        }
        self.last = save_checkpoint(
            self.root, step, self.engine, self.optimizer, self.mesh, meta,
            is_main=self.runtime.is_main, keep=self.cfg.keep,
            tokenizer_files=self.loader.tokenizer_files,
        )  # fmt: skip
        return self.last

    def restore(self, resume: str, say: Callable[[str], None]) -> tuple[int, int]:
        """Continue as ``--resume`` says (auto, never, a path): load the engine, optimizer
        and data position; returns (step, skipped steps), (0, 0) for a fresh start."""
        found = self._find(resume, say)
        if found is None:
            return 0, 0
        load_checkpoint(found.path, self.engine, self.optimizer, self.mesh)
        self.loader.load_state_dict(found.manifest["loader"])
        self.last = found.path
        return found.step, found.manifest.get("skipped_steps", 0)

    def _find(self, resume: str, say: Callable[[str], None]) -> SavedCheckpoint | None:
        """Rank 0 inspects the files and decides; every rank gets the same answer or error."""
        answer: object = None
        if self.runtime.is_main and resume != "never":
            try:
                if resume == "auto":
                    answer = find_resume_checkpoint(self.root, self.model, say)
                else:
                    answer = open_checkpoint(Path(resume), self.model)
            except CheckpointError as error:
                answer = str(error)
        answer = self.runtime.broadcast_object(answer)
        if isinstance(answer, str):
            raise CheckpointError(answer)
        return answer


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """DCP warns on every save and load without a process group; one process is a normal
    case here (world size 1, export, generation), and a normal run prints no warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_mesh(runtime: Runtime) -> DeviceMesh | None:
    """The one-dimensional mesh DCP shards over; None in a single process."""
    if not runtime.distributed:
        return None
    return init_device_mesh(runtime.device.type, (runtime.world_size,))


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
