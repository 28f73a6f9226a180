"""Everything a run needs before its first step, built in data-flow order.

``setup`` reads as the list of what a run is made of: its data (and held-out data), its
directory, the model and the engine that owns its weights, the optimizer, the point it
resumes from, its loggers and its meter. It returns them as one ``Run``, which the loop
steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from yatrain.common import DTYPES
from yatrain.config import Recipe, check_vocab, validate_world_size
from yatrain.data import BatchLoader
from yatrain.data import build_loader as data_loader
from yatrain.models.llama import build_model
from yatrain.plan import resolve_auto_checkpoint_layers
from yatrain.sharding import InitHooks, ShardedEngine
from yatrain.train.checkpoint import Checkpointer
from yatrain.train.evaluate import Evaluator, build_evaluator
from yatrain.train.loggers import Loggers
from yatrain.train.metrics import StepMeter
from yatrain.train.optim import build_optimizer
from yatrain.train.profile import StepProfiler
from yatrain.train.resume import check_fresh_start_allowed, run_dir_for
from yatrain.train.runtime import Runtime
from yatrain.train.weights import init_from_source


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
    start_step: int = 0
    skipped_steps: int = 0


def setup(
    recipe: Recipe, runtime: Runtime, *, recipe_name: str, run_dir: Path | None, resume: str,
    progress: bool,
) -> Run:  # fmt: skip
    """Build the run (see the module docstring); collective under torchrun."""
    validate_world_size(recipe, runtime.world_size)
    loggers = Loggers(runtime, progress)
    loader = build_loader(recipe, runtime, loggers)
    evaluator = build_evaluator(
        recipe, runtime, (loader.tokenizer_sha256, loader.bos_id, loader.eos_id)
    )
    run_dir = Path(runtime.broadcast_object(str(
        run_dir_for(resume, run_dir, recipe_name, recipe.checkpoint.dir)
    )))  # fmt: skip
    check_fresh_start_allowed(run_dir, resume)
    try:
        model, engine = build_engine(recipe, runtime, loggers)
        optimizer = build_optimizer(engine.param_groups(recipe.optim.weight_decay), recipe.optim)
        checkpointer = Checkpointer(
            recipe, run_dir / recipe.checkpoint.dir, engine, optimizer, loader, runtime
        )
        start_step, skipped = checkpointer.restore(resume, loggers.say)
        loggers.open(run_dir, recipe, start_step)
        meter = StepMeter(recipe, runtime, loader.tokens_per_step)
        profiler = StepProfiler(recipe.train.profile, run_dir, runtime.rank, runtime.device,
                                start_step, loggers.say)  # fmt: skip
        last = checkpointer.last
        where = f"resumed from {last} (step {start_step})" if last else "fresh start"
        loggers.say(
            f"run dir {run_dir} | {where} | world size {runtime.world_size} | device "
            f"{runtime.device} | wandb {loggers.wandb_mode} | peak FLOP/s "
            f"{meter.peak_flops / 1e12:.3g}T ({meter.peak_source})"
        )
        loggers.say(loader.describe(recipe.train.steps))
        for line in [evaluator.schedule(), *evaluator.short_notices()] if evaluator.enabled else []:
            loggers.say(line)
    except BaseException:
        loggers.close()  # nothing half-open (a W&B run, metrics.jsonl) after a failed start
        raise
    return Run(recipe, runtime, run_dir, loader, model, engine, optimizer, checkpointer, loggers,
               meter, profiler, evaluator, start_step, skipped)  # fmt: skip


def build_loader(recipe: Recipe, runtime: Runtime, loggers: Loggers) -> BatchLoader:
    """This rank's view of the global batches (one directory or a mixture), checked against
    the model's vocabulary; a mixture's notices go to the console."""
    loader = data_loader(
        recipe.data, seed=recipe.train.seed, rank=runtime.rank, world_size=runtime.world_size,
        notice=loggers.say if runtime.is_main else None,
    )  # fmt: skip
    check_vocab(recipe, loader.vocab_size)
    return loader


def checkpoint_layers(recipe: Recipe, runtime: Runtime, loggers: Loggers) -> int:
    """The recipe's number of checkpointed layers, or the planner's choice for ``auto``."""
    layers = recipe.sharding.activation_checkpoint_layers
    if layers != "auto":
        return layers
    layers, why = resolve_auto_checkpoint_layers(recipe, runtime.world_size, runtime.device)
    loggers.say(why)
    return layers


def build_engine(
    recipe: Recipe, runtime: Runtime, loggers: Loggers
) -> tuple[nn.Module, ShardedEngine]:
    """The model on the meta device, sharded by the engine as each rank materialises it
    (from ``train.init_from`` when set, else from the seed)."""
    layers = checkpoint_layers(recipe, runtime, loggers)
    model = build_model(recipe.model, layers, recipe.train.loss_chunk_tokens)
    init = InitHooks.from_seed(model, recipe.train.seed)
    if recipe.train.init_from is not None:
        init = init_from_source(Path(recipe.train.init_from), recipe.model, model)
    engine = ShardedEngine.from_model(
        model,
        device=runtime.device,
        init=init,
        param_dtype=DTYPES[recipe.train.dtype],
        reduce_dtype=DTYPES[recipe.sharding.reduce_dtype],
        prefetch_depth=recipe.sharding.prefetch_depth,
        force_process_group=recipe.sharding.force_process_group,
    )
    return model, engine
