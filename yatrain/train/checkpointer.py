"""A run's checkpoints: when to save (``due``), what goes in, and where the run resumes.

With ``checkpoint.async`` a save returns once the state is in host memory and is written in
the background (``checkpoint.background_save``); the next save, the end of the run and a
stop wait for it.

Finding the resume point is shared out: rank 0 runs the cheap checks of
``open_checkpoint`` (schema, sizes, safe metadata, model), then every rank verifies the
checksums of its share of the files, so a 70B checkpoint is read once, spread over the
ranks, and all ranks agree on the answer. With ``--resume auto`` a damaged checkpoint is
moved aside (``corrupt-step-N``) and the next older one is tried.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch.optim import Optimizer

from yatrain.checkpoint.background_save import AsyncSaver
from yatrain.checkpoint.manifest import (
    MANIFEST,
    RESUME_FIX,
    CheckpointError,
    CorruptCheckpoint,
    SavedCheckpoint,
    complete_checkpoints,
    open_checkpoint,
    verify_files,
)
from yatrain.checkpoint.store import (
    dcp_mesh,
    load_checkpoint,
    load_weights,
    move_aside,
    remove_stale_saves,
    save_checkpoint,
)
from yatrain.data import BatchLoader
from yatrain.recipe.config import ModelConfig, Recipe, recipe_to_dict, recipe_to_yaml
from yatrain.runtime.process import Runtime
from yatrain.sharding import ShardedEngine


class Checkpointer:
    """A run's checkpoints (see the module docstring). Collective like the saves
    themselves: every rank holds one and calls it at the same steps."""

    def __init__(
        self,
        recipe: Recipe,
        root: Path,
        engine: ShardedEngine,
        optimizer: Optimizer,
        loader: BatchLoader,
        runtime: Runtime,
        *,
        verify: bool = True,
    ) -> None:
        self.cfg, self.total_steps, self.model = recipe.checkpoint, recipe.train.steps, recipe.model
        self.root, self.engine, self.optimizer, self.loader = root, engine, optimizer, loader
        self.runtime, self.verify = runtime, verify
        self.meta = {
            "model": dataclasses.asdict(recipe.model),
            "recipe_sha256": hashlib.sha256(recipe_to_yaml(recipe).encode()).hexdigest(),
            "recipe": recipe_to_dict(recipe),  # for `yatrain eval`: its data, batches, dtype
            "dtype": recipe.train.dtype,
            "optimizer": recipe.optim.name,  # a resume with another is refused (restore)
        }
        self.mesh = dcp_mesh(runtime, engine)
        self.last: Path | None = None  # the newest checkpoint this run saved or resumed from
        self.stale: list[Path] = remove_stale_saves(root) if runtime.is_main else []
        self.saver = None
        if self.cfg.background:
            self.saver = AsyncSaver(runtime.device, self.mesh, runtime.timeout_s)

    def due(self, step: int, stop: bool = False) -> bool:
        """Save after this step? Every ``checkpoint.every`` steps, at the end, and when the
        run is stopping; never when checkpoints are off."""
        every = self.cfg.every
        periodic = bool(every) and step % every == 0
        return self.cfg.enabled and (periodic or step == self.total_steps or stop)

    def save(self, step: int, skipped_steps: int, *, wait: bool = False) -> Path | None:
        """Collective. Synchronous: save and return ``step-N``. Asynchronous: wait for the
        previous save, copy the state to host memory, return None while it is written in the
        background (its path, once complete, with ``wait``)."""
        meta = {
            **self.meta,
            "loader": self.loader.state_dict(),
            "tokens_seen": step * self.loader.tokens_per_step,
            "skipped_steps": skipped_steps,
        }
        is_main, keep, tokenizer = self.runtime.is_main, self.cfg.keep, self.loader.tokenizer_files
        if self.saver is None:
            self.last = save_checkpoint(
                self.root,
                step,
                self.engine,
                self.optimizer,
                self.mesh,
                meta,
                is_main=is_main,
                keep=keep,
                tokenizer_files=tokenizer,
            )
            return self.last
        self.wait()
        self.saver.save(
            self.root,
            step,
            self.engine,
            self.optimizer,
            meta,
            is_main=is_main,
            keep=keep,
            tokenizer_files=tokenizer,
        )
        return self.wait() if wait else None

    @property
    def writing(self) -> int | None:
        """The step of the checkpoint being written in the background, if any."""
        return self.saver.in_flight if self.saver is not None else None

    def wait(self) -> Path | None:
        """The checkpoint being written in the background, once complete (None if none);
        raises its failure (the same CheckpointError on every rank)."""
        if self.saver is None or self.saver.in_flight is None:
            return None
        self.last = self.saver.wait()
        return self.last

    def written(self) -> Path | None:
        """The background save, if it has finished without error since last asked (never
        blocks; a failure is left for ``wait`` to raise, at the same step on every rank)."""
        if self.saver is None or not self.saver.finished() or self.saver.failed():
            return None
        return self.wait()

    def close(self, say: Callable[[str], None]) -> None:
        """On any exit: let a background save complete (it holds a good state), then
        release its threads, buffers and process group. A failure is reported, not raised
        (the run is already ending for another reason)."""
        if self.saver is None:
            return
        step = self.saver.in_flight
        try:
            self.wait()
        except Exception as error:  # a full disk, a lost peer: the run is ending anyway
            say(f"warning: the checkpoint of step {step} was not completed: {error}")
        finally:
            self.saver.close()

    def restore(
        self, resume: str, say: Callable[[str], None], reset_optimizer: bool = False
    ) -> tuple[int, int]:
        """Continue as ``--resume`` says (auto, never, a path): load the engine, optimizer
        and data position; returns (step, skipped steps), (0, 0) for a fresh start. A
        checkpoint of another optimizer is refused, or with ``reset_optimizer`` loaded
        without its optimizer state (the same optimizer's state always loads: a restarted
        job passes the flag again)."""
        if self.stale:
            say(
                f"removed {len(self.stale)} unfinished save(s) of an earlier run: "
                + ", ".join(p.name for p in self.stale)
            )
        found = self._find(resume, say)
        if found is None:
            return 0, 0
        if "loader" not in found.manifest:
            raise CheckpointError(
                f"checkpoint {found.path} has no data position: it cannot be resumed; use "
                "train.init_from to start from its weights"
            )
        if self._other_optimizer(found, reset_optimizer, say):
            load_weights(found.path, self.engine, self.mesh)
        else:
            load_checkpoint(found.path, self.engine, self.optimizer, self.mesh)
        self.loader.load_state_dict(found.manifest["loader"])
        self.last = found.path
        return found.step, found.manifest.get("skipped_steps", 0)

    def _other_optimizer(
        self, found: SavedCheckpoint, reset: bool, say: Callable[[str], None]
    ) -> bool:
        """Was ``found`` trained with another optimizer (then ``reset`` or a refusal)?
        Checkpoints from before the manifest named it were AdamW's."""
        saved, mine = found.manifest.get("optimizer", "adamw"), self.meta["optimizer"]
        if saved == mine:
            return False
        if not reset:
            raise CheckpointError(
                f"checkpoint {found.path} was trained with optim.name {saved}, this run uses "
                f"{mine}: set optim.name: {saved}, or pass --reset-optimizer to start {mine}'s "
                "state afresh from its weights"
            )
        say(f"--reset-optimizer: {found.path.name} was trained with {saved}; {mine} starts afresh")
        return True

    def _find(self, resume: str, say: Callable[[str], None]) -> SavedCheckpoint | None:
        """The checkpoint to resume from; every rank gets the same answer or error. Damaged
        checkpoints newer than the one found are moved aside; when none is usable nothing is
        moved and the run stops (it never silently starts over)."""
        if resume == "never":
            return None
        auto = resume == "auto"
        candidates = [str(p) for p in complete_checkpoints(self.root)] if auto else [resume]
        skipped: list[tuple[Path, CheckpointError]] = []
        for path in map(Path, self.runtime.broadcast_object(candidates)):
            found, error = self._open(path)
            if error is None:
                for bad, why in skipped if self.runtime.is_main else []:
                    say(self._set_aside(bad, why))
                return found
            if not auto:
                raise error
            skipped.append((path, error))
        if skipped:  # the first reason, as its own kind (another model: a recipe problem)
            first = skipped[0][1]
            raise type(first)(f"no usable checkpoint in {self.root}: {first}")
        return None

    def _open(self, path: Path) -> tuple[SavedCheckpoint | None, CheckpointError | None]:
        return open_shared(path, self.runtime, self.model, verify=self.verify)

    def _set_aside(self, path: Path, error: CheckpointError) -> str:
        """Rank 0: move a damaged checkpoint out of the way; the line that says what
        happened."""
        if isinstance(error, CorruptCheckpoint):
            aside = move_aside(path)
            return (
                f"warning: skipping {path.name}: {error}; moved it to {aside.name} and falling "
                "back to an older checkpoint"
            )
        return f"warning: skipping {path.name}: {error}; falling back to an older checkpoint"


