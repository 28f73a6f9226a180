"""Checkpoint files read without trusting them: DCP's index unpickled with nothing but
DCP's metadata classes (of ``torch``, its dtypes only) and storage paths that are plain
names inside the checkpoint; a manifest whose layout is not its model's refused; a
safetensors header's sizes whole numbers, never booleans. Every file is written here by
hand, a few hundred bytes each: no training run, no DCP save."""

from __future__ import annotations

import io
import json
import pickle
import re
import struct
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from yatrain.checkpoint.checksums import HASH, hash_file
from yatrain.checkpoint.manifest import FORMAT, MANIFEST, CorruptCheckpoint, open_checkpoint
from yatrain.checkpoint.safe_load import (
    METADATA,
    SafeReader,
    SafeUnpickler,
    UnsafeCheckpoint,
    data_files,
    read_metadata,
)
from yatrain.checkpoint.safetensors_header import TensorEntry, read_header
from yatrain.errors import ConfigError


class SavesAFile:
    """Unpickling this calls ``torch.save(..., target)``: a file written on load."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return torch.save, ({"planted": 1}, str(self.target))


def naming_torch_save(target: Path) -> bytes:
    """A pickle calling ``torch.save``, named as ``torch.save`` (pickle itself writes
    ``torch.serialization.save``): protocol 2 names it in one GLOBAL opcode."""
    data = pickle.dumps(SavesAFile(target), protocol=2)
    assert data.count(b"ctorch.serialization\nsave\n") == 1
    return data.replace(b"ctorch.serialization\nsave\n", b"ctorch\nsave\n")


def test_a_metadata_naming_a_torch_function_is_refused_before_it_runs(tmp_path):
    target, checkpoint = tmp_path / "written-on-load", tmp_path / "step-4"
    checkpoint.mkdir()
    exploit = naming_torch_save(target)
    (checkpoint / METADATA).write_bytes(exploit)
    with pytest.raises(UnsafeCheckpoint, match=r"^torch\.save$"):
        read_metadata(checkpoint)
    assert not target.exists()
    pickle.loads(exploit)  # the same bytes, unpickled plainly: the file is written
    assert target.is_file()


@pytest.mark.parametrize("name", ["save", "load", "tensor", "Tensor", "ones"])
def test_the_unpickler_takes_of_torch_only_its_dtypes_and_size(name):
    for allowed in (torch.float32, torch.bfloat16, torch.int64, torch.Size([2, 3])):
        assert SafeUnpickler(io.BytesIO(pickle.dumps(allowed))).load() == allowed
    with pytest.raises(UnsafeCheckpoint, match=rf"^torch\.{name}$"):
        SafeUnpickler(io.BytesIO(f"ctorch\n{name}\n.".encode())).load()


def write_metadata(checkpoint: Path, storage_paths: list[str]) -> None:
    storage = {
        MetadataIndex(f"w{i}"): _StorageInfo(path, 0, 4) for i, path in enumerate(storage_paths)
    }
    metadata = Metadata(state_dict_metadata={}, storage_data=storage)
    checkpoint.mkdir()
    (checkpoint / METADATA).write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("path", ["../../../x", "sub/../../x", "/etc/passwd", "..", "", "a\\b"])
def test_a_storage_path_outside_the_checkpoint_is_refused(tmp_path, path):
    """DCP reads each tensor from ``checkpoint / relative_path``: a path out of it is a
    read anywhere, refused by ``read_metadata`` and by the reader every load goes through."""
    checkpoint = tmp_path / "step-4"
    write_metadata(checkpoint, ["__0_0.distcp", path])
    refusal = rf"^a storage path {re.escape(repr(path))} outside the checkpoint$"
    with pytest.raises(UnsafeCheckpoint, match=refusal):
        read_metadata(checkpoint)
    with pytest.raises(UnsafeCheckpoint, match=refusal):
        SafeReader(checkpoint)


def test_storage_paths_that_are_plain_names_are_read(tmp_path):
    checkpoint = tmp_path / "step-4"
    write_metadata(checkpoint, ["__0_0.distcp", "__1_0.distcp", "..distcp"])
    assert data_files(read_metadata(checkpoint)) == {"__0_0.distcp", "__1_0.distcp", "..distcp"}


MODEL = {"dim": 16, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 32}
MODEL |= {"vocab_size": 64, "max_seq_len": 16}
EMBEDDING = 64 * 16
LAYER = 16 * 16 + 2 * (16 * 8) + 16 * 16 + 3 * (16 * 32)  # wq, wk and wv (1 kv head), wo; ffn
NORMS = (2 * 2 + 1) * 16  # two in each layer, one before the head
LAYOUT = [EMBEDDING, LAYER, LAYER, EMBEDDING, NORMS]  # embedding, the layers, head, norms


def write_checkpoint(checkpoint: Path, unit_numels: list[int]) -> bytes:
    """A checkpoint of MODEL holding no tensors; its manifest's bytes."""
    checkpoint.mkdir()
    (checkpoint / METADATA).write_bytes(
        pickle.dumps(Metadata(state_dict_metadata={}, storage_data={}))
    )
    entry = {
        "bytes": (checkpoint / METADATA).stat().st_size,
        HASH: hash_file(checkpoint / METADATA),
    }
    manifest = {"format": FORMAT, "step": 4, "world_size_at_save": 1}
    manifest |= {"unit_numels": unit_numels, "files": {METADATA: entry}, "model": MODEL}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    return (checkpoint / MANIFEST).read_bytes()


