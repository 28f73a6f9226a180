"""The rules of `prepare-data --shard I/N` and `--merge`, in this process on small inputs:
the plan cuts parts of equal size, parts merge whatever path named their tokenizer, the
merge names the first bad record, and a one-machine output is never taken for parts.
(End-to-end equivalence with one `prepare-data`: tests/integration/test_prepare_shards.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizer_fixtures import sample_texts

from yatrain.data import Corpus, TokenShards, partition, prepare_data, train_tokenizer
from yatrain.data.merge import merge_parts
from yatrain.data.partition import plan_parts
from yatrain.data.parts import parse_shard, prepare_part
from yatrain.errors import DataError

OPTIONS = dict(progress=False, workers=1, shard_tokens=700, val_fraction=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return train_tokenizer(sample_texts(), tmp_path_factory.mktemp("sp") / "sp", 400)


def _jsonl(path: Path, records: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(records))
    return path


def _records(n: int, seed: int = 0) -> list[str]:
    return [json.dumps({"text": t}) + "\n" for t in sample_texts(n, seed=seed)]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_partition_cuts_parts_of_about_equal_size(tmp_path):
    """Two JSONL files of 300 records of different lengths, 4 parts: each part is a quarter
    of all the bytes to within one line, and the parts tile the files in order."""
    lines = [json.dumps({"text": f"doc {i:03d} " + "x" * (i % 8 * 5)}) + "\n" for i in range(300)]
    _jsonl(tmp_path / "in" / "a.jsonl", lines[:110])
    _jsonl(tmp_path / "in" / "b.jsonl", lines[110:])
    files = Corpus([tmp_path / "in"]).files
    sizes = [path.stat().st_size for path, _ in files]
    total, longest = sum(sizes), max(len(line) for line in lines)
    plan = plan_parts(files, 4)
    assert len(plan) == 4
    covered = {i: 0 for i in range(len(files))}  # bytes of each file taken so far, in order
    parts = []
    for part in plan:
        size = 0
        for piece in part:
            whole = piece.kind == "file"
            start, end = (0, sizes[piece.index]) if whole else (piece.start, piece.end)
            assert piece.kind in ("file", "lines") and start == covered[piece.index]
            covered[piece.index] = end
            size += end - start
        parts.append(size)
    assert covered == dict(enumerate(sizes)) and sum(parts) == total
    assert all(abs(size - total / 4) <= longest for size in parts), (parts, total)


def test_parts_made_with_the_same_tokenizer_at_different_paths_merge(tmp_path, model):
    inputs = _jsonl(tmp_path / "in" / "a.jsonl", _records(40))
    elsewhere = tmp_path / "copy" / "sp.model"
    elsewhere.parent.mkdir()
    shutil.copyfile(model, elsewhere)
    out = tmp_path / "parts"
    prepare_part(out, [inputs], model, (0, 2), **OPTIONS)
    prepare_part(out, [inputs], elsewhere, (1, 2), **OPTIONS)
    merged = merge_parts(out)
    one = prepare_data(tmp_path / "one", [inputs], tokenizer=model, **OPTIONS)
    assert merged["num_documents"] == one["num_documents"] == 40
    a, b = TokenShards.open(tmp_path / "one"), TokenShards.open(out)
    assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
    assert merge_parts(out) == merged  # merged already: nothing to do


def test_the_merge_names_the_first_bad_record_of_all_parts(tmp_path, model):
    records = _records(60, seed=3)
    records[2] = "{not json\n"  # line 3, in part 0
    records[57] = "[1, 2]\n"  # line 58, in part 2
    inputs = _jsonl(tmp_path / "in" / "a.jsonl", records)
    options = {**OPTIONS, "skip_bad_records": True}
    parts = [prepare_part(tmp_path / "out", [inputs], model, (i, 3), **options) for i in range(3)]
    assert parts[0]["first_bad_record"].startswith(f"{inputs}:3: ")
    assert parts[1]["first_bad_record"] is None
    assert parts[2]["first_bad_record"].startswith(f"{inputs}:58: ")
    merged = merge_parts(tmp_path / "out")
    assert merged["first_bad_record"].startswith(f"{inputs}:3: invalid JSON")
    assert merged["skipped_bad_records"] == 2


def test_merging_a_one_machine_output_is_refused_and_changes_nothing(tmp_path, model):
    inputs = _jsonl(tmp_path / "in" / "a.jsonl", _records(10))
    out = tmp_path / "one"
    prepare_data(out, [inputs], tokenizer=model, **OPTIONS)
    before = _tree(out)
    with pytest.raises(DataError, match="holds a one-machine prepare-data output, not parts to"):
        merge_parts(out)
    assert _tree(out) == before


def test_the_number_of_parts_is_bounded_by_the_five_digit_part_names():
    assert parse_shard("99998/99999") == (99998, 99999)
    for text in ("0/100000", "0/99999999999999999999"):
        with pytest.raises(DataError, match=r"at most 99,999 parts \(part folders are numbered"):
            parse_shard(text)


def test_a_task_looks_only_at_its_own_two_cuts(tmp_path, monkeypatch):
    """A task of N parts reads the inputs at two cuts, not N - 1: a job of N tasks costs
    O(N), not O(N^2); and its pieces are those of the whole plan."""
    lines = [json.dumps({"text": f"doc {i:04d} " + "y" * (i % 13)}) + "\n" for i in range(900)]
    _jsonl(tmp_path / "in" / "a.jsonl", lines[:500])
    _jsonl(tmp_path / "in" / "b.jsonl", lines[500:])
    files = Corpus([tmp_path / "in"]).files
    whole = plan_parts(files, 40)
    real, looked = partition._cut, []
    monkeypatch.setattr(partition, "_cut", lambda *a: looked.append(a) or real(*a))
    for index in (0, 17, 39):
        looked.clear()
        assert partition.part_pieces(files, 40, index) == whole[index]
        assert len(looked) <= 2
    looked.clear()
    partition.part_pieces(files, 10**8, 12345)
    assert len(looked) <= 2
