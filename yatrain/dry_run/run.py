"""A dry run: the training loop's own steps at a world size this machine does not have.

One process joins torch's fake process group as rank R of N (collectives return at once and
move no data) and runs under ``FakeTensorMode`` (tensors with shape, dtype and device but no
storage), on the CPU: fake CUDA tensors abort a CPU-only torch once autograd touches them, so
the engine is told to take its CUDA path (streams, events, the stream reducer: what a GPU
rank runs) over fake streams whose events report done. The model and engine come from
``train.build`` like a run's, with no initialisation (values do not exist); the loop is
``train.loop.train`` on synthetic micro-batches of the recipe's shapes, every read of a
device value answered "unknown" (``runtime.host_reads``). Nothing is read from or written
to disk: no data, tokenizer, weights, run directory or checkpoint.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# FakeTensorMode and torch's fake process group: the house rules' allowed private imports,
# for dry runs only (torchtitan imports the fake group the same way).
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from yatrain.common import DTYPES
from yatrain.context_parallel.split import ContextParallel
from yatrain.data import BatchLoader
from yatrain.data.batch import MicroBatch
from yatrain.dry_run.categories import CategoryMeter, TrackedPeak, side_by_side
from yatrain.errors import ConfigError
from yatrain.output.loggers import Loggers
from yatrain.plan import MemoryPlan, plan_for_layers, plan_memory
from yatrain.recipe.config import Recipe
from yatrain.recipe.topology import job_layout
from yatrain.runtime.process import Runtime
from yatrain.runtime.watchdog import Watchdog
from yatrain.sharding import InitHooks, ShardedEngine, hybrid_mesh
from yatrain.sharding.comm import KINDS
from yatrain.train.build import build_model_and_engine
from yatrain.train.checkpointer import Checkpointer
from yatrain.train.evaluate import Evaluator
from yatrain.train.loop import train
from yatrain.train.optim import run_optimizer
from yatrain.train.profile import StepProfiler
from yatrain.train.run import Opened, Run

CPU = torch.device("cpu")
NO_DIR = Path("(dry run: no run directory)")  # named in the loop's summary; never created


@dataclass
class DryRun:
    """What a dry run measured, beside the plan for the same layers and world."""

    recipe: str
    world_size: int
    rank: int
    steps: int
    tracked_peak_bytes: int  # live tensors at the last (steady-state) step's peak
    plan: MemoryPlan
    collectives: dict[str, dict[str, int]]  # the engine's, of one step: kind -> count, bytes
    attention: str  # the attention kernel whose saved tensors were measured
    seconds: float
    tracked: TrackedPeak  # the tracked peak's moment and categories (``categories``)

    @property
    def planned_peak_bytes(self) -> int:
        return self.plan.tensor_peak_bytes

    @property
    def fits(self) -> bool | None:
        """The tracked peak plus the planner's runtime allowance against the GPU's memory."""
        limit = self.plan.gpu_memory_bytes
        return None if limit is None else self.tracked_peak_bytes + self.allowance <= limit

    @property
    def allowance(self) -> int:
        return self.plan.runtime_allowance_bytes

    def categories(self) -> dict[str, dict[str, int]]:
        """Each category's tracked and planned bytes at the peak, and their difference."""
        return side_by_side(self.tracked.categories, self.plan.breakdown)

    def to_json(self) -> dict:
        return {
            "recipe": self.recipe,
            "world_size": self.world_size,
            "rank": self.rank,
            "steps": self.steps,
            "activation_checkpoint_layers": self.plan.activation_checkpoint_layers,
            "tracked_peak_bytes": self.tracked_peak_bytes,
            "planned_peak_bytes": self.planned_peak_bytes,
            "difference_bytes": self.tracked_peak_bytes - self.planned_peak_bytes,
            "runtime_allowance_bytes": self.allowance,
            "gpu_memory_bytes": self.plan.gpu_memory_bytes,
            "fits": self.fits,
            "collectives": self.collectives,
            "attention": self.attention,
            "seconds": self.seconds,
            "tracked_peak_moment": self.tracked.moment,
            "planned_peak_moment": self.plan.peak_moment,
            "categories": self.categories(),
        }


