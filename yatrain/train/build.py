"""Recipe -> model and engine, in one place: a training run, ``yatrain eval``, ``yatrain
generate`` and every benchmark build them here, so they all build the same thing.

``meta_model`` is the model alone on the meta device, with its checkpointed layers resolved
(``sharding.activation_checkpoint_layers: auto`` through the memory planner).
``build_model_and_engine`` adds what training owns: float8, the initial weights (the seed,
or ``train.init_from``), the engine that shards them (over the whole world, or within shard
groups: hybrid sharding) and, with ``train.compile``, each decoder layer's compiled forward.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from yatrain.checkpoint.init_from import init_from_source
from yatrain.common import DTYPES
from yatrain.models.float8 import apply_float8
from yatrain.models.llama import Llama, build_model
from yatrain.plan import resolve_auto_checkpoint_layers
from yatrain.plan.limits import staging_memory
from yatrain.recipe.config import ModelConfig, Recipe
from yatrain.recipe.topology import JobLayout, job_layout
from yatrain.runtime.process import Runtime
from yatrain.sharding import InitHooks, ShardedEngine, hybrid_mesh
from yatrain.sharding.sizes import staging_budget
from yatrain.train.checkpointer import verify_init_source

Say = Callable[[str], None]


def checkpoint_layers(
    recipe: Recipe, world_size: int, device: torch.device | str, say: Say | None = None
) -> int:
    """The recipe's number of checkpointed layers, or for ``auto`` the planner's choice for
    ``world_size`` ranks on ``device`` (the line that explains it goes to ``say``)."""
    layers = recipe.sharding.activation_checkpoint_layers
    if layers != "auto":
        return layers
    layers, why = resolve_auto_checkpoint_layers(recipe, world_size, device)
    if say is not None:
        say(why)
    return layers


def meta_model(
    source: Recipe | ModelConfig,
    world_size: int = 1,
    device: torch.device | str = "cpu",
    *,
    layers: int | None = None,
    say: Say | None = None,
) -> Llama:
    """The model on the meta device. From a recipe: ``layers`` of its decoder layers
    checkpointed (default: the recipe's, see ``checkpoint_layers``) and its loss chunk. From
    a model config alone (a checkpoint's model, for inference): none checkpointed."""
    if isinstance(source, ModelConfig):
        return build_model(source)
    if layers is None:
        layers = checkpoint_layers(source, world_size, device, say)
    return build_model(source.model, layers, source.train.loss_chunk_tokens)


def recipe_init(model: Llama, recipe: Recipe, runtime: Runtime, verify: bool = True) -> InitHooks:
    """The initial weights a run starts from: ``train.init_from`` when set (a Hugging Face
    directory or a yatrain checkpoint, checked once under torchrun), else the seed."""
    if recipe.train.init_from is None:
        return InitHooks.from_seed(model, recipe.train.seed)
    source = Path(recipe.train.init_from)
    verify = verify_init_source(source, runtime, recipe.model, verify)
    return init_from_source(source, recipe.model, model, verify=verify)


def shard_model(
    model: Llama,
    recipe: Recipe,
    runtime: Runtime,
    *,
    layout: JobLayout | None = None,
    staging_of: int | None = None,
    init: InitHooks | None = None,
    verify: bool = True,
    say: Say | None = None,
    cuda_path: bool = False,
) -> ShardedEngine:
    """The engine over a meta ``model``: each rank materialises its shards from ``init``
    (default: ``recipe_init``), over the whole world or within the ``layout``'s shard
    groups (HSDP; default: the recipe laid over this runtime), the recipe's projections
    gathered in float8; ``auto`` staging a share of ``staging_of`` bytes (default: this
    device's, ``staging_memory``); ``say`` gets what the loading reports (the bytes this
    rank read); ``cuda_path``: the engine's CUDA path on a CPU (a dry run, groups.py)."""
    float8 = apply_float8(model, recipe.train.float8)
    if init is None:
        init = recipe_init(model, recipe, runtime, verify)
    if layout is None:
        layout = job_layout(recipe, runtime.world_size, runtime.local_world_size, batch=False)
    if staging_of is None:
        staging_of = staging_memory(recipe, runtime.device)
    group = layout.shard_group
    hybrid = group < runtime.world_size
    engine = ShardedEngine.from_model(
        model,
        device=runtime.device,
        init=init,
        param_dtype=DTYPES[recipe.train.dtype],
        reduce_dtype=DTYPES[recipe.sharding.reduce_dtype],
        prefetch_depth=recipe.sharding.prefetch_depth,
        force_process_group=recipe.sharding.force_process_group,
        staging_bytes=staging_budget(recipe.sharding.reduce_staging_mib, staging_of),
        mesh=hybrid_mesh(runtime.device.type, group) if hybrid else None,
        float8=float8,
        cuda_path=cuda_path,
    )
    if say is not None and init.report is not None:
        say(init.report())
    return engine


def build_model_and_engine(
    recipe: Recipe,
    runtime: Runtime,
    *,
    layout: JobLayout | None = None,
    layers: int | None = None,
    staging_of: int | None = None,
    init: InitHooks | None = None,
    verify: bool = True,
    say: Say | None = None,
    cuda_path: bool = False,
) -> tuple[Llama, ShardedEngine]:
    """The recipe's model (``meta_model``; ``layers``: already resolved) sharded by the engine
    (``shard_model``: ``layout``, ``staging_of``, ``init``), each decoder layer's forward
    compiled with ``train.compile`` (the engine's hooks stay outside); collective under
    torchrun."""
    model = meta_model(recipe, runtime.world_size, runtime.device, layers=layers, say=say)
    engine = shard_model(
        model,
        recipe,
        runtime,
        layout=layout,
        staging_of=staging_of,
        init=init,
        verify=verify,
        say=say,
        cuda_path=cuda_path,
    )
    if recipe.train.compile:
        from yatrain.runtime.compile import compile_layers  # dynamo: only for a compiled run

        cp = recipe.sharding.context_parallel > 1  # attention's collectives stay eager
        compile_layers(model.layers, recipe.train.compile_backend, eager_attention=cp)
    return model, engine
