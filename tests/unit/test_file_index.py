"""The file index beside a manifest: large data opens without parsing the manifest, reads
the same tokens, and an index that does not match its manifest (edited, damaged, half
written) is ignored, so the manifest stays the truth and every directory stays valid."""

import json
import os
import shutil

import numpy as np
import pytest
from test_data import _fake_data

from yatrain.data import file_index
from yatrain.data import shards as shards_module
from yatrain.data.file_index import INDEX, read_file_index, write_file_index
from yatrain.data.manifest import MANIFEST, load_manifest
from yatrain.data.shards import TokenShards
from yatrain.errors import DataError


@pytest.fixture
def indexed(tmp_path, monkeypatch):
    """Large data (files checked when first read) with an index, as prepare-data writes."""
    monkeypatch.setattr(shards_module, "_VERIFY_MAX_BYTES", 0)
    path = _fake_data(tmp_path / "large", num_tokens=1000, shard_tokens=37).path
    write_file_index(path, load_manifest(path))
    return path


def _refuse_manifest(monkeypatch):
    """Make reading the whole manifest an error: what the index must spare a rank."""

    def parse(path, part=False):
        raise AssertionError(f"the manifest of {path} was parsed")

    monkeypatch.setattr(file_index, "load_manifest", parse)
    monkeypatch.setattr(shards_module, "load_manifest", parse)


def test_prepare_data_writes_a_current_index(small_data):
    indexed = read_file_index(small_data)
    manifest = load_manifest(small_data)
    assert indexed is not None
    for split, part in (("train", manifest), ("validation", manifest["validation"])):
        table = indexed.tables[split]
        assert [table.name(i) for i in range(len(table))] == [f["name"] for f in part["files"]]
        ends = np.cumsum([f["num_tokens"] for f in part["files"]]).tolist()
        assert [table.end(i) for i in range(len(table))] == ends
        tokens = sorted({0, *ends, *(e - 1 for e in ends)})
        expected = np.searchsorted(ends, tokens, side="right").tolist()
        assert [table.locate(token) for token in tokens] == expected
    assert "files" not in indexed.manifest and "files" not in indexed.manifest["validation"]


def test_large_data_opens_from_the_index_alone(indexed, monkeypatch):
    _refuse_manifest(monkeypatch)
    shards = TokenShards.open(indexed)
    assert np.array_equal(shards.read(0, 1000), np.arange(1000))
    assert np.array_equal(shards.read(30, 50), np.arange(30, 80))


def test_small_data_hashes_its_files_from_the_manifest(indexed, monkeypatch):
    monkeypatch.setattr(shards_module, "_VERIFY_MAX_BYTES", 10**9)
    file = indexed / "tokens-00003.bin"
    file.write_bytes(bytes(reversed(file.read_bytes())))  # same size, other bytes
    with pytest.raises(DataError, match="fails its sha256 check"):
        TokenShards.open(indexed)


def _same_size_edit(path):
    """Move a token from file 0 to file 1 in the manifest, keeping its size and modification
    time (an edit within the clock's tick): only the content fingerprint differs."""
    manifest = path / MANIFEST
    stat = manifest.stat()
    text = manifest.read_text().replace('"num_tokens": 37,', '"num_tokens": 36,', 1)
    manifest.write_text(text.replace('"num_tokens": 37,', '"num_tokens": 38,', 1))
    os.utime(manifest, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_an_edited_manifest_is_read_not_the_index(indexed):
    _same_size_edit(indexed)
    assert read_file_index(indexed) is None
    with pytest.raises(DataError, match="has 74 bytes, the manifest says 72"):
        TokenShards.open(indexed).read(0, 10)


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: (p / INDEX).write_text("{not json"),
        lambda p: (p / INDEX).write_text(json.dumps({"format": "yatrain-file-index-v0"})),
        lambda p: (p / "file-index.train-ends.npy").unlink(),
        lambda p: np.save(p / "file-index.train-ends.npy", np.arange(3, dtype=np.int64)),
        lambda p: np.save(p / "file-index.train-ends.npy", np.array([object()]), allow_pickle=True),
        lambda p: (p / "file-index.train-names.npy").write_bytes(b"\x93NUMPY garbage"),
    ],
    ids=["header-not-json", "other-format", "array-gone", "wrong-ends", "pickle", "garbage"],
)
def test_a_damaged_index_falls_back_to_the_manifest(indexed, damage):
    damage(indexed)
    assert read_file_index(indexed) is None
    assert np.array_equal(TokenShards.open(indexed).read(0, 1000), np.arange(1000))


def test_a_directory_copied_without_file_times_reads_its_manifest(indexed, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(indexed, copy, copy_function=shutil.copyfile)  # new modification times
    assert read_file_index(copy) is None
    assert np.array_equal(TokenShards.open(copy).read(0, 1000), np.arange(1000))


def test_a_part_is_refused_from_its_index_too(indexed, monkeypatch):
    manifest = load_manifest(indexed)
    manifest["part"] = {"index": 0, "count": 2}
    (indexed / MANIFEST).write_text(json.dumps(manifest))
    write_file_index(indexed, manifest)
    _refuse_manifest(monkeypatch)
    with pytest.raises(DataError, match="is part 0/2 of a data set prepared in parts"):
        TokenShards.open(indexed)
