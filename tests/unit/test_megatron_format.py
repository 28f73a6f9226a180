"""Megatron-LM ``.bin``/``.idx`` pairs: read as ``[bos] doc [eos]`` with the index's document
boundaries, and crafted indexes refused in one line before any read."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron_files import write_megatron
from tokenizer_fixtures import sample_texts

from yatrain.data import document_layout, load_tokenizer, megatron, train_tokenizer
from yatrain.data.heldout import open_held_out
from yatrain.data.megatron import MegatronTokens, megatron_prefix, open_stream
from yatrain.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_tokenizer(sample_texts(), tmp_path_factory.mktemp("sp") / "sp", 400)


def test_documents_come_from_the_index_wrapped_like_prepared_data(tmp_path, tokenizer):
    tok = load_tokenizer(tokenizer)
    bos, eos = tok.bos_id, tok.eos_id
    documents = [
        [[5, 6, 7]],
        [[8], [9, 10]],  # two sequences, one document
        [],  # an empty document: skipped
        [[11, 12, eos]],  # ends with EOS already (--append-eod): not doubled
        [[bos, 13]],  # starts with BOS already
    ]
    prefix = write_megatron(tmp_path / "web_text_document", documents)
    assert megatron_prefix(f"{prefix}.idx") == prefix and megatron_prefix(tmp_path) is None
    data = MegatronTokens.open(prefix, tokenizer)
    stream = [bos, 5, 6, 7, eos, bos, 8, 9, 10, eos, bos, 11, 12, eos, bos, 13, eos]
    assert data.num_documents == 4 and data.num_tokens == len(stream)
    assert data.read(0, data.num_tokens).tolist() == stream
    for start in range(len(stream)):
        for length in range(len(stream) - start + 1):
            assert data.read(start, length).tolist() == stream[start : start + length]
    layout = document_layout(torch.tensor([stream]), bos, eos, restart_positions=True)
    assert layout["document_ids"][0].tolist() == [1] * 5 + [2] * 5 + [3] * 4 + [4] * 3
    assert layout["positions"][0].tolist() == [*range(5), *range(5), *range(4), *range(3)]
    assert data.windows(4) == 4 and data.vocab_size == tok.vocab_size


def _valid(tmp_path: Path, dtype=np.uint16) -> Path:
    return write_megatron(tmp_path / "d", [[[5, 6, 7]], [[8, 9]], [[10]]], dtype)


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


# Header: magic 0-8, version 9-16, dtype code 17, sequences 18-25, document entries 26-33;
# then 3 int32 lengths (34), 3 int64 pointers (46), 4 int64 document indices (70).
CRAFTED = [
    ("magic", lambda p: _patch(p, 0, b"MMIDIDY"), "starts with"),
    ("version", lambda p: _patch(p, 9, struct.pack("<Q", 2)), "has version 2"),
    ("float dtype", lambda p: _patch(p, 17, b"\x07"), r"dtype code 7 \(float32"),
    ("unknown dtype", lambda p: _patch(p, 17, b"\x09"), r"dtype code 9 \(unknown"),
    ("huge count", lambda p: _patch(p, 18, struct.pack("<Q", 2**62)), "header .* needs"),
    ("no documents", lambda p: _patch(p, 26, struct.pack("<Q", 0)), "header .* needs"),
    ("truncated", lambda p: p.write_bytes(p.read_bytes()[:-5]), "header .* needs"),
    ("short header", lambda p: p.write_bytes(p.read_bytes()[:20]), "fewer than its 34-byte"),
    ("negative length", lambda p: _patch(p, 34, struct.pack("<i", -3)), "negative sequence"),
    ("length past .bin", lambda p: _patch(p, 42, struct.pack("<i", 9)), "the .bin has"),
    ("pointer", lambda p: _patch(p, 54, struct.pack("<q", 4000)), "points sequence 1"),
    ("document index", lambda p: _patch(p, 94, struct.pack("<q", 7)), "document index"),
    ("unordered documents", lambda p: _patch(p, 78, struct.pack("<q", 3)), "document index"),
]


@pytest.mark.parametrize("name, craft, says", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_a_crafted_index_is_refused_in_one_line(tmp_path, tokenizer, name, craft, says):
    prefix = _valid(tmp_path)
    craft(Path(f"{prefix}.idx"))
    with pytest.raises(DataError, match=says) as error:
        MegatronTokens.open(prefix, tokenizer)
    assert "\n" not in str(error.value) and f"{prefix}.idx" in str(error.value)


def test_the_bin_and_the_vocabulary_are_checked(tmp_path, tokenizer):
    prefix = _valid(tmp_path)
    Path(f"{prefix}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes()[:-2])
    with pytest.raises(DataError, match="describes 12 bytes of tokens, but the .bin has 10"):
        MegatronTokens.open(prefix, tokenizer)
    big = write_megatron(tmp_path / "big", [[[5, 4000]]])  # 4000: beyond the 400-piece vocab
    with pytest.raises(DataError, match="token id 4000 .* outside the vocabulary of 400"):
        MegatronTokens.open(big, tokenizer)
    negative = write_megatron(tmp_path / "neg", [[[5, -2]]], np.int16)
    with pytest.raises(DataError, match="token id -2"):
        MegatronTokens.open(negative, tokenizer)
    Path(f"{prefix}.bin").unlink()
    with pytest.raises(DataError, match=r"d\.bin is missing"):
        MegatronTokens.open(prefix, tokenizer)
    with pytest.raises(ConfigError, match="set data.tokenizer"):
        MegatronTokens.open(big, None)


def test_an_index_with_sequence_modes_reads_like_one_without(tmp_path, tokenizer):
    tok = load_tokenizer(tokenizer)
    documents = [[[5, 6, 7]], [[8], [9, 10]], [[11]]]
    plain = write_megatron(tmp_path / "plain", documents)
    moded = write_megatron(tmp_path / "moded", documents, modes=True)
    sequences = 4  # one int8 mode each, after the document index
    size = Path(f"{plain}.idx").stat().st_size
    assert Path(f"{moded}.idx").stat().st_size == size + sequences
    data = MegatronTokens.open(moded, tokenizer)
    bos, eos = tok.bos_id, tok.eos_id
    stream = [bos, 5, 6, 7, eos, bos, 8, 9, 10, eos, bos, 11, eos]
    assert data.num_documents == 3 and data.read(0, data.num_tokens).tolist() == stream


def test_windows_are_the_full_windows_of_seq_len_plus_one_tokens(tmp_path, tokenizer):
    """16 tokens: a multiple of 4 and 8, where a window count of tokens // seq_len would
    promise one window more than the stream holds."""
    documents = [[[5, 6, 7]], [[8, 9, 10]], [[11, 12, 13, 14]]]  # 5 + 5 + 6 tokens wrapped
    data = MegatronTokens.open(write_megatron(tmp_path / "d", documents), tokenizer)
    assert data.num_tokens == 16
    for seq_len in range(1, 20):
        fits = [n for n in range(20) if n * seq_len + 1 <= 16]  # window n-1 ends at n*seq_len
        assert data.windows(seq_len) == max(fits), seq_len
        for window in range(data.windows(seq_len)):  # every window counted can be read
            assert len(data.read(window * seq_len, seq_len + 1)) == seq_len + 1
    assert data.windows(4) == 3 and data.windows(8) == 1 and data.windows(16) == 0


def test_ids_read_lazily_from_a_large_bin_are_checked_against_the_vocabulary(
    tmp_path, tokenizer, monkeypatch
):
    """A .bin over the verify-at-open size is checked as it is read: every .bin is such a
    one here, the threshold lowered to 0 bytes."""
    monkeypatch.setattr(megatron, "_VERIFY_MAX_BYTES", 0)
    tok = load_tokenizer(tokenizer)
    bos, eos = tok.bos_id, tok.eos_id
    documents = [[[5, 6, 7]], [[8, 4000, 9]], [[10, 11]]]  # 4000: beyond the 400-piece vocab
    data = MegatronTokens.open(write_megatron(tmp_path / "big", documents), tokenizer)
    assert data.read(0, 5).tolist() == [bos, 5, 6, 7, eos]  # opened: nothing read yet
    assert data.read(10, 4).tolist() == [bos, 10, 11, eos]
    with pytest.raises(DataError, match="token id 4000 .* outside the vocabulary of 400"):
        data.read(5, 5)
    with pytest.raises(DataError, match="token id 4000"):
        data.read(0, data.num_tokens)
    negative = write_megatron(tmp_path / "neg", [[[5, 6]], [[7, -2, 8]]], np.int16)
    data = MegatronTokens.open(negative, tokenizer)
    assert data.read(0, 4).tolist() == [bos, 5, 6, eos]
    with pytest.raises(DataError, match="token id -2"):
        data.read(4, 5)


@pytest.mark.parametrize("typed", ["web_text_documnt", "web_text_documnt.bin", "web_text"])
def test_a_misspelt_prefix_names_the_prefixes_beside_it(tmp_path, tokenizer, typed):
    """Not the advice to tokenize the built-in corpus into the misspelt path."""
    write_megatron(tmp_path / "web_text_document", [[[5, 6, 7]]])
    before = sorted(tmp_path.iterdir())
    for attempt in (
        lambda: open_stream(tmp_path / typed, tokenizer),
        lambda: open_held_out(tmp_path / typed, tokenizer=str(tokenizer)),
    ):
        with pytest.raises(DataError) as missing:
            attempt()
        line = str(missing.value)
        assert "\n" not in line and str(tmp_path / typed) in line
        assert f"{tmp_path / 'web_text_document'}" in line and "Megatron" in line
        assert "built-in corpus" not in line and "prepare-data" not in line
    assert sorted(tmp_path.iterdir()) == before
