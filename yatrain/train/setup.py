"""Everything a run needs before its first step, built in data-flow order.

``setup`` reads as the list of what a run is made of: the fit check (will it fit this
device, by the planner), its data (and held-out data), its directory (locked: one run at a
time), the model and the engine that owns its weights, the optimizer, the point it resumes
from, its loggers and its meter. It returns them as one ``Run``, which the loop steps.
Everything that can refuse a run cheaply comes before anything is allocated or written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from yatrain.context_parallel.split import ContextParallel, data_rank
from yatrain.data import BatchLoader
from yatrain.data import build_loader as data_loader
from yatrain.errors import ConfigError
from yatrain.models.float8 import check_float8
from yatrain.output.loggers import Loggers
from yatrain.output.tensorboard_logger import require_tensorboard
from yatrain.plan import check_fit
from yatrain.recipe.checks import check_vocab
from yatrain.recipe.config import Recipe
from yatrain.recipe.topology import shard_group_size, validate_world_size
from yatrain.runtime.compile_cache import cache_for_run
from yatrain.runtime.hang import HangReporter, StackFile
from yatrain.runtime.process import Runtime, nccl_flight_recorder
from yatrain.runtime.watchdog import Watchdog
from yatrain.sharding import ShardedEngine
from yatrain.train.build import build_model_and_engine, checkpoint_layers
from yatrain.train.checkpointer import Checkpointer
from yatrain.train.evaluate import Evaluator, build_evaluator
from yatrain.train.metrics import StepMeter
from yatrain.train.optim import build_optimizer
from yatrain.train.profile import StepProfiler
from yatrain.train.rundir import RunDirLock, check_fresh_start_allowed, check_run_dir, run_dir_for

if TYPE_CHECKING:  # imported by a compiled run only (compile_watch)
    from yatrain.train.compile import CompileWatch


@dataclass(frozen=True)
class Checks:
    """What a run checks before and while it starts (the command line's switches)."""

    fit: bool = True  # refuse a run the planner says will not fit (--no-fit-check: off)
    verify: bool = True  # checkpoint checksums before a load (--no-verify: off)
    tensor_step: int | None = None  # on CPU, count live tensors during this step


@dataclass
class Run:
    """One training run as the loop sees it."""

    recipe: Recipe
    runtime: Runtime
    run_dir: Path
    loader: BatchLoader
    model: nn.Module
    engine: ShardedEngine
    optimizer: torch.optim.Optimizer
    checkpointer: Checkpointer
    loggers: Loggers
    meter: StepMeter
    profiler: StepProfiler
    evaluator: Evaluator
    lock: RunDirLock | None
    watchdog: Watchdog
    compiler: CompileWatch | None = None  # train.compile: counts and times compilations
    context: ContextParallel | None = None  # sharding.context_parallel > 1
    start_step: int = 0
    skipped_steps: int = 0
    step_number: int = field(default=0)  # the step being run (for messages)

    def close(self) -> None:
        """A background save completed, loggers closed, watchdog stopped, run directory
        unlocked (on any exit)."""
        if (writing := self.checkpointer.writing) is not None:
            self.watchdog.phase(f"the background write of checkpoint step-{writing}")
        self.checkpointer.close(self.loggers.say)
        self.watchdog.close()
        self.loggers.close()
        if self.compiler is not None:
            self.compiler.close()
        if self.lock is not None:
            self.lock.release()


def setup(
    recipe: Recipe,
    runtime: Runtime,
    *,
    recipe_name: str,
    run_dir: Path | None,
    resume: str,
    progress: bool,
    checks: Checks = Checks(),
) -> Run:
    """Build the run (see the module docstring); collective under torchrun."""
    loggers = Loggers(runtime, progress)
    layers = check_recipe(recipe, runtime, checks.fit, loggers.say)
    context = ContextParallel.of_recipe(recipe, runtime)
    loader, evaluator = build_inputs(recipe, runtime, loggers, context)
    run_dir, lock = claim_run_dir(runtime, resume, run_dir, recipe_name, recipe.checkpoint.dir)
    watchdog = Watchdog(recipe.train.collective_timeout_s, runtime.rank, runtime.distributed)
    checkpointer = compiler = None
    try:
        model, engine = build_model_and_engine(
            recipe, runtime, layers=layers, verify=checks.verify, say=loggers.say
        )
        compiler = compile_watch(recipe, run_dir)
        if context is not None:
            context.time_waits(engine.waits)
        optimizer = build_optimizer(engine.param_groups(recipe.optim.weight_decay), recipe.optim)
        checkpointer = Checkpointer(
            recipe,
            run_dir / recipe.checkpoint.dir,
            engine,
            optimizer,
            loader,
            runtime,
            verify=checks.verify,
        )
        start_step, skipped = checkpointer.restore(resume, loggers.say)
        loggers.open(run_dir, recipe, start_step)
        meter = StepMeter(recipe, runtime, loader.tokens_per_step, checks.tensor_step, engine)
        profiler = StepProfiler(
            recipe.train.profile, run_dir, runtime.rank, runtime.device, start_step, loggers.say
        )
        attach_hang_report(watchdog, runtime, run_dir, start_step, meter, engine)
        last = checkpointer.last
        where = f"resumed from {last} (step {start_step})" if last else "fresh start"
        layout = _layout(engine, context)
        loggers.say(
            f"run dir {run_dir} | {where} | world size {runtime.world_size}{layout} | "
            f"device {runtime.device} | wandb {loggers.wandb_mode} | peak FLOP/s "
            f"{meter.peak_flops / 1e12:.3g}T ({meter.peak_source})"
        )
        loggers.say(loader.describe(recipe.train.steps))
        for line in [evaluator.schedule(), *evaluator.short_notices()] if evaluator.enabled else []:
            loggers.say(line)
    except BaseException:
        abandon(checkpointer, watchdog, loggers, compiler, lock)
        raise
    parts = (loader, model, engine, optimizer, checkpointer, loggers, meter, profiler, evaluator)
    return Run(
        recipe, runtime, run_dir, *parts, lock, watchdog, compiler, context, start_step, skipped
    )


def check_recipe(recipe: Recipe, runtime: Runtime, fit: bool, say: Callable[[str], None]) -> int:
    """Everything that refuses a run before anything is allocated or written (the world and
    shard group sizes, TensorBoard, the fit, the compile backend, float8); returns the
    number of checkpointed layers (``auto`` resolved, its choice told to ``say``)."""
    validate_world_size(recipe, runtime.world_size)
    require_tensorboard(recipe)
    shard_group_size(recipe, runtime.world_size, runtime.local_world_size)
    layers = checkpoint_layers(recipe, runtime.world_size, runtime.device, say)
    if fit:
        check_fit(recipe, runtime.world_size, runtime.device, layers)
    if recipe.train.compile:
        from yatrain.train.compile import check_backend  # dynamo: only for a compiled run

        check_backend(recipe.train.compile_backend, runtime.device)
    check_float8(recipe.train.float8, runtime.device, recipe.model)
    return layers


def abandon(
    checkpointer: Checkpointer | None,
    watchdog: Watchdog,
    loggers: Loggers,
    compiler: CompileWatch | None,
    lock: RunDirLock | None,
) -> None:
    """After a failed start: nothing left half-open (a background save, a W&B run,
    metrics.jsonl, the watchdog, the compile watch, the run directory's lock)."""
    if checkpointer is not None:
        checkpointer.close(loggers.say)
    watchdog.close()
    loggers.close()
    if compiler is not None:
        compiler.close()
    if lock is not None:
        lock.release(started=False)


def compile_watch(recipe: Recipe, run_dir: Path) -> CompileWatch | None:
    """With ``train.compile`` (the layers are compiled by ``build_model_and_engine``): its
    compilations counted and timed, inductor's code in ``train.compile_cache`` or the
    private per-user cache, never in the run directory (runtime/compile_cache.py)."""
    if not recipe.train.compile:
        return None
    from yatrain.train.compile import CompileWatch  # dynamo: only for a compiled run

    cache = cache_for_run(recipe.train.compile_cache, run_dir)
    return CompileWatch(recipe.train.compile_backend, cache)


def attach_hang_report(
    watchdog: Watchdog,
    runtime: Runtime,
    run_dir: Path,
    start_step: int,
    meter: StepMeter,
    engine: ShardedEngine,
) -> None:
    """Under a watchdog: this rank's stack file, and its side of the hang report (through
    the job's store, when there is one): what it is doing is the watchdog's phase, the
    meter's part of the step and the engine's progress."""
    if not watchdog.active:
        return
    reporter = None
    if runtime.store is not None:

        def snapshot() -> dict:
            return {"doing": watchdog.current, "stage": meter.stage(), **engine.progress()}

        cuda = runtime.device.type == "cuda"
        reporter = HangReporter(
            runtime.store,
            runtime.rank,
            runtime.world_size,
            run_dir,
            f"{run_dir}@{start_step}",
            snapshot,
            grace_s=2 * watchdog.interval + 2,
            flight_recorder=nccl_flight_recorder() if cuda else None,
        )
    watchdog.attach(reporter, StackFile(run_dir, runtime.rank))


def _layout(engine: ShardedEngine, context: ContextParallel | None) -> str:
    """How the world is laid out, when it is not one shard group of data ranks."""
    parts = [f"{engine.replicas} replicas of shard groups of {engine.shard_size}"]
    parts = parts if engine.replicas > 1 else []
    if context is not None:
        parts.append(f"{engine.world_size // context.size} data x {context.size} context")
    return f" ({', '.join(parts)})" if parts else ""


def claim_run_dir(
    runtime: Runtime, resume: str, run_dir: Path | None, recipe_name: str, ckpt_dirname: str
) -> tuple[Path, RunDirLock | None]:
    """Rank 0 picks the run directory and locks it (and a checkpoint directory outside it);
    every rank gets the path, or the same one-line error (a file in the way, another run
    holding it or the checkpoint directory, a directory that is not a run)."""
    answer: object = None
    lock = None
    if runtime.is_main:
        try:
            path = run_dir_for(resume, run_dir, recipe_name, ckpt_dirname)
            check_run_dir(path)
            lock = RunDirLock(path, Path(ckpt_dirname))
            check_fresh_start_allowed(path, resume)
            answer = str(path)
        except ConfigError as error:
            if lock is not None:
                lock.release(started=False)
                lock = None
            answer = error
    answer = runtime.broadcast_object(answer)
    if isinstance(answer, ConfigError):
        raise answer
    return Path(answer), lock


def build_inputs(
    recipe: Recipe, runtime: Runtime, loggers: Loggers, context: ContextParallel | None
) -> tuple[BatchLoader, Evaluator]:
    """The training batches and the held-out data this rank reads (its CP group's)."""
    loader = build_loader(recipe, runtime, loggers, context)
    tokenizer = (loader.tokenizer_sha256, loader.bos_id, loader.eos_id)
    return loader, build_evaluator(recipe, runtime, tokenizer, context=context)


def build_loader(
    recipe: Recipe, runtime: Runtime, loggers: Loggers, context: ContextParallel | None = None
) -> BatchLoader:
    """This rank's view of the global batches (one directory or a mixture), checked against
    the model's vocabulary; a mixture's notices go to the console. Under ``context``
    parallelism the ranks of a CP group read one data rank's slice."""
    rank, ranks = data_rank(context, runtime.rank, runtime.world_size)
    loader = data_loader(
        recipe.data,
        seed=recipe.train.seed,
        rank=rank,
        world_size=ranks,
        notice=loggers.say if runtime.is_main else None,
    )
    check_vocab(recipe, loader.vocab_size)
    return loader
