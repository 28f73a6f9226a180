"""Tests for the data pipeline: corpus reading, tokenizer, shard format, global-batch loader."""

import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from yatrain.data import (
    GlobalBatchLoader,
    TokenShards,
    default_corpus_files,
    iter_documents,
    load_tokenizer,
    prepare_data,
    train_tokenizer,
)
from yatrain.data.batch import MicroBatch
from yatrain.data.manifest import load_manifest, token_dtype
from yatrain.errors import DataError

SENTENCE = (
    "the model reads tokens from a packed stream and every sequence shares its boundary "
    "token with the next one so that resuming a run never repeats data while gradients "
    "accumulate over micro batches across ranks"
)
WORDS = SENTENCE.split(" ")


def _text(rng: random.Random, lines: int) -> str:
    """Varied, reproducible text: prose, code-like lines with indentation, digits, unicode."""
    out = []
    for i in range(lines):
        kind = i % 4
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        if kind == 0:
            out.append(words.capitalize() + ".")
        elif kind == 1:
            out.append(f"    x_{i} = compute({rng.randint(0, 99999)}, '{words[:20]}')")
        elif kind == 2:
            out.append(f"\tcafé naïve – {words} {rng.random():.4f}")
        else:
            out.append(f"# {words}  ")
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    (root / "a_prose.txt").write_text(_text(rng, 120) + "\n\n" + _text(rng, 80) + "\n \n")
    (root / "b_code.py").write_text(
        "def f(x):\n\n    return x  # blank line kept\n" + _text(rng, 150)
    )
    (root / "c_notes.md").write_text("# Title\n\n" + _text(rng, 60))
    records = [{"text": _text(rng, rng.randint(1, 6))} for _ in range(30)]
    (root / "d_docs.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (root / ".hidden.txt").write_text("never read")
    return root


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare_data(out, [corpus], vocab_size=500, shard_tokens=997, progress=False)
    return out


def _documents_from_stream(shards: TokenShards) -> list[np.ndarray]:
    tokens = shards.read(0, shards.num_tokens)
    bos, eos = shards.bos_id, shards.eos_id
    starts, ends = np.flatnonzero(tokens == bos), np.flatnonzero(tokens == eos)
    assert len(starts) == len(ends) and tokens[0] == bos and tokens[-1] == eos
    return [tokens[s + 1 : e] for s, e in zip(starts, ends, strict=True)]


def test_round_trip_text_shards_text(corpus, prepared):
    shards = TokenShards.open(prepared)
    manifest = load_manifest(prepared)
    assert manifest["format"] == "yatrain-tokens-v1" and manifest["dtype"] == "uint16"
    assert len(manifest["files"]) > 1, "shard_tokens=997 should force several files"
    assert shards.num_tokens == sum(f["num_tokens"] for f in manifest["files"])
    expected = list(iter_documents([corpus]))
    assert manifest["num_documents"] == len(expected) == 2 + 1 + 1 + 30  # txt blocks, py, md, jsonl
    tok = load_tokenizer(shards.tokenizer_path)
    assert tok.sha256 == shards.tokenizer_sha256 and tok.vocab_size == shards.vocab_size
    decoded = [tok.decode(ids) for ids in _documents_from_stream(shards)]
    assert decoded == expected


def test_iter_documents_rules(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "blocks.txt").write_text("one\nline\n\n\ntwo\n  \nthree\n")
    (tmp_path / "sub" / "single.txt").write_text("no blank lines\nhere\n")
    (tmp_path / "notes.md").write_text("para one\n\npara two\n")
    (tmp_path / "empty.py").write_text("  \n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.pyc").write_bytes(b"\x00\x01")
    docs = list(iter_documents([tmp_path]))
    # Sorted walk: empty.py (skipped), notes.md, sub/blocks.txt, sub/single.txt.
    assert docs == [
        "para one\n\npara two\n",
        "one\nline",
        "two",
        "three",
        "no blank lines\nhere",
    ]


def test_jsonl_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": 3}\n')
    with pytest.raises(DataError, match=r'bad\.jsonl:3: "text" is int, not a string'):
        list(iter_documents([bad]))
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        list(iter_documents([bad]))
    with pytest.raises(DataError, match="does not exist"):
        list(iter_documents([tmp_path / "missing.txt"]))


def test_jsonl_input_with_existing_tokenizer(prepared, tmp_path):
    texts = ["first document\nwith two lines", "  second, indented", "третий 3"]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)))
    out = tmp_path / "out"
    manifest = prepare_data(out, [src], tokenizer=prepared / "tokenizer.model", progress=False)
    assert manifest["num_documents"] == 3
    assert manifest["tokenizer_sha256"] == TokenShards.open(prepared).tokenizer_sha256
    shards = TokenShards.open(out)
    tok = load_tokenizer(shards.tokenizer_path)
    assert [tok.decode(d) for d in _documents_from_stream(shards)] == texts


