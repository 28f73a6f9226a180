"""A checkpoint directory's manifest (written last, read first) and whether to trust it.

``yatrain-checkpoint.json`` records the format, the step, the model and its saved layout, the
loader position, and every file's size and CRC32. ``open_checkpoint`` is the one validation
path: resume, ``yatrain export`` and ``train.init_from`` all go through it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from yatrain.common import GIB
from yatrain.config import ModelConfig
from yatrain.errors import ConfigError, YatrainError
from yatrain.models.llama import build_model
from yatrain.sharding import StateEntry, describe_state
from yatrain.train.files import crc32

MANIFEST = "yatrain-checkpoint.json"
FORMAT = "yatrain-checkpoint-v1"
_CHECKSUM_MAX_BYTES = 2 * GIB  # above this, sizes only: hashing would dominate save time
RESUME_FIX = "resume it with its own recipe, or start a new --run-dir"


class CheckpointError(YatrainError):
    """A checkpoint is missing, incomplete, corrupt or belongs to another model."""


class ModelMismatch(CheckpointError, ConfigError):
    """A good checkpoint of another model shape than the recipe's."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """A validated checkpoint: its manifest, the model it holds and its saved layout."""

    path: Path
    manifest: dict
    model: ModelConfig
    layout: list[StateEntry]

    @property
    def step(self) -> int:
        return self.manifest["step"]


def file_table(folder: Path) -> dict[str, dict]:
    """Every file's size, and its CRC32 when the whole checkpoint is small enough."""
    files = {path.name: {"bytes": path.stat().st_size} for path in sorted(folder.iterdir())}
    if sum(f["bytes"] for f in files.values()) <= _CHECKSUM_MAX_BYTES:
        for name in files:
            files[name]["crc32"] = crc32(folder / name)
    return files


def complete_checkpoints(root: Path) -> list[Path]:
    """``step-N`` directories with a manifest, newest first."""
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        suffix = path.name.removeprefix("step-")
        if suffix.isdigit() and (path / MANIFEST).is_file():
            found.append((int(suffix), path))
    return [p for _, p in sorted(found, reverse=True)]


def open_checkpoint(
    path: Path, model: ModelConfig | None = None, fix: str = RESUME_FIX
) -> SavedCheckpoint:
    """The checkpoint at ``path`` if it is complete, intact and (when ``model`` is given) of
    that model; else CheckpointError (``ModelMismatch``, saying ``fix``, for another model)."""
    manifest = _read_manifest(path)
    _check_files(path, manifest)
    try:
        saved = ModelConfig(**manifest["model"])
    except (KeyError, TypeError):
        raise CheckpointError(f"checkpoint {path}: its manifest has no valid model") from None
    if model is not None and saved != model:
        current = dataclasses.asdict(model)
        theirs = dataclasses.asdict(saved)
        detail = ", ".join(
            f"model.{k} {theirs[k]} -> {v}" for k, v in current.items() if theirs[k] != v
        )
        raise ModelMismatch(f"checkpoint {path} was saved for another model ({detail}): {fix}")
    layout = describe_state(build_model(saved))
    if manifest.get("unit_numels") != [entry.numel for entry in layout]:
        raise CheckpointError(
            f"checkpoint {path} was saved for another model (layout differs): {fix}"
        )
    return SavedCheckpoint(path, manifest, saved, layout)


def _read_manifest(path: Path) -> dict:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} is not a complete yatrain checkpoint (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{manifest_path} is unreadable ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{manifest_path}: unknown format {found!r}")
    return manifest


def _check_files(path: Path, manifest: dict) -> None:
    for name, expect in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        if file.stat().st_size != expect["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} has {file.stat().st_size} bytes, "
                f"the manifest says {expect['bytes']} (truncated or replaced)"
            )
        if "crc32" in expect and crc32(file) != expect["crc32"]:
            raise CheckpointError(f"checkpoint {path}: {name} is corrupt (checksum mismatch)")
