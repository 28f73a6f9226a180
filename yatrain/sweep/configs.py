"""The configurations of a sweep: one recipe per (sequence length, checkpoint setting).

Tokens per global batch stay the recipe's unless asked otherwise, so throughput compares
like with like; every configuration is validated, and ``auto`` resolved by the planner,
before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from yatrain.errors import ConfigError
from yatrain.plan import plan_for_layers, resolve_auto_checkpoint_layers
from yatrain.plan.limits import local_device
from yatrain.recipe.config import Recipe
from yatrain.recipe.load import load_recipe


@dataclass
class SweepConfig:
    """One run of the sweep: its name, its recipe overrides and what the planner expects."""

    name: str
    seq_len: int
    checkpoint: str  # as given: "0", "4", "auto"
    layers: int  # the number of checkpointed layers (auto resolved by the planner)
    global_batch_size: int
    micro_batch_size: int
    overrides: list[str]
    predicted_peak_bytes: int
    context_parallel: int = 1  # ranks sharing each window (sharding.context_parallel)


def base_recipe(recipe_path: Path, overrides: list[str]) -> tuple[Recipe, int]:
    """The recipe the sweep starts from, and its own ``model.max_seq_len``. Its data.seq_len
    may exceed that context (it is replaced per configuration), so it is read with the
    context raised; everything else is validated as usual. The probe that reads the context
    runs one rank per window, which any length suits (CP cuts a window into 2 x CP chunks)."""
    probe = load_recipe(recipe_path, [*overrides, "data.seq_len=1", "sharding.context_parallel=1"])
    raised = f"model.max_seq_len={2**40}"  # any length passes; configs set their own
    return load_recipe(recipe_path, [*overrides, raised]), probe.model.max_seq_len


def batch_for(seq: int, base_seq: int, gbs: int, micro: int, world: int, keep_seqs: bool):
    """(global batch, micro-batch) in sequences for ``seq``: same tokens per step as the recipe
    unless ``keep_seqs``; the micro-batch shrinks only when the batch no longer holds it."""
    if not keep_seqs:
        tokens = gbs * base_seq
        if tokens % seq:
            raise ConfigError(
                f"--seq-len {seq}: the recipe's {tokens} tokens per global batch are not a "
                "multiple of it; choose lengths that divide it or pass --keep-batch-sequences"
            )
        gbs = tokens // seq
    if gbs % world:
        raise ConfigError(
            f"--seq-len {seq}: {gbs} sequences per global batch do not split over {world} "
            "processes; choose other lengths or pass --keep-batch-sequences"
        )
    micro = min(micro, gbs // world)
    while gbs % (micro * world):
        micro -= 1
    return gbs, micro


def _check_setting(setting: str, n_layers: int) -> None:
    digits = setting.isascii() and setting.isdigit()  # isdigit alone takes '²'
    if setting != "auto" and not (digits and len(setting) < 10 and int(setting) <= n_layers):
        raise ConfigError(
            f"--activation-checkpoint-layers: '{setting}' is not 'auto' or a layer "
            f"count in 0..{n_layers}"
        )


def shape_overrides(
    base: Recipe,
    max_seq_len: int,
    seq: int,
    cp: int | None,
    world: int,
    keep_seqs: bool,
    overrides: list[str],
) -> tuple[list[str], int, int]:
    """(overrides, global batch, micro-batch) that put the recipe at sequence length ``seq``
    and CP size ``cp`` (None: the recipe's, left unset) on ``world`` GPUs: the batch as the
    sweep keeps it (``batch_for``), the rotary positions long enough."""
    d = base.data
    ranks = max(world // (cp or base.sharding.context_parallel), 1)
    gbs, micro = batch_for(
        seq, d.seq_len, d.global_batch_size, d.micro_batch_size, ranks, keep_seqs
    )
    sets = [
        *overrides,
        f"data.seq_len={seq}",
        f"data.global_batch_size={gbs}",
        f"data.micro_batch_size={micro}",
        *([f"sharding.context_parallel={cp}"] if cp else []),
        *([f"model.max_seq_len={seq}"] if seq > max_seq_len else []),  # rotary: no table
    ]
    return sets, gbs, micro


def expand_configs(
    recipe_path: Path,
    overrides: list[str],
    seq_lens: list[int],
    checkpoints: list[str],
    steps: int,
    world: int,
    keep_seqs: bool,
    context_parallel: list[int] | None = None,
) -> list[SweepConfig]:
    """Every (sequence length, CP size, checkpoint setting), validated before anything
    runs; ``context_parallel``: the CP axis (default: the recipe's own, not in names)."""
    base, max_seq_len = base_recipe(recipe_path, overrides)
    for setting in checkpoints:
        _check_setting(setting, base.model.n_layers)
    configs = []
    for seq in seq_lens:
        for cp in context_parallel or [None]:
            sets, _, _ = shape_overrides(base, max_seq_len, seq, cp, world, keep_seqs, overrides)
            for setting in checkpoints:
                name = f"seq{seq}{f'-cp{cp}' if cp else ''}-ckpt{setting}"
                configs.append(_config(recipe_path, name, sets, setting, steps, world))
    return configs


def _config(
    recipe_path: Path, name: str, sets: list[str], setting: str, steps: int, world: int
) -> SweepConfig:
    """One configuration: the run's overrides, ``auto`` resolved, the planner's peak."""
    sets = [
        *sets,
        f"sharding.activation_checkpoint_layers={setting}",
        f"train.steps={steps}",
        "train.log_every=1",
        "checkpoint.dir=checkpoints",
        "checkpoint.enabled=false",
        "eval.every=0",
        "eval.at_end=false",
    ]
    recipe = load_recipe(recipe_path, sets)
    layers = (
        resolve_auto_checkpoint_layers(recipe, world, local_device())[0]
        if setting == "auto"
        else int(setting)
    )
    plan = plan_for_layers(recipe, world, layers)
    d = recipe.data
    return SweepConfig(
        name,
        d.seq_len,
        setting,
        layers,
        d.global_batch_size,
        d.micro_batch_size,
        sets,
        plan.tensor_peak_bytes,
        recipe.sharding.context_parallel,
    )


def sweep_dir_name(recipe_path: Path, stamp: str) -> Path:
    return Path("runs") / f"sweep-{recipe_path.stem}-{stamp}"
