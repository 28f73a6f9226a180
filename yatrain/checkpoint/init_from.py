"""``train.init_from``: start from a Hugging Face Llama directory or a yatrain checkpoint.

The engine materialises one unit at a time and asks for its weights (``InitHooks``),
naming the elements of each tensor this rank keeps: a Hugging Face directory is read
slice by slice (``hf_source.HFSource``), so each rank reads about its own share of the
model plus the norms, never the whole of it. A yatrain checkpoint is read one unit at a
time through ``open_checkpoint`` (restricted unpickling, checksums).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from yatrain.checkpoint.hf_source import HFSource, Rows, regular_file
from yatrain.checkpoint.manifest import MANIFEST, open_checkpoint
from yatrain.checkpoint.store import read_weights
from yatrain.errors import ConfigError
from yatrain.models.llama import Llama
from yatrain.recipe.config import ModelConfig
from yatrain.sharding import InitHooks
from yatrain.sharding.contract import Kept

Reader = Callable[[str, Rows, torch.Tensor], None]  # fill rows of the parameter named


def _unit_names(model: Llama) -> tuple[list[list[str]], list[str]]:
    """Qualified parameter names per unit (norms excluded), and the norms' names."""
    prefix = {id(module): name for name, module in model.named_modules()}
    norm_ids = {id(m) for m in model.norm_modules()}
    norm_names = [
        f"{prefix[id(m)]}.{n}" for m in model.norm_modules() for n, _ in m.named_parameters()
    ]
    units = []
    for unit in model.units():
        names = []
        for sub in unit.modules():
            if id(sub) in norm_ids:
                continue
            for attr, _ in sub.named_parameters(recurse=False):
                names.append(f"{prefix[id(sub)]}.{attr}")
        units.append(names)
    return units, norm_names


def _rows(kept: tuple[int, int], param: torch.Tensor) -> tuple[int, int]:
    """The rows (first dimension) holding the kept elements [lo, hi) of ``param``."""
    row = param[0].numel()
    return kept[0] // row, -(-kept[1] // row)


def init_from_source(
    source: Path, cfg: ModelConfig, model: Llama, *, verify: bool = True
) -> InitHooks:
    """Engine hooks that fill each freshly materialised unit from ``source``: of each
    tensor only the rows this rank keeps (a Hugging Face directory), or whole units."""
    unit_names, norm_names = _unit_names(model)
    report = None
    if regular_file(source / "config.json", f"train.init_from {source}").is_file():
        hf_source = HFSource(source, cfg)
        read: Reader = hf_source.fill
        report = hf_source.report
    elif (source / MANIFEST).is_file():
        read = _checkpoint_reader(source, cfg, verify)
    else:
        raise ConfigError(
            f"train.init_from {source} is neither a Hugging Face Llama directory (config.json "
            f"and safetensors) nor a yatrain checkpoint ({MANIFEST})"
        )

    @torch.no_grad()
    def fill(names: list[str], kept: Kept | None) -> None:
        for name in names:
            if kept is not None and name not in kept:
                continue  # this rank keeps none of it
            param = model.get_parameter(name)
            rows = None if kept is None or param.ndim < 2 else _rows(kept[name], param)
            read(name, rows, param)

    return InitHooks(
        lambda index, kept: fill(unit_names[index], kept), lambda: fill(norm_names, None), report
    )


def _checkpoint_reader(source: Path, cfg: ModelConfig, verify: bool) -> Reader:
    fix = "train.init_from needs a recipe with the checkpoint's model shape"
    saved = open_checkpoint(source, cfg, fix=fix, verify=verify)
    entry_of = {name: entry for entry in saved.layout for name, _, _ in entry.params}
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def read(name: str, rows: Rows, param: torch.Tensor) -> None:
        entry = entry_of[name]
        if entry.key not in cache:  # one unit in memory at a time
            cache.clear()
            cache[entry.key] = read_weights(saved, entry)
        full = cache[entry.key][name]
        if full.shape != param.shape:
            raise ConfigError(
                f"train.init_from {source}: {name} has shape {tuple(full.shape)}, the model "
                f"needs {tuple(param.shape)}"
            )
        first, end = rows if rows is not None else (0, len(full))
        if not torch.isfinite(full[first:end]).all():
            raise ConfigError(
                f"train.init_from {source}: {name} holds NaN or infinite values: these weights "
                "cannot train; start from an earlier checkpoint"
            )
        param[first:end].copy_(full[first:end])

    return read
