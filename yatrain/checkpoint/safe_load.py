"""Reading DCP checkpoints without running code from them.

``torch.distributed.checkpoint`` stores its index (``.metadata``) as a pickle and reads it
back with plain ``pickle.load``: a crafted file runs any command on load. Checkpoints are
shared, and ``train.init_from`` exists for other people's weights, so every read here goes
through ``SafeUnpickler``, which admits only the classes DCP's metadata is made of (its
dataclasses, ``torch.Size``, dtypes, layouts, paths) and refuses anything else with
``UnsafeCheckpoint`` before it is called. Tensor data is read by DCP with
``torch.load(weights_only=True)``; ``SafeLoadPlanner`` refuses non-tensor items, which DCP's
default planner would unpickle with ``weights_only=False``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

METADATA = ".metadata"

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout from its name, a table lookup
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class UnsafeCheckpoint(Exception):
    """A checkpoint's metadata names something other than DCP metadata: it could run code."""


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that can build DCP metadata and nothing else (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # torch.float32 and friends
        raise UnsafeCheckpoint(f"{module}.{name}")


def read_metadata(path: Path) -> Metadata:
    """The DCP index of checkpoint ``path``, unpickled safely and checked to be one.

    Raises UnsafeCheckpoint for anything that is not plain DCP metadata, including storage
    entries that point outside the checkpoint directory; OSError when it cannot be read;
    ``pickle.UnpicklingError`` (and the like) when it is not a pickle."""
    with (path / METADATA).open("rb") as f:
        metadata = SafeUnpickler(f).load()
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpoint(f"an object of type {type(metadata).__name__}")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _plain_name(name):
            raise UnsafeCheckpoint(f"a storage path {name!r} outside the checkpoint")
    return metadata


def data_files(metadata: Metadata) -> set[str]:
    """The files of a checkpoint its DCP index reads tensors from."""
    return {info.relative_path for info in metadata.storage_data.values()}


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


class SafeReader(FileSystemReader):
    """DCP's file reader, handing DCP the metadata ``read_metadata`` read before the call
    (so a refusal is raised here, cleanly, not logged by DCP as it tries other files)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.metadata = read_metadata(Path(path))

    def read_metadata(self) -> Metadata:  # no rank argument: DCP tries no per-rank files
        metadata = self.metadata
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing non-tensor items: our checkpoints hold tensors
    only (the loader position is in the JSON manifest), and DCP would unpickle such an item
    with ``torch.load(weights_only=False)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise UnsafeCheckpoint(f"a pickled (non-tensor) item {read_item.dest_index.fqn!r}")
