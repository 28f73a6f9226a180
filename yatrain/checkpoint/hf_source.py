"""A Hugging Face Llama directory as ``train.init_from`` reads it: its config.json checked
against the recipe, its safetensors read a row range at a time.

safetensors maps each file and reads the slice asked for, so a rank that keeps rows
[r0, r1) of a tensor reads those rows only (the rotary permutation of ``wq``/``wk`` maps
them to other rows of the same heads, which are read instead), and copies them straight
into the materialised parameter (cast there). Nothing is kept between reads: a file is
opened for one chunk of rows (``CHUNK_NUMEL``) and closed again, so the mapped pages and
the copies in flight stay a few MiB however large the tensor. Every file's header is
checked first (``safetensors_header``: F32, BF16 and F16 weights only, every field in
range), and every chunk read is checked finite: a file that would load wrong weights is
refused in one line naming the file and the tensor.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

from yatrain.checkpoint.safetensors_header import TensorEntry, read_header
from yatrain.common import format_bytes
from yatrain.errors import ConfigError
from yatrain.models import hf
from yatrain.recipe.config import ModelConfig
from yatrain.recipe.schema import to_dict

Rows = tuple[int, int] | None  # [r0, r1) of a tensor's first dimension; None: all of it
CHUNK_NUMEL = 2**22  # elements read per opening of a file: 8 MiB of bf16


class RowSlice(Protocol):
    """What ``safe_open(...).get_slice`` returns (untyped in safetensors): rows on indexing."""

    def __getitem__(self, rows: slice) -> torch.Tensor: ...


# The keys of the recipe's model section a directory must agree with.
_COMPARED = (
    *("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"),
    *("rope_theta", "norm_eps", "rope_scaling", "tie_embeddings"),
)


class HFSource:
    """Tensors of one Hugging Face directory in our layout; counts the bytes it read."""

    def __init__(self, source: Path, cfg: ModelConfig) -> None:
        self.source, self.cfg, self.where = source, cfg, f"train.init_from {source}"
        try:
            config = json.loads(regular_file(source / "config.json", self.where).read_text())
            theirs = hf.model_config_from_hf(config)
        except (OSError, ValueError) as error:
            raise ConfigError(f"{self.where}: config.json is unreadable ({error})") from None
        except RecursionError:
            raise ConfigError(
                f"{self.where}: config.json is nested too deeply to be a model's config"
            ) from None
        except ConfigError as error:
            raise ConfigError(f"{self.where}: {error}") from None
        if (why := hf.unsupported(config)) is not None:
            raise ConfigError(f"{self.where} uses {why}: refused rather than loaded wrongly")
        differs = [k for k in _COMPARED if getattr(theirs, k) != getattr(cfg, k)]
        if differs:
            detail = ", ".join(f"model.{k} {_show(cfg, k)} vs {_show(theirs, k)}" for k in differs)
            raise ConfigError(f"{self.where} has another architecture ({detail})")
        self.weight_map = _weight_map(source)
        _refuse_undescribed(set(self.weight_map), cfg, self.where)
        files = set(self.weight_map.values())
        self.headers = {file: read_header(source / file, self.where) for file in files}
        self.bytes_read = 0
        self.total_bytes = sum((source / file).stat().st_size for file in files)

    def fill(self, name: str, rows: Rows, param: torch.Tensor) -> None:
        """Copy rows [r0, r1) (all with None) of our parameter ``name`` into ``param``,
        a chunk of rows at a time, each through its own opening of the file (so no more
        than a chunk of it is mapped at once)."""
        key = hf.hf_name(name)
        entry = self._entry(key)
        at = f"{self.where}: {self.weight_map[key]}: tensor {key}"
        if entry.shape != tuple(param.shape):
            raise ConfigError(f"{at} has shape {entry.shape}, the model needs {tuple(param.shape)}")
        path = str(self.source / self.weight_map[key])
        first, end = rows if rows is not None else (0, entry.shape[0])
        step = max(1, CHUNK_NUMEL // max(param[0].numel(), 1)) if param.ndim > 1 else end
        for start in range(first, end, step):
            stop = min(start + step, end)
            wanted = hf.source_rows(name, range(start, stop), entry.shape[0], self.cfg)
            try:
                with safe_open(path, "pt") as f:
                    chunk = self._rows(f.get_slice(key), wanted)
            except SafetensorError as error:
                raise ConfigError(f"{at} cannot be read ({error}): replace the file") from None
            if not torch.isfinite(chunk).all():
                raise ConfigError(
                    f"{at} holds NaN or infinite values (in rows {start}-{stop - 1}): "
                    "these weights cannot train; replace the file"
                )
            param[start:stop].copy_(chunk)

    def _entry(self, key: str) -> TensorEntry:
        """The header entry of Hugging Face tensor ``key``, from the file the index names."""
        if key not in self.weight_map:
            raise ConfigError(f"{self.where} has no tensor {key}")
        file = self.weight_map[key]
        if key not in self.headers[file]:
            raise ConfigError(f"{self.where}: its index puts {key} in {file}, which lacks it")
        return self.headers[file][key]

    def _rows(self, part: RowSlice, wanted: list[int]) -> torch.Tensor:
        """Rows ``wanted`` (in that order) of a tensor, read as few contiguous runs."""
        if wanted == list(range(wanted[0], wanted[-1] + 1)):
            return self._count(part[wanted[0] : wanted[-1] + 1])
        needed = sorted(set(wanted))
        runs, start = [], needed[0]
        for previous, row in itertools.pairwise(needed):
            if row != previous + 1:
                runs.append(self._count(part[start : previous + 1]))
                start = row
        runs.append(self._count(part[start : needed[-1] + 1]))
        stacked = torch.cat(runs)
        position = {row: i for i, row in enumerate(needed)}
        return stacked[torch.tensor([position[row] for row in wanted])]

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def report(self) -> str:
        return (
            f"init_from {self.source}: this rank read {format_bytes(self.bytes_read)} of its "
            f"{format_bytes(self.total_bytes)} of weight files (its shard's rows and the norms)"
        )


def _show(cfg: ModelConfig, key: str) -> str:
    value = getattr(cfg, key)
    return json.dumps(to_dict(value)) if key == "rope_scaling" else str(value)


def _weight_map(source: Path) -> dict[str, str]:
    """Tensor name -> safetensors file of a Hugging Face directory, checked to stay in it."""
    where = f"train.init_from {source}"
    index = regular_file(source / "model.safetensors.index.json", where)
    single = regular_file(source / "model.safetensors", where)
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            weight_map = dict.fromkeys(read_header(single, where), single.name)
        else:
            raise ConfigError(
                f"{where} has no model.safetensors (or model.safetensors.index.json): only "
                "safetensors weights are read (a pytorch_model.bin is a pickle that could run "
                "code); save the model with safe_serialization=True"
            )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{where}: its safetensors index is unreadable ({error})") from None
    except RecursionError:  # valid JSON deeper than Python's recursion limit
        raise ConfigError(f"{where}: {index.name} is nested too deeply to be an index") from None
    files = set(weight_map.values()) if isinstance(weight_map, dict) else {None}
    for file in files:
        if not isinstance(file, str) or "/" in file or "\\" in file or file in ("", ".", ".."):
            raise ConfigError(
                f"{where}: its index names {file!r}, which is not a file name inside the "
                "directory (weights are read only from the directory itself): fix the index"
            )
        if not file.endswith(".safetensors"):
            raise ConfigError(
                f"{where}: its index's weight_map names {file!r}, not a .safetensors file "
                "(weights are read only from safetensors): fix the index"
            )
        if not regular_file(source / file, where).is_file():
            raise ConfigError(f"{where}: the weight file {file!r} is missing")
    return weight_map


def regular_file(path: Path, where: str) -> Path:
    """``path``, unless it exists as something other than a regular file (a FIFO would
    block the read, a directory is not weights): then ConfigError naming it."""
    if path.exists() and not path.is_file():
        raise ConfigError(f"{where}: {path.name} is not a regular file: replace it with the file")
    return path


# Tensors a Hugging Face file may hold that are not weights (older Llama exports).
_NOT_WEIGHTS = ".rotary_emb.inv_freq"


def _refuse_undescribed(names: set[str], cfg: ModelConfig, where: str) -> None:
    """Tensors that config.json does not describe mean it understates the model (fewer
    layers, tied embeddings): loading the rest would train a truncated model."""
    extra = sorted(n for n in names - hf.hf_names(cfg) if not n.endswith(_NOT_WEIGHTS))
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise ConfigError(
            f"{where} holds tensors its config.json does not describe ({', '.join(extra[:3])}"
            f"{more}): the weights are of a larger model than config.json says; fix "
            "config.json (num_hidden_layers, tie_word_embeddings)"
        )
