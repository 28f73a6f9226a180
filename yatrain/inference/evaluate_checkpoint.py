"""``yatrain eval``: a checkpoint's held-out loss, computed the way its run computed it.

The checkpoint is opened through ``manifest.open_checkpoint`` (the one validation path); the
recipe stored in its manifest names the held-out data, the windows (``data.seq_len``,
``data.global_batch_size``, ``eval.batches``) and the compute dtype; the model is sharded by
the engine as in training, at whatever world size this runs at (one process or torchrun),
and filled with the checkpoint's weights; and the run's own ``Evaluator`` runs once. So it
reproduces the ``val_loss`` the run logged at that step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

from yatrain.checkpoint.manifest import CheckpointError, SavedCheckpoint, open_checkpoint, reading
from yatrain.checkpoint.store import checkpoint_tokenizer, dcp_mesh, load_weights
from yatrain.data.megatron import megatron_prefix
from yatrain.errors import ConfigError, DataError
from yatrain.recipe.config import Recipe
from yatrain.recipe.load import load_recipe, recipe_from_dict
from yatrain.recipe.topology import job_layout
from yatrain.runtime.process import Runtime, init_runtime
from yatrain.sharding import InitHooks
from yatrain.train.build import build_model_and_engine
from yatrain.train.evaluate import build_evaluator

_NO_INIT = InitHooks(lambda index, kept: None, lambda: None)  # every weight is loaded afterwards


def evaluate_checkpoint(
    path: Path,
    *,
    data: Path | None = None,
    batches: int | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> dict:
    """The held-out loss of the checkpoint at ``path`` on ``data`` (default: its recipe's
    held-out data) over ``batches`` global batches (default: its recipe's eval.batches);
    collective under torchrun, every rank returns the result. ``say`` gets progress lines
    (rank 0)."""
    runtime = init_runtime()
    try:
        with reading(Path(path)):  # a running job's rotation may delete it meanwhile
            return _evaluate(Path(path), runtime, data, batches, say)
    finally:
        runtime.shutdown()


def _evaluate(
    path: Path,
    runtime: Runtime,
    data: Path | None,
    batches: int | None,
    say: Callable[[str], None],
) -> dict:
    saved = _open(path, runtime)
    recipe = saved_recipe(saved)  # evaluated without context parallelism (any world)
    recipe = dataclasses.replace(
        recipe, sharding=dataclasses.replace(recipe.sharding, context_parallel=1)
    )
    if batches is not None:
        recipe = dataclasses.replace(recipe, eval=dataclasses.replace(recipe.eval, batches=batches))
    tokenizer = checkpoint_tokenizer(saved.path)
    # A Megatron prefix records no tokenizer: it is read with the checkpoint's own (the one
    # the run trained with), wherever the run's data.tokenizer is now.
    recipe = dataclasses.replace(
        recipe, data=dataclasses.replace(recipe.data, tokenizer=str(tokenizer.path))
    )
    if data is None:
        _check_recipe_data(recipe)
    facts = (tokenizer.sha256, tokenizer.bos_id, tokenizer.eos_id)
    # any world evaluates: its ranks split the windows, padding the last micro-batches
    layout = job_layout(recipe, runtime.world_size, runtime.local_world_size, batch=False)
    evaluator = build_evaluator(recipe, runtime, layout, facts, data_dir=data, force=True)
    notes = [f"evaluating {saved.path} on {evaluator.describe()}", *evaluator.short_notices()]
    for line in notes if runtime.is_main else []:
        say(line)
    model, engine = build_model_and_engine(
        inference_recipe(recipe, saved), runtime, layout=layout, init=_NO_INIT
    )
    load_weights(saved.path, engine, dcp_mesh(runtime))
    result = evaluator.evaluate(model)
    return {
        "checkpoint": str(saved.path),
        "step": saved.step,
        **{k: v for k, v in result.record_fields().items() if k != "val_sources"},
        **{f"val_loss/{name}": loss for name, loss in result.by_source.items()},
        "val_windows": result.windows,
        "seq_len": recipe.data.seq_len,
        "data": [part.held.describe() for part in evaluator.parts],
        "dtype": recipe.train.dtype,
        "world_size": runtime.world_size,
        "seconds": result.seconds,
    }


def inference_recipe(recipe: Recipe, saved: SavedCheckpoint) -> Recipe:
    """The run's recipe as evaluation builds its model: the checkpoint's model, nothing
    checkpointed and nothing compiled (no backward), plain weights (no float8), sharded
    over this world however it is laid out, the run's weights loaded afterwards."""
    return dataclasses.replace(
        recipe,
        model=saved.model,
        train=dataclasses.replace(recipe.train, init_from=None, compile=False, float8=None),
        sharding=dataclasses.replace(
            recipe.sharding,
            activation_checkpoint_layers=0,
            reduce_dtype="fp32",
            force_process_group=False,
            shard_group_size=None,
        ),
    )


def _open(path: Path, runtime: Runtime) -> SavedCheckpoint:
    """Rank 0 validates the checkpoint; every rank gets the same answer or error."""
    answer: object = None
    if runtime.is_main:
        try:
            answer = open_checkpoint(path)
        except CheckpointError as error:
            answer = str(error)
    answer = runtime.broadcast_object(answer)
    if isinstance(answer, str):
        raise CheckpointError(answer)
    return answer


def _check_recipe_data(recipe: Recipe) -> None:
    data = recipe.data
    paths = [data.val_path] if data.val_path is not None else [data.path]
    if data.val_path is None and data.sources is not None:
        paths = [source.path for source in data.sources]
    for path in paths:
        if not Path(path).is_dir() and megatron_prefix(path) is None:
            raise DataError(
                f"the checkpoint's recipe evaluates on {path}, which is not here (relative paths "
                "are relative to where the run started): run from there, or pass --data DIR "
                "(a data directory or a Megatron prefix)"
            )


def saved_recipe(saved: SavedCheckpoint) -> Recipe:
    """The recipe the checkpoint's run trained with: stored in its manifest, or (older
    checkpoints) the run directory's config.yaml when its hash is the manifest's."""
    stored = saved.manifest.get("recipe")
    if isinstance(stored, dict):
        try:
            return recipe_from_dict(stored)
        except ConfigError as error:
            raise CheckpointError(
                f"checkpoint {saved.path}: its stored recipe is not valid here ({error})"
            ) from None
    want = saved.manifest.get("recipe_sha256")
    for folder in saved.path.resolve().parents:
        config = folder / "config.yaml"
        if config.is_file() and hashlib.sha256(config.read_bytes()).hexdigest() == want:
            return load_recipe(config)
    raise CheckpointError(
        f"checkpoint {saved.path} records no recipe and no config.yaml of its run matches it: "
        "it was saved by an older yatrain; evaluate a newer checkpoint"
    )
