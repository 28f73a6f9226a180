"""A checkpoint directory's manifest (written last, read first) and whether to trust it.

``yatrain-checkpoint.json`` records the format, the step, the model and its saved layout, the
loader position, and every file's size and XXH3-64 checksum. ``open_checkpoint`` is the one
validation path: resume, ``yatrain export``, ``train.init_from`` (and anything else that
reads a checkpoint) go through it. In order, cheapest first: the manifest against its schema
(types and required fields, so nothing later trips on a wrong type), every listed file's
presence and size, DCP's ``.metadata`` through the restricted unpickler (``safe_load``: a
pickle that would run code is refused), the model, and last the checksums (``verify``).

A reader of a running job's checkpoints (``eval``, ``generate``, ``export``) can lose the
checkpoint mid-read to the job's rotation (``checkpoint.keep``): ``reading`` names that as
what happened, with the checkpoint to read instead, rather than as damage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from yatrain.checkpoint.checksums import HASH, LEGACY_HASH, file_matches
from yatrain.checkpoint.safe_load import METADATA, UnsafeCheckpoint, data_files, read_metadata
from yatrain.common import DTYPES
from yatrain.errors import ConfigError, YatrainError
from yatrain.models.llama import build_model
from yatrain.recipe.config import ModelConfig
from yatrain.recipe.schema import build_dataclass
from yatrain.sharding import StateEntry, describe_state

MANIFEST = "yatrain-checkpoint.json"
FORMAT = "yatrain-checkpoint-v2"  # v2: XXH3-64 of every file; v1: CRC32 up to 2 GiB only
READABLE_FORMATS = ("yatrain-checkpoint-v1", FORMAT)
RESUME_FIX = "resume it with its own recipe, or start a new --run-dir"
NO_VERIFY = "pass --no-verify to load it without checksums"


class CheckpointError(YatrainError):
    """A checkpoint is missing, incomplete, corrupt or belongs to another model."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose files are damaged or untrustworthy: never to be loaded or kept."""


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


def complete_checkpoints(root: Path) -> list[Path]:
    """``step-N`` directories with a manifest, newest first (``corrupt-step-N`` is not)."""
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        suffix = path.name.removeprefix("step-")
        if suffix.isascii() and suffix.isdigit() and (path / MANIFEST).is_file():
            found.append((int(suffix), path))
    return [p for _, p in sorted(found, reverse=True)]


class CheckpointRemoved(CheckpointError):
    """A checkpoint deleted or moved away while it was being read."""


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Read the checkpoint at ``path`` inside this block: an error raised once a file that was
    there when it began is gone (the directory deleted or moved, as a running job's rotation
    does) becomes one ``CheckpointRemoved`` line naming the newest checkpoint beside it."""
    path = Path(path)
    try:
        present = [entry.name for entry in path.iterdir()]
    except OSError:  # not there (or not a directory): the reader's own checks say so
        present = []
    try:
        yield
    except Exception as error:
        if not present or all((path / name).exists() for name in present):
            raise
        raise CheckpointRemoved(_removed(path)) from error


def _removed(path: Path) -> str:
    newest = next((p for p in complete_checkpoints(path.parent) if p != path), None)
    instead = f"the newest now is {newest}" if newest else "point at one that is still there"
    return (
        f"checkpoint {path} was removed while it was being read (a running job's "
        f"checkpoint.keep rotation deletes older checkpoints): read another; {instead}"
    )


def open_checkpoint(
    path: Path, model: ModelConfig | None = None, fix: str = RESUME_FIX, *, verify: bool = True
) -> SavedCheckpoint:
    """The checkpoint at ``path`` if it is complete, intact, safe to read and (when ``model``
    is given) of that model; else CheckpointError: ``CorruptCheckpoint`` for damaged or
    unsafe files, ``ModelMismatch`` (saying ``fix``) for another model. ``verify=False``
    skips the checksums, the one step that reads every byte."""
    manifest = read_manifest(path)
    check_files(path, manifest)
    saved = _saved_model(path, manifest)
    if model is not None and saved != model:
        current, theirs = dataclasses.asdict(model), dataclasses.asdict(saved)
        detail = ", ".join(
            f"model.{k} {theirs[k]} -> {v}" for k, v in current.items() if theirs[k] != v
        )
        raise ModelMismatch(f"checkpoint {path} was saved for another model ({detail}): {fix}")
    layout = describe_state(build_model(saved))
    if manifest["unit_numels"] != [entry.numel for entry in layout]:
        raise CorruptCheckpoint(f"checkpoint {path}: its manifest's layout is not its model's")
    if verify:
        verify_files(path, manifest, list(manifest["files"]))
    return SavedCheckpoint(path, manifest, saved, layout)


def read_manifest(path: Path) -> dict:
    """The manifest of ``path``, checked against its schema (CorruptCheckpoint if not)."""
    manifest_path = path / MANIFEST
    if manifest_path.is_symlink():
        raise CorruptCheckpoint(f"checkpoint {path}: {MANIFEST} is a symbolic link: refused")
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} is not a complete yatrain checkpoint (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        raise CorruptCheckpoint(f"{manifest_path} is unreadable ({error})") from None
    except RecursionError:  # valid JSON deeper than Python's recursion limit
        raise CorruptCheckpoint(
            f"{manifest_path} is invalid: nested too deeply to be a manifest"
        ) from None
    problem = _schema_problem(manifest)
    if problem is not None:
        raise CorruptCheckpoint(f"{manifest_path} is invalid: {problem}")
    return manifest


_FIELDS = {  # key: (type, required)
    "format": (str, True),
    "step": (int, True),
    "world_size_at_save": (int, True),
    "unit_numels": (list, True),
    "files": (dict, True),
    "model": (dict, True),
    "yatrain_version": (str, False),
    "loader": (dict, False),
    "tokens_seen": (int, False),
    "skipped_steps": (int, False),
    "dtype": (str, False),
    "optimizer": (str, False),  # optim.name; absent: adamw (written before Muon)
    "recipe_sha256": (str, False),
    "recipe": (dict, False),
}


def _schema_problem(manifest: object) -> str | None:
    """What is wrong with a parsed manifest, or None."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    if manifest.get("format") not in READABLE_FORMATS:
        return f"unknown format {manifest.get('format')!r}"
    for key, (kind, required) in _FIELDS.items():
        if key not in manifest:
            if required:
                return f"the required field {key!r} is missing"
        elif not _is(manifest[key], kind):
            return f"{key!r} is {manifest[key]!r}, not a {kind.__name__}"
    if manifest["step"] < 0 or manifest["world_size_at_save"] < 1:
        return "its step or world size is out of range"
    if not all(_is(n, int) and n > 0 for n in manifest["unit_numels"]):
        return "'unit_numels' must list positive whole numbers"
    if manifest.get("dtype", "fp32") not in DTYPES:
        return f"unknown dtype {manifest['dtype']!r}"
    if manifest.get("optimizer", "adamw") not in ("adamw", "muon"):
        return f"unknown optimizer {manifest['optimizer']!r}"
    for name, entry in manifest["files"].items():
        if problem := _file_entry_problem(name, entry):
            return f"files[{name!r}]: {problem}"
    if METADATA not in manifest["files"]:
        return f"it does not list DCP's {METADATA}"
    return None


