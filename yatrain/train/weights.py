"""Weights in and out: Hugging Face export, and ``train.init_from`` (HF directory or ours).

Both directions go one unit (embedding, decoder layer, head) at a time: export streams
units from the checkpoint into safetensors shards, and import fills each unit while the
engine materialises it, so neither ever holds the whole model.

Nothing read here can run code: our checkpoints go through ``open_checkpoint`` (restricted
unpickling, checksums), Hugging Face weights are read from safetensors only (never
``pytorch_model.bin``, a pickle), and a ``config.json`` we cannot honour is refused.
An export is written to ``.tmp-OUT-PID-XXXX`` and renamed when complete; one left by a killed
export is removed by the next export to the same place.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from yatrain.common import DTYPES, GIB
from yatrain.config import ModelConfig
from yatrain.data import export_tokenizer
from yatrain.errors import ConfigError
from yatrain.models import hf
from yatrain.models.llama import Llama
from yatrain.sharding import InitHooks
from yatrain.train.checkpoint import iter_full_weights, read_weights
from yatrain.train.manifest import MANIFEST, SavedCheckpoint, open_checkpoint

SHARD_BYTES = 4 * GIB


def iter_checkpoint_weights(path: Path, verify: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of a checkpoint in fp32, one unit in memory at a time."""
    yield from iter_full_weights(open_checkpoint(path, verify=verify))


# ---------------------------------------------------------------------- export


def export_hf(
    checkpoint: Path, output: Path, dtype: str | None = None, *, verify: bool = True
) -> Path:
    """A ``LlamaForCausalLM`` directory: config.json, sharded safetensors, the tokenizer."""
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output} is a file: name a new directory")
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"{output} already exists and is not empty: choose another --output")
    saved = open_checkpoint(checkpoint, verify=verify)
    cfg = saved.model
    dtype = dtype or saved.manifest.get("dtype", "fp32")
    _remove_stale_exports(output)
    tmp = output.parent / f".tmp-{output.name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir(parents=True)
    except OSError as error:
        raise ConfigError(
            f"cannot write {output} ({error.strerror}): choose another --output"
        ) from None
    try:
        weight_map, total = _write_safetensors(saved, DTYPES[dtype], tmp)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        bos, eos = _copy_tokenizer(checkpoint, tmp)
        (tmp / "config.json").write_text(json.dumps(hf.hf_config(cfg, dtype, bos, eos), indent=1))
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=1)
        )
        _same_permissions(tmp, tmp / "config.json")
        if output.exists():
            output.rmdir()
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def _same_permissions(folder: Path, like: Path) -> None:
    """Every file of ``folder`` with the permissions of ``like`` (a file written the usual
    way): safetensors writes its files readable by their owner only."""
    mode = like.stat().st_mode & 0o777
    for file in folder.iterdir():
        os.chmod(file, mode)