def open_shared(
    path: Path, runtime: Runtime, model: ModelConfig, *, verify: bool, fix: str = RESUME_FIX
) -> tuple[SavedCheckpoint | None, CheckpointError | None]:
    """``open_checkpoint`` for all ranks at once (collective): rank 0's cheap checks, then
    each rank's share of the checksums; (the checkpoint, None) or (None, the error)."""
    answer: object = None
    if runtime.is_main:
        try:
            answer = open_checkpoint(path, model, fix, verify=False)
        except CheckpointError as error:
            answer = error
    answer = runtime.broadcast_object(answer)
    if isinstance(answer, CheckpointError):
        return None, answer
    assert isinstance(answer, SavedCheckpoint)
    if verify:
        names = sorted(answer.manifest["files"])[runtime.rank :: runtime.world_size]
        try:
            verify_files(path, answer.manifest, names)
            mine = None
        except CheckpointError as error:
            mine = error
        errors = [mine]
        if runtime.distributed:
            errors = [None] * runtime.world_size
            dist.all_gather_object(errors, mine)
        if bad := next((e for e in errors if e is not None), None):
            return None, bad
    return answer, None


def verify_init_source(source: Path, runtime: Runtime, model: ModelConfig, verify: bool) -> bool:
    """Under torchrun, check a yatrain checkpoint named by ``train.init_from`` once, shared
    over the ranks; returns whether each rank must still verify it alone (a single process
    does, in ``open_checkpoint``)."""
    if not verify or not runtime.distributed or not (source / MANIFEST).is_file():
        return verify
    fix = "train.init_from needs a recipe with the checkpoint's model shape"
    _, error = open_shared(source, runtime, model, verify=True, fix=fix)
    if error is not None:
        raise error
    return False