def _file_entry_problem(name: str, entry: object) -> str | None:
    if "/" in name or "\\" in name or name in ("", ".", "..", MANIFEST):
        return "not a file name inside the checkpoint"
    if not isinstance(entry, dict) or not _is(entry.get("bytes"), int) or entry["bytes"] < 0:
        return "needs a whole number of 'bytes'"
    if HASH in entry and not (isinstance(entry[HASH], str) and len(entry[HASH]) == 16):
        return f"{HASH} must be 16 hex digits"
    if LEGACY_HASH in entry and not _is(entry[LEGACY_HASH], int):
        return f"{LEGACY_HASH} must be a whole number"
    return None


def _is(value: object, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _saved_model(path: Path, manifest: dict) -> ModelConfig:
    try:
        return build_dataclass(ModelConfig, manifest["model"], prefix="model.")
    except ConfigError as error:
        raise CorruptCheckpoint(
            f"checkpoint {path}: its manifest's model is invalid ({error})"
        ) from None


def check_files(path: Path, manifest: dict) -> None:
    """Every listed file present at its size, and DCP's index safe and within the listing."""
    for name, expect in manifest["files"].items():
        file = path / name
        if file.is_symlink():  # checked first: nothing about the file it points to is told
            raise CorruptCheckpoint(
                f"checkpoint {path}: {name} is a symbolic link; a checkpoint holds its own "
                "files only: refused"
            )
        if not file.is_file():
            raise CorruptCheckpoint(f"checkpoint {path} is missing {name}")
        if file.stat().st_size != expect["bytes"]:
            raise CorruptCheckpoint(
                f"checkpoint {path}: {name} has {file.stat().st_size} bytes, "
                f"the manifest says {expect['bytes']} (truncated or replaced)"
            )
    try:
        metadata = read_metadata(path)
    except UnsafeCheckpoint as error:
        raise CorruptCheckpoint(
            f"checkpoint {path} is unsafe: its {METADATA} holds {error}, which is not "
            "checkpoint metadata and could run code when loaded; refused"
        ) from None
    except Exception as error:  # the unpickler runs no code: anything else is damage
        raise CorruptCheckpoint(
            f"checkpoint {path}: its {METADATA} is unreadable ({type(error).__name__}: {error})"
        ) from None
    unlisted = sorted(data_files(metadata) - set(manifest["files"]))
    if unlisted:
        raise CorruptCheckpoint(f"checkpoint {path}: {unlisted[0]} is not in its manifest")


def verify_files(path: Path, manifest: dict, names: list[str]) -> None:
    """Check the checksums of the listed files ``names`` (a share of them under torchrun)."""
    for name in names:
        matches = file_matches(path / name, manifest["files"][name])
        if matches is None:  # an old (v1) checkpoint above 2 GiB: not damaged, unchecked
            raise CheckpointError(f"checkpoint {path}: {name} has no checksum; {NO_VERIFY}")
        if not matches:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} is corrupt (checksum mismatch)")
