"""Megatron-LM input whose memory does not grow with its document count: reads through the
sparse group index equal the stream built from the documents, and 10^7 documents open in
under 64 MiB."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from megatron_files import write_megatron
from tokenizer_fixtures import sample_texts

from yatrain.data import load_tokenizer, megatron, train_tokenizer
from yatrain.data.megatron import MegatronTokens
from yatrain.errors import DataError

MAX_GROWTH_MIB = 64


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_tokenizer(sample_texts(), tmp_path_factory.mktemp("sp") / "sp", 400)


def _stream(documents: list[list[list[int]]], bos: int, eos: int) -> list[int]:
    """The expected stream: each document with tokens as [bos] tokens [eos], the BOS (EOS)
    left out when it starts (ends) with one."""
    stream = []
    for document in documents:
        tokens = [t for sequence in document for t in sequence]
        if tokens:
            stream += [bos] * (tokens[0] != bos) + tokens + [eos] * (tokens[-1] != eos)
    return stream


def _documents(rng: random.Random, count: int, bos: int, eos: int) -> list[list[list[int]]]:
    """Documents that do and do not start with BOS or end with EOS, empty ones (no sequence,
    or only empty sequences), lone BOS/EOS tokens and documents of several sequences."""
    documents = []
    for _ in range(count):
        sequences = []
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
            sequences.append([rng.randrange(3, 400) for _ in range(rng.choice([0, 1, 2, 5]))])
        if sequences and rng.random() < 0.3:
            sequences[0].insert(0, bos)
        if sequences and rng.random() < 0.3:
            sequences[-1].append(eos)
        documents.append(sequences)
    return [*documents, [[bos]], [[eos]], [[bos, eos]], [[eos, bos]], [[]], []]


@pytest.mark.parametrize(
    "group, chunk, window",
    [(3, 7, 8), (1, 1, 2), (5, 16, 1 << 20), (4096, 1 << 18, 1 << 20)],
    ids=["groups-of-3", "groups-of-1", "groups-of-5", "defaults"],
)
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_reads_through_groups_equal_the_stream_of_the_documents(
    tmp_path, tokenizer, monkeypatch, group, chunk, window, dtype
):
    """Groups, opening chunks and file-read windows shrunk so that reads cross groups and
    opening reads the index in many pieces."""
    monkeypatch.setattr(megatron, "_GROUP", group)
    monkeypatch.setattr(megatron, "_CHUNK", chunk)
    monkeypatch.setattr(megatron, "_WINDOW", window)
    tok = load_tokenizer(tokenizer)
    bos, eos = tok.bos_id, tok.eos_id
    rng = random.Random(group * 100 + chunk)
    for n, count in enumerate([0, 1, 40]):
        documents = _documents(rng, count, bos, eos)
        stream = _stream(documents, bos, eos)
        prefix = write_megatron(tmp_path / f"d{n}", documents, dtype, modes=n == 1)
        data = MegatronTokens(prefix, tok)
        assert data.num_tokens == len(stream)
        assert data.num_documents == sum(any(len(s) for s in d) for d in documents)
        assert data.read(0, len(stream)).tolist() == stream
        assert data.read(len(stream) - 1, 1).tolist() == stream[-1:]
        for start in range(len(stream)):
            assert data.read(start, 1).tolist() == [stream[start]]
        for _ in range(300):
            start = rng.randrange(len(stream) + 1)
            length = rng.randrange(len(stream) - start + 1)
            assert data.read(start, length).tolist() == stream[start : start + length]
        for start, length in [(-1, 1), (0, len(stream) + 1), (len(stream), 1)]:
            with pytest.raises(IndexError, match="outside"):
                data.read(start, length)


def test_an_id_outside_the_vocabulary_is_found_in_any_group(tmp_path, tokenizer, monkeypatch):
    """On a .bin read lazily (the verify-at-open size lowered to 0), a bad id in a later
    group fails a read that only reaches it across groups."""
    monkeypatch.setattr(megatron, "_VERIFY_MAX_BYTES", 0)
    monkeypatch.setattr(megatron, "_GROUP", 2)
    tok = load_tokenizer(tokenizer)
    documents = [[[5, 6]], [[7]], [[8, 9]], [[10, 4000]], [[11]]]
    data = MegatronTokens(write_megatron(tmp_path / "big", documents), tok)
    assert data.read(0, 11).tolist() == _stream(documents[:3], tok.bos_id, tok.eos_id)
    with pytest.raises(DataError, match="token id 4000 .* outside the vocabulary of 400"):
        data.read(3, 12)


# The scale data: 10^7 documents in periods of four, one sequence each: [t], [bos t],
# [t t eos], [bos t eos] (9 tokens in the .bin), read as 13 stream tokens. SLOT: what each
# stream token of a period is: -1 BOS, -2 EOS, else which of its four documents' t.
DOCUMENTS = 10**7
LENGTHS = [1, 2, 3, 3]
SLOT = np.array([-1, 0, -2, -1, 1, -2, -1, 2, 2, -2, -1, 3, -2])
READ = 2049


def _write_scale(prefix: Path, bos: int, eos: int) -> np.ndarray:
    """The .bin and .idx of the scale data (written with numpy, in a second); each document's
    t, so that the test knows the stream."""
    ordinary = np.setdiff1d(np.arange(400), [bos, eos])
    t = ordinary[np.arange(DOCUMENTS) * 7 % len(ordinary)].reshape(-1, 4)
    tokens = np.empty((len(t), 9), dtype="<u2")
    tokens[:, [0, 2, 3, 4, 7]] = t[:, [0, 1, 2, 2, 3]]
    tokens[:, [1, 6]], tokens[:, [5, 8]] = bos, eos
    tokens.tofile(f"{prefix}.bin")
    lengths = np.tile(np.array(LENGTHS, dtype="<i4"), len(t))
    pointers = np.zeros(DOCUMENTS, dtype="<i8")
    np.cumsum(lengths[:-1] * 2, out=pointers[1:])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, DOCUMENTS, DOCUMENTS + 1))
        lengths.tofile(f)
        pointers.tofile(f)
        np.arange(DOCUMENTS + 1, dtype="<i8").tofile(f)
    return t.ravel()


def _expected(t: np.ndarray, bos: int, eos: int, start: int, length: int) -> list[int]:
    """Stream tokens ``[start, start + length)`` of the scale data, from its periods."""
    period, at = np.divmod(np.arange(start, start + length), len(SLOT))
    slot = SLOT[at]
    real = t[4 * period + np.maximum(slot, 0)]
    return np.where(slot == -1, bos, np.where(slot == -2, eos, real)).tolist()


# Run in a fresh interpreter, measured by its peak resident memory (VmHWM): ru_maxrss would
# carry over the peak of the process that started it, which exec keeps.
MEASURE = """
import json, sys, time
import numpy as np
from yatrain.data import load_tokenizer
from {module} import MegatronTokens
def peak_kib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if "VmHWM" in line)
tokenizer = load_tokenizer(sys.argv[2])
before = peak_kib()
began = time.perf_counter()
data = MegatronTokens(sys.argv[1], tokenizer)
seconds = time.perf_counter() - began
growth = peak_kib() - before
reads = json.loads(sys.argv[3])
np.save(sys.argv[4], np.concatenate([data.read(s, n) for s, n in reads]))
print(json.dumps(dict(growth_mib=growth / 1024, open_seconds=seconds, num_tokens=data.num_tokens,
                      num_documents=data.num_documents)))
