"""`prepare-data --shard I/N` then `--merge`: the same data set as one `prepare-data`, and
merges that refuse missing, killed and foreign parts in one line."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizer_fixtures import sample_texts

from yatrain.data import Corpus, GlobalBatchLoader, TokenShards, prepare_data, train_tokenizer
from yatrain.data.merge import merge_parts
from yatrain.data.partition import plan_parts
from yatrain.data.parts import prepare_part
from yatrain.errors import DataError

VAL = 0.2
OPTIONS = dict(progress=False, workers=1, shard_tokens=700, val_fraction=VAL)


def _jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Mixed formats; a JSONL and a parquet file big enough to be split, compressed files
    that may not be, an empty record, a binary file that is skipped."""
    root = tmp_path_factory.mktemp("corpus") / "in"
    root.mkdir()
    texts = sample_texts(500, seed=11)
    (root / "a-big.jsonl").write_bytes(_jsonl(texts[:150] + ["   "] + texts[150:220]))
    table = pa.table({"text": pa.array(texts[220:280], type=pa.string())})
    pq.write_table(table, root / "b.parquet", row_group_size=6)
    lines = [t.replace("\n\n", "\n") for t in texts[280:400]]
    blocks = ["\n".join(lines[i : i + 6]) for i in range(0, 120, 6)]  # 24 lines each
    (root / "c.txt").write_text("\n \n".join(blocks[:8]) + "\n\n\n" + "\n\n".join(blocks[8:]))
    (root / "d.jsonl.gz").write_bytes(gzip.compress(_jsonl(texts[400:440])))
    (root / "e.md").write_text(texts[440])
    (root / "f.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(texts[441:])))
    (root / "g.bin").write_bytes(b"\x00\x01binary" * 10)
    return root


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return train_tokenizer(sample_texts(), tmp_path_factory.mktemp("sp") / "sp", 400)


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory, corpus, model) -> Path:
    out = tmp_path_factory.mktemp("one") / "data"
    prepare_data(out, [corpus], tokenizer=model, **OPTIONS)
    return out


def _parts(out: Path, corpus: Path, model: Path, count: int, **changes) -> None:
    for index in range(count):
        prepare_part(out, [corpus], model, (index, count), **{**OPTIONS, **changes})


def test_plan_cuts_inside_big_files_only_where_it_may(corpus):
    plan = plan_parts(Corpus([corpus]).files, 7)
    kinds = {piece.kind for part in plan for piece in part}
    assert {"lines", "blocks", "row_groups"} <= kinds
    files = Corpus([corpus]).files
    pieces = [piece for part in plan for piece in part]
    for piece in pieces:  # compressed and other files only whole
        if not files[piece.index][0].name.endswith((".jsonl", ".parquet", ".txt")):
            assert piece.kind == "file"
    assert [p.index for p in pieces] == sorted(p.index for p in pieces)


@pytest.mark.parametrize("count", [1, 3, 7])
def test_merged_parts_are_the_one_machine_data_set(tmp_path, corpus, model, one_machine, count):
    out = tmp_path / "parts"
    _parts(out, corpus, model, count)
    merge_parts(out)
    one, merged = (json.loads((d / "manifest.json").read_text()) for d in (one_machine, out))
    for key in ("num_documents", "num_tokens", "skipped_files", "empty_documents"):
        assert merged[key] == one[key], key
    assert merged["validation"]["num_documents"] == one["validation"]["num_documents"] > 0
    assert len(one["skipped_files"]) == 1 and one["empty_documents"] == 1
    for split in ("train", "validation"):
        a = TokenShards.open(one_machine, split=split)
        b = TokenShards.open(out, split=split)
        assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
    loaders = [GlobalBatchLoader(TokenShards.open(d), 16, 8, 2, seed=5) for d in (one_machine, out)]
    for _ in range(3):
        batches = [loader.next_batch() for loader in loaders]
        for (x1, y1, _), (x2, y2, _) in zip(*batches, strict=True):
            assert x1.equal(x2) and y1.equal(y2)


def test_a_finished_part_is_not_redone_and_a_killed_one_is(tmp_path, corpus, model, capsys):
    out = tmp_path / "parts"
    _parts(out, corpus, model, 3)
    done = out / "parts" / "part-00001-of-00003"
    killed = out / "parts" / ".tmp-part-00001-of-00003-0badc0de"
    os.rename(done, killed)
    (killed / ".prepare.lock").touch()  # as SIGKILL leaves it: the lock file, nobody holding it
    with pytest.raises(DataError) as error:
        merge_parts(out)
    message = str(error.value)
    assert "part 1/3" in message and "stopped while being written" in message
    assert "--shard 1/3" in message and "\n" not in message
    before = (out / "parts" / "part-00000-of-00003" / "manifest.json").stat().st_mtime_ns
    capsys.readouterr()
    _parts(out, corpus, model, 3)
    said = capsys.readouterr()
    assert said.out.count("already complete") == 2 and "nothing to do" in said.out
    assert "removed" in said.err  # the killed part's leftovers
    assert (out / "parts" / "part-00000-of-00003" / "manifest.json").stat().st_mtime_ns == before
    assert not list((out / "parts").glob(".tmp-*"))
    merge_parts(out)
    assert TokenShards.open(out).num_tokens > 0


def test_missing_and_foreign_parts_are_refused_in_one_line(tmp_path, corpus, model):
    out = tmp_path / "parts"
    for index in (0, 2):
        prepare_part(out, [corpus], model, (index, 3), **OPTIONS)
    with pytest.raises(DataError, match=r"part 1/3 .* is missing: run `yatrain prepare-data"):
        merge_parts(out)
    prepare_part(out, [corpus], model, (1, 3), **{**OPTIONS, "val_fraction": 0.3})
    with pytest.raises(DataError) as error:
        merge_parts(out)
    assert "part-00001-of-00003" in str(error.value) and "the options" in str(error.value)
    assert not (out / "manifest.json").exists()
    with pytest.raises(DataError, match="other inputs or options"):  # a rerun says so too
        prepare_part(out, [corpus], model, (1, 3), **OPTIONS)


def test_bad_records_are_named_at_their_line_in_the_whole_file(tmp_path, model):
    texts = sample_texts(60, seed=2)
    lines = [json.dumps({"text": t}) + "\n" for t in texts]
    lines[44] = "{not json\n"
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(lines))
    options = {**OPTIONS, "skip_bad_records": True}
    one = prepare_data(tmp_path / "one", [tmp_path / "in"], tokenizer=model, **options)
    for index in range(3):
        prepare_part(tmp_path / "parts", [tmp_path / "in"], model, (index, 3), **options)
    merged = merge_parts(tmp_path / "parts")
    assert merged["first_bad_record"] == one["first_bad_record"]
    assert one["first_bad_record"].startswith(f"{tmp_path / 'in' / 'a.jsonl'}:45: invalid JSON")
    assert merged["skipped_bad_records"] == one["skipped_bad_records"] == 1


def test_a_part_folder_without_manifest_is_named(tmp_path, corpus, model):
    out = tmp_path / "parts"
    prepare_part(out, [corpus], model, (0, 2), **OPTIONS)
    (out / "parts" / "part-00001-of-00002").mkdir()  # e.g. copied by hand, half-way
    with pytest.raises(DataError, match="part-00001-of-00002 has no manifest.json, so it is not"):
        merge_parts(out)