def _remove_stale_exports(output: Path) -> None:
    """Delete ``.tmp-OUT-PID-XXXX`` directories whose export process no longer runs."""
    for stale in output.parent.glob(f".tmp-{output.name}-*") if output.parent.is_dir() else []:
        pid = stale.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _write_safetensors(saved: SavedCheckpoint, torch_dtype: torch.dtype, folder: Path):
    """Stream units into files of at most SHARD_BYTES; name them once the count is known."""
    parts: list[tuple[Path, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = folder / f"part-{len(parts) + 1:05d}.safetensors"
        save_file(current, str(path), metadata={"format": "pt"})
        parts.append((path, list(current)))

    for name, tensor in iter_full_weights(saved):
        key, value = hf.to_hf(name, tensor.to(torch_dtype), saved.model)
        nbytes = value.numel() * value.element_size()
        if current and size + nbytes > SHARD_BYTES:
            flush()
            current, size = {}, 0
        current[key] = value.clone()
        size, total = size + nbytes, total + nbytes
    flush()
    weight_map = {}
    for number, (path, keys) in enumerate(parts, start=1):
        final = (
            "model.safetensors"
            if len(parts) == 1
            else (f"model-{number:05d}-of-{len(parts):05d}.safetensors")
        )
        path.rename(folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    return weight_map, total


def _copy_tokenizer(checkpoint: Path, folder: Path) -> tuple[int, int]:
    """The checkpoint's tokenizer in Hugging Face form; (BOS, EOS), Llama's 1, 2 without one."""
    return export_tokenizer(checkpoint, folder) or (1, 2)


# ---------------------------------------------------------------------- import (init_from)


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


def init_from_source(
    source: Path, cfg: ModelConfig, model: Llama, *, verify: bool = True
) -> InitHooks:
    """Engine hooks that fill each freshly materialised unit from ``source``."""
    unit_names, norm_names = _unit_names(model)
    if (source / "config.json").is_file():
        read = _hf_reader(source, cfg)
    elif (source / MANIFEST).is_file():
        read = _checkpoint_reader(source, cfg, verify)
    else:
        raise ConfigError(
            f"train.init_from {source} is neither a Hugging Face Llama directory (config.json "
            f"and safetensors) nor a yatrain checkpoint ({MANIFEST})"
        )

    @torch.no_grad()
    def fill(names: list[str]) -> None:
        for name in names:
            param = model.get_parameter(name)
            value = read(name)
            if value.shape != param.shape:
                raise ConfigError(
                    f"train.init_from {source}: {name} has shape {tuple(value.shape)}, the "
                    f"model needs {tuple(param.shape)}"
                )
            param.copy_(value.to(param.dtype))

    return InitHooks(lambda index: fill(unit_names[index]), lambda: fill(norm_names))


def _hf_reader(source: Path, cfg: ModelConfig) -> Callable[[str], torch.Tensor]:
    where = f"train.init_from {source}"
    try:
        config = json.loads((source / "config.json").read_text())
        theirs = hf.model_config_from_hf(config)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{where}: config.json is unreadable ({error})") from None
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    if (why := hf.unsupported(config)) is not None:
        raise ConfigError(f"{where} uses {why}: refused rather than loaded wrongly")
    keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "rope_theta",
            "norm_eps")  # fmt: skip
    differs = [k for k in keys if getattr(theirs, k) != getattr(cfg, k)]
    if differs:
        detail = ", ".join(f"model.{k} {getattr(cfg, k)} vs {getattr(theirs, k)}" for k in differs)
        raise ConfigError(f"{where} has another architecture ({detail})")
    weight_map = _weight_map(source)
    tied = hf.tied_embeddings(config)

    def read(name: str) -> torch.Tensor:
        key = hf.hf_name(name)
        if key not in weight_map and tied and name == "output.weight":
            key = hf.hf_name("tok_embeddings.weight")  # the head starts as the embedding
        if key not in weight_map:
            raise ConfigError(f"{where} has no tensor {key}")
        with safe_open(str(source / weight_map[key]), "pt") as f:
            return hf.from_hf(name, f.get_tensor(key), cfg)

    return read


def _weight_map(source: Path) -> dict[str, str]:
    """Tensor name -> safetensors file of a Hugging Face directory, checked to stay in it."""
    where = f"train.init_from {source}"
    index, single = source / "model.safetensors.index.json", source / "model.safetensors"
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with safe_open(str(single), "pt") as f:
                weight_map = dict.fromkeys(f.keys(), single.name)
        else:
            raise ConfigError(
                f"{where} has no model.safetensors (or model.safetensors.index.json): only "
                "safetensors weights are read (a pytorch_model.bin is a pickle that could run "
                "code); save the model with safe_serialization=True"
            )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{where}: its safetensors index is unreadable ({error})") from None
    files = set(weight_map.values()) if isinstance(weight_map, dict) else {None}
    for file in files:
        if not isinstance(file, str) or "/" in file or "\\" in file or file in ("", ".", ".."):
            raise ConfigError(
                f"{where}: its index names {file!r}, which is not a file name inside the "
                "directory (weights are read only from the directory itself): fix the index"
            )
        if not (source / file).is_file():
            raise ConfigError(f"{where}: the weight file {file!r} is missing")
    return weight_map


def _checkpoint_reader(
    source: Path, cfg: ModelConfig, verify: bool
) -> Callable[[str], torch.Tensor]:
    fix = "train.init_from needs a recipe with the checkpoint's model shape"
    saved = open_checkpoint(source, cfg, fix=fix, verify=verify)
    entry_of = {name: entry for entry in saved.layout for name, _, _ in entry.params}
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def read(name: str) -> torch.Tensor:
        entry = entry_of[name]
        if entry.key not in cache:  # one unit in memory at a time
            cache.clear()
            cache[entry.key] = read_weights(saved, entry)
        return cache[entry.key][name]

    return read