def test_token_dtype_choice():
    assert token_dtype(500) == "uint16"
    assert token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "uint32"
    assert token_dtype(128256) == "uint32"


def test_tokenizer_training_is_deterministic_and_validated(tmp_path):
    docs = [_text(random.Random(1), 200)]
    a = train_tokenizer(docs, tmp_path / "a" / "tok", 400)
    b = train_tokenizer(iter(docs), tmp_path / "b", 400)
    assert a.name == "tok.model" and load_tokenizer(a).sha256 == load_tokenizer(b).sha256
    tok = load_tokenizer(a)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.encode_batch(["ab", "c"]) == [tok.encode("ab"), tok.encode("c")]
    with pytest.raises(DataError, match="vocab size 100"):
        train_tokenizer(docs, tmp_path / "c", 100)
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"junk")
    with pytest.raises(DataError, match="is not a tokenizer: expected a sentencepiece model"):
        load_tokenizer(tmp_path / "junk.model")


def test_checksum_corruption_detected(prepared, tmp_path):
    data = shutil.copytree(prepared, tmp_path / "data")
    shard = data / "tokens-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"tokens-00001\.bin fails its sha256 check"):
        TokenShards.open(data)
    TokenShards.open(data, verify_checksums=False)  # sizes still fine: opens when asked