def for_dry_run(recipe: Recipe, steps: int) -> Recipe:
    """The recipe as a dry run steps it: ``steps`` steps, one log window, no checkpoint,
    evaluation, profile, W&B or compilation (compiled layers run eagerly), no weights read."""
    r = recipe
    train_cfg = dataclasses.replace(
        r.train, steps=steps, log_every=steps, profile=0, compile=False, init_from=None
    )
    return dataclasses.replace(
        r,
        train=train_cfg,
        checkpoint=dataclasses.replace(r.checkpoint, enabled=False, async_=False),
        eval=dataclasses.replace(r.eval, every=0, at_end=False),
    )


def planned(
    recipe: Recipe, world: int, gpu_memory: int | None, allowance: int | None
) -> MemoryPlan:
    """The planner's figure for the layers the run checkpoints (``auto``: its resolution)."""
    layout = job_layout(recipe, world, world)
    layers = recipe.sharding.activation_checkpoint_layers
    if layers == "auto":
        found = plan_memory(recipe, world, gpu_memory, allowance, shard_group=layout.shard_group)
        layers = found.activation_checkpoint_layers
    return plan_for_layers(
        recipe, world, layers, gpu_memory, allowance, shard_group=layout.shard_group
    )


def dry_run(
    recipe: Recipe,
    recipe_name: str,
    world: int,
    *,
    rank: int = 0,
    steps: int = 2,
    gpu_memory: int | None = None,
    allowance: int | None = None,
) -> DryRun:
    """Run ``steps`` steps of ``recipe`` as ``rank`` of ``world`` (see the module docstring)."""
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank}: pass a rank from 0 to {world - 1} (--gpus {world})")
    if steps < 2:
        raise ConfigError(f"--steps {steps}: pass at least 2 (the first step warms up)")
    start = time.perf_counter()
    gc.collect()  # the last step adopts every live tensor: none of an earlier run's
    recipe = for_dry_run(recipe, steps)
    plan = planned(recipe, world, gpu_memory, allowance)
    recipe = dataclasses.replace(
        recipe,
        sharding=dataclasses.replace(
            recipe.sharding, activation_checkpoint_layers=plan.activation_checkpoint_layers
        ),
    )
    if dist.is_initialized():
        raise ConfigError("a dry run needs a process of its own (a process group is already up)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        run, batches = build_run(recipe, Runtime(rank, world, rank, CPU), gpu_memory, fake)
        with fake:
            try:
                train(run)
            finally:
                run.close()
            attention = attention_kernel(recipe)
        peak = run.meter.records[-1].peak_tensor_bytes
        assert peak is not None  # the tracker counted the last step
        per_step = batches.last_step_traffic(run.engine)
    finally:
        dist.destroy_process_group()
    seconds = time.perf_counter() - start
    tracked = run.meter.tracked_peak  # a CategoryMeter's (build_run)
    return DryRun(
        recipe_name, world, rank, steps, peak, plan, per_step, attention, seconds, tracked
    )


def build_run(
    recipe: Recipe, runtime: Runtime, gpu_memory: int | None, fake: FakeTensorMode
) -> tuple[Run, Batches]:
    """The run ``train`` steps, built as ``setup`` builds one, minus everything on disk: its
    tensors under ``fake``; the hybrid mesh (which reads its ranks from a tensor), the CP
    groups and the meter's FLOP/s probe (this CPU's, measured) outside it."""
    layout = job_layout(recipe, runtime.world_size, runtime.world_size)
    if layout.shard_group < runtime.world_size:  # HSDP: the mesh the engine is built over
        hybrid_mesh(runtime.device.type, layout.shard_group)  # reads real ranks: not fake
    context = ContextParallel.of_layout(layout, runtime.device, cuda_path=True)
    nothing = InitHooks(lambda index, kept: None, lambda: None)  # values do not exist
    with fake:
        model, engine = build_model_and_engine(
            recipe, runtime, layout=layout, staging_of=gpu_memory, init=nothing, cuda_path=True
        )
        batches = Batches(recipe, layout.data_ranks, layout.data_rank(runtime.rank), engine)
        optimizer = run_optimizer(engine, model, recipe.optim)
    if context is not None:
        context.time_waits(engine.waits)
    loggers = Loggers(runtime, progress=False)
    loggers.destinations = [loggers.console] if loggers.active else []  # no metrics file
    opened = Opened(loggers, Watchdog(0, runtime.rank, False), None)
    opened.checkpointer = Checkpointer(recipe, NO_DIR, engine, optimizer, batches, runtime)
    steps = recipe.train.steps
    tokens = batches.tokens_per_step
    meter = CategoryMeter(recipe, runtime, tokens, steps, engine, model, optimizer)
    profiler = StepProfiler(0, NO_DIR, runtime.rank, CPU, 0, opened.loggers.say)
    evaluator = Evaluator.disabled(recipe, CPU)
    run = Run(
        recipe,
        runtime,
        layout,
        NO_DIR,
        batches,
        model,
        engine,
        optimizer,
        meter,
        profiler,
        evaluator,
        opened,
        context,
    )
    return run, batches


class Batches(BatchLoader):
    """Synthetic micro-batches of the recipe's exact shapes (token 0 everywhere): a dry run
    reads no data. Before the last step it notes the engine's collectives so far, so the
    last step's own are the difference."""

    def __init__(self, recipe: Recipe, data_ranks: int, data_rank: int, engine: ShardedEngine):
        d = recipe.data
        self.seq_len, self.global_batch_size = d.seq_len, d.global_batch_size
        self.micro_batch_size, self.world_size, self.rank, self.step = (
            d.micro_batch_size,
            data_ranks,
            data_rank,
            0,
        )
        self.tokenizer_files, self.tokenizer_sha256 = [], ""
        self.vocab_size, self.bos_id, self.eos_id = recipe.model.vocab_size, 0, 0
        self.document_mask, self.restart_positions = d.document_mask, d.restart_positions
        self.engine, self.last_steps = engine, recipe.train.steps
        self.before_last: dict = {}

    def describe(self, steps: int) -> str:
        return f"synthetic batches (dry run), {steps} steps"

    def next_batch(self) -> list[MicroBatch]:
        self.step += 1
        if self.step == self.last_steps:
            self.before_last = self.engine.traffic()
        shape = (self.micro_batch_size, self.seq_len)
        batches = []
        for _ in range(self.accumulation_steps):
            inputs = torch.zeros(shape, dtype=torch.int64)
            targets = torch.zeros(shape, dtype=torch.int64)
            batches.append(MicroBatch(inputs, targets, self.attention_inputs(inputs)))
        return batches

    def state_dict(self) -> dict:
        return {"step": self.step}

    def last_step_traffic(self, engine: ShardedEngine) -> dict[str, dict[str, int]]:
        now = engine.traffic()
        out = {}
        for kind in KINDS:  # merge_traffic answers every kind
            (count, nbytes), (c0, b0) = now[kind], self.before_last[kind]
            out[kind] = {"count": count - c0, "bytes": nbytes - b0}
        return out


def attention_kernel(recipe: Recipe) -> str:
    """The aten kernel ``scaled_dot_product_attention`` dispatches to on these fake CPU
    tensors at the recipe's shapes: whose saved tensors the dry run measured."""

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.__name__:
                self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    m, d = recipe.model, recipe.data
    dtype = DTYPES[recipe.train.dtype]
    shape = (d.micro_batch_size, m.n_heads, d.seq_len, m.dim // m.n_heads)
    q = torch.zeros(shape, dtype=dtype, requires_grad=True)
    kv = torch.zeros((shape[0], m.n_kv_heads, *shape[2:]), dtype=dtype)
    with Seen() as seen:
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    return seen.names[0].split(".")[0] if seen.names else "unknown"
