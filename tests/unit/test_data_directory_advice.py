"""What a data path that is not a whole tokenized data set is told: '.', '/' or '' without
a manifest get advice (not a traceback), a sharded output not merged yet is told to run
--merge, and one part of a sharded output is refused as training data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizer_fixtures import sample_texts

from yatrain.data import TokenShards, train_tokenizer
from yatrain.data.manifest import load_manifest
from yatrain.data.merge import merge_parts
from yatrain.data.parts import prepare_part
from yatrain.errors import DataError

OPTIONS = dict(progress=False, workers=1, shard_tokens=700, val_fraction=0.0)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """Two parts of a corpus, not merged."""
    root = tmp_path_factory.mktemp("sharded")
    model = train_tokenizer(sample_texts(), root / "sp", 400)
    inputs = root / "a.jsonl"
    inputs.write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_texts(30)))
    for index in range(2):
        prepare_part(root / "out", [inputs], model, (index, 2), **OPTIONS)
    return root / "out"


@pytest.mark.parametrize("name", [".", "", "/"])
def test_a_nameless_path_without_a_manifest_gets_advice(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.md").write_text("some text")
    with pytest.raises(DataError) as error:
        load_manifest(Path(name))
    message = str(error.value)
    assert "is not tokenized data" in message and "\n" not in message
    if name != "/":
        assert f"--output {tmp_path}-tokenized" in message


def test_a_sharded_output_not_merged_yet_is_told_to_merge(sharded):
    with pytest.raises(DataError) as error:
        TokenShards.open(sharded)
    message = str(error.value)
    assert f"yatrain prepare-data --merge {sharded}" in message and "--input" not in message


def test_one_part_of_a_sharded_output_is_not_training_data(sharded, tmp_path):
    part = sharded / "parts" / "part-00000-of-00002"
    for _ in range(2):  # before the merge and after it
        with pytest.raises(DataError) as error:
            TokenShards.open(part)
        message = str(error.value)
        assert "is part 0/2 of a data set prepared in parts" in message
        assert f"use {sharded}" in message and "--merge" in message
        merge_parts(sharded)