"""


def _measure_open(prefix: Path, tokenizer: Path, reads: list, out: Path, module: str) -> dict:
    """Opens ``prefix`` with ``module``'s MegatronTokens in a fresh interpreter: its peak
    memory growth and time, counts, and ``reads`` saved to ``out``."""
    code = MEASURE.format(module=module)
    args = [str(prefix), str(tokenizer), json.dumps(reads), str(out)]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_ten_million_documents_open_in_bounded_memory(tmp_path, tokenizer):
    """Per-document arrays would take hundreds of MiB here (the reader before the sparse
    index grew by 787 MiB); reads at group boundaries and the stream's end stay exact."""
    tok = load_tokenizer(tokenizer)
    prefix = tmp_path / "many"
    t = _write_scale(prefix, tok.bos_id, tok.eos_id)
    num_tokens = DOCUMENTS // 4 * len(SLOT)
    group_tokens = megatron._GROUP // 4 * len(SLOT)  # the stream tokens of one group
    reads = [
        (0, READ),
        (5 * group_tokens - 7, READ),  # across a group boundary
        (7 * group_tokens - 5, 3 * group_tokens),  # across several groups
        (num_tokens // 2 + 3, READ),
        (num_tokens - READ, READ),  # up to the last token
    ]
    out = tmp_path / "reads.npy"
    facts = _measure_open(prefix, tokenizer, reads, out, "yatrain.data.megatron")
    assert facts["num_tokens"] == num_tokens and facts["num_documents"] == DOCUMENTS
    assert facts["growth_mib"] < MAX_GROWTH_MIB, facts
    expected = [x for s, n in reads for x in _expected(t, tok.bos_id, tok.eos_id, s, n)]
    assert np.load(out).tolist() == expected
