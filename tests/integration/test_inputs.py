"""Input formats and compressions (a name that lies about its compression is one line),
content-based text detection, bad records, empty documents dropped and counted, and parallel
tokenization that gives the same bytes for any number of workers, bounded by the CPUs."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from test_failures import one_line_error, yatrain
from tokenizer_fixtures import sample_texts

from yatrain.data import (
    Corpus,
    TokenShards,
    iter_documents,
    load_tokenizer,
    prepare_data,
    train_tokenizer,
)
from yatrain.data import parallel as par
from yatrain.data.manifest import load_manifest
from yatrain.data.parallel import default_workers
from yatrain.errors import DataError

TEXTS = sample_texts(12, seed=7)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A sentencepiece model (fast to train, and Llama 2's format)."""
    return train_tokenizer(sample_texts(), tmp_path_factory.mktemp("sp") / "sp", 400)


def _jsonl(texts: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def _compress(data: bytes, compression: str | None) -> bytes:
    if compression == "gzip":
        return gzip.compress(data)
    if compression == "zstd":  # two frames, as `cat a.zst b.zst` gives
        half = len(data) // 2
        zstd = zstandard.ZstdCompressor()
        return zstd.compress(data[:half]) + zstd.compress(data[half:])
    return data


SUFFIX = {None: "", "gzip": ".gz", "zstd": ".zst"}


def _parquet(path: Path, texts: list, field: str = "text", row_group_size: int = 5) -> Path:
    table = pa.table({"id": list(range(len(texts))), field: pa.array(texts, type=pa.string())})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("compression", [None, "gzip", "zstd"])
def test_formats_and_compressions(compression, tmp_path):
    suffix = SUFFIX[compression]
    paragraphs = [t.replace("\n\n", "\n").strip("\n") for t in TEXTS[:4]]
    blocks = "\n\n \n".join(paragraphs)  # a whitespace-only line separates too
    (tmp_path / f"a.jsonl{suffix}").write_bytes(_compress(_jsonl(TEXTS[:3]), compression))
    (tmp_path / f"b.txt{suffix}").write_bytes(_compress(blocks.encode(), compression))
    (tmp_path / f"c.md{suffix}").write_bytes(_compress(TEXTS[5].encode(), compression))
    _parquet(tmp_path / "d.parquet", TEXTS[6:12])
    expected = [*TEXTS[:3], *paragraphs, TEXTS[5], *TEXTS[6:12]]
    assert list(iter_documents([tmp_path])) == expected


def test_text_field_and_content_detection(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(_jsonl(TEXTS[:2], field="content"))
    _parquet(tmp_path / "b.parquet", TEXTS[2:4], field="content")
    assert list(iter_documents([tmp_path], text_field="content")) == TEXTS[:4]
    # Content, not names: gzip data without .gz, text named .bin, a binary named .txt.
    other = tmp_path / "other"
    other.mkdir()
    (other / "1.jsonl").write_bytes(gzip.compress(_jsonl(TEXTS[:1])))
    (other / "2.bin").write_text(TEXTS[1])
    (other / "3.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (other / "4.png").write_bytes(bytes(range(256)))
    corpus = Corpus([other])
    assert list(corpus.documents()) == TEXTS[:2]
    assert [(Path(p).name, why) for p, why in corpus.stats.not_text] == [
        ("3.txt", "binary (a NUL byte at offset 8)"),
        ("4.png", "binary (a NUL byte at offset 0)"),
    ]
    with pytest.raises(DataError, match=r"input .*3\.txt is binary .*, not text"):
        list(iter_documents([other / "3.txt"]))


def test_binary_files_skipped_and_listed_in_manifest(model, tmp_path, capfd):
    data = tmp_path / "in"
    data.mkdir()
    (data / "doc.md").write_text(TEXTS[0])
    (data / "weights.bin").write_bytes(b"\x00" * 100)
    (data / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    manifest = prepare_data(tmp_path / "out", [data], tokenizer=model, progress=False)
    assert manifest["num_documents"] == 1
    assert manifest["skipped_files"] == [
        {"path": str(data / "latin1.txt"), "reason": "not UTF-8 (byte 0xe9 at offset 3)"},
        {"path": str(data / "weights.bin"), "reason": "binary (a NUL byte at offset 0)"},
    ]
    err = capfd.readouterr().err
    assert "skipped 2 file(s) that are not text: latin1.txt (not UTF-8" in err


def _bad(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


GOOD = b'{"text": "fine"}\n'
BAD_RECORDS = [
    ("missing.jsonl", GOOD + b'{"content": "x", "id": 1}\n', r'missing\.jsonl:2: no "text" field'),
    ("number.jsonl", GOOD + b'{"text": 3}\n', r'number\.jsonl:2: "text" is int, not a string'),
    ("null.jsonl", GOOD + b'{"text": null}\n', r'null\.jsonl:2: "text" is null'),
    ("broken.jsonl", GOOD + b"{oops\n", r"broken\.jsonl:2: invalid JSON"),
    ("utf8.jsonl", GOOD + b'{"text": "caf\xe9"}\n', r"utf8\.jsonl:2: not UTF-8 \(byte 0xe9 at "),
    ("late.jsonl", GOOD * 600 + b'{"text": "caf\xe9"}\n', r"late\.jsonl:601: not valid UTF-8"),
    ("surrogate.jsonl", GOOD + b'{"text": "\\ud800"}\n', r"surrogate\.jsonl:2: a lone surrogate"),
    ("cut.jsonl.gz", gzip.compress(GOOD * 50)[:-12], r"cut\.jsonl\.gz: broken gzip data"),
    (
        "cut.jsonl.zst",
        zstandard.ZstdCompressor().compress(GOOD * 50)[:-6],
        r"cut\.jsonl\.zst: broken zstd data .*truncated",
    ),
    ("late.txt", b"fine\n" * 3000 + b"caf\xe9\n", r"late\.txt:3001: not valid UTF-8"),
    ("latin1.md", "café".encode("latin-1"), r"latin1\.md: not UTF-8 \(byte 0xe9 at offset 3\)"),
]


@pytest.mark.parametrize(("name", "data", "message"), BAD_RECORDS, ids=[b[0] for b in BAD_RECORDS])
def test_bad_record_is_one_line_and_nothing_is_written(name, data, message, model, tmp_path):
    path = _bad(tmp_path, name, data)
    with pytest.raises(DataError, match=message) as error:
        prepare_data(tmp_path / "out", [path], tokenizer=model, workers=2, progress=False)
    assert "\n" not in str(error.value) and "--skip-bad-records" in str(error.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))


def test_parquet_bad_rows_and_columns(model, tmp_path):
    path = _parquet(tmp_path / "p.parquet", ["one", None, "three", 4 * "x"])
    with pytest.raises(DataError, match=r"p\.parquet: row 2: 'text' is null"):
        list(iter_documents([path]))
    corpus = Corpus([path], skip_bad_records=True)
    assert list(corpus.documents()) == ["one", "three", "xxxx"]
    assert corpus.stats.bad_records == 1
    with pytest.raises(DataError, match=r"has no column 'body' \(its columns: id, text\)"):
        list(Corpus([path], text_field="body", skip_bad_records=True).documents())
    with pytest.raises(DataError, match="column 'id' holds int64, not strings"):
        list(iter_documents([path], text_field="id"))


def test_skip_bad_records_counts_them(model, tmp_path, capfd):
    data = tmp_path / "in"
    data.mkdir()
    for name, content, _ in BAD_RECORDS:
        (data / name).write_bytes(content)
    manifest = prepare_data(
        tmp_path / "out", [data], tokenizer=model, skip_bad_records=True, progress=False
    )
    # In a directory, files whose first 8 KiB are not UTF-8 are listed, not counted.
    assert manifest["skipped_files"] == [
        {"path": str(data / "latin1.md"), "reason": "not UTF-8 (byte 0xe9 at offset 3)"},
        {"path": str(data / "utf8.jsonl"), "reason": "not UTF-8 (byte 0xe9 at offset 30)"},
    ]
    assert manifest["skipped_bad_records"] == len(BAD_RECORDS) - 2
    assert manifest["first_bad_record"].startswith(str(data / "broken.jsonl:2: invalid JSON"))
    assert f"skipped {len(BAD_RECORDS) - 2} bad record(s), the first:" in capfd.readouterr().err
    # The good records are kept: 5 single ones, late.jsonl's 600, late.txt's block (and
    # whatever the truncated streams held before their breaks).
    assert manifest["num_documents"] >= 5 + 600 + 1


def test_large_parquet_reads_in_batches(model, tmp_path):
    texts = [f"row {i} " + TEXTS[i % len(TEXTS)] for i in range(2500)]
    path = _parquet(tmp_path / "big.parquet", texts, row_group_size=700)
    assert list(iter_documents([path])) == texts


def _shard_bytes(path: Path) -> list[bytes]:
    """Every token file's bytes: the training split's, then the validation split's."""
    TokenShards.open(path)  # the loader accepts it
    manifest = load_manifest(path)
    files = [*manifest["files"], *manifest["validation"]["files"]]
    return [(path / f["name"]).read_bytes() for f in files]


def test_output_identical_for_any_worker_count(model, tmp_path, monkeypatch):
    monkeypatch.setattr(par, "CHUNK_CHARS", 3000)  # many chunks, so workers interleave
    monkeypatch.setattr("yatrain.data.prepare.default_workers", lambda: 3)  # even on 2 CPUs
    data = tmp_path / "in"
    data.mkdir()
    (data / "a.jsonl.zst").write_bytes(_compress(_jsonl(sample_texts(60, seed=1)), "zstd"))
    _parquet(data / "b.parquet", sample_texts(40, seed=2))
    (data / "c.txt.gz").write_bytes(gzip.compress("\n\n".join(sample_texts(30)).encode()))
    manifests = {}
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        manifests[workers] = prepare_data(
            out,
            [data],
            tokenizer=model,
            workers=workers,
            shard_tokens=1500,
            progress=False,
            val_fraction=0.25,
        )
    assert manifests[1] == manifests[2] == manifests[3]
    assert len(manifests[1]["files"]) > 3 and len(manifests[1]["validation"]["files"]) > 1
    assert _shard_bytes(tmp_path / "w1") == _shard_bytes(tmp_path / "w2")
    assert _shard_bytes(tmp_path / "w1") == _shard_bytes(tmp_path / "w3")


def test_parallel_encoding_is_ordered_and_bounded(model, monkeypatch):
    monkeypatch.setattr(par, "CHUNK_DOCS", 1)  # one document per chunk
    tok = load_tokenizer(model)
    docs = [f"document number {i}: " + TEXTS[i % len(TEXTS)] for i in range(40)]
    pulled = []

    def source():
        for doc in docs:
            pulled.append(doc)
            yield doc

    results = []
    for chunk in par.encode_stream(tok, source(), np.dtype("<u2"), workers=2):
        assert (chunk.train_documents, chunk.val_documents) == (1, 0)
        results.append(chunk.train)
        ahead = len(pulled) - len(results)
        assert ahead <= par._IN_FLIGHT_PER_WORKER * 2 + 1, "documents read far ahead of results"
    expected = [[tok.bos_id, *tok.encode(d), tok.eos_id] for d in docs]
    assert [r.tolist() for r in results] == expected


def test_cli_bad_record_is_one_line(model, tmp_path, isolated_env):
    path = _bad(tmp_path, "bad.jsonl", GOOD + b'{"body": "x"}\n')
    args = [sys.executable, "-m", "yatrain", "prepare-data", "--output", str(tmp_path / "o")]
    args += ["--input", str(path), "--tokenizer", str(model), "--no-progress"]
    done = subprocess.run(args, capture_output=True, text=True, env=isolated_env, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f'yatrain: error: {path}:2: no "text" field (its keys: body): fix or remove that '
        "record, or pass --skip-bad-records to skip and count such records"
    ]
    done = subprocess.run(
        [*args, "--skip-bad-records", "--text-field", "text", "--workers", "2"],
        capture_output=True,
        text=True,
        env=isolated_env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert ", 1 bad record skipped" in done.stdout, done.stdout  # was "1 bad records"


def _prepare(out: Path, *args: str) -> list[str]:
    return ["prepare-data", "--output", str(out), "--no-progress", *args]


def test_prepare_data_workers_are_bounded_by_the_cpus(small_data, isolated_env, tmp_path):
    tokenizer, work = str(small_data / "tokenizer.model"), tmp_path / "work"
    work.mkdir()
    for workers in ("10000", "0"):
        out = work / f"out-{workers}"
        result = yatrain(
            *_prepare(out, "--tokenizer", tokenizer, "--workers", workers), env=isolated_env
        )
        one_line_error(result, f"--workers {workers}: pass 1 to {default_workers()}")
        assert list(work.iterdir()) == []


def test_a_name_that_lies_about_compression_is_one_line(small_data, isolated_env, tmp_path):
    plain = tmp_path / "docs.jsonl.gz"
    plain.write_text(json.dumps({"text": "hello world"}) + "\n")
    args = _prepare(tmp_path / "out", "--input", str(plain), "--vocab-size", "64")
    one_line_error(yatrain(*args, env=isolated_env), "is named .gz but is not gzip-compressed")
    assert not (tmp_path / "out").exists()


def test_empty_documents_are_dropped_and_counted(small_data, isolated_env, tmp_path):
    docs = tmp_path / "docs.jsonl"
    texts = ["a first document", "   ", "a second one", "\n\t\n", "the third"] * 40
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "out"
    args = _prepare(
        out,
        "--input",
        str(docs),
        "--tokenizer",
        str(small_data / "tokenizer.model"),
        "--val-fraction",
        "0",
        "--workers",
        "1",
    )
    result = yatrain(*args, env=isolated_env)
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_documents"] == 120 and manifest["empty_documents"] == 80
    assert "80 empty documents dropped" in result.stdout
    assert "dropped 80 empty (whitespace-only) document(s)" in result.stderr