@pytest.mark.parametrize(
    "edit",
    [
        lambda n: [n[1], n[0], *n[2:]],  # two units swapped: as many, the same total
        lambda n: [n[0] + 1, n[1] - 1, *n[2:]],  # an element moved to the next unit
        lambda n: [*n, 16],  # one unit more
    ],
    ids=["swapped", "moved", "one-more"],
)
def test_a_manifest_whose_layout_is_not_its_models_is_refused(tmp_path, edit):
    write_checkpoint(tmp_path / "good", LAYOUT)
    assert [entry.numel for entry in open_checkpoint(tmp_path / "good").layout] == LAYOUT
    checkpoint = tmp_path / "edited"
    manifest = write_checkpoint(checkpoint, edit(LAYOUT))
    with pytest.raises(CorruptCheckpoint, match="its manifest's layout is not its model's"):
        open_checkpoint(checkpoint, verify=False)
    assert (checkpoint / MANIFEST).read_bytes() == manifest
    assert sorted(p.name for p in checkpoint.iterdir()) == [METADATA, MANIFEST]


def write_safetensors(path: Path, header: dict, data_bytes: int) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_bytes))


@pytest.mark.parametrize(
    "tensor,complaint",
    [
        ({"shape": [True, 4], "data_offsets": [0, 16]}, "shape [True, 4] is not a list of sizes"),
        ({"shape": [4, False], "data_offsets": [0, 0]}, "shape [4, False] is not a list of sizes"),
        ({"shape": [4], "data_offsets": [False, 16]}, "data_offsets [False, 16] are not two"),
    ],
)
def test_a_safetensors_size_that_is_a_boolean_is_refused_in_our_line(tmp_path, tensor, complaint):
    """JSON's ``true`` is Python's 1: taken as a size, safetensors refuses the file later
    with its own error instead of this line naming the file and the field."""
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"w": {"dtype": "F32", **tensor}}, 16)
    with pytest.raises(
        ConfigError, match=rf"^hf: model\.safetensors: tensor w: {re.escape(complaint)}"
    ):
        read_header(path, "hf")
    write_safetensors(path, {"w": {"dtype": "F32", "shape": [1, 4], "data_offsets": [0, 16]}}, 16)
    assert read_header(path, "hf") == {"w": TensorEntry("F32", (1, 4), 0, 16)}
