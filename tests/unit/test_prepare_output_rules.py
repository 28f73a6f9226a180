"""What `prepare-data --shard I/N` and `--merge` may write, and where: an OUTPUT holds only
what prepare-data writes there, nothing is written through a link or over a user's file, a
part's folder name and its declared index agree, disagreeing parts name the minority, a
part finished twice or lost after the merge is not an error, and a full disk leaves
nothing cut. (The data set itself: test_prepare_parts.py, test_prepare_shards.py.)"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from faults import FullDisk
from tokenizer_fixtures import sample_texts

import yatrain.data.parts as parts_module
from yatrain.data import TokenShards, prepare_data, train_tokenizer
from yatrain.data.merge import merge_parts
from yatrain.data.parts import prepare_part
from yatrain.errors import DataError, YatrainError

OPTIONS = dict(progress=False, workers=1, shard_tokens=700, val_fraction=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return train_tokenizer(sample_texts(), tmp_path_factory.mktemp("sp") / "sp", 400)


@pytest.fixture()
def inputs(tmp_path) -> Path:
    path = tmp_path / "in" / "a.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_texts(45, seed=4)))
    return path


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry below ``root``: a file's bytes, a link's target, a folder's marker."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = (
            f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes() if p.is_file() else "/"
        )
    return out


def _parts(out: Path, inputs: Path, model: Path, count: int, **changes) -> None:
    for index in range(count):
        prepare_part(out, [inputs], model, (index, count), **{**OPTIONS, **changes})


def test_a_shard_output_holding_a_users_file_is_refused_before_tokenizing(tmp_path, inputs, model):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DataError) as error:
        prepare_part(out, [inputs], model, (0, 2), **OPTIONS)
    message = str(error.value)
    assert f"{out / 'notes.txt'}" in message and "not written by prepare-data" in message
    assert "\n" not in message
    assert _tree(out) == {"notes.txt": b"mine"}  # no parts/ either: refused before any work


@pytest.mark.parametrize("planted", ["tokenizer.model", ".manifest.json.tmp", "manifest.json"])
def test_the_merge_never_writes_over_or_through_a_users_file(tmp_path, inputs, model, planted):
    out = tmp_path / "out"
    _parts(out, inputs, model, 2)
    outside = tmp_path / "precious"
    outside.write_bytes(b"the user's own file")
    (out / planted).symlink_to(outside)
    before = _tree(out)
    with pytest.raises(YatrainError) as error:
        merge_parts(out)
    assert str(out / planted) in str(error.value) and "\n" not in str(error.value)
    assert outside.read_bytes() == b"the user's own file" and _tree(out) == before


def test_the_merge_keeps_a_users_tokenizer_model_in_output(tmp_path, inputs, model):
    out = tmp_path / "out"
    _parts(out, inputs, model, 2)
    (out / "tokenizer.model").write_bytes(b"someone else's tokenizer")
    with pytest.raises(DataError, match="is not the parts' tokenizer"):
        merge_parts(out)
    assert (out / "tokenizer.model").read_bytes() == b"someone else's tokenizer"
    assert not (out / "manifest.json").exists()


def test_a_part_copied_under_another_parts_name_is_refused(tmp_path, inputs, model):
    out = tmp_path / "out"
    _parts(out, inputs, model, 3)
    folder = out / "parts"
    shutil.rmtree(folder / "part-00002-of-00003")
    shutil.copytree(folder / "part-00000-of-00003", folder / "part-00002-of-00003")
    with pytest.raises(DataError) as error:
        merge_parts(out)
    message = str(error.value)
    assert "part-00002-of-00003 holds part 0/3" in message and "not 2/3" in message
    assert "--shard 2/3" in message and not (out / "manifest.json").exists()


def test_disagreeing_parts_name_the_minority_even_when_it_is_part_0(tmp_path, inputs, model):
    out = tmp_path / "out"
    prepare_part(out, [inputs], model, (0, 3), **{**OPTIONS, "val_fraction": 0.3})  # stale
    for index in (1, 2):
        prepare_part(out, [inputs], model, (index, 3), **OPTIONS)
    with pytest.raises(DataError) as error:
        merge_parts(out)
    message = str(error.value)
    assert "part-00000-of-00003" in message and "the options differ" in message
    assert "--val-fraction 0.0 --shard 0/3" in message and "part-00001" not in message
    assert not (out / "manifest.json").exists()


def test_a_tie_between_disagreeing_parts_names_both_sides(tmp_path, inputs, model):
    out = tmp_path / "out"
    prepare_part(out, [inputs], model, (0, 2), **OPTIONS)
    prepare_part(out, [inputs], model, (1, 2), **{**OPTIONS, "val_fraction": 0.3})
    with pytest.raises(DataError) as error:
        merge_parts(out)
    message = str(error.value)
    assert "part 0" in message and "part 1" in message and "the options differ" in message
    assert "keep the side" in message


def test_a_part_another_task_finished_meanwhile_is_complete(tmp_path, inputs, model, monkeypatch):
    """Two tasks of one part at once (a resubmitted array): the second to finish finds the
    part complete, which is success, not 'choose another directory'."""
    out = tmp_path / "out"
    real, raced = parts_module.tokenize, []

    def racing(*args, **kwargs):
        manifest = real(*args, **kwargs)
        if not raced:  # the other task completes the part before this one renames it
            raced.append(None)
            raced.append(prepare_part(out, [inputs], model, (0, 2), **OPTIONS))
        return manifest

    monkeypatch.setattr(parts_module, "tokenize", racing)
    manifest = prepare_part(out, [inputs], model, (0, 2), **OPTIONS)
    assert manifest["num_tokens"] == raced[1]["num_tokens"] > 0
    assert [p.name for p in (out / "parts").iterdir()] == ["part-00000-of-00002"]


def test_a_part_lost_after_the_merge_is_named_and_can_be_redone(tmp_path, inputs, model):
    out = tmp_path / "out"
    _parts(out, inputs, model, 3)
    merged = merge_parts(out)
    before = TokenShards.open(out).read(0, merged["num_tokens"])
    shutil.rmtree(out / "parts" / "part-00001-of-00003")
    with pytest.raises(DataError, match=r"part 1/3 .* is missing: run `yatrain prepare-data"):
        merge_parts(out)
    prepare_part(out, [inputs], model, (1, 3), **OPTIONS)  # allowed into a merged output
    assert merge_parts(out) == merged
    assert np.array_equal(TokenShards.open(out).read(0, merged["num_tokens"]), before)


def test_a_full_disk_during_the_merge_names_the_file_and_leaves_nothing(
    tmp_path, inputs, model, monkeypatch
):
    out = tmp_path / "out"
    _parts(out, inputs, model, 2)
    before = _tree(out)
    FullDisk(monkeypatch, out, room=100)
    with pytest.raises(OSError) as error:
        merge_parts(out)
    assert error.value.errno == errno.ENOSPC
    assert error.value.filename == str(out / "tokenizer.model")
    assert _tree(out) == before  # no cut tokenizer, no temporary, no manifest


def test_a_part_that_runs_out_of_space_names_its_output(tmp_path, inputs, model, monkeypatch):
    out = tmp_path / "out"
    FullDisk(monkeypatch, out, room=2000)
    with pytest.raises(OSError) as error:
        prepare_part(out, [inputs], model, (0, 1), **OPTIONS)
    assert error.value.errno == errno.ENOSPC and str(out) in str(error.value.filename)
    assert list((out / "parts").iterdir()) == []  # the temporary part is gone


def test_a_single_difference_is_worded_in_the_singular(tmp_path, inputs, model):
    out = tmp_path / "out"
    prepare_part(out, [inputs], model, (0, 2), **OPTIONS)
    other = train_tokenizer(sample_texts(60, seed=9), tmp_path / "other", 400)
    with pytest.raises(DataError, match=r"\(the tokenizer differs\)"):
        prepare_part(out, [inputs], other, (0, 2), **OPTIONS)


def test_an_output_inside_an_input_is_refused_before_any_work(tmp_path, inputs, model):
    folder = inputs.parent
    before = _tree(folder)
    for run in (
        lambda: prepare_part(folder / "tokens", [folder], model, (0, 2), **OPTIONS),
        lambda: prepare_data(folder / "sub" / "tokens", [folder], tokenizer=model, **OPTIONS),
    ):
        with pytest.raises(DataError, match=r"is inside --input .*; choose an --output outside"):
            run()
        assert _tree(folder) == before


def test_an_output_that_is_a_link_is_refused_before_any_work(tmp_path, inputs, model):
    target = tmp_path / "empty"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(DataError) as error:
        prepare_data(link, [inputs], tokenizer=model, **OPTIONS)
    message = str(error.value)
    assert f"{link} is a symbolic link" in message and str(target) in message
    assert os.readlink(link) == str(target) and list(target.iterdir()) == []
    assert not list(tmp_path.glob(".tmp-*"))


def test_the_summary_counts_one_document_in_the_singular():
    from yatrain.cli.data import _summary

    manifest = dict(
        num_tokens=1, num_documents=1, validation=None, tokenizer_kind="sentencepiece",
        vocab_size=400, skipped_bad_records=1, empty_documents=1,
    )  # fmt: skip
    said = _summary(manifest)
    assert "1 token," in said and "1 document," in said
    assert "1 empty document dropped" in said and "1 tokens" not in said


def test_the_progress_line_counts_one_document_in_the_singular(tmp_path, model, capsys):
    one = tmp_path / "one.md"
    one.write_text("a single document of a few words")
    prepare_data(tmp_path / "out", [one], tokenizer=model, **OPTIONS)
    said = capsys.readouterr().err
    assert "tokenized 1 document into" in said and "1 documents" not in said