def test_truncated_shard_and_bad_manifest_detected(prepared, tmp_path):
    data = shutil.copytree(prepared, tmp_path / "data")
    shard = data / "tokens-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"tokens-00000\.bin has \d+ bytes"):
        TokenShards.open(data, verify_checksums=False)
    shard.unlink()
    with pytest.raises(DataError, match=r"tokens-00000\.bin is missing"):
        TokenShards.open(data)
    (data / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        TokenShards.open(data)
    (data / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(DataError, match="expected 'yatrain-tokens-v1'"):
        TokenShards.open(data)


def test_tokenizer_mismatch_detected(prepared, tmp_path):
    data = shutil.copytree(prepared, tmp_path / "data")
    (data / "tokenizer.model").write_bytes(b"another tokenizer")
    with pytest.raises(DataError, match="does not match the tokenizer_sha256"):
        TokenShards.open(data)


def test_missing_data_dir_message(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError) as err:
        TokenShards.open(missing)
    assert str(err.value) == (
        f"no tokenized data at {missing}: run `yatrain prepare-data --output {missing} "
        "--vocab-size 4096 --val-fraction 0.02` (the built-in corpus) first"
    )


def _no_leftovers(parent: Path, name: str) -> bool:
    return not (parent / name).exists() and not list(parent.glob(".tmp-*"))


def test_output_exists_and_no_half_written_output(prepared, tmp_path):
    model = prepared / "tokenizer.model"
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="already exists: choose another directory or delete"):
        prepare_data(existing, [model], tokenizer=model, progress=False)
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]

    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    with pytest.raises(DataError, match="no text"):
        prepare_data(tmp_path / "out", [blank], vocab_size=400, progress=False)
    assert _no_leftovers(tmp_path, "out")

    # A failure after the temporary directory exists (bad line late in the file).
    late = tmp_path / "late.jsonl"
    late.write_text('{"text": "fine"}\n{"text": "also fine"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"late\.jsonl:3"):
        prepare_data(tmp_path / "out", [late], tokenizer=model, progress=False)
    assert _no_leftovers(tmp_path, "out")

    with pytest.raises(DataError, match="exactly one of"):
        prepare_data(tmp_path / "out", [late], tokenizer=model, vocab_size=400)
    # An existing but empty output directory is fine and gets filled.
    (tmp_path / "empty").mkdir()
    late.write_text('{"text": "fine"}\n')
    prepare_data(tmp_path / "empty", [late], tokenizer=model, progress=False)
    assert load_manifest(tmp_path / "empty")["num_documents"] == 1


def test_default_corpus_files():
    files = default_corpus_files()
    assert files[0].as_posix().endswith("pydoc_data/topics.py")
    assert sum(f.stat().st_size for f in files) <= 24_000_000
    excluded = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    assert all(f.suffix == ".py" and not excluded & set(f.parts) for f in files)
    rest = [f.as_posix() for f in files[1:]]
    assert rest == sorted(rest)
    small = default_corpus_files(max_bytes=100_000)
    assert small and sum(f.stat().st_size for f in small) <= 100_000
    assert small == default_corpus_files(max_bytes=100_000)


# --- loader, on hand-written shards whose token i is simply i -------------------------------


def _fake_data(
    path: Path, num_tokens: int, shard_tokens: int, tokens: np.ndarray | None = None
) -> TokenShards:
    """Write the on-disk format directly (also pins the format down independently); token
    i is i unless ``tokens`` are given."""
    path.mkdir()
    (path / "tokenizer.model").write_bytes(b"stand-in tokenizer")
    if tokens is None:
        tokens = np.arange(num_tokens, dtype="<u2")
    tokens = np.asarray(tokens, dtype="<u2")
    assert len(tokens) == num_tokens
    files = []
    for i, start in enumerate(range(0, num_tokens, shard_tokens)):
        data = tokens[start : start + shard_tokens].tobytes()
        (path / f"tokens-{i:05d}.bin").write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        files.append({"name": f"tokens-{i:05d}.bin", "num_tokens": len(data) // 2, "sha256": sha})
    manifest = {
        "format": "yatrain-tokens-v1",
        "dtype": "uint16",
        "tokenizer_sha256": hashlib.sha256(b"stand-in tokenizer").hexdigest(),
        "vocab_size": 65536,
        "bos_id": 1,
        "eos_id": 2,
        "num_documents": 1,
        "num_tokens": num_tokens,
        "files": files,
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return TokenShards.open(path)


@pytest.fixture
def shards(tmp_path) -> TokenShards:
    return _fake_data(tmp_path / "fake", num_tokens=1000, shard_tokens=37)


def test_read_crosses_file_boundaries(shards):
    assert len(load_manifest(shards.path)["files"]) == 28
    for start, length in [(0, 1000), (36, 2), (37, 37), (30, 100), (999, 1), (500, 0)]:
        out = shards.read(start, length)
        assert out.dtype == np.int64 and out.tolist() == list(range(start, start + length))
    with pytest.raises(IndexError):
        shards.read(990, 11)


def test_windows_share_boundary_tokens(shards):
    loader = GlobalBatchLoader(shards, seq_len=16, global_batch_size=4, micro_batch_size=2)
    assert loader.num_windows == 999 // 16 and loader.accumulation_steps == 2
    assert loader.tokens_per_step == 64
    windows = loader.global_batch(0)
    (x0, y0, _), (x1, y1, _) = loader.next_batch()
    x, y = torch.cat([x0, x1]), torch.cat([y0, y1])
    assert x.shape == (4, 16) and x.dtype == torch.int64
    expected = torch.from_numpy(windows[:, None] * 16 + np.arange(16))
    assert torch.equal(x, expected) and torch.equal(y, expected + 1)


def _step_inputs(shards, step, world, micro, seq_len=8, batch=8, seed=3) -> torch.Tensor:
    """Concatenate every rank's micro-batch inputs for ``step``, rank by rank."""
    parts = []
    for rank in range(world):
        loader = GlobalBatchLoader(shards, seq_len, batch, micro, rank, world, seed)
        loader.load_state_dict({**loader.state_dict(), "step": step})
        parts += [batch.inputs for batch in loader.next_batch()]
    return torch.cat(parts)


def test_global_batch_is_independent_of_world_and_micro_size(shards):
    reference = GlobalBatchLoader(
        shards, seq_len=8, global_batch_size=8, micro_batch_size=8, seed=3
    )
    assert reference.batches_per_epoch == 15  # 124 windows // 8
    for step in [0, 1, 14, 15, 31]:  # crosses epoch boundaries
        windows = torch.from_numpy(reference.global_batch(step))
        expected = windows[:, None] * 8 + torch.arange(8)
        for world in (1, 2, 4):
            for micro in (1, 2):
                assert torch.equal(_step_inputs(shards, step, world, micro), expected)
    seen = np.concatenate([reference.global_batch(s) for s in range(15)])
    assert len(set(seen.tolist())) == 120, "an epoch never repeats a window"
    assert not np.array_equal(reference.global_batch(0), reference.global_batch(1))
    assert not np.array_equal(reference.global_batch(0), reference.global_batch(15))
    other_seed = GlobalBatchLoader(shards, 8, 8, 8, seed=4)
    assert not np.array_equal(reference.global_batch(0), other_seed.global_batch(0))


def test_state_dict_round_trip(shards):
    loader = GlobalBatchLoader(shards, seq_len=8, global_batch_size=8, micro_batch_size=2)
    for _ in range(3):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["step"] == 3
    expected = torch.cat([batch.inputs for batch in loader.next_batch()])
    resumed = GlobalBatchLoader(shards, 8, 8, micro_batch_size=4, rank=0, world_size=2)
    resumed.load_state_dict(state)
    assert resumed.step == 3
    assert torch.equal(resumed.next_batch()[0][0], expected[:4])
    with pytest.raises(DataError, match="seed=0, this run has 1"):
        GlobalBatchLoader(shards, 8, 8, 2, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="seq_len"):
        GlobalBatchLoader(shards, 4, 8, 2).load_state_dict(state)


def test_loader_validation(shards):
    with pytest.raises(DataError, match="fewer than one global batch of 128 sequences"):
        GlobalBatchLoader(shards, seq_len=16, global_batch_size=128, micro_batch_size=1)
    with pytest.raises(DataError, match="not a multiple of"):
        GlobalBatchLoader(shards, seq_len=16, global_batch_size=6, micro_batch_size=4)
    with pytest.raises(DataError, match="not a multiple of"):
        GlobalBatchLoader(shards, 16, 8, micro_batch_size=2, rank=0, world_size=3)
    with pytest.raises(DataError, match="rank 2 is outside"):
        GlobalBatchLoader(shards, 16, 8, micro_batch_size=1, rank=2, world_size=2)


def test_resume_is_refused_on_data_with_another_window_count_or_batch(shards, tmp_path):
    loader = GlobalBatchLoader(shards, seq_len=8, global_batch_size=8, micro_batch_size=2)
    for _ in range(3):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))
    longer = _fake_data(tmp_path / "longer", num_tokens=1200, shard_tokens=37)
    other_data = GlobalBatchLoader(longer, 8, 8, 2)
    with pytest.raises(DataError, match="num_windows=124, this run has 149: resume with the same"):
        other_data.load_state_dict(state)
    assert other_data.step == 0  # nothing resumed: still at the start of its own order
    other_batch = GlobalBatchLoader(shards, 8, 16, 2)
    with pytest.raises(DataError, match="global_batch_size=8, this run has 16"):
        other_batch.load_state_dict(state)
    assert other_batch.step == 0


# Documents [bos] text [eos] of 3 to 9 tokens back to back (bos 1, eos 2, text 10..).
_DOCUMENTS = np.concatenate([[1, *range(10, 10 + n), 2] for n in [1, 4, 7, 2, 5, 3, 6] * 20])


def _restarted_positions(row: list[int]) -> list[int]:
    """Positions counted from 0 at the window's start and at each BOS that follows an EOS."""
    out = []
    for i, token in enumerate(row):
        starts = i == 0 or (token == 1 and row[i - 1] == 2)
        out.append(0 if starts else out[-1] + 1)
    return out


def test_training_batches_carry_restarted_positions_when_asked(tmp_path):
    shards = _fake_data(tmp_path / "docs", len(_DOCUMENTS), 97, tokens=_DOCUMENTS)
    options = dict(seq_len=16, global_batch_size=8, micro_batch_size=2, seed=1)
    loader = GlobalBatchLoader(shards, **options, document_mask=True, restart_positions=True)
    masked_only = GlobalBatchLoader(shards, **options, document_mask=True)
    plain = GlobalBatchLoader(shards, **options)
    for _ in range(3):
        for batch, other, bare in zip(
            loader.next_batch(), masked_only.next_batch(), plain.next_batch(), strict=True
        ):
            want = [_restarted_positions(row) for row in batch.inputs.tolist()]
            assert batch.extra["positions"].tolist() == want
            assert any(p == 0 for row in want for p in row[1:]), "a document starts inside"
            assert set(other.extra) == {"document_ids"} and dict(bare.extra) == {}


def test_a_micro_batch_moves_its_model_inputs_with_it():
    tokens = torch.tensor([[1, 10, 2, 1], [11, 2, 1, 12]])
    extra = {"document_ids": torch.tensor([[1, 1, 1, 2], [1, 1, 2, 2]]), "positions": tokens * 0}
    moved = MicroBatch(tokens, tokens + 1, extra).to(torch.device("meta"))
    assert moved.inputs.device.type == moved.targets.device.type == "meta"
    assert set(moved.extra) == {"document_ids", "positions"}
    for name, value in moved.extra.items():
        assert value.device.type == "meta" and value.shape == extra[name].shape, name
    assert extra["positions"].device.type == "cpu"  # the original stays where it was
