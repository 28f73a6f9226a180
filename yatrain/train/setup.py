"""Everything a run needs before its first step, built in data-flow order.

``setup`` reads as the list of what a run is made of: the fit check (will it fit this
device, by the planner), its data (and held-out data), its directory (locked: one run at a
time), the model and the engine that owns its weights, the optimizer, the point it resumes
from, its loggers and its meter. It returns them as one ``Run``, which the loop steps.
Everything that can refuse a run cheaply comes before anything is allocated or written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from yatrain.context_parallel.split import ContextParallel
from yatrain.data import BatchLoader
from yatrain.data import build_loader as data_loader
from yatrain.models.float8 import check_float8
from yatrain.output.loggers import Loggers
from yatrain.output.tensorboard_logger import require_tensorboard
from yatrain.plan import MemoryBudget, memory_budget, start_plan
from yatrain.recipe.checks import check_vocab
from yatrain.recipe.config import Recipe
from yatrain.recipe.topology import JobLayout, job_layout
from yatrain.runtime.compile_cache import cache_for_run
from yatrain.runtime.hang import HangReporter, StackFile
from yatrain.runtime.process import Runtime, nccl_flight_recorder
from yatrain.runtime.watchdog import Watchdog
from yatrain.sharding import ShardedEngine
from yatrain.train.build import build_model_and_engine
from yatrain.train.checkpointer import Checkpointer
from yatrain.train.evaluate import Evaluator, build_evaluator
from yatrain.train.metrics import StepMeter
from yatrain.train.optim import run_optimizer
from yatrain.train.profile import StepProfiler
from yatrain.train.run import Opened, Run
from yatrain.train.rundir import claim_run_dir

if TYPE_CHECKING:  # imported by a compiled run only (compile_watch)
    from yatrain.runtime.compile import CompileWatch


@dataclass(frozen=True)
class Checks:
    """What a run checks before and while it starts (the command line's switches)."""

    fit: bool = True  # refuse a run the planner says will not fit (--no-fit-check: off)
    verify: bool = True  # checkpoint checksums before a load (--no-verify: off)
    tensor_step: int | None = None  # on CPU, count live tensors during this step
    # resume a checkpoint of another optim.name: weights only, a fresh optimizer state
    reset_optimizer: bool = False


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
    """Build the run (see the module docstring); collective under torchrun. The job's
    layout and memory budget are resolved here, once, and handed to what needs them."""
    loggers = Loggers(runtime, progress)
    layout = job_layout(recipe, runtime.world_size, runtime.local_world_size)
    budget = memory_budget(recipe, runtime.device, layout)
    layers = check_recipe(recipe, runtime, layout, budget, checks.fit, loggers.say)
    context = ContextParallel.of_layout(layout, runtime.device)
    loader, evaluator = build_inputs(recipe, runtime, layout, loggers, context)
    run_dir, lock = claim_run_dir(runtime, resume, run_dir, recipe_name, recipe.checkpoint.dir)
    watchdog = Watchdog(recipe.train.collective_timeout_s, runtime.rank, runtime.distributed)
    opened = Opened(loggers, watchdog, lock)
    try:
        return start(
            recipe,
            runtime,
            layout,
            budget,
            layers,
            context,
            loader,
            evaluator,
            run_dir,
            opened,
            resume,
            checks,
        )
    except BaseException:
        opened.close(started=False)
        raise


def start(
    recipe: Recipe,
    runtime: Runtime,
    layout: JobLayout,
    budget: MemoryBudget,
    layers: int,
    context: ContextParallel | None,
    loader: BatchLoader,
    evaluator: Evaluator,
    run_dir: Path,
    opened: Opened,
    resume: str,
    checks: Checks,
) -> Run:
    """The run's parts that allocate; each that holds something open joins ``opened``."""
    say = opened.loggers.say
    model, engine = build_model_and_engine(
        recipe,
        runtime,
        layout=layout,
        layers=layers,
        staging_of=budget.staging,
        verify=checks.verify,
        say=say,
    )
    opened.compiler = compile_watch(recipe, run_dir)
    if context is not None:
        context.time_waits(engine.waits)
    optimizer = run_optimizer(engine, model, recipe.optim)
    ckpt_dir = run_dir / recipe.checkpoint.dir
    checkpointer = Checkpointer(
        recipe, ckpt_dir, engine, optimizer, loader, runtime, verify=checks.verify
    )
    opened.checkpointer = checkpointer
    start_step, skipped = checkpointer.restore(resume, say, checks.reset_optimizer)
    opened.loggers.open(run_dir, recipe, start_step)
    meter = StepMeter(recipe, runtime, loader.tokens_per_step, checks.tensor_step, engine)
    profiler = StepProfiler(
        recipe.train.profile, run_dir, runtime.rank, runtime.device, start_step, say
    )
    run = Run(
        recipe=recipe,
        runtime=runtime,
        layout=layout,
        run_dir=run_dir,
        loader=loader,
        model=model,
        engine=engine,
        optimizer=optimizer,
        meter=meter,
        profiler=profiler,
        evaluator=evaluator,
        opened=opened,
        context=context,
        start_step=start_step,
        skipped_steps=skipped,
    )
    attach_hang_report(opened.watchdog, runtime, run_dir, start_step, meter, engine)
    announce(run)
    return run


def announce(run: Run) -> None:
    """The start's lines: where the run lives and resumes from, how the world is laid out,
    the device, its peak FLOP/s, the data and the evaluation schedule."""
    last, say = run.checkpointer.last, run.loggers.say
    where = f"resumed from {last} (step {run.start_step})" if last else "fresh start"
    say(
        f"run dir {run.run_dir} | {where} | world size {run.runtime.world_size}"
        f"{_words(run.layout)} | device {run.runtime.device} | wandb {run.loggers.wandb_mode} | "
        f"peak FLOP/s {run.meter.peak_flops / 1e12:.3g}T ({run.meter.peak_source})"
    )
    say(run.loader.describe(run.recipe.train.steps))
    evaluator = run.evaluator
    for line in [evaluator.schedule(), *evaluator.short_notices()] if evaluator.enabled else []:
        say(line)


def check_recipe(
    recipe: Recipe,
    runtime: Runtime,
    layout: JobLayout,
    budget: MemoryBudget,
    fit: bool,
    say: Callable[[str], None],
) -> int:
    """Everything that refuses a run before anything is allocated or written (TensorBoard,
    the fit, the compile backend, float8; the layout was checked as it was resolved);
    returns the number of checkpointed layers (``auto`` resolved, its choice told to
    ``say``), from the run's one plan."""
    require_tensorboard(recipe)
    layers = start_plan(recipe, layout, budget, fit, say)
    if recipe.train.compile:
        from yatrain.runtime.compile import check_backend  # dynamo: only for a compiled run

        check_backend(recipe.train.compile_backend, runtime.device)
    check_float8(recipe.train.float8, runtime.device, recipe.model)
    return layers


def compile_watch(recipe: Recipe, run_dir: Path) -> CompileWatch | None:
    """With ``train.compile`` (the layers are compiled by ``build_model_and_engine``): its
    compilations counted and timed, inductor's code in ``train.compile_cache`` or the
    private per-user cache, never in the run directory (runtime/compile_cache.py)."""
    if not recipe.train.compile:
        return None
    from yatrain.runtime.compile import CompileWatch  # dynamo: only for a compiled run

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


def _words(layout: JobLayout) -> str:
    """How the world is laid out, when it is not one shard group of data ranks."""
    parts = [f"{layout.replicas} replicas of shard groups of {layout.shard_group}"]
    parts = parts if layout.replicas > 1 else []
    if layout.context > 1:
        parts.append(f"{layout.data_ranks} data x {layout.context} context")
    return f" ({', '.join(parts)})" if parts else ""


def build_inputs(
    recipe: Recipe,
    runtime: Runtime,
    layout: JobLayout,
    loggers: Loggers,
    context: ContextParallel | None,
) -> tuple[BatchLoader, Evaluator]:
    """The training batches and the held-out data this rank reads (its data rank's: a CP
    group's ranks read the same)."""
    loader = build_loader(recipe, runtime, layout, loggers)
    tokenizer = (loader.tokenizer_sha256, loader.bos_id, loader.eos_id)
    return loader, build_evaluator(recipe, runtime, layout, tokenizer, context=context)


def build_loader(
    recipe: Recipe, runtime: Runtime, layout: JobLayout, loggers: Loggers
) -> BatchLoader:
    """This rank's view of the global batches (one directory or a mixture), checked against
    the model's vocabulary; a mixture's notices go to the console."""
    loader = data_loader(
        recipe.data,
        seed=recipe.train.seed,
        rank=layout.data_rank(runtime.rank),
        world_size=layout.data_ranks,
        notice=loggers.say if runtime.is_main else None,
    )
    check_vocab(recipe, loader.vocab_size)
    return loader
