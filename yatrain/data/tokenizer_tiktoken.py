"""Llama 3's tokenizer: a tiktoken BPE ranks file plus Meta's pattern and special tokens.

The ranks file (``tokenizer.model`` in Meta's release) has one ``base64(token bytes) rank``
line per token. It is parsed here, from the local file only: tiktoken's own loader keeps a
copy in a cache directory keyed by the file's *path* (and would serve that stale copy if the
file at that path changed), which a training pipeline must not depend on.

Encoding follows Meta's reference tokenizer exactly: the text is cut into pieces of at most
400,000 characters, each piece into runs of at most 25,000 consecutive whitespace or
non-whitespace characters (tiktoken's regex overflows its stack on longer ones), and each
part is encoded as ordinary text, so special-token strings in the data stay text.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import tiktoken

from yatrain.data.tokenizer import Tokenizer, file_sha256
from yatrain.errors import DataError

PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256
MAX_ENCODE_CHARS = 400_000  # Meta's piece length
MAX_RUN_CHARS = 25_000  # Meta's longest run of whitespace or of non-whitespace per part
# A run longer than MAX_RUN_CHARS, found from its first character only (the look-behind
# keeps the search linear: positions inside a run fail at once).
_BASE64 = re.compile(rb"[A-Za-z0-9+/]+={0,2}")
_LONG_RUN = re.compile(rf"(?<!\s)\s{{{MAX_RUN_CHARS + 1},}}|(?<!\S)\S{{{MAX_RUN_CHARS + 1},}}")


def special_tokens() -> list[str]:
    """Llama 3's 256 special tokens, in id order after the ranks."""
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        9: "<|eot_id|>",
    }
    tokens, reserved = [], 0
    for i in range(NUM_SPECIAL_TOKENS):
        if i in named:
            tokens.append(named[i])
        else:
            tokens.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tokens


def read_ranks(path: Path) -> dict[bytes, int]:
    """token bytes -> rank from a tiktoken BPE file, validated line by line."""
    ranks: dict[bytes, int] = {}
    fix = "expected a tiktoken BPE file (one 'base64 rank' per line, as Llama 3's tokenizer.model)"
    lines = path.read_bytes().splitlines()
    for lineno, line in enumerate(lines, start=1):
        parts = line.split()
        if not parts:
            continue
        try:
            if len(parts) != 2 or not _BASE64.fullmatch(parts[0]):
                raise ValueError
            token, rank = binascii.a2b_base64(parts[0]), int(parts[1])
        except (ValueError, binascii.Error):
            raise DataError(f"{path}:{lineno}: not a 'base64 rank' line: {fix}") from None
        if not token or token in ranks:
            raise DataError(f"{path}:{lineno}: empty or repeated token: {fix}")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once: {fix}")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(
            f"{path}: {len(missing)} of the 256 single bytes have no rank, so some text could "
            f"not be encoded: {fix}"
        )
    return ranks


def _may_have_long_run(piece: str) -> bool:
    """False when ``piece`` surely has no run longer than MAX_RUN_CHARS, checked at C speed.

    Such a run covers a whole aligned block of half that length, and that block would be
    all whitespace, or hold no whitespace at all; ordinary text has neither.
    """
    half = MAX_RUN_CHARS // 2
    for start in range(0, len(piece) - half + 1, half):
        block = piece[start : start + half]
        if block.isspace():
            return True
        if len(block.split(None, 1)) == 1 and not (block[0].isspace() or block[-1].isspace()):
            return True  # no whitespace inside, nor at either end
    return False


def split_for_encoding(text: str) -> Iterator[str]:
    """Meta's cut of ``text`` into parts tiktoken encodes safely (see the module docstring)."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        piece = text[start : start + MAX_ENCODE_CHARS]
        if len(piece) <= MAX_RUN_CHARS or not _may_have_long_run(piece):
            yield piece
            continue
        cut = 0
        for run in _LONG_RUN.finditer(piece):
            # A run is cut every MAX_RUN_CHARS characters from its start.
            for at in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield piece[cut:at]
                cut = at
        yield piece[cut:]


class TiktokenTokenizer(Tokenizer):
    """Llama 3's tokenizer: ranks from the file, 256 special tokens right after them."""

    kind = "tiktoken"

    def __init__(self, path: Path):
        self.path = Path(path)
        ranks = read_ranks(self.path)
        self.num_base_tokens = len(ranks)
        self.special = {token: self.num_base_tokens + i for i, token in enumerate(special_tokens())}
        self.encoding = tiktoken.Encoding(
            name=self.path.name,
            pat_str=PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special,
        )
        self.vocab_size = self.encoding.n_vocab
        self.bos_id = self.special["<|begin_of_text|>"]
        self.eos_id = self.special["<|end_of_text|>"]
        self.sha256 = file_sha256(self.path)

    def __reduce__(self):
        return type(self), (self.path,)

    def encode(self, text: str) -> list[int]:
        encode = self.encoding.encode_ordinary  # special-token strings stay ordinary text
        if len(text) <= MAX_RUN_CHARS:
            return encode(text)
        ids: list[int] = []
        for part in split_for_encoding(text):
            ids.extend(encode(part))
        return ids

    def encode_packed(self, texts: list[str], dtype: np.dtype, threads: int = 1) -> np.ndarray:
        """As the base class, with tiktoken writing each part's ids straight into an array."""
        if threads > 1:
            return super().encode_packed(texts, dtype, threads)
        bos, eos = np.array([self.bos_id], np.uint32), np.array([self.eos_id], np.uint32)
        parts = []
        for text in texts:
            parts.append(bos)
            # allowed_special=set() with no check: special-token strings stay ordinary text
            parts += [
                self.encoding.encode_to_numpy(p, disallowed_special=())
                for p in ([text] if len(text) <= MAX_RUN_CHARS else split_for_encoding(text))
            ]
            parts.append(eos)
        return np.concatenate(parts).astype(dtype, copy=False)

    def decode(self, ids: Iterable[int]) -> str:
        specials = (self.bos_id, self.eos_id)
        return self.encoding.decode([int(i) for i in ids if int(i) not in specials])

    def token_id(self, token: str) -> int | None:
        if token in self.special:
            return self.special[token]
        try:
            return self.encoding.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None

    def ranks(self) -> dict[bytes, int]:
        """token bytes -> rank of the ordinary (non-special) vocabulary."""
        return {self.encoding.decode_single_token_bytes(i): i for i in range(self.num_base_tokens)}
